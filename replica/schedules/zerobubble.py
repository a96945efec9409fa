"""Zero-bubble schedules: backward split into B and W, ordered by greedy list scheduling.

Each generator here fixes a placement and how many micro-batches each rank admits, then
lets :func:`list_schedule` order the actions, the W in what would be the bubbles. Pure
functions of integers (and relative durations); nothing here imports torch.
"""

from __future__ import annotations

import collections
import heapq
from typing import Sequence

from replica.errors import ScheduleError
from replica.schedules.actions import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Action,
    Schedule,
    check_looped,
    check_sizes,
    dependencies,
    dependents,
)
from replica.schedules.replay import play

__all__ = ["list_schedule", "zero_bubble_h1", "zero_bubble_v", "zero_bubble_interleaved"]

_UNIT = (1.0, 1.0, 1.0)
_NEVER = float("inf")


def list_schedule(
    stage_ranks: Sequence[int],
    num_microbatches: int,
    *,
    split_backward: bool,
    admit: Sequence[int],
    durations: tuple[float, float, float] = _UNIT,
) -> Schedule:
    """Greedy list scheduling: whenever a rank is free it runs a ready B (it unblocks the
    ranks upstream), else the F of its deepest stage that is ready (entering a new
    micro-batch into its first stage only while fewer than ``admit[rank]`` micro-batches
    hold activations there), else a deferred W (which also frees activations); with
    nothing ready it waits for the next action anywhere to finish. ``durations`` are the
    relative times of F, B and W (unit ticks by default). ``stage_ranks[s]`` places stage
    s; readiness is :func:`~replica.schedules.actions.dependencies`. Pure and deterministic;
    O(A log A) for A actions, times the stages of a rank for the F it picks.
    """
    num_stages = len(stage_ranks)
    num_ranks = max(stage_ranks) + 1
    length = {FORWARD: durations[0], BACKWARD: durations[1], WEIGHT: durations[2]}
    mine = [[s for s in range(num_stages) if stage_ranks[s] == r] for r in range(num_ranks)]
    deepest_first = [sorted(stages, reverse=True) for stages in mine]
    ended: dict[Action, float] = {}
    next_f = [0] * num_stages
    held = [0] * num_ranks  # micro-batches with activations alive on the rank's first stage
    ready_b: list[list[tuple[float, int, int]]] = [[] for _ in range(num_ranks)]  # (ready at, i, -s)
    pending_w: list[collections.deque[tuple[float, Action]]] = [collections.deque() for _ in range(num_ranks)]
    schedule: Schedule = [[] for _ in range(num_ranks)]
    running: list[tuple[float, int, int, int, str]] = []  # heap of (end, rank, stage, micro-batch, kind)
    free_ranks = [(0.0, r) for r in range(num_ranks)]  # heap of (free at, rank)
    waiting: list[int] = []  # ranks that found nothing ready; they look again after the next event
    remaining = num_stages * num_microbatches * (3 if split_backward else 2)

    def ready_at(a: Action) -> float:
        """When the last of ``a``'s dependencies ended (infinity while one has not)."""
        at = 0.0
        for d in dependencies(a, num_stages):
            at = max(at, ended.get(d, _NEVER))
        return at

    def finish(end: float, r: int, a: Action) -> None:
        ended[a] = end
        for c in dependents(a, num_stages):  # a B or W this end makes ready joins its rank's queue
            if c.kind == FORWARD or (c.kind == WEIGHT and not split_backward):
                continue  # an F is found by its stage's next micro-batch
            at = ready_at(c)
            if at == _NEVER:
                continue
            if c.kind == BACKWARD:
                heapq.heappush(ready_b[stage_ranks[c.stage_index]], (at, c.microbatch_index, -c.stage_index))
            else:
                pending_w[stage_ranks[c.stage_index]].append((at, c))
        if a.stage_index == mine[r][0] and a.kind == (WEIGHT if split_backward else BACKWARD):
            held[r] -= 1  # its last action frees the micro-batch's activations

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
                if i >= num_microbatches or (s == mine[r][0] and held[r] >= admit[r]):
                    continue
                if ready_at(Action(s, FORWARD, i)) > now:
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


