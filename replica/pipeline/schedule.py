"""Pipeline schedules as data: pure functions of integers returning per-rank action lists.

An :class:`Action` is ``(stage_index, kind, microbatch_index)`` and prints as ``2F0``
(stage 2, forward, micro-batch 0); ``B`` is a backward, ``W`` a deferred weight
gradient. ``schedule[rank]`` is the ordered list of actions that rank runs. The
runtimes, the simulator and the visualizer all read these lists; nothing here
imports torch.
"""

from __future__ import annotations

import collections
import heapq
import re
from typing import Callable, NamedTuple, Sequence

from replica.errors import ScheduleError

__all__ = [
    "Action", "Schedule", "gpipe", "one_f_one_b", "interleaved_one_f_one_b", "zero_bubble_h1",
    "zero_bubble_v", "zero_bubble_interleaved", "list_schedule", "SCHEDULES", "INTERLEAVED", "V_SHAPED", "make_schedule",
    "stages_per_rank", "splits_backward", "fused_weight_grads", "max_in_flight", "WEIGHT_SHARE", "durations_of",
    "validate", "placement", "execution_order", "format_grid",
]

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
_ACTION = re.compile(r"^(\d+)([FBW])(\d+)$")


class Action(NamedTuple):
    stage_index: int
    kind: str
    microbatch_index: int

    def __str__(self) -> str:
        return f"{self.stage_index}{self.kind}{self.microbatch_index}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        match = _ACTION.match(text.strip())
        if not match:
            raise ScheduleError(f"cannot parse action {text!r}; expected e.g. '2F0' (stage, F/B/W, micro-batch)")
        return cls(int(match[1]), match[2], int(match[3]))


Schedule = list[list[Action]]


