"""Replica vs torch.distributed.pipelining on 2 CPU ranks (gloo, 1 thread each), side by side.

GPT 8 layers, d=256, vocab 512, batch 32×128, 8 micro-batches. Modes, alternated
round by round in one pair of processes so machine noise hits all alike:

- ``single``: the plain model, one process, one thread (rank 0 alone; rank 1 waits);
- ``torch-1f1b``: torch's ``Schedule1F1B`` on hand-built stages split at the middle block
  (embeddings + blocks 0-3 | blocks 4-7 + final norm + head);
- ``replica-<schedule>``: ``replica.auto_parallel`` with no hint but the schedule.

Peak RSS is measured per framework in fresh processes (ru_maxrss is a lifetime peak).
Usage: ``python benchmarks/pipeline_vs_torch.py [--rounds 5] [--steps 3]``.
"""

from __future__ import annotations

import argparse
import copy
import json
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


def torch_pipeline(rank: int, model: GPT, schedule: str = "1f1b"):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    half = CONFIG["n_layer"] // 2
    module = FirstHalf(model, half) if rank == 0 else SecondHalf(model, half)
    stage = PipelineStage(module, stage_index=rank, num_stages=2, device=torch.device("cpu"))
    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    return module, cls(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)


def torch_step(rank: int, module: nn.Module, sched, x: torch.Tensor, y: torch.Tensor) -> None:
    module.zero_grad(set_to_none=True)
    if rank == 0:
        sched.step(x)
    else:
        sched.step(target=y, losses=[])


def timed(fn, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) / steps


def compare(rank: int, world: int, rounds: int, steps: int, schedules: list[str]) -> dict:
    model, x, y = build()
    plain = copy.deepcopy(model)
    t_module, t_sched = torch_pipeline(rank, copy.deepcopy(model))
    pms = {s: replica.auto_parallel(copy.deepcopy(model), (x,), num_stages=2, num_microbatches=MICROBATCHES,
                                    schedule=s, loss_fn=loss_fn) for s in schedules}

    def single() -> None:
        if rank == 0:
            plain.zero_grad(set_to_none=True)
            loss_fn(plain(x), y).backward()

    modes = {"single": single, "torch-1f1b": lambda: torch_step(rank, t_module, t_sched, x, y)}
    for s, pm in pms.items():
        modes[f"replica-{s}"] = (lambda pm=pm: (pm.zero_grad(), pm.train_step(x, y)))
    for fn in modes.values():  # warm up every path once
        timed(fn, 1)
    times: dict[str, list[float]] = {k: [] for k in modes}
    for _ in range(rounds):
        for name, fn in modes.items():
            times[name].append(timed(fn, steps))
    plan = next(iter(pms.values())).plan
    return {"times": times, "plan": [len(s.node_names) for s in plan.stages],
            "predicted": [s.predicted_time_s for s in plan.stages], "summary": plan.summary()}


def rss_job(rank: int, world: int, framework: str, steps: int) -> float:
    model, x, y = build()
    if framework == "torch":
        module, sched = torch_pipeline(rank, model)
        for _ in range(steps):
            torch_step(rank, module, sched, x, y)
    else:
        pm = replica.auto_parallel(model, (x,), num_stages=2, num_microbatches=MICROBATCHES, loss_fn=loss_fn)
        for _ in range(steps):
            pm.zero_grad()
            pm.train_step(x, y)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedules", default="1f1b")
    parser.add_argument("--json", help="also write the raw figures here")
    args = parser.parse_args()
    schedules = args.schedules.split(",")
    result = run_local(compare, 2, args.rounds, args.steps, schedules, timeout_s=1800)[0]
    tokens = BATCH * SEQ
    med = {k: statistics.median(v) for k, v in result["times"].items()}
    base = med["single"]
    ideal = 2 * MICROBATCHES / (MICROBATCHES + 1)
    print(result["summary"])
    print(f"\nGPT {CONFIG['n_layer']} layers d={CONFIG['n_embd']} vocab {CONFIG['vocab_size']}, batch {BATCH}x{SEQ}, "
          f"{MICROBATCHES} micro-batches, 2 gloo ranks x 1 thread; median of {args.rounds} rounds x {args.steps} steps")
    print(f"{'mode':<18}{'step s':>9}{'tokens/s':>11}{'vs single':>11}{'of ideal':>10}{'vs torch':>10}")
    for name, t in med.items():
        speedup = base / t
        print(f"{name:<18}{t:>9.3f}{tokens / t:>11.0f}{speedup:>10.2f}x{speedup / ideal:>10.1%}"
              f"{med['torch-1f1b'] / t:>9.2f}x")
    rss = {fw: run_local(rss_job, 2, fw, 3, timeout_s=600) for fw in ("torch", "replica")}
    print("peak RSS per rank (MiB): " + ", ".join(f"{fw} {[round(v) for v in r]}" for fw, r in rss.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"median_s": med, "rss_mib": rss, "ideal": ideal}, indent=2))


if __name__ == "__main__":
    main()
