"""Refinement passes over a chosen plan: graded micro-batches, and rebuilds in backward where they pay."""

from __future__ import annotations

import dataclasses
from typing import Callable

from replica.partition.partitioner import held_activations, saves_activation
from replica.partition.plan import Plan
from replica.planner.costs import stage_costs_from_plan
from replica.planner.pricing import Pricing
from replica.schedules.grading import grade
from replica.schedules.schedule import Schedule, placement, plan_schedule
from replica.schedules.simulate import StageCosts, simulate
from replica.stage.remat import REBUILT_OPS

__all__ = ["finish", "rebuilds", "pay_for_grading", "graded_plan"]


def finish(pricing: Pricing, plan: Plan, batch_fraction: float = 1.0, graded: bool | None = None,
           rebuild: bool = True) -> Plan:
    """The chosen plan made final: micro-batches graded (unless ``graded`` is False, or
    the planner was made without), then rebuilds where they pay for the graded sizes'
    memory (:meth:`pay_for_grading`), then where they are as good as free in what time
    is left (:meth:`rebuilds`): needed memory first, unasked memory only from true idle
    time; unless ``rebuild`` is False: ``recompute=False`` keeps every activation."""
    graded = pricing.graded if graded is None else graded
    shaped = graded_plan(pricing, plan, batch_fraction) if graded else plan
    if not rebuild:
        return shaped
    paid = shaped if shaped is plan else pay_for_grading(pricing, shaped, plan, batch_fraction)
    return rebuilds(pricing, paid, batch_fraction)


def rebuilds(pricing: Pricing, plan: Plan, batch_fraction: float = 1.0) -> Plan:
    """``plan`` with ``rebuilds``: the (stage, kind) pairs whose op outputs (GELU / SiLU,
    LayerNorm) are rebuilt in backward (:mod:`replica.stage.remat`) instead of kept,
    where the rebuild fills time the stage would spend waiting for a slower one: a pair
    is taken if its stage, rebuild added, stays no slower than the plan's slowest stage
    and the simulated step within ``PlannerOptions.tie`` of the plan's (predictions that close are a
    tie the least memory wins, as in the tuner). The stages with the most idle time go
    first, and on each the most bytes per second of rebuild. The slowest stage rebuilds
    nothing: measured, rebuilding GELU outputs there cost 2% of the step where the model
    predicted 0.7% (benchmarks/RESULTS.md). For the same reason a free rebuild must fit
    its stage's idle time at ``PlannerOptions.rebuild_risk`` times its price: a memory nobody asked for
    is not worth a bet on the model's idle time. A GELU's output is a quarter of a transformer
    layer's activations, each norm's a sixteenth. A taken pair adds its rebuild to the
    stage's predicted backward and takes its outputs off the stage's activations (held
    as often as the plan holds the stage's micro-batches)."""
    found = _rebuild_candidates(pricing, plan, batch_fraction)
    if not found:
        return plan  # nothing kept to rebuild; rebuilt everywhere already; nobody waits
    step_time = _step_time(pricing, plan)
    base = step_time(plan)
    # the rebuilds the plan has (paying for graded sizes) stay; risked: those taken here
    # priced at rebuild_risk times
    taken, best, risked = list(plan.rebuilds), plan, plan
    for k, kind in sorted(found, key=lambda key: (plan.stages[key[0]].predicted_time_s,
                                                  -found[key][1] / max(found[key][0], 1e-12))):
        seconds, nbytes = found[(k, kind)]
        trial = _with_rebuild(risked, k, seconds * pricing.options.rebuild_risk, nbytes)
        if trial.stages[k].predicted_time_s > plan.bottleneck_s:
            continue  # it would not fill a wait but lengthen the slowest stage
        if step_time(trial) <= base * (1 + pricing.options.tie):
            taken.append((k, kind))
            best, risked = _with_rebuild(best, k, seconds, nbytes), trial
    if best is plan:
        return plan
    return dataclasses.replace(best, rebuilds=tuple(sorted(taken)),
                               predicted_step_time_s=plan.predicted_step_time_s + step_time(best) - base)


def pay_for_grading(pricing: Pricing, plan: Plan, even: Plan, batch_fraction: float = 1.0) -> Plan:
    """``plan`` (graded, nothing rebuilt yet) with rebuilds where its graded micro-batches
    make a rank hold more than ``even`` (the same stages with even micro-batches, nothing
    rebuilt) would at its simulated peak, as far as the grading's time gain pays for
    them: the step stays at least ``PlannerOptions.min_gain`` shorter than even's.

    The larger middle micro-batches raise the peak of a rank that holds several at once
    (the first of 1F1B holds two on two ranks: 5 + 5 samples of 32 instead of 4 + 4).
    Such a rank rebuilds, most bytes per second first, on its stages but the plan's
    slowest (see :meth:`rebuilds`), even where that makes the stage a little slower than
    a free rebuild may. A rank that runs out of candidates keeps the rest of its peak."""
    found = _rebuild_candidates(pricing, plan, batch_fraction)
    schedule = plan_schedule(plan)
    where = placement(schedule)
    costs = _stage_costs(pricing, schedule)
    sizes = plan.relative_microbatch_sizes
    even_timeline = simulate(schedule, costs(even))
    limit, ceiling = even_timeline.peak_memory_bytes, even_timeline.step_time_s * (1 - pricing.options.min_gain)
    start = timeline = simulate(schedule, costs(plan), sizes=sizes)
    taken, best = list(plan.rebuilds), plan
    over = {r for r, peak in enumerate(timeline.peak_memory_bytes) if peak > limit[r]}
    options = [key for key in found if even.stages[key[0]].predicted_time_s < even.bottleneck_s]
    while over:
        options = [key for key in options if where[key[0]] in over]
        if not options:
            break
        key = max(options, key=lambda key: found[key][1] / max(found[key][0], 1e-12))
        options.remove(key)
        trial = _with_rebuild(best, key[0], *found[key])
        t = simulate(schedule, costs(trial), sizes=sizes)
        if t.step_time_s > ceiling:
            continue  # the grading would no longer pay for itself
        best, timeline = trial, t
        taken.append(key)
        over = {r for r in over if timeline.peak_memory_bytes[r] > limit[r]}
    if best is plan:
        return plan
    return dataclasses.replace(best, rebuilds=tuple(sorted(taken)), predicted_step_time_s=(
        plan.predicted_step_time_s + timeline.step_time_s - start.step_time_s))


