"""What a rebuild kind (or the in-place weight-gradient sum) costs Replica's 1F1B, measured
in one pair of ranks: the plan's pipeline and a variant alternate every two steps, so the
machine's noise hits both alike.

The benchmark GPT of ``pipeline_vs_torch.py`` on 2 gloo ranks x 1 thread, 8 micro-batches.
Variants of the planned pipeline (each against the plan as it is):

- ``norm``: stage 0 also rebuilds LayerNorm outputs;
- ``keep``: no stage rebuilds anything;
- ``rewrite-0``: stage 0's linears rewritten to collect their weight gradients
  (``stage/weightgrad.py``), each added into ``.grad`` by ``addmm_`` inside the backward,
  as before commit ae4faae; the plan runs autograd's own linears there, as a stage that
  sends no input gradient back does now. (Until that commit this file measured the
  reverse, ``autograd-w``: autograd's accumulation on a rewritten stage 0.)

Prints, per variant, both median step times and the median over step pairs of variant over
plan. Usage: ``python benchmarks/rebuild_cost.py [--steps 40] [--variants norm,keep,rewrite-0]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch.distributed as dist
import torch.fx as fx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
from benchmarks.pipeline_vs_torch import build  # noqa: E402
from examples.gpt.model import loss_fn  # noqa: E402
from replica.launch import run_local  # noqa: E402
from replica.stage.weightgrad import defer_linear_weight_grads  # noqa: E402

VARIANTS = ("norm", "keep", "rewrite-0")


def job(rank: int, world: int, variant: str, steps: int) -> tuple[list[float], list[float], str]:
    model, x, y = build()
    pm = replica.auto_parallel(model, (x,), loss_fn=loss_fn, num_stages=2, num_microbatches=8, schedule="1f1b")
    runtime = pm.runtime
    planned = dict(runtime.executor.rebuilt)
    modules = {}
    if variant == "rewrite-0" and 0 in runtime.stages:  # a rewritten twin sharing the stage's parameters
        plain = runtime.stages[0].module
        twin = fx.GraphModule(plain, copy.deepcopy(plain.graph))
        if not defer_linear_weight_grads(twin):
            raise SystemExit("rewrite-0: stage 0 has no linear to rewrite")
        modules = {False: plain, True: twin}

    def use(variant_now: bool) -> None:
        if modules:
            runtime.stages[0].module = modules[variant_now]
        runtime.executor.rebuilt = dict(planned)
        if variant_now and variant == "keep":
            runtime.executor.rebuilt = {}
        if variant_now and variant == "norm" and 0 in runtime.stages:
            runtime.executor.rebuilt[0] = planned.get(0, frozenset()) | {"norm"}

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
        plan, alt, rebuilds = run_local(job, 2, variant, args.steps, timeout_s=1800,
                                            keep_freed_memory=True)[0]  # glibc keeps freed memory
        pairs = [b / a for a, b in zip(plan, alt)]
        print(f"{variant:11s} plan (rebuilds {rebuilds}) {statistics.median(plan):.3f} s, variant "
              f"{statistics.median(alt):.3f} s; variant / plan per pair {statistics.median(pairs):.3f} "
              f"({min(pairs):.2f}-{max(pairs):.2f})")


if __name__ == "__main__":
    main()
