"""The auto-tuner: tensor × pipeline ranks × replicas × experts × sharding × micro-batches × schedule, by simulation.

For every way to factor the world into tensor-parallel ranks per stage, pipeline ranks and
data-parallel replicas (and, in a mixture of experts, each expert-parallel size the replicas
allow), the graph is partitioned once (per stage count, replica count, tensor-parallel size,
expert-parallel size, micro-batch count and recompute); every schedule, sharding of the
replicas and micro-batch count is then priced by replaying its action lists in the
simulator with the stages' costs scaled to the replica's batch, their memory as the
sharding holds it checked against the memory budget, and charged what the replicas'
collectives leave exposed (:mod:`replica.planner.dataparallel`). The fastest
configuration that fits is partitioned again exactly for its own micro-batches,
schedule and sharding.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

from replica.errors import ConfigError, PartitionError, ScheduleError
from replica.layout import TUNED_SCHEDULES, Layout, schedule_kind
from replica.partition.cost import DeviceSpec
from replica.partition.partitioner import held_activations
from replica.partition.plan import Plan
from replica.planner.costs import rank_memory, stage_costs_from_plan
from replica.planner.mix import mix_recompute, rank_peaks
from replica.planner.options import PlannerOptions
from replica.schedules.schedule import (
    WEIGHT_SHARE,
    Schedule,
    durations_of,
    make_schedule,
    max_in_flight,
    stage_scale_of,
)
from replica.schedules.simulate import simulate

__all__ = ["Candidate", "tune", "lower_bound"]

INF = float("inf")


@dataclass(frozen=True)
class Candidate:
    """One configuration and what the simulator predicts for it."""

    layout: Layout
    num_microbatches: int
    step_time_s: float
    peak_memory_bytes: int
    fits: bool
    recompute: bool | str | int | tuple[bool | str | int, ...] = False  # one mode, or each stage's
    bubble: float = -1.0

    def describe(self) -> str:
        return (f"{self.layout.describe()}, {self.num_microbatches} micro-batches"
                f"{'' if self.recompute is False else f', recompute={self.recompute!r}'}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _microbatch_choices(batch: int, ranks: int, given: int | None, stages: int,
                        max_actions: int = PlannerOptions().max_simulated_actions) -> list[int]:
    """A few micro-batch counts around the pipeline depth (the bubble shrinks as m grows,
    the per-call overhead grows), small enough to simulate quickly."""
    if given is not None:
        return [given] if given <= batch else []
    if ranks == 1:  # no bubble: micro-batches only shrink each op's tensors (to fit the cache)
        return [m for m in (1, 2, 4, 8) if m <= batch]
    # beyond 4 micro-batches per rank the bubble gain is small and every extra micro-batch
    # pays the runtime's per-action cost, which the op profile does not see
    wanted = {ranks, 2 * ranks, 4 * ranks}
    cap = max(ranks, max_actions // (3 * stages))
    return sorted(m for m in wanted if 1 <= m <= min(batch, cap))


LayOut = Callable[[Plan, Layout, Schedule], tuple[Plan, list[float]]]

KEPT = 6  # the best candidate and the alternatives a plan names (Plan.alternatives: 5)


def _rank_of(layout: Layout, k: int) -> int:
    """The pipeline rank stage ``k`` runs on under ``layout``'s schedule (its placement)."""
    p = layout.pipeline_ranks
    placement = layout.kind.placement
    if placement == "looped":
        return k % p
    if placement == "v":
        return k if k < p else 2 * p - 1 - k
    return k


