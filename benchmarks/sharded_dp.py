"""Sharded data parallelism (FSDP2, issue #30) against replicated replicas, on gloo CPU ranks.

The benchmark GPT of ``pipeline_vs_torch.py`` (8 layers, d=256, vocab 512; its ``build`` and
``CONFIG``), one global batch (default 32x128) in 4 equal micro-batches, 1F1B, AdamW, in two
layouts: 2 ranks = 1 stage x 2 replicas, 4 ranks = 2 stages x 2 replicas. Each layout runs its
replicas three ways (``Layout.sharding``): ``none`` (replicated: whole stages, gradients
all-reduced), ``zero3`` (FSDP2, weights resharded after every forward) and ``zero2`` (kept to
the step's last backward), forced with ``auto_parallel(sharded_data_parallel=False | "zero3" |
"zero2")`` (``PlanRequest`` takes a sharding's name).

Two runs per layout:

- timing, collectives and tensor memory, all three shardings built in the same processes:
  their steps (``zero_grad`` + ``train_step`` + ``AdamW.step``, between two barriers)
  alternated round by round, each round starting one sharding later (as
  ``pipeline_vs_torch.py`` does); per rank the median step time and the median of its per-round
  ratio to ``none``. One step per sharding with counting wrappers around
  ``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` (what torch 2.13's FSDP2
  calls, ``fsdp/_fully_shard/_fsdp_collectives.py``; ``all_gather_into_tensor`` /
  ``reduce_scatter_tensor`` too, in case) and ``all_reduce`` (the replicated gradients' buckets
  when on the data-parallel group), each call attributed to the executor action it ran in
  (``F<i>`` / ``B<i>``), beside what the planner's model
  (``replica.planner.dataparallel.gathers_per_step``) predicts. One step per sharding under
  torch's profiler (``profile_memory``): the tensors held at the step's start and the most
  alive at once during it (every allocation and free summed in order: glibc's retained
  memory, which RSS counts, left out). The bytes the rank holds after the step in parameters
  + gradients + AdamW state (local shards: ``replica.parallel.fsdp.local_tensor``), beside
  the same tensors whole (what a replicated rank holds for its stages).
- RSS, in fresh processes per sharding (``ru_maxrss`` is a lifetime peak): RSS after the
  set-up (``auto_parallel`` + AdamW built), the peak of the training steps above it (VmHWM,
  reset through ``/proc/self/clear_refs`` after the set-up) and the lifetime peak.

Usage: ``python benchmarks/sharded_dp.py [--worlds 2,4] [--rounds 5] [--steps 1]
[--mem-steps 3] [--batch 32] [--microbatches 4] [--no-memory] [--no-timing]``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
from benchmarks.big_model import peak_rss, rss_now  # noqa: E402
from benchmarks.choice import chosen_vs_rejected  # noqa: E402
from benchmarks.mixed_precision import reset_peak  # noqa: E402
from benchmarks.pipeline_vs_torch import CONFIG, build, timed  # noqa: E402
from examples.gpt.model import loss_fn  # noqa: E402
from replica.launch import run_local  # noqa: E402
from replica.parallel.fsdp import block_groups, local_tensor  # noqa: E402
from replica.schedules.actions import BACKWARD, FORWARD  # noqa: E402

MiB = 1 << 20
SHARDINGS = ("none", "zero3", "zero2")
STAGES = {2: 1, 4: 2}  # world -> pipeline stages (the rest: 2 replicas each)

# --- counting collectives ---------------------------------------------------------------
_COUNTS: Counter = Counter()
_STATE: dict[str, Any] = {"on": False, "label": "runtime", "dp_group": None}


def _counting(name: str, fn):
    def wrapper(*args: Any, **kwargs: Any):
        if _STATE["on"]:
            if name == "all_reduce":
                group = kwargs.get("group", args[2] if len(args) > 2 else None)
                key = "AR" if group is not None and group is _STATE["dp_group"] else "AR-other"
            else:
                key = name
            _COUNTS[(key, _STATE["label"])] += 1
        return fn(*args, **kwargs)

    wrapper._counted = fn  # type: ignore[attr-defined]
    return wrapper


def install_counters() -> None:
    """Counting wrappers on torch.distributed's collectives (looked up as ``dist.<name>`` at
    call time by FSDP2 and by Replica, so patching the module attribute catches them)."""
    names = {"all_gather_single": "AG", "all_gather_into_tensor": "AG", "reduce_scatter_single": "RS",
             "reduce_scatter_tensor": "RS", "all_reduce": "all_reduce"}
    for attr, key in names.items():
        fn = getattr(dist, attr, None)
        if fn is not None and not hasattr(fn, "_counted"):
            setattr(dist, attr, _counting(key, fn))


def label_actions(pm) -> None:
    """Attribute collectives to the executor action (``F<i>`` / ``B<i>``) they run in;
    "executor": its step outside any action (the reducer's flush); "runtime": the rest (the
    loss's all-reduce, tied weights' gradients, the optimizer)."""
    ex = pm.runtime.executor
    forward, backward, train_step = ex.forward, ex.backward, ex.train_step

    def labelled(fn, kind):
        def run(step, action, *args, **kwargs):
            before, _STATE["label"] = _STATE["label"], f"{kind}{action.microbatch_index}"
            try:
                return fn(step, action, *args, **kwargs)
            finally:
                _STATE["label"] = before
        return run

    def whole_step(*args, **kwargs):
        before, _STATE["label"] = _STATE["label"], "executor"
        try:
            return train_step(*args, **kwargs)
        finally:
            _STATE["label"] = before

    ex.forward, ex.backward, ex.train_step = labelled(forward, "F"), labelled(backward, "B"), whole_step


# --- one rank's pipelines ---------------------------------------------------------------
def make(sharding: str, world: int, batch: int, microbatches: int):
    model, x, y = build()
    x, y = x[:batch], y[:batch]
    pm = replica.auto_parallel(model, (x,), num_stages=STAGES[world], num_microbatches=microbatches,
                               schedule="1f1b", loss_fn=loss_fn, graded_microbatches=False,
                               sharded_data_parallel=False if sharding == "none" else sharding)
    assert pm.plan.layout.sharding == sharding, (pm.plan.layout.sharding, sharding)
    assert pm.plan.data_parallel_size == 2, pm.plan.layout.describe()
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4, weight_decay=0.1)
    return pm, optimizer, x, y


def free_choice(world: int, batch: int, microbatches: int) -> str:
    """The sharding the planner chooses for the benchmark's layout when left free
    (``sharded_data_parallel=None``), priced as the ranks' plans are."""
    model, x, _ = build()
    plan = replica.plan(model, (x[:batch],), world_size=world, num_stages=STAGES[world],
                        num_microbatches=microbatches, schedule="1f1b", graded_microbatches=False)
    return plan.layout.sharding


