"""When each action of a step ran: the records behind ``PipelineModel.measure_step``.

A runtime calls :meth:`StepClock.begin` before an action, :meth:`StepClock.ready` when a
message it waited on arrived, and :meth:`StepClock.end` when the action is done. An
action's interval starts at the later of the two, so a wait for a peer shows as idle
time before it, as in a simulated timeline, not as work. Ending a part and going on
(:meth:`end` then more work then :meth:`end` again) records the parts one after the
other: a backward's weight gradients after its input gradients left (the early path of
1F1B) read as their own W. Outside ``measure_step`` the runtimes hold :data:`NO_CLOCK`,
whose methods do nothing.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

from replica.schedules.actions import Action

__all__ = ["StepClock", "NO_CLOCK", "timing"]


class StepClock:
    """``(action, start_s, end_s)`` records, seconds since the clock was made."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.records: list[tuple[Action, float, float]] = []
        self._start = self._ready = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def begin(self) -> None:
        self._start = self._ready = self.now()

    def ready(self) -> None:
        self._ready = self.now()

    def end(self, action: Action) -> None:
        now = self.now()
        self.records.append((action, max(self._start, self._ready), now))
        self._start = self._ready = now


class _NoClock(StepClock):
    """A clock that records nothing (the runtimes' default)."""

    def begin(self) -> None:
        pass

    def ready(self) -> None:
        pass

    def end(self, action: Action) -> None:
        pass


NO_CLOCK = _NoClock()


@contextlib.contextmanager
def timing(runtime: Any) -> Iterator[StepClock]:
    """A fresh :class:`StepClock` in ``runtime.clock`` for the block, :data:`NO_CLOCK` after."""
    runtime.clock = clock = StepClock()
    try:
        yield clock
    finally:
        runtime.clock = NO_CLOCK
