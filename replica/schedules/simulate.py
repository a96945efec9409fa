"""Playing per-rank action lists against per-stage costs: the timeline a schedule would produce.

:func:`replica.schedules.replay.play` runs each rank's actions in list order under the
dependency rule (:func:`replica.schedules.actions.dependencies`); here each action takes
its stage's seconds, and a dependency on another rank arrives a transfer later::

    F(s, i)  after  F(s-1, i) + send(s-1)          (send only across ranks)
    B(s, i)  after  F(s, i),  B(s+1, i) + send(s)  (the gradient of stage s's outputs comes back)
    W(s, i)  after  B(s, i)

A B's input gradient may leave for another rank before the B ends (the runtimes send it
before a whole backward's weight gradients): there B(s, i) waits only for the first
``input_grad_share`` of B(s+1, i).

Transfers overlap compute and never contend for a link. :func:`simulate` is O(total
actions), plus one sort of the events. Nothing here imports torch; a plan's stages are
priced into :class:`StageCosts` by :func:`replica.planner.costs.stage_costs_from_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from replica.errors import ConfigError
from replica.schedules.actions import BACKWARD, FORWARD, WEIGHT, Action, placement
from replica.schedules.replay import Event, play

__all__ = ["StageCosts", "Event", "Timeline", "simulate", "peak_memory"]

_KIND_NAMES = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "weight"}


@dataclass(frozen=True)
class StageCosts:
    """Seconds and bytes for ONE micro-batch on one stage.

    ``backward_s`` is the input-gradient part when the schedule splits weight gradients
    out into W actions (which take ``weight_s``), else the whole backward. ``send_s``
    moves this stage's outputs to the next stage (and, in the backward, their gradient
    back); it only counts where the next stage lives on another rank.
    ``activation_bytes`` stay alive from the start of F until the end of B; where the
    schedule splits out a W, ``weight_bytes`` of them (a deferred weight gradient's inputs
    and output gradients) stay on until W ends. ``backward_bytes`` are held while B runs (a
    recomputed block and its gradients); ``static_bytes`` are parameters, gradients and
    optimizer, but ``gradient_bytes`` of them, which the stage's first B makes (gradients
    are None from ``zero_grad()`` until then).
    ``input_grad_share`` is the part of B after which its input gradient leaves for
    another rank (1: at its end; the runtimes send it before a whole backward's weight
    gradients, so plans of schedules without W use ``1 - WEIGHT_SHARE``).
    """

    forward_s: float
    backward_s: float
    weight_s: float = 0.0
    send_s: float = 0.0
    activation_bytes: int = 0
    static_bytes: int = 0
    forward_fixed_s: float = 0.0  # the part of forward_s a smaller micro-batch does not save (launches)
    backward_fixed_s: float = 0.0
    input_grad_share: float = 1.0
    weight_bytes: int = 0
    backward_bytes: int = 0
    gradient_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "weight_s", "send_s", "activation_bytes", "static_bytes",
                     "forward_fixed_s", "backward_fixed_s", "weight_bytes", "backward_bytes", "gradient_bytes"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"StageCosts.{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.input_grad_share <= 1:
            raise ConfigError(f"StageCosts.input_grad_share is a share of B, in [0, 1]; got {self.input_grad_share!r}")


@dataclass(frozen=True)
class Timeline:
    """What a step looks like: every action's interval, and the figures drawn from them.

    ``busy_s[r]`` is rank r's compute time; ``bubble_fraction`` is
    ``1 - sum(busy_s) / (num_ranks * step_time_s)``; ``peak_memory_bytes[r]`` is the
    static bytes of rank r's stages plus the most activations it holds at once.
    """

    events: tuple[Event, ...]
    num_ranks: int
    step_time_s: float
    busy_s: tuple[float, ...]
    bubble_fraction: float
    peak_memory_bytes: tuple[int, ...]

    @classmethod
    def from_events(
        cls,
        events: Iterable[Event],
        *,
        num_ranks: int | None = None,
        costs: Sequence[StageCosts] = (),
        step_time_s: float | None = None,
        sizes: Sequence[float] = (),
    ) -> "Timeline":
        """The figures of a timeline from its events (simulated or measured). Memory is
        counted only where ``costs`` give the bytes (scaled by relative micro-batch ``sizes``);
        ``step_time_s`` defaults to the last end."""
        ordered = tuple(sorted(events, key=lambda e: (e.start_s, e.rank, e.end_s)))
        ranks = num_ranks if num_ranks is not None else max((e.rank + 1 for e in ordered), default=0)
        if any(not 0 <= e.rank < ranks for e in ordered):
            raise ConfigError(f"events name ranks outside 0..{ranks - 1}; pass num_ranks")
        if any(e.end_s < e.start_s for e in ordered):
            bad = next(e for e in ordered if e.end_s < e.start_s)
            raise ConfigError(
                f"event {bad.action} on rank {bad.rank} ends ({bad.end_s}) before it starts ({bad.start_s})"
            )
        step = step_time_s if step_time_s is not None else max((e.end_s for e in ordered), default=0.0)
        busy = [0.0] * ranks
        for e in ordered:
            busy[e.rank] += e.end_s - e.start_s
        bubble = 1.0 - sum(busy) / (ranks * step) if ranks and step > 0 else 0.0
        return cls(ordered, ranks, step, tuple(busy), bubble, _peak_memory(ordered, ranks, costs, sizes))

    def to_chrome_trace(self, *, name: str = "replica") -> dict[str, Any]:
        """``{"traceEvents": [...]}`` for chrome://tracing or Perfetto: one complete event
        (``"ph": "X"``, microseconds) per action, ``pid`` = rank, ``tid`` = stage."""
        trace: list[dict[str, Any]] = []
        stages: dict[int, set[int]] = {r: set() for r in range(self.num_ranks)}
        for e in self.events:
            stages[e.rank].add(e.action.stage_index)
        for r in range(self.num_ranks):
            trace.append(_metadata("process_name", r, 0, f"rank {r}"))
            trace += [_metadata("thread_name", r, s, f"stage {s}") for s in sorted(stages[r])]
        for e in self.events:
            s, kind, i = e.action
            trace.append({
                "name": str(e.action), "cat": _KIND_NAMES.get(kind, kind), "ph": "X",
                "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6, "pid": e.rank, "tid": s,
                "args": {"stage_index": s, "microbatch_index": i, "kind": kind},
            })
        return {
            "traceEvents": trace,
            "displayTimeUnit": "ms",
            "otherData": {"name": name, "step_time_s": self.step_time_s, "bubble_fraction": self.bubble_fraction},
        }


def _metadata(kind: str, pid: int, tid: int, label: str) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "ts": 0, "dur": 0, "pid": pid, "tid": tid, "args": {"name": label}}


def _peak_memory(events: Sequence[Event], num_ranks: int, costs: Sequence[StageCosts],
                 sizes: Sequence[float] = ()) -> tuple[int, ...]:
    """Per rank: static bytes of its stages plus the peak of live activations. A micro-batch's
    activations on stage s count from the start of F(s, i) to the end of B(s, i), but their
    ``weight_bytes``, which stay until W(s, i) ends where there is one; B(s, i) holds its
    ``backward_bytes`` while it runs, and the stage's first B makes its ``gradient_bytes``;
    ``sizes[i]`` scales micro-batch i's. ``events`` come in time order (each rank's in its list
    order at least)."""
    if not costs:
        return (0,) * num_ranks
    split = {(e.action.stage_index, e.action.microbatch_index) for e in events if e.action.kind == WEIGHT}
    static = [0] * num_ranks
    seen: set[int] = set()
    graded: set[int] = set()
    changes: list[list[tuple[float, int, int]]] = [[] for _ in range(num_ranks)]  # (time, order, bytes)
    for e in events:  # in time order (per rank: its list order), so a stage's first B comes first
        s, kind, i = e.action
        if s >= len(costs):
            raise ConfigError(f"event {e.action} names stage {s}, but costs cover {len(costs)} stages")
        c, size = costs[s], (sizes[i] if sizes else 1.0)
        if s not in seen:
            seen.add(s)
            static[e.rank] += c.static_bytes - min(c.gradient_bytes, c.static_bytes)
        if kind == BACKWARD and s not in graded:
            graded.add(s)
            changes[e.rank].append((e.start_s, 1, min(c.gradient_bytes, c.static_bytes)))
        later = round(min(c.weight_bytes, c.activation_bytes) * size) if (s, i) in split else 0
        if kind == FORWARD:
            changes[e.rank].append((e.start_s, 1, round(c.activation_bytes * size)))
        elif kind == BACKWARD:  # at a tie, free before allocating
            changes[e.rank].append((e.start_s, 1, round(c.backward_bytes * size)))
            changes[e.rank].append((e.end_s, 0, later - round(c.activation_bytes * size)
                                    - round(c.backward_bytes * size)))
        elif kind == WEIGHT:
            changes[e.rank].append((e.end_s, 0, -later))
    peaks = []
    for r in range(num_ranks):
        live = peak = 0
        for _, _, delta in sorted(changes[r]):
            live += delta
            peak = max(peak, live)
        peaks.append(static[r] + peak)
    return tuple(peaks)


def peak_memory(schedule: Sequence[Sequence[Action]], costs: Sequence[StageCosts]) -> list[int]:
    """Per rank of ``schedule``, the bytes it holds at its fullest, its actions run in list
    order (what :func:`simulate` gives whatever the seconds: a rank runs one action at a time)."""
    events = [Event(r, a, float(n), n + 0.5) for r, actions in enumerate(schedule) for n, a in enumerate(actions)]
    return list(_peak_memory(events, len(schedule), costs))


def _duration(a: Action, costs: Sequence[StageCosts], size: float = 1.0) -> float:
    """Seconds of ``a`` on a micro-batch ``size`` times the even one: the fixed part, plus the
    rest in proportion."""
    c = costs[a.stage_index]
    if a.kind == FORWARD:
        return c.forward_fixed_s + (c.forward_s - c.forward_fixed_s) * size
    if a.kind == BACKWARD:
        return c.backward_fixed_s + (c.backward_s - c.backward_fixed_s) * size
    return c.weight_s * size


def simulate(
    schedule: Sequence[Sequence[Action]],
    costs: Sequence[StageCosts],
    *,
    allreduce_s: Sequence[float] = (),
    sizes: Sequence[float] = (),
) -> Timeline:
    """Play ``schedule`` (``schedule[rank]`` in order) with ``costs[stage_index]`` per
    micro-batch; ``allreduce_s[rank]`` (data-parallel gradient reduction) is added after
    each rank's last action. ``sizes[i]`` scales micro-batch i against the even size (the
    fixed costs stay). Raises ``ScheduleError`` if the schedule deadlocks."""
    where = placement(schedule)
    num_ranks = len(schedule)
    num_stages = max(where, default=-1) + 1
    if len(costs) < num_stages:
        raise ConfigError(
            f"the schedule has {num_stages} stages but costs cover {len(costs)}; pass one StageCosts per stage"
        )
    if allreduce_s and len(allreduce_s) != num_ranks:
        raise ConfigError(f"allreduce_s has {len(allreduce_s)} entries for {num_ranks} ranks; pass one per rank")

    def duration(a: Action) -> float:
        return _duration(a, costs, sizes[a.microbatch_index] if sizes else 1.0)

    def arrival(dep: Event, a: Action) -> float:
        """When ``dep``'s output (or input gradient) reaches ``a``'s rank."""
        if dep.rank == where[a.stage_index]:
            return dep.end_s
        left = dep.end_s  # a B's input gradient leaves after its first input_grad_share
        if dep.action.kind == BACKWARD:
            left = dep.start_s + (dep.end_s - dep.start_s) * costs[dep.action.stage_index].input_grad_share
        link = costs[min(a.stage_index, dep.action.stage_index)].send_s  # the link between the two stages
        return left + link * (sizes[a.microbatch_index] if sizes else 1.0)

    events = play(schedule, duration, num_stages=num_stages, arrival=arrival)
    free = [0.0] * num_ranks
    for e in events:
        free[e.rank] = e.end_s
    ends = [free[r] + (allreduce_s[r] if allreduce_s else 0.0) for r in range(num_ranks)]
    return Timeline.from_events(events, num_ranks=num_ranks, costs=costs, step_time_s=max(ends, default=0.0),
                                sizes=sizes)
