"""Pipeline schedules as data: pure functions of integers returning per-rank action lists.

``schedule[rank]`` is the ordered list of :class:`~replica.schedules.actions.Action` that
rank runs (``2F0``: stage 2, forward, micro-batch 0; ``B`` a backward, ``W`` a deferred
weight gradient). This module holds the 1F1B family, the zero-bubble ones
(:mod:`replica.schedules.zerobubble`) by name, the one a plan runs (:func:`plan_schedule`),
and what is read off a schedule: validation, in-flight micro-batches, a serial order, the
drawn grid. The runtimes, the simulator and
the visualizer all read these lists; nothing here imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Literal, Sequence

from replica.errors import ScheduleError
from replica.layout import schedule_kind, schedule_names
from replica.schedules.actions import (
    BACKWARD,
    FORWARD,
    KINDS,
    WEIGHT,
    Action,
    Schedule,
    check_looped,
    check_sizes,
    placement,
    splits_backward,
)
from replica.schedules.replay import play
from replica.schedules.zerobubble import list_schedule, zero_bubble_h1, zero_bubble_interleaved, zero_bubble_v

if TYPE_CHECKING:
    from replica.partition.plan import Plan

__all__ = [
    "Action", "Schedule", "FORWARD", "BACKWARD", "WEIGHT", "gpipe", "one_f_one_b", "interleaved_one_f_one_b",
    "zero_bubble_h1", "zero_bubble_v", "zero_bubble_interleaved", "list_schedule", "SCHEDULES", "INTERLEAVED",
    "V_SHAPED", "make_schedule", "plan_schedule", "stages_per_rank", "splits_backward", "fused_weight_grads",
    "max_in_flight", "WEIGHT_SHARE", "durations_of", "stage_scale_of", "validate", "placement", "execution_order",
    "format_grid",
]

# Of a backward, the share that is linear-layer weight gradients (W) in a transformer:
# the simulator and the zero-bubble durations (:func:`durations_of`) both assume it.
WEIGHT_SHARE = 0.4


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards. Rank r holds stage r. For 3 stages, 4 micro-batches
    (one column a time step, ``...`` idle)::

        rank 0: 0F0 0F1 0F2 0F3 ... ... ... ... 0B0 0B1 0B2 0B3
        rank 1: ... 1F0 1F1 1F2 1F3 ... ... 1B0 1B1 1B2 1B3 ...
        rank 2: ... ... 2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3 ... ...

    Every rank keeps the activations of all ``num_microbatches`` micro-batches.
    """
    check_sizes(num_stages, num_microbatches)
    m = range(num_microbatches)
    return [[Action(s, FORWARD, i) for i in m] + [Action(s, BACKWARD, i) for i in m] for s in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B: ``num_stages - 1 - r`` warm-up forwards on rank r, then one forward and one
    backward in turn, then the remaining backwards. For 3 stages, 4 micro-batches::

        rank 0: 0F0 0F1 0F2 ... ... 0B0 0F3 0B1 ... 0B2 ... 0B3
        rank 1: ... 1F0 1F1 ... 1B0 1F2 1B1 1F3 1B2 ... 1B3 ...
        rank 2: ... ... 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 ... ...

    Rank r holds at most ``num_stages - r`` micro-batches' activations.
    """
    check_sizes(num_stages, num_microbatches)
    schedule: Schedule = []
    for s in range(num_stages):
        warmup = min(num_stages - 1 - s, num_microbatches)
        actions = [Action(s, FORWARD, i) for i in range(warmup)]
        for i in range(num_microbatches - warmup):
            actions.append(Action(s, FORWARD, warmup + i))
            actions.append(Action(s, BACKWARD, i))
        actions += [Action(s, BACKWARD, i) for i in range(num_microbatches - warmup, num_microbatches)]
        schedule.append(actions)
    return schedule


def interleaved_one_f_one_b(num_ranks: int, num_stages: int, num_microbatches: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): rank r holds stages r, r + P, r + 2P, ... (P ranks,
    v = num_stages / P stages each, looped placement); micro-batches go through the stages
    of a rank in groups of P, which cuts the bubble by v. ``num_microbatches`` must be a
    multiple of P. For 2 ranks, 4 stages, 4 micro-batches::

        rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 ... 2B2 ... 2B3 0B2 0B3
        rank 1: ... 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 ...
    """
    check_looped("interleaved 1F1B", num_ranks, num_stages, num_microbatches)
    p = num_ranks
    if num_microbatches % p:
        raise ScheduleError(
            f"interleaved 1F1B needs num_microbatches a multiple of the {p} pipeline ranks, got "
            f"{num_microbatches}; use {max(p, num_microbatches // p * p)} or {(num_microbatches // p + 1) * p}"
        )
    v = num_stages // p
    total = num_microbatches * v

    def unit(k: int, kind: str, rank: int) -> Action:
        chunk = (k % (p * v)) // p
        if kind == BACKWARD:
            chunk = v - 1 - chunk
        return Action(chunk * p + rank, kind, (k // (p * v)) * p + k % p)

    schedule: Schedule = []
    for r in range(p):
        warmup = total if num_microbatches == p else min((p - r - 1) * 2 + (v - 1) * p, total)
        actions = [unit(k, FORWARD, r) for k in range(warmup)]
        for k in range(total - warmup):
            actions.append(unit(k + warmup, FORWARD, r))
            actions.append(unit(k, BACKWARD, r))
        actions += [unit(k, BACKWARD, r) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zero_bubble_h1,
}
INTERLEAVED = {"interleaved": interleaved_one_f_one_b, "zb-interleaved": zero_bubble_interleaved}
V_SHAPED = {"zb-v": zero_bubble_v}


def stages_per_rank(name: str) -> int:
    """How many stages the named schedule puts on each pipeline rank by default (the registry's)."""
    return schedule_kind(name).stages_per_rank



def fused_weight_grads(actions: Sequence[Action]) -> set[tuple[int, int]]:
    """``(stage, micro-batch)`` whose W directly follows its B in ``actions``: deferring those
    gains nothing, so a runtime runs them as one backward (weight gradients computed while
    their inputs are still in cache) and skips the W."""
    return {(a.stage_index, a.microbatch_index) for a, b in zip(actions, actions[1:])
            if a.kind == BACKWARD and b.kind == WEIGHT and a.stage_index == b.stage_index
            and a.microbatch_index == b.microbatch_index}


def make_schedule(
    name: str, num_stages: int, num_microbatches: int, num_ranks: int | None = None, *, check: bool = True,
    durations: tuple[float, float, float] | None = None, stage_scale: Sequence[float] | None = None,
) -> Schedule:
    """The named schedule for ``num_stages`` stages over ``num_ranks`` pipeline ranks (default:
    one stage per rank, or two for interleaved schedules), validated. ``durations`` (relative
    F, B, W) and ``stage_scale`` (relative stage times) shape the zero-bubble orders."""
    key = name.lower()
    if num_ranks is not None and num_ranks < 1:
        raise ScheduleError(f"num_ranks must be >= 1, got {num_ranks}")
    if key in INTERLEAVED:
        ranks = num_ranks or max(1, num_stages // stages_per_rank(key))
        extra = {"durations": durations} if durations and key == "zb-interleaved" else {}
        schedule = INTERLEAVED[key](ranks, num_stages, num_microbatches, **extra)
    elif key in V_SHAPED:
        if num_ranks not in (None, num_stages // 2) or num_stages % 2:
            raise ScheduleError(
                f"the {name!r} schedule puts two stages on each rank in a V: num_stages must be twice the "
                f"pipeline ranks, got num_stages={num_stages} on {num_ranks} ranks; use num_stages="
                f"{2 * (num_ranks or 1)}"
            )
        schedule = V_SHAPED[key](num_stages, num_microbatches, durations=durations or (1.0, 1.0, 1.0),
                                 stage_scale=stage_scale)
    elif key in SCHEDULES:
        if num_ranks not in (None, num_stages):
            raise ScheduleError(
                f"the {name!r} schedule puts one stage on each rank, but num_stages={num_stages} and "
                f"{num_ranks} pipeline ranks; use num_stages={num_ranks} or schedule='interleaved'"
            )
        schedule = SCHEDULES[key](num_stages, num_microbatches, **({"durations": durations}
                                                                  if durations and key == "zb-h1" else {}))
    else:
        raise ScheduleError(
            f"unknown schedule {name!r}; choose one of {schedule_names()}"
        )
    if check:  # the generators are tested; the tuner skips re-validating thousands of them
        validate(schedule, num_stages, num_microbatches)
    return schedule


def stage_scale_of(forward_s: Sequence[float], backward_s: Sequence[float]) -> tuple[float, ...]:
    """Each stage's time relative to the mean stage, rounded alike on every rank: what the
    V generator weighs its candidate orders by."""
    totals = [f + b for f, b in zip(forward_s, backward_s)]
    mean = sum(totals) / max(1, len(totals))
    return tuple(round(t / mean, 2) if mean > 0 else 1.0 for t in totals)


def durations_of(forward_s: Sequence[float], backward_s: Sequence[float]) -> tuple[float, float, float]:
    """Relative F, B, W durations for the zero-bubble generators from stage times, rounded
    so every rank derives the same schedule from the same plan."""
    f = sum(forward_s) / max(1, len(forward_s))
    b = sum(backward_s) / max(1, len(backward_s))
    if f <= 0:
        return (1.0, 1.0, 1.0)
    return (1.0, round(b * (1 - WEIGHT_SHARE) / f, 2), round(b * WEIGHT_SHARE / f, 2))


def plan_schedule(plan: "Plan", num_ranks: int | None | Literal["plan"] = "plan", *, check: bool = True) -> Schedule:
    """The action lists of ``plan``: those it carries (``Plan.actions``, worked out once by the
    planner), checked to be a complete schedule of its stages and micro-batches; else the
    schedule's order by the plan's own stage times. ``num_ranks`` defaults to the plan's own
    pipeline ranks (``Plan.pipeline_ranks``); None leaves it to the schedule (and derives)."""
    if num_ranks == "plan" and plan.actions:
        carried = [[Action.parse(a) for a in actions] for actions in plan.actions]
        try:
            validate(carried, plan.num_stages, plan.num_microbatches)
        except ScheduleError as exc:
            raise ScheduleError(
                f"the plan's actions are not a schedule of its {plan.num_stages} stages and "
                f"{plan.num_microbatches} micro-batches ({exc}); re-plan, or replace actions=() to derive them"
            ) from None
        if len(carried) != plan.pipeline_ranks:
            raise ScheduleError(
                f"the plan's actions are for {len(carried)} ranks but its layout has {plan.pipeline_ranks} "
                "pipeline ranks; re-plan, or replace actions=() to derive them"
            )
        return carried
    if num_ranks == "plan":
        num_ranks = plan.pipeline_ranks
    forward, backward = [s.forward_time_s for s in plan.stages], [s.backward_time_s for s in plan.stages]
    return make_schedule(plan.schedule, plan.num_stages, plan.num_microbatches, num_ranks, check=check,
                         durations=durations_of(forward, backward), stage_scale=stage_scale_of(forward, backward))


def _ticks(schedule: Sequence[Sequence[Action]], num_stages: int) -> list[list[Action | None]]:
    """Unit-time replay: every rank runs its next action in the first tick after its
    dependencies finished (``None``: idle). Raises ``ScheduleError`` on a deadlock."""
    grid: list[list[Action | None]] = [[] for _ in schedule]
    for e in play(schedule, lambda a: 1.0, num_stages=num_stages):
        row = grid[e.rank]
        row += [None] * (int(e.start_s) - len(row)) + [e.action]
    return grid


def validate(schedule: Sequence[Sequence[Action]], num_stages: int, num_microbatches: int) -> None:
    """Raise ``ScheduleError`` unless every stage runs F and B once per micro-batch (and W
    once, after B, where present), each stage on one rank, with no deadlock."""
    seen: dict[Action, int] = {}
    for actions in schedule:
        for a in actions:
            if a.kind not in KINDS:
                raise ScheduleError(f"action {a} has kind {a.kind!r}; kinds are F, B and W")
            if not (0 <= a.stage_index < num_stages and 0 <= a.microbatch_index < num_microbatches):
                raise ScheduleError(
                    f"action {a} is outside {num_stages} stages × {num_microbatches} micro-batches"
                )
            seen[a] = seen.get(a, 0) + 1
    twice = sorted(str(a) for a, c in seen.items() if c > 1)
    if twice:
        raise ScheduleError(f"actions appear more than once: {twice[:6]}")
    kinds = KINDS if any(a.kind == WEIGHT for a in seen) else (FORWARD, BACKWARD)
    for s in range(num_stages):
        for i in range(num_microbatches):
            for kind in kinds:  # W for every (stage, micro-batch) or for none
                if Action(s, kind, i) not in seen:
                    raise ScheduleError(f"schedule never runs {Action(s, kind, i)}")
    placement(schedule)
    _ticks(schedule, num_stages)


def max_in_flight(schedule: Sequence[Sequence[Action]], num_stages: int) -> list[int]:
    """Per stage, the most micro-batches whose activations it holds at once: forwarded and
    not yet through their last backward action (B, or W when the schedule splits it)."""
    last = WEIGHT if splits_backward(schedule) else BACKWARD
    peak = [0] * num_stages
    for actions in schedule:
        live = [0] * num_stages
        for a in actions:
            if a.kind == FORWARD:
                live[a.stage_index] += 1
                peak[a.stage_index] = max(peak[a.stage_index], live[a.stage_index])
            elif a.kind == last:
                live[a.stage_index] -= 1
    return peak


def execution_order(schedule: Sequence[Sequence[Action]], num_stages: int) -> list[Action]:
    """One deadlock-free serial order of every action: what a single process runs."""
    grid = _ticks(schedule, num_stages)
    return [row[t] for t in range(max(map(len, grid), default=0)) for row in grid if t < len(row) and row[t]]


def format_grid(schedule: Sequence[Sequence[Action]], num_stages: int) -> str:
    """The unit-time grid drawn in the schedule docstrings (``...`` is an idle tick)."""
    grid = _ticks(schedule, num_stages)
    width = max(map(len, grid), default=0)
    lines = []
    for rank, row in enumerate(grid):
        cells = [str(a) if a else "..." for a in row] + ["..."] * (width - len(row))
        lines.append(f"rank {rank}: " + " ".join(cells))
    return "\n".join(lines)
