"""Sharded replicas reducing gradients once a step against every micro-batch (#39, ``grad_sync``), on gloo CPU ranks.

The benchmark GPT of ``sharded_dp.py`` (8 layers, d=256, vocab 512), one global batch (default
32x128) in 4 micro-batches, 1F1B, AdamW, 2 replicas of 1 stage (2 ranks) or of 2 stages (4 ranks),
each sharding (zero3, zero2) run two ways: ``grad_sync="step"`` (FSDP2 accumulates unsharded
gradients over the micro-batches, one reduce-scatter a step) and ``"microbatch"`` (a reduce-scatter
after every backward, gradients accumulated sharded). All four pipelines are built in the same
processes; their steps (``zero_grad`` + ``train_step`` + ``AdamW.step``, between barriers) alternate
round by round, each round starting one later. Per rank: the median step; the tensor peak of one
step (torch's profiler, allocations matched to frees by address, from the weights and AdamW state
held at its start: :func:`live_peak`), of ``train_step`` alone and with ``AdamW.step``; the
reduce-scatters the step started (``sharded_dp``'s counting wrappers); beside what the plan
predicts: its step (``Plan.predicted_step_time_s``) and this rank's peak by the memory walk
(``replica.planner.costs.rank_memory``).

Usage: ``python benchmarks/grad_sync.py [--worlds 2,4] [--shardings zero3,zero2] [--rounds 5]
[--batch 32] [--microbatches 4]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
from benchmarks import sharded_dp  # noqa: E402
from benchmarks.pipeline_vs_torch import CONFIG, build, timed  # noqa: E402
from examples.gpt.model import loss_fn  # noqa: E402
from replica.launch import run_local  # noqa: E402
from replica.planner.costs import rank_memory, stage_costs_from_plan  # noqa: E402
from replica.schedules.schedule import plan_schedule  # noqa: E402

MiB = 1 << 20
SYNCS = ("step", "microbatch")
STAGES = {2: 1, 4: 2}  # world -> pipeline stages (2 replicas each)


def make(sharding: str, grad_sync: str, world: int, batch: int, microbatches: int):
    model, x, y = build()
    x, y = x[:batch], y[:batch]
    pm = replica.auto_parallel(model, (x,), num_stages=STAGES[world], num_microbatches=microbatches,
                               schedule="1f1b", loss_fn=loss_fn, graded_microbatches=False,
                               sharded_data_parallel=sharding, grad_sync=grad_sync)
    assert pm.plan.layout.sharding == sharding and pm.plan.data_parallel_size == 2, pm.plan.layout.describe()
    assert {s.grad_sync for s in pm.plan.stages} == {grad_sync}, [s.grad_sync for s in pm.plan.stages]
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-4, weight_decay=0.1), x, y


def predicted_peak(pm) -> float:
    """This rank's bytes at its fullest, by the plan's memory walk over its actions."""
    plan = pm.plan
    schedule = plan_schedule(plan)
    return rank_memory(stage_costs_from_plan(plan, schedule), schedule)[pm.runtime.topology.pipeline_rank]


def tensor_peak(pm, optimizer, x, y, with_optimizer: bool) -> int:
    """One step under torch's profiler (``profile_memory``): the tensor bytes this rank holds at its
    start (weights and AdamW state) plus the most alive at once during ``train_step`` (and
    ``AdamW.step``, ``with_optimizer``; its temporaries are no part of the plan's memory model),
    by :func:`live_peak`."""
    pm.zero_grad()
    start = sharded_dp.held(pm, optimizer)[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        pm.train_step(x, y)
        if with_optimizer:
            optimizer.step()
    return start + live_peak(prof)


def live_peak(prof: torch.profiler.profile) -> int:
    """The most bytes alive at once above the start of ``prof``, allocations matched to frees by
    address: gloo frees some buffers (its reduce-scatter's copy of the input) on its own threads,
    which the profiler does not record, so a running sum of allocations and frees
    (``sharded_dp.allocation_peak``) keeps them forever; here an allocation at an address still
    held means the earlier one was freed. A free of an address allocated before the profile
    lowers the total (``zero_grad``'s gradients, say)."""
    from torch._C._profiler import _EventType

    events, tree = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while tree:
        e = tree.pop()
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr))
        tree.extend(e.children)
    held: dict[int, int] = {}
    live = peak = 0
    for _, size, ptr in sorted(events):
        if size > 0:
            live += size - held.get(ptr, 0)
            held[ptr] = size
        else:
            live -= held.pop(ptr, -size)
        peak = max(peak, live)
    return peak


def job(rank: int, world: int, shardings: list[str], rounds: int, batch: int, microbatches: int) -> dict:
    sharded_dp._quiet()
    sharded_dp.install_counters()
    runs = {(s, g): make(s, g, world, batch, microbatches) for s in shardings for g in SYNCS}

    def step_fn(pm, optimizer, x, y):
        def step() -> None:
            pm.zero_grad()
            pm.train_step(x, y)
            optimizer.step()
        return step

    fns = {key: step_fn(*r) for key, r in runs.items()}
    for fn in fns.values():  # warm up: the first step allocates the gradients and AdamW's state
        timed(fn, 1)
    counts = {}
    for key, (pm, *_) in runs.items():  # one counted step each
        sharded_dp._COUNTS.clear()
        sharded_dp._STATE.update(on=True, dp_group=pm.runtime.data_parallel_group)
        dist.barrier()
        fns[key]()
        dist.barrier()
        sharded_dp._STATE["on"] = False
        counts[key] = sum(v for (k, _), v in sharded_dp._COUNTS.items() if k == "RS")
    peaks = {key: tensor_peak(pm, optimizer, x, y, True) for key, (pm, optimizer, x, y) in runs.items()}
    backward_peaks = {key: tensor_peak(pm, optimizer, x, y, False) for key, (pm, optimizer, x, y) in runs.items()}
    times: dict = {key: [] for key in runs}
    order = list(runs)
    for r in range(rounds):
        for key in order[r % len(order):] + order[:r % len(order)]:
            times[key].append(timed(fns[key], 1)[0])
    return dict(rank=rank, stages=[st.stage_index for st in next(iter(runs.values()))[0].stages],
                times=times, peaks=peaks, train_peaks=backward_peaks, reduce_scatters=counts,
                units={key: sharded_dp.units(r[0]) for key, r in runs.items()},
                predicted_step={key: r[0].plan.predicted_step_time_s for key, r in runs.items()},
                predicted_peak={key: predicted_peak(r[0]) for key, r in runs.items()},
                gathers={key: [s.gathers for s in r[0].plan.stages] for key, r in runs.items()})


def table(results: list[tuple[int, list[dict]]], shardings: list[str]) -> list[str]:
    lines = ["| ranks | stage (ranks) | sharding | grad_sync | RS / unit / step | median step s (microbatch / step) "
             "| predicted step s (ratio) | tensor peak MiB: train_step (+ AdamW.step) | predicted peak MiB | "
             "train_step peak saved MiB: measured (predicted) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for world, reports in results:
        by_stage: dict[str, list[dict]] = {}
        for r in reports:
            by_stage.setdefault(",".join(map(str, r["stages"])), []).append(r)
        for stage, rs in by_stage.items():
            r, ranks = rs[0], ",".join(str(x["rank"]) for x in rs)
            for s in shardings:
                for g in SYNCS:
                    key, base = (s, g), (s, "step")
                    median = statistics.median(r["times"][key]) if r["times"][key] else float("nan")
                    ratios = [a / b for a, b in zip(r["times"][key], r["times"][base])]
                    ratio = f" ({statistics.median(ratios):.3f}, {min(ratios):.2f}-{max(ratios):.2f})" \
                        if g != "step" and ratios else ""
                    predicted = r["predicted_step"][key]
                    pratio = f" ({predicted / r['predicted_step'][base]:.3f})" if g != "step" else ""
                    peak = statistics.mean(x["train_peaks"][key] for x in rs)
                    whole = statistics.mean(x["peaks"][key] for x in rs)
                    ppeak = statistics.mean(x["predicted_peak"][key] for x in rs)
                    saved = "-" if g == "step" else \
                        f"{(statistics.mean(x['train_peaks'][base] for x in rs) - peak) / MiB:.1f} " \
                        f"({(statistics.mean(x['predicted_peak'][base] for x in rs) - ppeak) / MiB:.1f})"
                    lines.append(f"| {world} | {stage} ({ranks}) | {s} | {g} | "
                                 f"{r['reduce_scatters'][key] / max(1, r['units'][key]):g} | {median:.3f}{ratio} | "
                                 f"{predicted:.3f}{pratio} | {peak / MiB:.1f} ({whole / MiB:.1f}) | "
                                 f"{ppeak / MiB:.1f} | {saved} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4", help="2 (1 stage x 2 replicas) and/or 4 (2 stages x 2)")
    parser.add_argument("--shardings", default="zero3,zero2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="global batch (each replica trains half)")
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    shardings = args.shardings.split(",")
    start, load = time.perf_counter(), os.getloadavg()
    results = []
    for world in map(int, args.worlds.split(",")):
        results.append((world, run_local(job, world, shardings, args.rounds, args.batch, args.microbatches,
                                         timeout_s=900, keep_freed_memory=True)))
    print(f"batch {args.batch}x{CONFIG['block_size']}, {args.microbatches} micro-batches, 1F1B, AdamW, "
          f"{args.rounds} rounds; rows: one per stage (the mean over its replicas for memory, the first for time)\n")
    print("\n".join(table(results, shardings)))
    print(f"\nwall time {time.perf_counter() - start:.0f} s; load average (1, 5, 15 min) at the start "
          f"{', '.join(f'{v:.1f}' for v in load)}, at the end {', '.join(f'{v:.1f}' for v in os.getloadavg())} "
          f"({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