def _check(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ScheduleError(
            f"a schedule needs num_stages >= 1 and num_microbatches >= 1, got {num_stages} and {num_microbatches}"
        )


def _check_looped(what: str, num_ranks: int, num_stages: int, num_microbatches: int) -> None:
    """Looped placement needs several stages on every rank."""
    _check(num_stages, num_microbatches)
    p = num_ranks
    if p < 1 or num_stages % p or num_stages == p:
        raise ScheduleError(
            f"{what} needs num_stages a multiple (>= 2x) of the {p} pipeline ranks, got "
            f"num_stages={num_stages}; use num_stages={2 * p} (2 stages per rank) or the '1f1b' schedule"
        )


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards. Rank r holds stage r. For 3 stages, 4 micro-batches
    (one column a time step, ``...`` idle)::

        rank 0: 0F0 0F1 0F2 0F3 ... ... ... ... 0B0 0B1 0B2 0B3
        rank 1: ... 1F0 1F1 1F2 1F3 ... ... 1B0 1B1 1B2 1B3 ...
        rank 2: ... ... 2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3 ... ...

    Every rank keeps the activations of all ``num_microbatches`` micro-batches.
    """
    _check(num_stages, num_microbatches)
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
    _check(num_stages, num_microbatches)
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
    _check_looped("interleaved 1F1B", num_ranks, num_stages, num_microbatches)
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


def list_schedule(
    stage_ranks: Sequence[int],
    num_microbatches: int,
    *,
    split_backward: bool,
    admit: Sequence[int],
    durations: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> Schedule:
    """Greedy list scheduling: whenever a rank is free it runs a ready B (it unblocks the
    ranks upstream), else the F of its deepest stage that is ready (entering a new
    micro-batch into its first stage only while fewer than ``admit[rank]`` micro-batches
    hold activations there), else a deferred W (which also frees activations); with
    nothing ready it waits for the next action anywhere to finish. ``durations`` are the
    relative times of F, B and W (unit ticks by default). ``stage_ranks[s]`` places stage
    s. Pure and deterministic.
    """
    num_stages = len(stage_ranks)
    num_ranks = max(stage_ranks) + 1
    length = {FORWARD: durations[0], BACKWARD: durations[1], WEIGHT: durations[2]}
    mine = [[s for s in range(num_stages) if stage_ranks[s] == r] for r in range(num_ranks)]
    deepest_first = [sorted(stages, reverse=True) for stages in mine]
    forwarded: dict[tuple[int, int], float] = {}  # (stage, micro-batch) -> when its F ends
    next_f = [0] * num_stages
    held = [0] * num_ranks  # micro-batches with activations alive on the rank's first stage
    ready_b: list[list[tuple[float, int, int]]] = [[] for _ in range(num_ranks)]  # (ready at, i, -s)
    pending_w: list[collections.deque[tuple[float, Action]]] = [collections.deque() for _ in range(num_ranks)]
    schedule: Schedule = [[] for _ in range(num_ranks)]
    running: list[tuple[float, int, int, int, str]] = []  # heap of (end, rank, stage, micro-batch, kind)
    free_ranks = [(0.0, r) for r in range(num_ranks)]  # heap of (free at, rank)
    waiting: list[int] = []  # ranks that found nothing ready; they look again after the next event
    remaining = num_stages * num_microbatches * (3 if split_backward else 2)

    def finish(end: float, r: int, a: Action) -> None:
        s, kind, i = a
        if kind == FORWARD:
            forwarded[(s, i)] = end
            if s == num_stages - 1:
                heapq.heappush(ready_b[r], (end, i, -s))
        elif kind == BACKWARD:
            if s > 0:
                heapq.heappush(ready_b[stage_ranks[s - 1]], (end, i, -(s - 1)))
            if split_backward:
                pending_w[r].append((end, Action(s, WEIGHT, i)))
            elif s == mine[r][0]:
                held[r] -= 1
        elif s == mine[r][0]:
            held[r] -= 1

    while remaining:
        if not free_ranks:  # every free rank waits: jump to the next action's end
            if not running:
                raise ScheduleError("list scheduling stalled: the admission limits are too small")
            t = running[0][0]
            free_ranks = [(t, q) for q in waiting]
            heapq.heapify(free_ranks)
            waiting = []
        now, r = heapq.heappop(free_ranks)
        settled = False
        while running and running[0][0] <= now:
            end, q, s_, i_, k_ = heapq.heappop(running)
            finish(end, q, Action(s_, k_, i_))
            settled = True
        if settled and waiting:  # what just ended may have readied the waiting ranks
            for q in waiting:
                heapq.heappush(free_ranks, (now, q))
            waiting = []
        choice: Action | None = None
        if ready_b[r] and ready_b[r][0][0] <= now:
            _, i, neg = heapq.heappop(ready_b[r])
            choice = Action(-neg, BACKWARD, i)
        else:
            for s in deepest_first[r]:
                i = next_f[s]
                if i >= num_microbatches or (s > 0 and forwarded.get((s - 1, i), float("inf")) > now):
                    continue
                if s == mine[r][0] and held[r] >= admit[r]:
                    continue
                choice = Action(s, FORWARD, i)
                next_f[s] += 1
                held[r] += s == mine[r][0]
                break
        if choice is None and pending_w[r] and pending_w[r][0][0] <= now:
            choice = pending_w[r].popleft()[1]
        if choice is None:
            waiting.append(r)
            continue
        end = now + length[choice.kind]
        schedule[r].append(choice)
        heapq.heappush(running, (end, r, choice.stage_index, choice.microbatch_index, choice.kind))
        heapq.heappush(free_ranks, (end, r))
        remaining -= 1
    return schedule


# Of a backward, the share that is linear-layer weight gradients (W) in a transformer:
# the simulator and the zero-bubble generators both assume it.
WEIGHT_SHARE = 0.4


def zero_bubble_h1(
    num_stages: int, num_microbatches: int, *, durations: tuple[float, float, float] = (1.0, 1.0, 1.0)
) -> Schedule:
    """ZB-H1: 1F1B's order and memory (rank r admits ``num_stages - r`` micro-batches), with
    each backward split into B (input gradient, sent upstream at once) and W (weight
    gradient) deferred into what would be the bubbles. For 3 stages, 4 micro-batches::

        rank 0: 0F0 0F1 0F2 ... ... 0B0 0W0 0F3 0B1 0W1 ... 0B2 0W2 ... 0B3 0W3
        rank 1: ... 1F0 1F1 ... 1B0 1W0 1F2 1B1 1W1 1F3 1B2 1W2 ... 1B3 1W3 ...
        rank 2: ... ... 2F0 2B0 2W0 2F1 2B1 2W1 2F2 2B2 2W2 2F3 2B3 2W3 ... ...
    """
    _check(num_stages, num_microbatches)
    return list_schedule(list(range(num_stages)), num_microbatches, split_backward=True,
                         admit=[num_stages - r for r in range(num_stages)], durations=durations)


def zero_bubble_v(
    num_stages: int, num_microbatches: int, *, durations: tuple[float, float, float] = (1.0, 1.0, 1.0),
    stage_scale: Sequence[float] | None = None,
) -> Schedule:
    """ZB-V: ``num_stages = 2P`` stages on P ranks in a V (rank r holds stages r and
    2P-1-r, so the first and the last stage share rank 0), split backward, W in the
    bubbles. Rank r admits ``2P - r`` micro-batches into its first stage: never more than
    the first rank holds (the most of any, as in 1F1B), and enough that the later ranks
    keep their second stage fed (with ``2(P - r)`` a 4-rank V kept a 20% bubble).
    ``durations`` (relative F, B, W times; the runtime passes the plan's) shape the order;
    in unit time, for 4 stages on 2 ranks, 4 micro-batches::

        rank 0: 0F0 0F1 0F2 3F0 3B0 3F1 3B1 0B0 0F3 0B1 3W0 3F2 3B2 3W1 0W0 0B2 0W1 3F3 3B3 3W2 0W2 0B3 3W3 0W3 ...
        rank 1: ... 1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1 1F2 2F2 2W0 1W0 2B2 1B2 1F3 2F3 2W1 1W1 2B3 1B3 2W2 1W2 2W3 1W3
    """
    _check(num_stages, num_microbatches)
    if num_stages % 2:
        raise ScheduleError(
            f"V placement needs an even num_stages (two per rank), got {num_stages}; use {num_stages + 1}"
        )
    p = num_stages // 2
    ranks = [s if s < p else 2 * p - 1 - s for s in range(num_stages)]
    # A greedy list schedule is not monotonic in its admission limits: try a few, each
    # rank never above 2P - r (so no rank outgrows the first), keep the shortest, timed
    # with ``stage_scale`` (each stage's relative time; 1 for all by default).
    from replica.pipeline.simulate import StageCosts, simulate  # simulate imports this module

    scale = list(stage_scale) if stage_scale is not None and len(stage_scale) == num_stages else [1.0] * num_stages
    costs = [StageCosts(forward_s=durations[0] * k, backward_s=durations[1] * k, weight_s=durations[2] * k)
             for k in scale]
    best: tuple[float, Schedule] | None = None
    for top, slope in ((2 * p, 1), (2 * p - 1, 0), (2 * p, 0), (2 * p - 1, 1), (2 * p, 2)):
        admit = [min(2 * p - r, max(1, top - slope * r)) for r in range(p)]
        try:
            schedule = list_schedule(ranks, num_microbatches, split_backward=True, admit=admit, durations=durations)
        except ScheduleError:  # these limits stall the greedy: not a candidate
            continue
        step = simulate(schedule, costs).step_time_s
        if best is None or step < best[0] - 1e-9:
            best = (step, schedule)
    assert best is not None  # (2P, 1) is 2P - r: it never stalls
    return best[1]


def zero_bubble_interleaved(
    num_ranks: int, num_stages: int, num_microbatches: int, *,
    durations: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> Schedule:
    """Interleaved zero bubble: looped placement (rank r holds stages r, r + P, ...), split
    backward, W in the bubbles; each rank admits as many micro-batches into its first stage
    as interleaved 1F1B keeps in flight there. For 2 ranks, 4 stages, 4 micro-batches::

        rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 2W0 0B0 2B1 0W0 0B1 0F3 2F2 2W1 0W1 2B2 2W2 0B2 2F3 0W2 ... 2B3 2W3 0B3 0W3
        rank 1: ... 1F0 1F1 3F0 3B0 3F1 1B0 3B1 3W0 1B1 1W0 1F2 3W1 3F2 3B2 1W1 1B2 1F3 3W2 3F3 3B3 1W2 1B3 3W3 1W3
    """
    _check_looped("interleaved zero bubble", num_ranks, num_stages, num_microbatches)
    p = num_ranks
    v = num_stages // p
    admit = [min(num_microbatches, (p - r - 1) * 2 // v + p) for r in range(p)]
    return list_schedule([s % p for s in range(num_stages)], num_microbatches, split_backward=True, admit=admit,
                         durations=durations)


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zero_bubble_h1,
}
INTERLEAVED = {"interleaved": interleaved_one_f_one_b, "zb-interleaved": zero_bubble_interleaved}
V_SHAPED = {"zb-v": zero_bubble_v}


def stages_per_rank(name: str) -> int:
    """How many stages the named schedule puts on each pipeline rank by default."""
    return 2 if name.lower() in INTERLEAVED or name.lower() in V_SHAPED else 1


def splits_backward(schedule: Sequence[Sequence[Action]]) -> bool:
    """Whether a schedule runs weight gradients (W) apart from input gradients (B)."""
    return any(a.kind == WEIGHT for actions in schedule for a in actions)


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
            f"unknown schedule {name!r}; choose one of {sorted([*SCHEDULES, *INTERLEAVED, *V_SHAPED])}"
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


def placement(schedule: Sequence[Sequence[Action]]) -> dict[int, int]:
    """``{stage_index: rank}``; each stage must live on exactly one rank."""
    where: dict[int, int] = {}
    for rank, actions in enumerate(schedule):
        for a in actions:
            if where.setdefault(a.stage_index, rank) != rank:
                raise ScheduleError(f"stage {a.stage_index} appears on ranks {where[a.stage_index]} and {rank}")
    return where


def _dependencies(a: Action, num_stages: int) -> list[Action]:
    s, kind, i = a
    if kind == FORWARD:
        return [Action(s - 1, FORWARD, i)] if s > 0 else []
    if kind == BACKWARD:
        return [Action(s, FORWARD, i)] + ([Action(s + 1, BACKWARD, i)] if s < num_stages - 1 else [])
    return [Action(s, BACKWARD, i)]


def _ticks(schedule: Sequence[Sequence[Action]], num_stages: int) -> list[list[Action | None]]:
    """Unit-time replay: in each tick every rank runs its next action if its dependencies
    finished in an earlier tick. Raises ``ScheduleError`` on a deadlock."""
    done: set[Action] = set()
    cursor = [0] * len(schedule)
    grid: list[list[Action | None]] = [[] for _ in schedule]
    remaining = sum(len(r) for r in schedule)
    while remaining:
        ready = []
        for rank, actions in enumerate(schedule):
            a = actions[cursor[rank]] if cursor[rank] < len(actions) else None
            ready.append(a if a is not None and all(d in done for d in _dependencies(a, num_stages)) else None)
        if not any(ready):
            stuck = [str(actions[cursor[r]]) for r, actions in enumerate(schedule) if cursor[r] < len(actions)]
            raise ScheduleError(f"schedule deadlocks: every rank waits (next actions {stuck})")
        for rank, a in enumerate(ready):
            grid[rank].append(a)
            if a is not None:
                done.add(a)
                cursor[rank] += 1
                remaining -= 1
    return grid


def validate(schedule: Sequence[Sequence[Action]], num_stages: int, num_microbatches: int) -> None:
    """Raise ``ScheduleError`` unless every stage runs F and B once per micro-batch (and W
    once, after B, where present), each stage on one rank, with no deadlock."""
    seen: dict[Action, int] = {}
    for actions in schedule:
        for a in actions:
            if a.kind not in (FORWARD, BACKWARD, WEIGHT):
                raise ScheduleError(f"action {a} has kind {a.kind!r}; kinds are F, B and W")
            if not (0 <= a.stage_index < num_stages and 0 <= a.microbatch_index < num_microbatches):
                raise ScheduleError(
                    f"action {a} is outside {num_stages} stages × {num_microbatches} micro-batches"
                )
            seen[a] = seen.get(a, 0) + 1
    twice = sorted(str(a) for a, c in seen.items() if c > 1)
    if twice:
        raise ScheduleError(f"actions appear more than once: {twice[:6]}")
    kinds = (FORWARD, BACKWARD, WEIGHT) if any(a.kind == WEIGHT for a in seen) else (FORWARD, BACKWARD)
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
