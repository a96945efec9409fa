"""Playing per-rank action lists in time under the dependency rule: the core of the simulator.

Each rank runs its actions strictly in list order; an action starts when its rank is
free and every action it depends on (:func:`replica.schedules.actions.dependencies`) has
arrived, which by default is when that action ended. With unit durations the starts are
the ticks of the grids drawn in the schedule docstrings; with seconds per action and
transfer delays it is :func:`replica.schedules.simulate.simulate`.

Every action is looked at a bounded number of times (once per missing dependency, at
most two, plus once to run), so :func:`play` is O(total actions). Nothing here imports
torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from replica.errors import ScheduleError
from replica.schedules.actions import Action, dependencies

__all__ = ["Event", "play"]


@dataclass(frozen=True)
class Event:
    """One action run on one rank from ``start_s`` to ``end_s``."""

    rank: int
    action: Action
    start_s: float
    end_s: float


def _ended(dep: Event, a: Action) -> float:
    return dep.end_s


def play(
    schedule: Sequence[Sequence[Action]],
    duration: Callable[[Action], float],
    *,
    num_stages: int | None = None,
    arrival: Callable[[Event, Action], float] = _ended,
) -> list[Event]:
    """Run ``schedule`` (``schedule[rank]`` in order), ``duration(a)`` long each; ``a`` may
    start once ``arrival(dep, a)`` has passed for each of its dependencies ``dep`` (the
    event that ran it). ``num_stages`` defaults to one past the highest stage named. The
    events come in the order they were settled, not sorted by time. Raises
    ``ScheduleError`` naming every stuck rank if the schedule deadlocks."""
    num_ranks = len(schedule)
    if num_stages is None:
        num_stages = max((a.stage_index for actions in schedule for a in actions), default=-1) + 1
    done: dict[Action, Event] = {}
    free = [0.0] * num_ranks
    cursor = [0] * num_ranks
    waiting: dict[Action, list[int]] = {}
    blocked_on: dict[int, Action] = {}
    ready = deque(range(num_ranks))
    events: list[Event] = []
    while ready:
        r = ready.popleft()
        actions = schedule[r]
        while cursor[r] < len(actions):
            a = actions[cursor[r]]
            start = free[r]
            missing = None
            for dep in dependencies(a, num_stages):
                if dep not in done:
                    missing = dep
                    break
                start = max(start, arrival(done[dep], a))
            if missing is not None:
                waiting.setdefault(missing, []).append(r)
                blocked_on[r] = missing
                break
            event = Event(r, a, start, start + duration(a))
            done[a] = event
            free[r] = event.end_s
            cursor[r] += 1
            events.append(event)
            for other in waiting.pop(a, ()):
                del blocked_on[other]
                ready.append(other)
    if blocked_on:
        stuck = ", ".join(f"rank {r} at {schedule[r][cursor[r]]} waits for {d}" for r, d in sorted(blocked_on.items()))
        raise ScheduleError(f"schedule deadlocks: {stuck}; check each rank's order against the F/B/W dependencies")
    return events
