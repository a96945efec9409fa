"""Two versions of one plan, measured in one pair of ranks: the planner's and a variant of it,
alternating every two steps, so the machine's noise hits both alike.

The benchmark GPT of ``pipeline_vs_torch.py`` on 2 gloo ranks x 1 thread, 8 micro-batches,
Replica's 1F1B. A variant edits the plan the planner made:

- ``shares=A,B,...``: these micro-batch sizes, in samples of the batch of 32 (``even``: 4 each);
- ``plan=PATH``: a whole other plan of the same model (``Plan.to_json``), e.g. another split.

Several edits join with ``;`` (``plan=`` first). At commit 56dd18b it also took ``lag=S:I``
(lagged weight gradients, measured void and taken out: ``benchmarks/RESULTS.md``). Prints
both plans' cut and micro-batch sizes, both median step times, and the median over step
pairs of variant over plan with its 95% bootstrap interval.
Usage: ``python benchmarks/plan_ab.py --steps 40 --variant 'shares=2,5,5,5,5,5,3,2'``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
from benchmarks.pipeline_vs_torch import BATCH, MICROBATCHES, build, median_interval  # noqa: E402
from examples.gpt.model import loss_fn  # noqa: E402
from replica.launch import run_local  # noqa: E402


def parse(variant: str) -> list[replica.Plan | list[int]]:
    """The edits ``variant`` names, checked (see the module docstring), in order: a whole plan,
    or micro-batch sizes. Exits with the reason on a bad one, before any rank starts."""
    edits: list[replica.Plan | list[int]] = []
    for part in filter(None, (p.strip() for p in variant.split(";"))):
        key, _, value = part.partition("=")
        if key == "plan":
            if not Path(value).is_file():
                raise SystemExit(f"plan={value}: no such file; write one with Path(...).write_text(plan.to_json())")
            edits.append(replica.Plan.from_json(Path(value).read_text()))
        elif key == "shares":
            even = ",".join([str(BATCH // MICROBATCHES)] * MICROBATCHES)
            try:
                sizes = [int(n) for n in (even if value == "even" else value).split(",")]
            except ValueError:
                sizes = []
            if len(sizes) != MICROBATCHES or sum(sizes) != BATCH or min(sizes) < 1:
                raise SystemExit(f"shares={value}: give {MICROBATCHES} sizes of at least 1 summing to {BATCH}")
            edits.append(sizes)
        else:
            raise SystemExit(f"unknown edit {part!r}; use plan=PATH or shares=A,B,... (or even)")
    return edits


def edit(plan: replica.Plan, variant: str) -> replica.Plan:
    """``plan`` with the edits ``variant`` names."""
    for change in parse(variant):
        if isinstance(change, replica.Plan):
            plan = change
        else:
            plan = dataclasses.replace(plan, microbatch_shares=tuple(n / BATCH for n in change))
    return plan


def describe(plan: replica.Plan) -> str:
    sizes = [round(s * BATCH) for s in plan.microbatch_shares] or [BATCH // MICROBATCHES] * MICROBATCHES
    cut = ", ".join(b.name for b in plan.stages[0].outputs if b.nbytes)
    return f"cut sends {cut}; sizes {'/'.join(map(str, sizes))}"


def job(rank: int, world: int, variant: str, steps: int) -> tuple[list[float], list[float], str, str]:
    model, x, y = build()
    spare = copy.deepcopy(model)  # a distributed auto_parallel frees the weights other ranks hold
    planned = replica.auto_parallel(model, (x,), loss_fn=loss_fn, num_stages=2, num_microbatches=MICROBATCHES,
                                    schedule="1f1b")
    other = replica.auto_parallel(spare, (x,), loss_fn=loss_fn, plan=edit(planned.plan, variant))
    pms = (planned, other)
    for pm in pms:  # warm-up
        for _ in range(2):
            pm.zero_grad()
            pm.train_step(x, y)
    times: tuple[list[float], list[float]] = ([], [])
    for s in range(steps):
        which = (s // 2) % 2
        dist.barrier()
        start = time.perf_counter()
        pms[which].zero_grad()
        pms[which].train_step(x, y)
        times[which].append(time.perf_counter() - start)
    return times[0], times[1], describe(planned.plan), describe(other.plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps (half of them the variant)")
    parser.add_argument("--variant", action="append", required=True,
                        help="an edit of the plan, e.g. 'shares=2,5,5,5,5,5,3,2' or 'plan=other.json'; repeat for more")
    args = parser.parse_args()
    for variant in args.variant:
        parse(variant)  # a bad edit stops here, not inside the ranks
    for variant in args.variant:
        plan_times, variant_times, plan_text, variant_text = run_local(job, 2, variant, args.steps,
                                                                       timeout_s=1800, keep_freed_memory=True)[0]
        pairs = [b / a for a, b in zip(plan_times, variant_times)]
        low, high = median_interval(pairs)
        print(f"plan    ({plan_text}): {statistics.median(plan_times):.3f} s\n"
              f"variant ({variant_text}): {statistics.median(variant_times):.3f} s\n"
              f"variant / plan per pair {statistics.median(pairs):.3f} [{low:.3f}-{high:.3f}] "
              f"(range {min(pairs):.2f}-{max(pairs):.2f})")


if __name__ == "__main__":
    main()
