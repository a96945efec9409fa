"""What a rebuild kind (or the in-place weight-gradient sum) costs Replica's 1F1B, measured
in one pair of ranks: the plan's pipeline and a variant alternate every two steps, so the
machine's noise hits both alike.

The benchmark GPT of ``pipeline_vs_torch.py`` on 2 gloo ranks x 1 thread, 8 micro-batches.
Variants of the planned pipeline (each against the plan as it is):

- ``norm``: stage 0 also rebuilds LayerNorm outputs;
- ``keep``: no stage rebuilds anything;
- ``autograd-w``: a backward's weight gradients go through autograd's accumulation (a
  temporary, then an add) instead of ``addmm_`` into ``.grad``.

Prints, per variant, both median step times and the median over step pairs of variant over
plan. Usage: ``python benchmarks/rebuild_cost.py [--steps 40] [--variants norm,keep,autograd-w]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
import replica.pipeline.distributed as distributed  # noqa: E402
from benchmarks.pipeline_vs_torch import build  # noqa: E402
from examples.gpt.model import loss_fn  # noqa: E402
from replica.launch import run_local  # noqa: E402
from replica.pipeline.weightgrad import WeightGrads  # noqa: E402

VARIANTS = ("norm", "keep", "autograd-w")


def job(rank: int, world: int, variant: str, steps: int) -> tuple[list[float], list[float], str]:
    model, x, y = build()
    pm = replica.auto_parallel(model, (x,), loss_fn=loss_fn, num_stages=2, num_microbatches=8, schedule="1f1b")
    runtime = pm.runtime
    planned = dict(runtime.pointwise_recompute)
    alt = [False]
    if variant == "autograd-w":  # the runtime's in-place collector off while the variant runs
        distributed.WeightGrads = lambda now=False: None if now and alt[0] else WeightGrads(now=now)  # type: ignore

    def use(variant_now: bool) -> None:
        alt[0] = variant_now
        runtime.pointwise_recompute = dict(planned)
        if variant_now and variant == "keep":
            runtime.pointwise_recompute = {}
        if variant_now and variant == "norm" and 0 in runtime.stages:
            runtime.pointwise_recompute[0] = planned.get(0, frozenset()) | {"norm"}

    for _ in range(2):  # warm-up
        pm.zero_grad()
        pm.train_step(x, y)
    times: dict[bool, list[float]] = {False: [], True: []}
    for s in range(steps):
        variant_now = (s // 2) % 2 == 1
        use(variant_now)
        dist.barrier()
        start = time.perf_counter()
        pm.zero_grad()
        pm.train_step(x, y)
        times[variant_now].append(time.perf_counter() - start)
    return times[False], times[True], str(pm.plan.rebuilds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per variant run (half of them the variant)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    for variant in variants:
        plan, alt, rebuilds = run_local(job, 2, variant, args.steps, timeout_s=1800)[0]
        pairs = [b / a for a, b in zip(plan, alt)]
        print(f"{variant:11s} plan (rebuilds {rebuilds}) {statistics.median(plan):.3f} s, variant "
              f"{statistics.median(alt):.3f} s; variant / plan per pair {statistics.median(pairs):.3f} "
              f"({min(pairs):.2f}-{max(pairs):.2f})")


if __name__ == "__main__":
    main()