def zero_bubble_h1(
    num_stages: int, num_microbatches: int, *, durations: tuple[float, float, float] = _UNIT
) -> Schedule:
    """ZB-H1: 1F1B's order and memory (rank r admits ``num_stages - r`` micro-batches), with
    each backward split into B (input gradient, sent upstream at once) and W (weight
    gradient) deferred into what would be the bubbles. For 3 stages, 4 micro-batches::

        rank 0: 0F0 0F1 0F2 ... ... 0B0 0W0 0F3 0B1 0W1 ... 0B2 0W2 ... 0B3 0W3
        rank 1: ... 1F0 1F1 ... 1B0 1W0 1F2 1B1 1W1 1F3 1B2 1W2 ... 1B3 1W3 ...
        rank 2: ... ... 2F0 2B0 2W0 2F1 2B1 2W1 2F2 2B2 2W2 2F3 2B3 2W3 ... ...
    """
    check_sizes(num_stages, num_microbatches)
    return list_schedule(list(range(num_stages)), num_microbatches, split_backward=True,
                         admit=[num_stages - r for r in range(num_stages)], durations=durations)


def zero_bubble_v(
    num_stages: int, num_microbatches: int, *, durations: tuple[float, float, float] = _UNIT,
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
    check_sizes(num_stages, num_microbatches)
    if num_stages % 2:
        raise ScheduleError(
            f"V placement needs an even num_stages (two per rank), got {num_stages}; use {num_stages + 1}"
        )
    p = num_stages // 2
    ranks = [s if s < p else 2 * p - 1 - s for s in range(num_stages)]
    # A greedy list schedule is not monotonic in its admission limits: try a few, each
    # rank never above 2P - r (so no rank outgrows the first), keep the shortest, played
    # in time with ``stage_scale`` (each stage's relative time; 1 for all by default).
    scale = list(stage_scale) if stage_scale is not None and len(stage_scale) == num_stages else [1.0] * num_stages
    length = {FORWARD: durations[0], BACKWARD: durations[1], WEIGHT: durations[2]}
    best: tuple[float, Schedule] | None = None
    for top, slope in ((2 * p, 1), (2 * p - 1, 0), (2 * p, 0), (2 * p - 1, 1), (2 * p, 2)):
        admit = [min(2 * p - r, max(1, top - slope * r)) for r in range(p)]
        try:
            schedule = list_schedule(ranks, num_microbatches, split_backward=True, admit=admit, durations=durations)
        except ScheduleError:  # these limits stall the greedy: not a candidate
            continue
        events = play(schedule, lambda a: length[a.kind] * scale[a.stage_index], num_stages=num_stages)
        step = max((e.end_s for e in events), default=0.0)
        if best is None or step < best[0] - 1e-9:
            best = (step, schedule)
    assert best is not None  # (2P, 1) is 2P - r: it never stalls
    return best[1]


def zero_bubble_interleaved(
    num_ranks: int, num_stages: int, num_microbatches: int, *, durations: tuple[float, float, float] = _UNIT,
) -> Schedule:
    """Interleaved zero bubble: looped placement (rank r holds stages r, r + P, ...), split
    backward, W in the bubbles; each rank admits as many micro-batches into its first stage
    as interleaved 1F1B keeps in flight there. For 2 ranks, 4 stages, 4 micro-batches::

        rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 2W0 0B0 2B1 0W0 0B1 0F3 2F2 2W1 0W1 2B2 2W2 0B2 2F3 0W2 ... 2B3 2W3 0B3 0W3
        rank 1: ... 1F0 1F1 3F0 3B0 3F1 1B0 3B1 3W0 1B1 1W0 1F2 3W1 3F2 3B2 1W1 1B2 1F3 3W2 3F3 3B3 1W2 1B3 3W3 1W3
    """
    check_looped("interleaved zero bubble", num_ranks, num_stages, num_microbatches)
    p = num_ranks
    v = num_stages // p
    admit = [min(num_microbatches, (p - r - 1) * 2 // v + p) for r in range(p)]
    return list_schedule([s % p for s in range(num_stages)], num_microbatches, split_backward=True, admit=admit,
                         durations=durations)