def _rebuild_candidates(pricing: Pricing, plan: Plan,
                        batch_fraction: float) -> dict[tuple[int, str], tuple[float, int]]:
    """(stage, kind) -> (seconds per step, bytes per micro-batch) of rebuilding that kind's
    kept outputs on that stage; nothing under full or pointwise recompute, or on one stage; no
    norm where sharded replicas run a split backward (a W would rebuild it from weights FSDP may
    have freed since its B: :func:`replica.parallel.parallelize.parallelize` leaves them as they are)."""
    found: dict[tuple[int, str], tuple[float, int]] = {}
    if plan.recompute or plan.pointwise_recompute or plan.num_stages == 1:
        return found
    no_norms = plan.layout.sharded and plan.layout.kind.splits_backward
    t = plan.layout.tensor_parallel_size
    by_name = {n.name: n for n in pricing.graph_for(t).nodes}
    specs = pricing.specs(plan.num_stages)
    for st, sp in zip(plan.stages, specs):
        cm = pricing.cost_model(sp, batch_fraction, t)
        for name in st.node_names:
            n = by_name[name]
            kind = REBUILT_OPS.get(n.target)
            if kind is not None and saves_activation(n) and (st.stage_index, kind) not in plan.rebuilds \
                    and not (no_norms and kind == "norm"):
                seconds, nbytes = found.get((st.stage_index, kind), (0.0, 0))
                found[(st.stage_index, kind)] = (seconds + cm.forward_time(n, plan.num_microbatches),
                                                 nbytes + int(cm.scaled(n.output_bytes)))
    return found


def _with_rebuild(plan: Plan, k: int, seconds: float, nbytes: int) -> Plan:
    """``plan`` with stage ``k`` rebuilding ``nbytes`` of outputs in ``seconds`` more backward."""
    st = plan.stages[k]
    held = held_activations(nbytes, 0, 0, st.in_flight, plan.num_microbatches)  # per micro-batch in flight
    stage = dataclasses.replace(
        st, backward_time_s=st.backward_time_s + seconds, activation_bytes=st.activation_bytes - nbytes,
        memory=dataclasses.replace(st.memory, activations=int(st.memory.activations - held)))
    return dataclasses.replace(plan, stages=tuple(stage if s.stage_index == k else s for s in plan.stages))


def _stage_costs(pricing: Pricing, schedule: Schedule) -> Callable[[Plan], list[StageCosts]]:
    """A plan's per-micro-batch stage costs under ``schedule`` on this planner's device."""
    device = pricing.first_spec()
    return lambda p: stage_costs_from_plan(p, schedule, device=device)


def _step_time(pricing: Pricing, plan: Plan) -> Callable[[Plan], float]:
    """The simulated step of a plan like ``plan`` (same schedule and micro-batch sizes)."""
    schedule = plan_schedule(plan)
    costs = _stage_costs(pricing, schedule)
    sizes = plan.relative_microbatch_sizes
    return lambda p: simulate(schedule, costs(p), sizes=sizes).step_time_s


def graded_plan(pricing: Pricing, plan: Plan, batch_fraction: float = 1.0) -> Plan:
    """``plan`` with graded micro-batch shares when the simulator says they beat even ones
    (its predicted step shortened by what they save), else ``plan`` itself."""
    m = plan.num_microbatches
    if plan.num_stages == 1 or m < 2:
        return plan
    schedule = plan_schedule(plan)
    costs = stage_costs_from_plan(plan, schedule, device=pricing.first_spec())
    batch = max(m, round(pricing.batch * batch_fraction))
    sizes, step, even = grade(schedule, costs, batch, m, memory_limit=pricing.budget_per_device(),
                                min_gain=pricing.options.min_gain)
    if len(set(sizes)) == 1:
        return plan
    timeline = simulate(schedule, costs, sizes=[s * m / batch for s in sizes])
    return dataclasses.replace(
        plan, microbatch_shares=tuple(s / batch for s in sizes), simulated_bubble=timeline.bubble_fraction,
        predicted_step_time_s=max(0.0, plan.predicted_step_time_s - (even - step)),
    )
