"""Replica vs torch.distributed.pipelining on 2 CPU ranks (gloo, 1 thread each), side by side.

GPT 8 layers, d=256, vocab 512, batch 32×128, 8 micro-batches. Modes, alternated
round by round in one pair of processes so machine noise hits all alike (each round
starts one mode later, so every mode runs in every place of a round in turn):

- ``single``: the plain model, one process, one thread (rank 0 alone; rank 1 waits);
- ``torch-1f1b``: torch's ``Schedule1F1B`` on hand-built stages split at the middle block
  (embeddings + blocks 0-3 | blocks 4-7 + final norm + head); ``torch-zbv``: its
  ``ScheduleZBVZeroBubble`` on four hand-built V-placed stages (blocks 2/2/2/2,
  embeddings on stage 0, head on stage 3; rank 0 holds stages 0 and 3);
- ``replica-<schedule>``: ``replica.auto_parallel`` with the stage count, micro-batches and
  schedule given (2 stages, or 4 for V / interleaved) but no split; ``replica-auto`` with
  no hint at all.

Peak RSS is measured per framework in fresh processes (ru_maxrss is a lifetime peak).
The ranks call ``replica.keep_freed_memory()`` (glibc keeps freed memory for the next
micro-batch), as CPU pipelines did unasked before it became opt-in; the torch-only RSS
processes do not.
Usage: ``python benchmarks/pipeline_vs_torch.py [--rounds 5] [--steps 3] [--schedules 1f1b,zb-v,auto]
[--torch-schedules 1f1b,zbv] [--vocab 8192]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
from examples.gpt.model import GPT, GPTConfig, loss_fn  # noqa: E402
from replica.launch import run_local  # noqa: E402
from replica.schedules.schedule import format_grid  # noqa: E402

CONFIG = dict(block_size=128, vocab_size=512, n_layer=8, n_head=8, n_embd=256, dropout=0.0)
BATCH, SEQ, MICROBATCHES = 32, 128, 8


def build(seed: int = 0) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**CONFIG))
    x = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
    y = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
    return model, x, y


class FirstHalf(nn.Module):
    """What a user writes by hand for torch.distributed.pipelining: embeddings + first blocks."""

    def __init__(self, gpt: GPT, blocks: int) -> None:
        super().__init__()
        self.wte, self.wpe, self.h = gpt.transformer.wte, gpt.transformer.wpe, gpt.transformer.h[:blocks]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return x


class SecondHalf(nn.Module):
    """The other half: remaining blocks, final norm and the (untied copy of the) head."""

    def __init__(self, gpt: GPT, blocks: int) -> None:
        super().__init__()
        self.h, self.ln_f = gpt.transformer.h[blocks:], gpt.transformer.ln_f
        self.lm_head = nn.Linear(gpt.config.n_embd, gpt.config.vocab_size, bias=False)
        self.lm_head.weight = nn.Parameter(gpt.lm_head.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class Middle(nn.Module):
    """Blocks only: the inner stages of a V."""

    def __init__(self, gpt: GPT, start: int, end: int) -> None:
        super().__init__()
        self.h = gpt.transformer.h[start:end]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = block(x)
        return x


def torch_pipeline(rank: int, model: GPT, schedule: str = "1f1b"):
    """torch.distributed.pipelining with hand-built stages: halves at the middle block for
    1F1B / GPipe; four quarters in a V (rank 0: stages 0 and 3) for ZBVZeroBubble."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleZBVZeroBubble

    n = CONFIG["n_layer"]
    cpu = torch.device("cpu")
    if schedule == "zbv":
        q = n // 4
        first, last = (FirstHalf(model, q), SecondHalf(model, 3 * q)) if rank == 0 else \
            (Middle(model, q, 2 * q), Middle(model, 2 * q, 3 * q))
        index = (0, 3) if rank == 0 else (1, 2)
        stages = [PipelineStage(first, index[0], 4, cpu), PipelineStage(last, index[1], 4, cpu)]
        module = nn.ModuleList([first, last])
        return module, ScheduleZBVZeroBubble(stages, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    half = n // 2
    module = FirstHalf(model, half) if rank == 0 else SecondHalf(model, half)
    stage = PipelineStage(module, stage_index=rank, num_stages=2, device=cpu)
    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    return module, cls(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)


def torch_step(rank: int, module: nn.Module, sched, x: torch.Tensor, y: torch.Tensor, v: bool = False) -> None:
    """One step; the first stage feeds x, the last (rank 1, or rank 0 in a V) takes y."""
    module.zero_grad(set_to_none=True)
    if v:  # rank 0 holds the first and the last stage
        if rank == 0:
            sched.step(x, target=y, losses=[])
        else:
            sched.step()
    elif rank == 0:
        sched.step(x)
    else:
        sched.step(target=y, losses=[])


def faults() -> int:
    """Minor page faults of this process so far: pages the kernel mapped in (and zeroed)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(fn, steps: int) -> tuple[float, float]:
    """Seconds and page faults per step, over ``steps`` steps."""
    dist.barrier()
    before, start = faults(), time.perf_counter()
    for _ in range(steps):
        fn()
    after = faults()
    dist.barrier()
    return (time.perf_counter() - start) / steps, (after - before) / steps


def compare(rank: int, world: int, rounds: int, steps: int, schedules: list[str], torch_schedules: list[str],
            vocab: int) -> dict:
    CONFIG["vocab_size"] = vocab  # spawned ranks start from the module's defaults
    model, x, y = build()
    plain = copy.deepcopy(model)
    torch_runs = {t: torch_pipeline(rank, copy.deepcopy(model), t) for t in torch_schedules}
    pms = {}
    for s in schedules:  # "auto": no hint at all, the tuner picks stages, micro-batches and schedule
        # "-even": micro-batches of one size (no grading);
        # "-late": a backward computes its weight gradients before sending its input gradient
        # "-pointwise": GELU outputs rebuilt in backward (recompute="pointwise");
        # "-keep": every activation kept (recompute=False: not even the planner's free rebuilds);
        # "-after": data-parallel all-reduces started after the backward, not during it
        name = s
        mbs = None  # "-m<N>": N micro-batches (for "auto", the tuner's choice otherwise)
        if "-m" in name and name.rsplit("-m", 1)[1].isdigit():
            name, mbs = name.rsplit("-m", 1)
        for suffix in ("-even", "-late", "-pointwise", "-keep", "-after"):
            name = name.removesuffix(suffix)
        hints = {} if name == "auto" else dict(num_stages=4 if name in ("zb-v", "interleaved") else 2,
                                            num_microbatches=MICROBATCHES, schedule=name)
        if mbs is not None:
            hints["num_microbatches"] = int(mbs)
        if "-even" in s:
            hints["graded_microbatches"] = False
        if s.endswith("-pointwise"):
            hints["recompute"] = "pointwise"
        if s.endswith("-keep"):
            hints["recompute"] = False
        pms[s] = replica.auto_parallel(copy.deepcopy(model), (x,), loss_fn=loss_fn, **hints)
        if s.endswith("-late"):
            pms[s].runtime.executor.early = set()  # the runtime's switch: no backward sends before its W part
        reducer = pms[s].runtime.reducer
        if "-after" in s and reducer is not None:
            arm = reducer.arm
            reducer.arm = lambda stage, listen=True, arm=arm: arm(stage, listen=False)

    def single() -> None:
        if rank == 0:
            plain.zero_grad(set_to_none=True)
            loss_fn(plain(x), y).backward()

    modes = {"single": single}
    for t, (t_module, t_sched) in torch_runs.items():
        modes[f"torch-{t}"] = (lambda m=t_module, sc=t_sched, v=(t == "zbv"): torch_step(rank, m, sc, x, y, v))
    for s, pm in pms.items():
        modes[f"replica-{s}"] = (lambda pm=pm: (pm.zero_grad(), pm.train_step(x, y)))
    for fn in modes.values():  # warm up every path once
        timed(fn, 1)
    times: dict[str, list[float]] = {k: [] for k in modes}
    faulted: dict[str, list[float]] = {k: [] for k in modes}
    order = list(modes)
    for r in range(rounds):
        # each round starts one mode later: a mode's place in the round (right after torch's
        # step, say) measurably changes its time, so every mode takes every place in turn
        for name in order[r % len(order):] + order[:r % len(order)]:
            seconds, pages = timed(modes[name], steps)
            times[name].append(seconds)
            faulted[name].append(pages)
    summaries = {s: pm.plan.summary() + "\n" + format_grid(pm.schedule, pm.plan.num_stages) for s, pm in pms.items()}
    return {"times": times, "summaries": summaries,
            "faults": {k: statistics.median(v) for k, v in faulted.items()}}


def rss_job(rank: int, world: int, framework: str, steps: int, vocab: int = 0, v: bool = False) -> float:
    """Peak RSS of one framework's 1F1B (or, with ``v``, torch's ZBV and Replica's ZB-V);
    ``replica-auto``: Replica with no hint."""
    if vocab:
        CONFIG["vocab_size"] = vocab
    model, x, y = build()
    if framework == "torch":
        module, sched = torch_pipeline(rank, model, "zbv" if v else "1f1b")
        for _ in range(steps):
            torch_step(rank, module, sched, x, y, v)
    elif framework == "replica-auto":  # no hint at all: the tuner's choice
        replica.keep_freed_memory()  # as every Replica run here: glibc keeps freed memory (runtime/heap.py)
        pm = replica.auto_parallel(model, (x,), loss_fn=loss_fn)
        for _ in range(steps):
            pm.zero_grad()
            pm.train_step(x, y)
    else:
        replica.keep_freed_memory()
        pm = replica.auto_parallel(model, (x,), num_stages=4 if v else 2, num_microbatches=MICROBATCHES,
                                   schedule="zb-v" if v else "1f1b", loss_fn=loss_fn,
                                   graded_microbatches=framework != "replica-even",
                                   recompute={"replica-pointwise": "pointwise", "replica-keep": False}.get(framework))
        for _ in range(steps):
            pm.zero_grad()
            pm.train_step(x, y)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB


def median_interval(values: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (rounds drawn with replacement):
    where the median of another run of as many rounds would likely land on this machine."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def paired(times: dict[str, list[float]]) -> None:
    """Per-round ratios: each round times every mode back to back, so a ratio within a round
    is free of the slower drifts between rounds; the median over the rounds, its 95%
    bootstrap interval and the range. The last two columns are the speed-up over
    ``single`` in the same round, as a share of the 1F1B ideal and of two cores' 2.0x."""
    torch_modes = [k for k in times if k.startswith("torch-")]
    if not torch_modes:
        return
    ideal = 2 * MICROBATCHES / (MICROBATCHES + 1)

    def cell(values: list[float], fmt: str) -> str:
        low, high = median_interval(values)
        return (f"{statistics.median(values):{fmt}} [{low:{fmt}}-{high:{fmt}}] "
                f"({min(values):{fmt}}-{max(values):{fmt}})")

    print("\nper-round tokens/s ratios vs torch, and of the ideal and of 2.0x "
          "(median [its 95% interval], min-max over rounds)")
    w = max(20, *(len(k) + 2 for k in times))
    col = 36  # a cell: median [interval] (range)
    print(f"{'mode':<{w}}" + "".join(f"{'vs ' + t:>{col}}" for t in torch_modes) + f"{'of 1F1B ideal':>{col}}"
          f"{'of 2.0x':>{col}}")
    for name, ts in times.items():
        if name == "single":
            continue
        per_batch = ts  # every mode trains the same batch a step: data-parallel replicas split it
        cells = []
        for t in (torch_modes if name.startswith("replica-") else []):
            cells.append(cell([tt / r for tt, r in zip(times[t], per_batch)], ".3f"))
        cells += [""] * (len(torch_modes) - len(cells))
        speedups = [s / r for s, r in zip(times["single"], per_batch)]
        cells.append(cell([x / ideal for x in speedups], ".1%"))
        cells.append(cell([x / 2 for x in speedups], ".1%"))
        print(f"{name:<{w}}" + "".join(f"{c:>{col}}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedules", default="1f1b", help="Replica schedules, comma-separated ('auto': no hint; "
                        "'<name>-even': without graded micro-batches; "
                        "'<name>-late': input gradients sent after the weight gradients; '<name>-pointwise': GELU outputs "
                        "rebuilt in backward; '<name>-keep': every activation kept (recompute=False, no rebuilds); "
                        "'<name>-after': data-parallel all-reduces after the backward; "
                        "'<name>-m<N>': N micro-batches, e.g. 'auto-m1')")
    parser.add_argument("--torch-schedules", default="1f1b", help="torch's: 1f1b, gpipe, zbv")
    parser.add_argument("--vocab", type=int, default=CONFIG["vocab_size"])
    parser.add_argument("--no-rss", action="store_true")
    parser.add_argument("--rss-only", action="store_true", help="measure peak RSS only (torch, replica, keep, "
                        "even, pointwise; and auto beside torch's ZBV)")
    parser.add_argument("--json", help="also write the raw figures here")
    args = parser.parse_args()
    CONFIG["vocab_size"] = args.vocab
    schedules = args.schedules.split(",")
    torch_schedules = args.torch_schedules.split(",")
    if args.rss_only:
        for v, what in ((False, "1F1B"), (True, "ZBV / ZB-V")):
            frameworks = ("torch", "replica", "replica-keep", "replica-even", "replica-pointwise") + \
                (("replica-auto",) if v else ())
            rss = {fw: run_local(rss_job, 2, fw, 3, args.vocab, v, timeout_s=600) for fw in frameworks}
            print(f"peak RSS per rank (MiB), {what}: " + ", ".join(f"{fw} {[round(x) for x in r]}"
                                                                   for fw, r in rss.items()))
        return
    # every mode of a round shares the ranks: all run with glibc keeping freed memory (runtime/heap.py)
    results = run_local(compare, 2, args.rounds, args.steps, schedules, torch_schedules, args.vocab,
                        timeout_s=3000, keep_freed_memory=True)
    result = results[0]
    tokens = BATCH * SEQ
    # every mode trains the same global batch a step (data-parallel replicas split it)
    med = {k: statistics.median(v) for k, v in result["times"].items()}
    base = med["single"]
    ideal = 2 * MICROBATCHES / (MICROBATCHES + 1)
    for name, summary in result["summaries"].items():
        print(f"--- replica {name}\n{summary}")
    best_torch = min(t for k, t in med.items() if k.startswith("torch-"))
    print(f"\nGPT {CONFIG['n_layer']} layers d={CONFIG['n_embd']} vocab {CONFIG['vocab_size']}, batch {BATCH}x{SEQ}, "
          f"{MICROBATCHES} micro-batches, 2 gloo ranks x 1 thread; median of {args.rounds} rounds x {args.steps} steps"
          "; 'step s' is per batch of 32 sequences (data-parallel replicas split it)")
    w = max(20, *(len(k) + 2 for k in med))
    print(f"{'mode':<{w}}{'step s':>9}{'tokens/s':>11}{'vs single':>11}{'of 1F1B ideal':>15}{'of 2.0x':>9}"
          f"{'vs torch best':>15}")
    for name, t in med.items():
        speedup = base / t
        print(f"{name:<{w}}{t:>9.3f}{tokens / t:>11.0f}{speedup:>10.2f}x{speedup / ideal:>15.1%}{speedup / 2:>9.1%}"
              f"{best_torch / t:>14.2f}x")
    paired(result["times"])
    # glibc hands a freed heap top back to the system and the next allocation faults it in
    # again, zero-filled: the cost runtime/heap.py keeps Replica's CPU ranks from paying
    print("\npage faults per step, median over rounds [rank 0, rank 1]: " + ", ".join(
        f"{k} {[round(r['faults'][k]) for r in results]}" for k in result["times"]))
    rss = {}
    if not args.no_rss:
        rss = {fw: run_local(rss_job, 2, fw, 3, args.vocab, timeout_s=600)
               for fw in ("torch", "replica", "replica-pointwise")}
        print("peak RSS per rank (MiB): " + ", ".join(f"{fw} {[round(v) for v in r]}" for fw, r in rss.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"median_s": med, "rss_mib": rss, "ideal": ideal}, indent=2))


if __name__ == "__main__":
    main()
