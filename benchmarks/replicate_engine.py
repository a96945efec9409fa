"""Whole data-parallel replicas: Replica's bucketed all-reduce against torch's engine (FSDP2 without sharding).

Issue #37 asks for replicated data parallelism on torch's own engine unless a benchmark shows it
cannot serve. Torch's engines and Replica's schedules:

- DDP (``DistributedDataParallel``, composable ``replicate``) decides at FORWARD time whether the
  matching backward synchronises (``require_backward_grad_sync``), so in a pipeline, where a
  micro-batch's forward runs before other micro-batches' backwards, it would reduce on the wrong
  backward: it cannot serve a pipeline with several micro-batches at all.
- FSDP2 with a shard group of one replica (HSDP over ``(dp_replicate=d, dp_shard=1)``, i.e.
  ``sharded_data_parallel="zero2", shard_group_size=1``) all-reduces each unit's gradients in its
  post-backward hook and is told per backward whether it is the step's last
  (``set_requires_gradient_sync``). It serves GPipe / 1F1B / interleaved, but not weight gradients
  computed outside autograd's backward: zero-bubble's W actions, nor a backward that sends its input
  gradient to the previous rank before computing its weight gradients (Replica's default across
  ranks, ``Plan.sends_input_grads_early``). Its parameters and ``.grad`` become DTensors.
- ``replica/parallel/gradsync.py``: buckets of 4 MiB all-reduced as the last backward makes them,
  or after the action where weight gradients are deferred; plain tensors; every schedule.

This script trains the benchmark GPT of ``pipeline_vs_torch.py`` under both engines in the same
processes, alternating them round by round: 2 ranks (1 stage x 2 replicas, where both engines run
the same backward) and 4 ranks (2 stages x 2 replicas, 1F1B: gradsync with early input-gradient
sends, FSDP2 without, as it must). Step = ``zero_grad`` + ``train_step`` + ``AdamW.step``. It also
checks that both give the same gradients (gathered) on the first step.

Usage: ``python benchmarks/replicate_engine.py [--worlds 2,4] [--rounds 7] [--steps 2] [--batch 32]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
from benchmarks.pipeline_vs_torch import build, timed  # noqa: E402
from examples.gpt.model import loss_fn  # noqa: E402
from replica.launch import run_local  # noqa: E402

STAGES = {2: 1, 4: 2}  # world -> pipeline stages (2 replicas each)
ENGINES = {"gradsync": dict(sharded_data_parallel=False),
           "fsdp2-replicate": dict(sharded_data_parallel="zero2", shard_group_size=1)}


def job(rank: int, world: int, rounds: int, steps: int, batch: int) -> dict:
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    runs = {}
    for name, engine in ENGINES.items():
        model, x, y = build()
        x, y = x[:batch], y[:batch]
        pm = replica.auto_parallel(model, (x,), num_stages=STAGES[world], num_microbatches=4, schedule="1f1b",
                                   loss_fn=loss_fn, graded_microbatches=False, **engine)
        runs[name] = (pm, torch.optim.AdamW(pm.parameters(), lr=1e-4), x, y)
    first = {}
    for name, (pm, _, x, y) in runs.items():  # the same gradients, gathered whole
        pm.zero_grad()
        pm.train_step(x, y)
        first[name] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                       for n, p in pm.named_parameters()}
    a, b = first.values()
    worst = max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-12)) for n in a)

    def step_fn(pm, optimizer, x, y):
        def step() -> None:
            pm.zero_grad()
            pm.train_step(x, y)
            optimizer.step()
        return step

    fns = {name: step_fn(*r) for name, r in runs.items()}
    for fn in fns.values():
        timed(fn, 1)
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for r in range(rounds):
        for name in order[r % 2:] + order[:r % 2]:
            times[name].append(timed(fns[name], steps)[0])
    layouts = {name: r[0].plan.layout.describe() + (", early input gradients" if r[0].runtime.executor.early else "")
               for name, r in runs.items()}
    return dict(rank=rank, times=times, worst=worst, layouts=layouts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}, load {os.getloadavg()[0]:.1f}, {args}")
    print("| ranks | layout (gradsync) | gradsync step s | FSDP2-replicate step s | FSDP2 / gradsync (median, range) "
          "| worst relative grad difference |")
    print("|---|---|---|---|---|---|")
    for world in [int(w) for w in args.worlds.split(",")]:
        start = time.perf_counter()
        results = run_local(job, world, args.rounds, args.steps, args.batch, timeout_s=900, keep_freed_memory=True)
        r0 = results[0]
        ratios = [f / g for f, g in zip(r0["times"]["fsdp2-replicate"], r0["times"]["gradsync"])]
        print(f"| {world} | {r0['layouts']['gradsync']} | {statistics.median(r0['times']['gradsync']):.3f} | "
              f"{statistics.median(r0['times']['fsdp2-replicate']):.3f} | {statistics.median(ratios):.3f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}) | {max(r['worst'] for r in results):.1e} |")
        print(f"  ({time.perf_counter() - start:.0f} s; FSDP2's layout: {r0['layouts']['fsdp2-replicate']})",
              file=sys.stderr)


if __name__ == "__main__":
    main()
