"""Expert parallelism (issue #41) against replicated experts, on 2 gloo CPU ranks.

A small MoE GPT (``tests/moe.py``'s ``MoETransformer``: 4 layers, d=128, 8 SwiGLU experts of
hidden 256 per layer, top-2, vocab 512, 64 tokens a sample; the ``"loop"`` experts), one global
batch (default 16 samples) in 2 micro-batches, 1F1B, AdamW, 1 stage x 2 replicas, two ways:
``expert_parallel_size=1`` (every replica holds all 8 experts of a layer, their gradients
all-reduced with the rest) and ``=2`` (each holds 4; tokens go to their experts' rank and back by
``all_to_all_single``; the experts' gradients are not all-reduced). Both are built in the same
processes and their steps (``zero_grad`` + ``train_step`` + ``AdamW.step``, between barriers)
alternated round by round, each round starting with the other one; per rank the median step and
the median, min and max of the per-round ratio to ep=1.

Bytes: wrappers on ``torch.distributed.all_to_all_single`` (the bytes a rank sends to the other
ranks: its input less its own split) and ``all_reduce`` counted over one step, beside the
planner's ``plan.expert_parallel_bytes``. Memory: the bytes a rank holds after a step in
parameters + gradients + AdamW state (local shards), and the most tensor bytes alive during one
step (torch's profiler, as ``sharded_dp.py`` measures it).

Usage: ``python benchmarks/moe.py [--rounds 7] [--batch 16] [--experts 8] [--layers 4]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
from benchmarks.sharded_dp import allocation_peak, held  # noqa: E402
from replica.launch import run_local  # noqa: E402
from tests import moe  # noqa: E402
from tests.models import lm_loss  # noqa: E402

MiB = 1 << 20
SIZES = (1, 2)
_BYTES: Counter = Counter()
_ON = {"on": False}


def _count_all_to_all(fn):
    def wrapper(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if _ON["on"]:
            me = dist.get_rank(group)
            rows = input.shape[0] if input.dim() else 1
            splits = input_split_sizes or [rows // dist.get_world_size(group)] * dist.get_world_size(group)
            row_bytes = input.numel() // max(rows, 1) * input.element_size()
            _BYTES["all-to-all"] += (sum(splits) - splits[me]) * row_bytes
        return fn(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
    return wrapper


def _count_all_reduce(fn):
    def wrapper(tensor, *args, **kwargs):
        if _ON["on"]:
            _BYTES["all-reduce"] += tensor.numel() * tensor.element_size()
        return fn(tensor, *args, **kwargs)
    return wrapper


def make(ep: int, batch: int, experts: int, layers: int) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    config = moe.MoEConfig(dim=128, hidden_dim=256, num_experts=experts, top_k=2)
    model = moe.MoETransformer(config, vocab_size=512, seq_len=64, num_layers=layers, num_heads=4)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 512, (batch, 64), generator=g), torch.randint(0, 512, (batch, 64), generator=g)
    pm = replica.auto_parallel(model, (x,), num_stages=1, num_microbatches=2, schedule="1f1b", loss_fn=lm_loss,
                               sharded_data_parallel=False, expert_parallel_size=ep, graded_microbatches=False)
    assert pm.plan.layout.expert_parallel_size == ep and pm.data_parallel_size == 2, pm.plan.layout.describe()
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-4), x, y


def step(pm, optimizer, x, y) -> None:
    pm.zero_grad()
    pm.train_step(x, y)
    optimizer.step()


def job(rank: int, world: int, rounds: int, batch: int, experts: int, layers: int) -> dict:
    dist.all_to_all_single = _count_all_to_all(dist.all_to_all_single)
    dist.all_reduce = _count_all_reduce(dist.all_reduce)
    runs = {ep: make(ep, batch, experts, layers) for ep in SIZES}
    out: dict[str, Any] = {"rank": rank}
    for ep, (pm, opt, x, y) in runs.items():
        step(pm, opt, x, y)  # warm-up
        _BYTES.clear()
        _ON["on"] = True
        step(pm, opt, x, y)
        _ON["on"] = False
        local, whole = held(pm, opt)
        pm.zero_grad()
        start = held(pm, opt)[0]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            pm.train_step(x, y)
            opt.step()
        out[ep] = {"bytes": dict(_BYTES), "predicted_a2a": pm.plan.expert_parallel_bytes, "held": local,
                   "whole": whole, "peak": start + allocation_peak(prof), "times": [],
                   "imbalance": pm.plan.expert_imbalance, "predicted_s": pm.plan.predicted_step_time_s}
    for r in range(rounds):
        for ep in (SIZES if r % 2 == 0 else SIZES[::-1]):
            dist.barrier()
            start = time.perf_counter()
            step(*runs[ep])
            dist.barrier()
            out[ep]["times"].append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    a = parser.parse_args()
    results = run_local(job, 2, a.rounds, a.batch, a.experts, a.layers, timeout_s=1800, keep_freed_memory=True)
    print("| rank | experts per rank | median step s | vs ep=1 (min-max) | all-to-all MiB sent / step (planner) "
          "| all-reduce MiB / step | held MiB (of whole) | tensor peak MiB (vs ep=1) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        base = r[1]
        for ep in SIZES:
            d = r[ep]
            ratios = [t / b for t, b in zip(d["times"], base["times"])]
            a2a = d["bytes"].get("all-to-all", 0) / MiB
            print(f"| {r['rank']} | {a.experts // ep} (ep={ep}) | {statistics.median(d['times']):.3f} | "
                  f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
                  f"{a2a:.2f} ({d['predicted_a2a'] / MiB:.2f}) | {d['bytes'].get('all-reduce', 0) / MiB:.2f} | "
                  f"{d['held'] / MiB:.1f} ({d['held'] / d['whole']:.0%}) | "
                  f"{d['peak'] / MiB:.1f} ({d['peak'] / base['peak']:.2f}) |")
    print(f"routing imbalance on the example batch (ep=2): {results[0][2]['imbalance']:.2f}; "
          f"predicted step s: ep=1 {results[0][1]['predicted_s']:.3f}, ep=2 {results[0][2]['predicted_s']:.3f}")


if __name__ == "__main__":
    main()
