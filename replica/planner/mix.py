"""Per-stage recompute modes: the tuner's layout with each stage checkpointing only what its rank's memory needs.

The tuner prices every stage of a layout in one recompute mode. Under 1F1B the first stage
holds P micro-batches in flight and the last one, so a mode that the first stage needs to fit
is wasted time on the last. :func:`mix_recompute` takes the tuner's pick (a plan checkpointing
somewhere) and its cuts, prices each stage in every mode (False, its first k blocks, "selective",
True: one re-pricing of the same cuts per mode, nothing solved), and starts every stage at its
fastest mode; while a rank is over the budget (its peak walked over its actions,
:func:`replica.planner.costs.rank_memory`) the stage of that rank whose next slower mode saves
the most bytes per second added moves to it. The mix is then cut again for its own modes (the
solver balances stages of different modes) and kept, re-cut or not, where it is faster than the
uniform plan and fits. O(modes) re-pricings, one solve, a few simulations.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from replica.errors import PartitionError
from replica.layout import Layout
from replica.partition.plan import Plan, StagePlan
from replica.planner.costs import rank_memory, stage_costs_from_plan
from replica.schedules.actions import placement
from replica.schedules.schedule import Schedule

__all__ = ["mix_recompute", "stage_modes", "rank_peaks"]

Mode = Any  # bool | str | int: a recompute mode
MAX_K = 4  # k modes tried per mix: the first k blocks for at most this many values of k


def stage_modes(num_blocks: int) -> list[Mode]:
    """The modes a stage of ``num_blocks`` blocks may take, roughly fastest first: none, its first
    k blocks (k < all: a few values spread over them), selective, every block."""
    ks = sorted({max(1, round(num_blocks * j / MAX_K)) for j in range(1, MAX_K + 1)} - {num_blocks})
    return [False, *(ks if num_blocks > 1 else []), "selective", True] if num_blocks else [False, True]


def _time(s: StagePlan) -> float:
    return s.forward_time_s + s.backward_time_s


def mix_recompute(plan: Plan, layout: Layout, schedule: Schedule, *,
                  price: Callable[[Mode | tuple[Mode, ...], Plan | None], Plan],
                  memory: Callable[[Plan, Schedule], list[float]], budget: float) -> list[Plan]:
    """Plans of ``layout`` whose stages each take the fastest recompute mode their rank's memory
    allows, from ``plan`` (the tuner's, checkpointing somewhere): on its cuts, and cut again for
    those modes where that fits; none where no mix fits or differs from ``plan``.
    ``price(modes, like)`` prices the layout with ``modes`` (one, or one per stage) on ``like``'s
    cuts (None: cut anew within the budget); ``memory(plan, schedule)``: each rank's peak bytes."""
    n = plan.num_stages
    modes_of = [stage_modes(len(s.blocks)) for s in plan.stages]
    priced: dict[str, Plan] = {}
    for mode in {repr(x): x for ms in modes_of for x in ms}.values():
        try:
            priced[repr(mode)] = price(mode, plan)
        except PartitionError:
            continue
    where = placement(schedule)
    # per stage, its modes that each hold less than every faster one: (mode, its stage plan)
    rungs: list[list[tuple[Mode, StagePlan]]] = []
    for k in range(n):
        options = sorted(((x, priced[repr(x)].stages[k]) for x in modes_of[k] if repr(x) in priced),
                         key=lambda o: _time(o[1]))
        kept: list[tuple[Mode, StagePlan]] = []
        for x, s in options:
            if not kept or s.memory.activations < kept[-1][1].memory.activations:
                kept.append((x, s))
        rungs.append(kept)
    if any(not r for r in rungs):
        return []
    choice = [0] * n

    def assemble() -> Plan:
        stages = tuple(rungs[k][choice[k]][1] for k in range(n))
        checkpoints = any(s.recompute is not False and s.recompute != 0 for s in stages)
        return dataclasses.replace(plan, stages=stages, recompute=checkpoints, early_input_grads=False)

    for _ in range(sum(len(r) for r in rungs)):
        mixed = assemble()
        over = [r for r, b in enumerate(memory(mixed, schedule)) if b > budget]
        if not over:
            break
        for r in over:
            steps = [(k, rungs[k][choice[k]][1], rungs[k][choice[k] + 1][1]) for k in range(n)
                     if where[k] == r and choice[k] + 1 < len(rungs[k])]
            if not steps:
                return []
            k = max(steps, key=lambda t: (t[1].memory.activations - t[2].memory.activations)
                    / max(_time(t[2]) - _time(t[1]), 1e-12))[0]
            choice[k] += 1
    else:
        return []
    modes = tuple(rungs[k][choice[k]][0] for k in range(n))
    if [repr(x) for x in modes] == [repr(s.recompute) for s in plan.stages]:
        return []
    mixes = [assemble()]
    try:  # cut again for these modes: the stages that rerun less may take more ops
        recut = price(modes, None)
    except PartitionError:
        return mixes
    # a stage cut again may hold fewer blocks than its k: that cut means another mode than chosen
    if all(not isinstance(x, int) or isinstance(x, bool) or x < len(s.blocks) for x, s in zip(modes, recut.stages)):
        mixes.append(recut)
    return mixes


def rank_peaks(lay_out: Callable[[Plan, Layout, Schedule], tuple[Plan, Sequence[float]]], layout: Layout,
               device: Any) -> Callable[[Plan, Schedule], list[float]]:
    """``memory`` for :func:`mix_recompute`: each rank's peak of a plan laid out in ``layout``."""
    def peaks(plan: Plan, schedule: Schedule) -> list[float]:
        held, _ = lay_out(plan, layout, schedule)
        return rank_memory(stage_costs_from_plan(held, schedule, device=device), schedule)
    return peaks
