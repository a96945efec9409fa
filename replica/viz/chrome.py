"""Chrome-trace export of pipeline timelines, simulated or measured (chrome://tracing, Perfetto)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Sequence, Union

from replica.errors import ConfigError
from replica.schedules.schedule import Action
from replica.schedules.simulate import Event, StageCosts, Timeline

__all__ = ["write_chrome_trace", "measured_timeline"]

Record = tuple[int, Union[Action, str], float, float]


def measured_timeline(
    records: Iterable[Record], *, num_ranks: int | None = None, costs: Sequence[StageCosts] = ()
) -> Timeline:
    """A :class:`Timeline` from measured ``(rank, action, start_s, end_s)`` records, the action
    an :class:`Action` or its text (``"2F0"``). Times may come from any one clock (e.g.
    ``time.perf_counter`` on every rank of one machine): they are shifted so the earliest
    start is 0. Peak memory is counted only where ``costs`` give the bytes."""
    events = []
    for record in records:
        try:
            rank, action, start, end = record
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"a record is (rank, action, start_s, end_s), got {record!r}") from exc
        events.append(Event(int(rank), action if isinstance(action, Action) else Action.parse(str(action)),
                            float(start), float(end)))
    origin = min((e.start_s for e in events), default=0.0)
    shifted = [Event(e.rank, e.action, e.start_s - origin, e.end_s - origin) for e in events]
    return Timeline.from_events(shifted, num_ranks=num_ranks, costs=costs)


def write_chrome_trace(
    timeline_or_events: Timeline | Iterable[Event], path: str | os.PathLike[str], *, name: str = "replica"
) -> Path:
    """Write a timeline (or bare events) as a chrome trace JSON file; returns the path."""
    timeline = (timeline_or_events if isinstance(timeline_or_events, Timeline)
                else Timeline.from_events(timeline_or_events))
    out = Path(path)
    out.write_text(json.dumps(timeline.to_chrome_trace(name=name)))
    return out