def lower_bound(plan: Plan, layout: Layout) -> float:
    """A step time no schedule of ``layout`` simulates ``plan``'s stages (even micro-batches)
    faster than: per rank, its actions back to back after the first micro-batch's forward
    reaches its first stage; where backward is not split (the rank's last action is then its
    first stage's last backward), plus that backward's input gradient travelling back to
    stage 0 (each backward sends it after ``1 - WEIGHT_SHARE`` of itself at the earliest).
    Transfers and collectives only add to it."""
    m = plan.num_microbatches
    forward = [s.forward_time_s / m for s in plan.stages]
    backward = [s.backward_time_s / m for s in plan.stages]
    busy: dict[int, float] = {}
    first: dict[int, int] = {}
    for k in range(plan.num_stages):
        r = _rank_of(layout, k)
        busy[r] = busy.get(r, 0.0) + (forward[k] + backward[k]) * m
        first[r] = min(first.get(r, k), k)
    share = 1 - WEIGHT_SHARE
    best = 0.0
    for r, work in busy.items():
        k = first[r]
        bound = sum(forward[:k]) + work
        if k > 0 and not layout.kind.splits_backward:
            bound += share * sum(backward[1:k]) + backward[0] - (1 - share) * backward[k]
        best = max(best, bound, work)  # a rank does its own work at least
    return best


def _zero_bubble_floor(plan: Plan, layout: Layout) -> float:
    """The memory of a zero-bubble candidate's fullest rank by the micro-batches its order
    admits, without making the order (seconds of list scheduling at hundreds of stages): ZB-H1
    holds 1F1B's in flight (P - r on rank r), zero-bubble interleaved interleaved 1F1B's, and
    ZB-V's first rank admits at least 2P - 1 into stage 0 (each of its admission limits; the
    round trip of the V keeps it filling them) and one into stage 2P - 1. An estimate, not a
    bound: a candidate over the budget by it is not simulated (the greedy order could in
    principle hold fewer)."""
    m, p = plan.num_microbatches, layout.pipeline_ranks
    name = layout.schedule
    if name == "zb-v":
        held = {0: min(m, 2 * p - 1), plan.num_stages - 1: 1}
    elif name == "zb-h1":
        held = {k: min(m, p - k) for k in range(plan.num_stages)}
    else:
        try:
            held = dict(enumerate(max_in_flight(make_schedule("interleaved", plan.num_stages, m, p, check=False),
                                                plan.num_stages)))
        except ScheduleError:
            return 0.0
    memory: dict[int, float] = {}
    for s in plan.stages:
        r = _rank_of(layout, s.stage_index)
        static = s.memory.parameters + s.memory.gradients + s.memory.optimizer
        memory[r] = memory.get(r, 0.0) + static + held_activations(
            s.activation_bytes, s.recompute_bytes, sum(b.nbytes for b in s.inputs), held.get(s.stage_index, 1), m)
    return max(memory.values(), default=0.0)


def _static_peak(plan: Plan, layout: Layout) -> float:
    """The most weights, gradients and optimizer state one rank holds (as ``plan`` prices them)."""
    held: dict[int, float] = {}
    for s in plan.stages:
        r = _rank_of(layout, s.stage_index)
        held[r] = held.get(r, 0.0) + s.memory.parameters + s.memory.gradients + s.memory.optimizer
    return max(held.values(), default=0.0)


def _evaluate(plan: Plan, layout: Layout, device: DeviceSpec, budget: float, lay_out: LayOut) -> Candidate | None:
    """Price ``plan``'s stages (one replica's batch, priced for the plan's own micro-batch
    count) in ``layout`` (its schedule, ranks, replicas and sharding: ``lay_out`` gives the
    stages' memory and collectives there, and what each rank waits for them), by simulation;
    memory per rank from the schedule's own in-flight counts."""
    m = plan.num_microbatches
    ranks = layout.pipeline_ranks
    try:
        forward, backward = [s.forward_time_s for s in plan.stages], [s.backward_time_s for s in plan.stages]
        schedule = make_schedule(layout.schedule, plan.num_stages, m, ranks, check=False,
                                 durations=durations_of(forward, backward),
                                 stage_scale=stage_scale_of(forward, backward))
    except ScheduleError:
        return None
    plan, waits = lay_out(plan, layout, schedule)
    costs = stage_costs_from_plan(plan, schedule, device=device)
    peak = int(max(rank_memory(costs, schedule)))
    timeline = simulate(schedule, costs, allreduce_s=waits)
    return Candidate(layout, m, timeline.step_time_s, peak, peak <= budget, plan.recompute, timeline.bubble_fraction)