def units(pm) -> int:
    """FSDP units holding parameters on this rank's stages (one per block, the root)."""
    try:
        from torch.distributed.fsdp import FSDPModule

        groups = set()
        for stage in pm.stages:
            for m in stage.module.modules():
                if isinstance(m, FSDPModule):
                    group = m._get_fsdp_state()._fsdp_param_group
                    if group is not None:
                        groups.add(id(group))
        return len(groups)
    except (ImportError, AttributeError):  # private API moved: the docstring's count
        return sum(len(block_groups(s.module)) + 1 for s in pm.stages)


def held(pm, optimizer) -> tuple[int, int]:
    """Bytes this rank holds in parameters + gradients + optimizer state (local shards), and
    the same tensors whole (a DTensor's ``numel()`` is its global one)."""
    local = whole = 0
    for p in pm.parameters():
        for t in (p, p.grad, *optimizer.state.get(p, {}).values()):
            if isinstance(t, torch.Tensor):
                local += local_tensor(t).numel() * t.element_size()
                whole += t.numel() * t.element_size()
    return local, whole


def tensor_peak(pm, optimizer, x, y) -> tuple[int, int]:
    """One step under torch's profiler (``profile_memory``): the bytes of tensors this rank
    holds at the step's start (weights and AdamW state; ``zero_grad`` freed the gradients)
    and the most bytes of tensors alive at once during the step (that plus the running sum of
    every allocation and free the profiler saw): what a caching allocator would peak at,
    without glibc's retained memory that RSS counts."""
    pm.zero_grad()
    start = held(pm, optimizer)[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        pm.train_step(x, y)
        optimizer.step()
    return start, start + allocation_peak(prof)


def allocation_peak(prof: torch.profiler.profile) -> int:
    """The most tensor bytes alive at once above the start of ``prof`` (a profile taken with
    ``profile_memory=True``): the running sum of every allocation and free it saw, in order."""
    from torch._C._profiler import _EventType

    sizes, tree = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while tree:
        e = tree.pop()
        if e.tag == _EventType.Allocation:
            sizes.append((e.start_time_ns, e.extra_fields.alloc_size))
        tree.extend(e.children)
    live = peak = 0
    for _, size in sorted(sizes):
        live += size
        peak = max(peak, live)
    return peak


def predicted_gathers(pm, sharding: str) -> int | None:
    """All-gathers a step the planner's model expects (per unit, summed over this rank's
    stages), from the actions this rank runs."""
    try:
        from replica.planner.dataparallel import gathers_per_step
    except ImportError:
        return None
    ex = pm.runtime.executor
    return sum(gathers_per_step([a.kind for a in ex.actions if a.stage_index == k], sharding) for k in ex.stages)


def _quiet() -> None:
    # FSDP2 warns that a unit's Linear returned a view (F.linear on 3-D inputs): harmless
    # here, the GPT adds residuals out of place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def timing_job(rank: int, world: int, rounds: int, steps: int, batch: int, microbatches: int) -> dict:
    _quiet()
    install_counters()
    runs = {s: make(s, world, batch, microbatches) for s in SHARDINGS}

    def step_fn(pm, optimizer, x, y):
        def step() -> None:
            pm.zero_grad()
            pm.train_step(x, y)
            optimizer.step()
        return step

    fns = {s: step_fn(*r) for s, r in runs.items()}
    for pm, *_ in runs.values():
        label_actions(pm)
    for fn in fns.values():  # warm up (the first step allocates gradients and AdamW's state)
        timed(fn, 1)
    counts, actions = {}, {}
    for s, (pm, *_) in runs.items():  # one counted step each
        _COUNTS.clear()
        _STATE.update(on=True, dp_group=pm.runtime.data_parallel_group)
        dist.barrier()
        fns[s]()
        dist.barrier()
        _STATE["on"] = False
        counts[s] = dict(_COUNTS)
        actions[s] = [f"{a.kind}{a.microbatch_index}" for a in pm.runtime.executor.actions
                      if a.kind in (FORWARD, BACKWARD)]
    peaks = {s: tensor_peak(pm, optimizer, x, y) for s, (pm, optimizer, x, y) in runs.items()}
    chosen = free_choice(world, batch, microbatches) if rank == 0 else None
    times: dict[str, list[float]] = {s: [] for s in SHARDINGS}
    order = list(SHARDINGS)
    for r in range(rounds):
        for s in order[r % len(order):] + order[:r % len(order)]:
            times[s].append(timed(fns[s], steps)[0])
    return dict(rank=rank, stages=[st.stage_index for st in runs["none"][0].stages], times=times, counts=counts,
                chosen=chosen, predicted_step={s: r[0].plan.predicted_step_time_s for s, r in runs.items()},
                actions=actions, units={s: units(r[0]) if s != "none" else 0 for s, r in runs.items()},
                predicted={s: predicted_gathers(r[0], s) for s, r in runs.items() if s != "none"},
                held={s: held(r[0], r[1]) for s, r in runs.items()}, peaks=peaks,
                layout={s: r[0].plan.layout.describe() + (", early input gradients" if r[0].runtime.executor.early
                                                          else "") for s, r in runs.items()})


def _hwm() -> int:
    """Peak RSS (VmHWM) since the last reset, bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read())[1]) * 1024


def memory_job(rank: int, world: int, sharding: str, steps: int, batch: int, microbatches: int) -> dict:
    _quiet()
    before = rss_now()
    pm, optimizer, x, y = make(sharding, world, batch, microbatches)
    dist.barrier()
    baseline = rss_now()
    reset = reset_peak()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        pm.zero_grad()
        pm.train_step(x, y)
        optimizer.step()
        times.append(time.perf_counter() - start)
    return dict(rank=rank, before=before, baseline=baseline, peak=_hwm() if reset else peak_rss(), reset=reset,
                lifetime=peak_rss(), times=times)


# --- report -----------------------------------------------------------------------------
def _per_step(counts: dict, key: str, labels: list[str]) -> list[int]:
    return [counts.get((key, label), 0) for label in labels]


def report(world: int, timing: list[dict], memory: dict[str, list[dict]], batch: int, microbatches: int,
           rounds: int, steps: int) -> list[str]:
    lines = []
    timed_as = f"{rounds} rounds x {steps} step(s), shardings alternated in one run (keep_freed_memory)" \
        if rounds else "not run"
    measured = f"fresh processes per sharding, {len(next(iter(memory.values()))[0]['times'])} steps" \
        if memory else "not run"
    lines.append(f"\n{world} gloo ranks x 1 thread = {STAGES[world]} stage(s) x 2 replicas; batch "
                 f"{batch}x{CONFIG['block_size']}, {microbatches} micro-batches, 1F1B, AdamW; timing: {timed_as}; "
                 f"memory: {measured}")
    lines.append("")
    lines.append("| rank | stage | sharding | median step s | vs none (per-round median, min-max) | "
                 "held: W+G+AdamW MiB (of whole stages) | tensors MiB: step start -> step peak (peak vs none) | "
                 "RSS MiB: set-up -> training peak (+growth) | lifetime peak RSS MiB |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for r in timing:
        for s in SHARDINGS:
            ts = r["times"][s]
            ratios = [t / n for t, n in zip(ts, r["times"]["none"])]
            ratio = "-" if not ts else "1" if s == "none" else \
                f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"
            median = f"{statistics.median(ts):.3f}" if ts else "-"
            local, whole = r["held"][s]
            mem = memory.get(s)
            m = mem[r["rank"]] if mem else None
            span = (lambda a, b: f"{a / MiB:.0f} -> {b / MiB:.0f} (+{(b - a) / MiB:.0f})")
            begin, top = r["peaks"][s]
            tensors = f"{begin / MiB:.1f} -> {top / MiB:.1f} ({top / r['peaks']['none'][1]:.2f})"
            rss = span(m["baseline"], m["peak"]) if m else "-"
            life = f"{m['lifetime'] / MiB:.0f}" if m else "-"
            lines.append(f"| {r['rank']} | {','.join(map(str, r['stages']))} | {s} | {median} | "
                         f"{ratio} | {local / MiB:.1f} ({local / whole:.1%} of {whole / MiB:.1f}) | {tensors} | "
                         f"{rss} | {life} |")
    lines.append("")
    lines.append("collectives in one step, per rank, by the executor action they ran in (AG all-gathers, RS "
                 "reduce-scatters, AR all-reduces on the data-parallel group; per unit: / FSDP units):")
    lines.append("")
    lines.append("| rank | stage | sharding | FSDP units | actions | AG per action | AG / step (per unit) | "
                 "planner's model: gathers per unit | RS / step (per unit), in | AR / step, in | other |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in timing:
        for s in SHARDINGS:
            c, acts, u = r["counts"][s], r["actions"][s], r["units"][s]
            ag = _per_step(c, "AG", acts)
            total_ag = sum(v for (k, _), v in c.items() if k == "AG")
            rs = {label: v for (k, label), v in c.items() if k == "RS"}
            ar = {label: v for (k, label), v in c.items() if k == "AR"}
            stray = {f"{k} in {label}": v for (k, label), v in c.items()
                     if k not in ("AG", "RS", "AR") or (k in ("AG", "RS") and label not in acts)}
            per_unit = (lambda n, u=u: f"{n} ({n / u:g})" if u else str(n))
            where = (lambda d: " in " + ", ".join(f"{k}: {v}" for k, v in d.items()) if d else "")
            pred = r["predicted"].get(s)
            lines.append(f"| {r['rank']} | {','.join(map(str, r['stages']))} | {s} | {u or '-'} | {' '.join(acts)} | "
                         f"{' '.join(map(str, ag)) if total_ag else '-'} | {per_unit(total_ag)} | "
                         f"{pred if pred is not None else '-'} | {per_unit(sum(rs.values()))}{where(rs)} | "
                         f"{sum(ar.values())}{where(ar)} | "
                         f"{', '.join(f'{k}: {v}' for k, v in stray.items()) or '-'} |")
    return lines


def summary(results: list[tuple[int, list[dict], dict[str, list[dict]]]]) -> list[str]:
    """One row per layout, stage and sharding (its replicas agree but for RSS: a range over them)."""
    lines = [("| ranks | stage (its ranks) | sharding | median step s | vs none | held: W+G+AdamW MiB (of whole) | "
              "tensor peak MiB (vs none) | RSS: set-up -> training peak MiB | all-gathers per action, per unit | "
              "AG / unit / step (planner's model) | RS / unit / step |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for world, timing, memory in results:
        by_stage: dict[str, list[dict]] = {}
        for r in timing:
            by_stage.setdefault(",".join(map(str, r["stages"])), []).append(r)
        for stage, rs in by_stage.items():
            r, ranks = rs[0], [x["rank"] for x in rs]
            for s in SHARDINGS:
                ts = r["times"][s]
                ratio = statistics.median(t / n for t, n in zip(ts, r["times"]["none"])) if ts else None
                local, whole = r["held"][s]
                top = r["peaks"][s][1]
                mem = [memory[s][k] for k in ranks] if memory.get(s) else []
                span = (lambda key, mem=mem:
                        f"{min(m[key] for m in mem) / MiB:.0f}-{max(m[key] for m in mem) / MiB:.0f}")
                rss = f"{span('baseline')} -> {span('peak')}" if mem else "-"
                u, c, acts = r["units"][s], r["counts"][s], r["actions"][s]
                if u:
                    ag = _per_step(c, "AG", acts)
                    per_action = " ".join(f"{a}:{n / u:g}" for a, n in zip(acts, ag))
                    rs_ = sum(v for (k, _), v in c.items() if k == "RS")
                    agc = f"{sum(ag) / u:g} ({r['predicted'].get(s)})"
                    rsc = f"{rs_ / u:g}"
                else:
                    ar = sum(v for (k, _), v in c.items() if k == "AR")
                    per_action, agc, rsc = f"- ({ar} gradient all-reduce buckets a step)", "-", "-"
                lines.append(f"| {world} | {stage} ({','.join(map(str, ranks))}) | {s} | "
                             f"{statistics.median(ts) if ts else float('nan'):.3f} | "
                             f"{'-' if ratio is None else f'{ratio:.3f}'} | {local / MiB:.1f} ({local / whole:.0%}) | "
                             f"{top / MiB:.1f} ({top / rs[0]['peaks']['none'][1]:.2f}) | {rss} | {per_action} | "
                             f"{agc} | {rsc} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4", help="2 (1 stage x 2 replicas) and/or 4 (2 stages x 2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1, help="steps timed per sharding per round")
    parser.add_argument("--mem-steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="global batch (each replica trains half)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory runs")
    parser.add_argument("--no-timing", action="store_true",
                        help="skip the timed rounds (counts, tensor peaks, RSS runs still run)")
    args = parser.parse_args()
    if not 0 < args.batch <= build()[1].size(0):
        parser.error(f"--batch must be 1 to {build()[1].size(0)} (the benchmark's batch, sliced)")
    start, load = time.perf_counter(), os.getloadavg()
    results = []
    for world in map(int, args.worlds.split(",")):
        timing = run_local(timing_job, world, 0 if args.no_timing else args.rounds, args.steps, args.batch,
                           args.microbatches, timeout_s=900, keep_freed_memory=True)
        memory = {} if args.no_memory else \
            {s: run_local(memory_job, world, s, args.mem_steps, args.batch, args.microbatches, timeout_s=600)
             for s in SHARDINGS}
        lines = report(world, timing, memory, args.batch, args.microbatches, 0 if args.no_timing else args.rounds,
                       args.steps)
        print("\n".join(lines), flush=True)
        results.append((world, timing, memory))
        print("layouts:", timing[0]["layout"])
        if memory:
            print("memory runs, per rank: RSS before auto_parallel (MiB), step times (s):")
            for s, ms in memory.items():
                print(f"  {s}: " + "; ".join(f"rank {m['rank']} {m['before'] / MiB:.0f}, "
                                             f"{[round(t, 2) for t in m['times']]}" for m in ms)
                      + ("" if all(m["reset"] for m in ms) else " (VmHWM not resettable: lifetime peaks)"))
    print(f"\nsummary (batch {args.batch}, {args.microbatches} micro-batches, 1F1B, AdamW; {args.rounds} rounds):")
    print("\n".join(summary(results)))
    if not args.no_timing:
        print("\nchosen vs rejected, measured (rank 0; the planner's choice with sharded_data_parallel=None):")
        for world, timing, _ in results:
            r0 = next(r for r in timing if r["rank"] == 0)
            print(f"\n{world} ranks:")
            print("\n".join(chosen_vs_rejected(r0["chosen"], r0["predicted_step"], r0["times"])))
    print(f"\nwall time {time.perf_counter() - start:.0f} s; load average (1, 5, 15 min) at the start "
          f"{', '.join(f'{v:.1f}' for v in load)}, at the end {', '.join(f'{v:.1f}' for v in os.getloadavg())} "
          f"({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