def tune(
    partition_for: Callable[..., Plan],
    lay_out: LayOut,
    *,
    world_size: int,
    batch: int,
    num_ops: int,
    device: DeviceSpec,
    memory_budget: float,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    schedules: Sequence[str] = TUNED_SCHEDULES,
    data_parallel_size: int | None = None,
    recompute: Sequence[bool | str | int] = (False, True),
    shardings: Sequence[str] = ("none",),
    tensor_parallel_sizes: Sequence[int] = (1,),
    shard_groups: Callable[[int, int], Sequence[int]] = lambda replicas, ranks_per_replica: (replicas,),
    options: PlannerOptions = PlannerOptions(),
    sequence_parallel: Callable[[int], Sequence[bool]] = lambda tensor_parallel_size: (False,),
    work_for: Callable[[Layout, int, bool], float] | None = None,
    expert_parallel: Callable[[int], Sequence[int]] = lambda replicas: (1,),
) -> tuple[Plan, list[Candidate]]:
    """Search the layouts of ``world_size`` devices for the fastest that fits a global ``batch``.

    ``partition_for(layout, num_microbatches, within_budget, recompute[, like])`` makes a plan for
    one replica's share of the batch (of which, where ``within_budget`` is False, only the
    cut's stages are read: their times and memory; ``like``: a plan whose cuts to keep, given
    where ``device`` models no cache: the same stages cut at another micro-batch count);
    ``lay_out(plan, layout, schedule)`` gives that plan's memory and collectives in ``layout``
    (see :func:`_evaluate`). Both settings of activation
    ``recompute`` given are tried, and each of ``shardings`` (:data:`replica.layout.SHARDINGS`)
    where the layout allows it (more than one replica, not zb-v's V), each sharded one in the shard groups
    ``shard_groups(replicas, ranks per replica)`` gives (HSDP
    where a group is smaller than the replicas); and each of ``tensor_parallel_sizes`` that
    divides the world, with each of ``sequence_parallel(tensor_parallel_size)``, and each of
    ``expert_parallel(replicas)``: the expert-parallel sizes a layout of that many replicas may
    spread its experts over (``(1,)`` for a model without experts: no search over it; ``()``
    where none can, the layout skipped), each cut on its own share of the experts.
    Returns the best plan (with ``predicted_step_time_s``, its layout and the alternatives
    filled in) and the candidates simulated, best first. Raises ``PartitionError`` naming the
    world that would fit.

    Configurations are taken in the order of a bound known before any cut: ``work_for(layout,
    num_microbatches, recompute)``, the seconds of compute one replica does in a step, over its
    pipeline ranks (0 where not given). Each is cut only where that bound may still win, then
    bounded again by its cut's :func:`lower_bound` (never below the first: a rank does its own
    stages' work); those whose bound shows they can neither win (within ``tie``) nor be among the
    alternatives are not cut or not simulated, nor those of a zero-bubble schedule that cannot win
    (their orders are the costly ones to make: the alternatives are the next best of those
    simulated) or would not fit by the micro-batches their orders admit
    (:func:`_zero_bubble_floor`), nor replicated ones whose weights, gradients and optimizer
    state alone exceed the budget (unless nothing fits: the error then names the leanest).
    """
    candidates: list[Candidate] = []
    plans: dict[tuple[int, int, bool | str | int, int, int, bool, int], Plan | None] = {}
    # the first cut of each (stages, replicas, recompute, tp, sequence parallel, ep)
    cuts: dict[tuple[int, int, bool | str | int, int, bool, int], Plan] = {}
    queued: list[tuple[float, int, tuple[int, int, bool | str | int, int, int, bool, int], Layout]] = []
    no_experts: list[int] = []  # replica counts no expert-parallel size allowed fits
    for tp, ranks in ((t, r) for t in tensor_parallel_sizes if world_size % t == 0
                      for r in _divisors(world_size // t)):
        if ranks > options.max_pipeline_ranks and num_stages is None:
            continue  # deeper pipelines than this never pay for their bubble and hand-offs
        replicas = world_size // tp // ranks
        if data_parallel_size is not None and replicas != data_parallel_size:
            continue
        if batch % replicas:
            continue
        spreads = tuple(expert_parallel(replicas))
        if not spreads:
            no_experts.append(replicas)
            continue
        for name in schedules:
            kind = schedule_kind(name)
            stages = ranks * kind.stages_per_rank
            if (ranks == 1 and stages > 1) or stages > num_ops or (num_stages is not None and stages != num_stages):
                continue
            for sharding, group, sp, ep in ((s, g, sp, ep) for s in shardings
                                            for g in ((None,) if s == "none" else shard_groups(replicas, ranks * tp))
                                            for sp in sequence_parallel(tp) for ep in spreads):
                if sharding != "none" and (replicas == 1 or kind.placement == "v"):
                    continue
                layout = Layout(schedule=name, num_stages=stages, pipeline_ranks=ranks, data_parallel_size=replicas,
                                tensor_parallel_size=tp, sharding=sharding,
                                shard_group_size=None if group in (None, replicas) else group, sequence_parallel=sp,
                                expert_parallel_size=ep)
                for again in recompute:
                    for m in _microbatch_choices(batch // replicas, ranks, num_microbatches, stages,
                                                 options.max_simulated_actions):
                        if kind.microbatch_multiple and m % ranks:
                            continue
                        # a bound before any cut: the replica's compute shared evenly by its ranks
                        early = work_for(layout, m, again) / ranks if work_for is not None else 0.0
                        # priced at this micro-batch size: an op whose tensors fit the cache at m runs faster
                        queued.append((early, len(queued), (stages, replicas, again, m, tp, sp, ep), layout))
    # the schedules quick to make first (their best sets the bar), then the zero-bubble ones,
    # whose list-scheduled orders take seconds at hundreds of stages: each in the order of its
    # bound, best first. A configuration comes first with its bound before the cut; where that
    # may still win it is cut (a second each at hundreds of stages) and queued again with its
    # cut's bound, so the simulations run in the order of the cuts' bounds, as if all were cut
    heap = [(layout.kind.splits_backward, early, False, i, key, layout) for early, i, key, layout in queued]
    heapq.heapify(heap)
    times: list[float] = []  # of the fitting candidates, sorted
    timed: set[tuple[Layout, int]] = set()
    heavy: list[tuple[Plan, Layout]] = []

    def pruned(bound: float, layout: Layout) -> bool:
        if not times:
            return False
        if layout.kind.splits_backward and bound > times[0] * (1 + options.tie):
            return True  # a zero-bubble order costs seconds to make: made only where it may win
        # neither the best, nor within its tie, nor among the alternatives
        return bound > max(times[0] * (1 + options.tie), times[KEPT - 1] if len(times) >= KEPT else INF)

    while heap:
        group, bound, was_cut, i, key, layout = heapq.heappop(heap)
        if pruned(bound, layout):
            continue
        if key not in plans:
            stages, replicas, again, m, tp, sp, ep = key
            # without a cache model an op's price is linear in the micro-batch count, but for its
            # launches: the same stages at another count keep their cuts (priced again, not solved)
            like = cuts.get((stages, replicas, again, tp, sp, ep)) if device.cache_bandwidth <= 0 else None
            try:  # memory is checked per layout below, so this cut ignores the budget
                cut = Layout(schedule="1f1b", num_stages=stages, pipeline_ranks=stages, data_parallel_size=replicas,
                             tensor_parallel_size=tp, sequence_parallel=sp, expert_parallel_size=ep)
                plans[key] = partition_for(cut, m, False, again) if like is None else \
                    partition_for(cut, m, False, again, like)
            except PartitionError:
                plans[key] = None
            if plans[key] is not None:
                cuts.setdefault((stages, replicas, again, tp, sp, ep), plans[key])
        plan = plans[key]
        if plan is None:
            continue
        if not was_cut:
            heapq.heappush(heap, (group, lower_bound(plan, layout), True, i, key, layout))
            continue
        if not layout.sharded and _static_peak(plan, layout) > memory_budget or \
                layout.kind.splits_backward and _zero_bubble_floor(plan, layout) > memory_budget:
            heavy.append((plan, layout))
            continue
        found = _evaluate(plan, layout, device, memory_budget, lay_out)
        if found is not None:
            candidates.append(found)
            if found.fits and (layout, found.num_microbatches) not in timed:  # one time per layout and m,
                timed.add((layout, found.num_microbatches))  # whichever recompute mode it is priced in
                bisect.insort(times, found.step_time_s)
    if not times:  # nothing fits: the error names the leanest of all
        for plan, layout in heavy:
            found = _evaluate(plan, layout, device, memory_budget, lay_out)
            if found is not None:
                candidates.append(found)

    def step_time(c: Candidate) -> float:
        return c.step_time_s

    fitting = sorted((c for c in candidates if c.fits), key=step_time)
    if not candidates and no_experts:
        raise ConfigError(
            f"no layout of {world_size} devices leaves data-parallel replicas that the expert_parallel_size asked "
            f"divides: the experts spread over groups of replicas of each stage, and the layouts tried had "
            f"{sorted(set(no_experts))} replicas. Give data_parallel_size= a multiple of expert_parallel_size, or "
            "expert_parallel_size=None")
    if not candidates and num_stages is not None:
        divisors = [k for k in range(1, world_size + 1) if world_size % k == 0]
        raise ConfigError(
            f"num_stages={num_stages} fits no layout of {world_size} devices the planner may use"
            + (f" with data_parallel_size={data_parallel_size}" if data_parallel_size else "")
            + f": with one stage per rank, world_size = num_stages × data-parallel replicas × tensor-parallel ranks "
            f"(a stage needs at least one of the model's {num_ops} ops, and the replicas must divide the batch of "
            f"{batch}); interleaved schedules put several stages on each rank, zb-v two. Use num_stages in "
            f"{[k for k in divisors if k <= num_ops]}, a named schedule, or leave num_stages to the planner"
        )
    if not candidates:
        raise PartitionError(
            f"no way to lay out {world_size} devices as pipeline ranks x data-parallel replicas: a pipeline of P "
            f"ranks needs at least P of the model's {num_ops} ops, and R replicas need a global batch divisible "
            f"by R (it is a batch of {batch})" + (f", with num_stages={num_stages}" if num_stages else "")
            + (f", with data_parallel_size={data_parallel_size}" if data_parallel_size else "")
            + (", sharded (which needs more than one replica, and a schedule other than zb-v)"
               if "none" not in shardings else "")
            + f". Use a world_size that factors as (<= {num_ops} stages) x (a divisor of {batch})."
        )
    if not fitting:
        raise _no_fit(candidates, world_size, memory_budget)
    # predictions closer than the model can tell apart are a tie: take whole replicas if one is
    # among them (sharding hands the user DTensor shards and adds collectives, for memory the
    # tie says is not needed), then the fewest tensor-parallel ranks (fewer collectives the model
    # cannot see overlap or contend), then without sequence parallelism (half the collectives
    # of the same bytes), then the one holding least memory
    near = [c for c in fitting if c.step_time_s <= fitting[0].step_time_s * (1 + options.tie)]
    best = min(near, key=lambda c: (c.layout.sharded, c.layout.tensor_parallel_size, c.layout.sequence_parallel,
                                    c.layout.expert_parallel_size, c.peak_memory_bytes, c.step_time_s))
    fitting.remove(best)
    fitting.insert(0, best)
    try:
        final = partition_for(best.layout, best.num_microbatches, True, best.recompute)
    except PartitionError:  # the solver's per-stage bound is stricter than the walk per rank that
        # found the pick within the budget (a stage's fullest moment, not its rank's): the pick's own cuts
        cut = plans[(best.layout.num_stages, best.layout.data_parallel_size, best.recompute, best.num_microbatches,
                     best.layout.tensor_parallel_size, best.layout.sequence_parallel,
                     best.layout.expert_parallel_size)]
        final = partition_for(best.layout, best.num_microbatches, True, best.recompute, cut)
    again = _evaluate(final, best.layout, device, memory_budget, lay_out)
    if len(recompute) > 1 and again is not None and final.recompute is not False:
        final, again = _mixed(final, again, partition_for, lay_out, device, memory_budget)
        best = dataclasses.replace(best, recompute=again.recompute)
        fitting[0] = best
    step = again.step_time_s if again is not None else best.step_time_s
    # the next best layouts: each (layout, micro-batches) once, in its fastest recompute mode
    named = {(best.layout, best.num_microbatches)}
    others = [c for c in fitting[1:] if (c.layout, c.num_microbatches) not in named
              and not named.add((c.layout, c.num_microbatches))]
    alternatives = tuple((c.describe(), c.step_time_s) for c in others[:5])
    plan = dataclasses.replace(final, layout=best.layout, predicted_step_time_s=step, alternatives=alternatives,
                               simulated_bubble=again.bubble if again is not None else final.simulated_bubble)
    return plan, fitting + sorted((c for c in candidates if not c.fits), key=step_time)


def _mixed(plan: Plan, found: Candidate, partition_for: Callable[..., Plan], lay_out: LayOut, device: DeviceSpec,
           budget: float) -> tuple[Plan, Candidate]:
    """``plan`` (and its candidate ``found``) or, where faster and within ``budget``, a mix of
    recompute modes per stage (:func:`replica.planner.mix.mix_recompute`)."""
    layout, m = found.layout, found.num_microbatches
    forward, backward = [s.forward_time_s for s in plan.stages], [s.backward_time_s for s in plan.stages]
    schedule = make_schedule(layout.schedule, plan.num_stages, m, layout.pipeline_ranks, check=False,
                             durations=durations_of(forward, backward), stage_scale=stage_scale_of(forward, backward))
    mixes = mix_recompute(plan, layout, schedule,
                          price=lambda modes, like: partition_for(layout, m, like is None, modes, like),
                          memory=rank_peaks(lay_out, layout, device), budget=budget)
    for mixed in mixes:
        c = _evaluate(mixed, layout, device, budget, lay_out)
        if c is not None and c.fits and c.step_time_s < found.step_time_s:
            plan, found = mixed, dataclasses.replace(c, recompute=tuple(s.recompute for s in mixed.stages))
    return plan, found


def _no_fit(candidates: list[Candidate], world_size: int, budget: float) -> PartitionError:
    least = min(candidates, key=lambda c: c.peak_memory_bytes)
    # Memory per device falls about linearly with the pipeline depth: scale the world up.
    factor = least.peak_memory_bytes / budget
    needed = world_size
    while needed < world_size * factor * 1.05:
        needed *= 2
    return PartitionError(
        f"no configuration of {world_size} devices fits {budget / 2**30:.0f} GiB per device: the leanest "
        f"({least.describe()}) needs {least.peak_memory_bytes / 2**30:.0f} GiB on its fullest device. "
        f"About {needed} devices are needed (memory shrinks with pipeline depth); pass world_size={needed}, "
        "or lighten the optimizer state (a lighter optimizer, bf16 weights, sharding)."
    )
