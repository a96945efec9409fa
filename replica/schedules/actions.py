"""Actions and the one F/B/W dependency rule between them: the base every schedule module reads.

An :class:`Action` is ``(stage_index, kind, microbatch_index)`` and prints as ``2F0``
(stage 2, forward, micro-batch 0); ``B`` is a backward (the input gradient when a W
follows), ``W`` a deferred weight gradient. ``schedule[rank]`` is the ordered list of
actions that rank runs. Stages form a chain: stage s takes stage s-1's outputs and
hands its own to stage s+1, so::

    F(s, i)  after  F(s-1, i)                 (its inputs)
    B(s, i)  after  F(s, i),  B(s+1, i)       (its activations; the gradient of its outputs)
    W(s, i)  after  B(s, i)

:func:`dependencies` is that rule; validation, list scheduling, replay and the simulator
all ask it. Nothing here imports torch.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Sequence

from replica.errors import ScheduleError

__all__ = [
    "FORWARD", "BACKWARD", "WEIGHT", "KINDS", "Action", "Schedule", "dependencies", "dependents", "placement",
    "splits_backward", "check_sizes", "check_looped",
]

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
KINDS = (FORWARD, BACKWARD, WEIGHT)
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


# The rule as data: what an action of each kind waits for, as (stage offset, kind) of the
# same micro-batch. Both directions below are read off this one table.
_RULE: dict[str, tuple[tuple[int, str], ...]] = {
    FORWARD: ((-1, FORWARD),),
    BACKWARD: ((0, FORWARD), (1, BACKWARD)),
    WEIGHT: ((0, BACKWARD),),
}
_INVERSE: dict[str, tuple[tuple[int, str], ...]] = {
    kind: tuple((-offset, waiting) for waiting, rule in _RULE.items() for offset, needed in rule if needed == kind)
    for kind in KINDS
}


def dependencies(a: Action, num_stages: int) -> tuple[Action, ...]:
    """The actions ``a`` waits for, in a chain of ``num_stages`` stages (the rule above)."""
    s, kind, i = a
    return tuple([Action(s + d, k, i) for d, k in _RULE[kind] if 0 <= s + d < num_stages])


def dependents(a: Action, num_stages: int) -> tuple[Action, ...]:
    """The actions that wait for ``a``: the same rule read backwards (every B has a W among
    them; a schedule without W never runs it)."""
    s, kind, i = a
    return tuple([Action(s + d, k, i) for d, k in _INVERSE[kind] if 0 <= s + d < num_stages])


def placement(schedule: Sequence[Sequence[Action]]) -> dict[int, int]:
    """``{stage_index: rank}``; each stage must live on exactly one rank."""
    where: dict[int, int] = {}
    for rank, actions in enumerate(schedule):
        for a in actions:
            if where.setdefault(a.stage_index, rank) != rank:
                raise ScheduleError(f"stage {a.stage_index} appears on ranks {where[a.stage_index]} and {rank}")
    return where


def splits_backward(schedule: Sequence[Sequence[Action]]) -> bool:
    """Whether a schedule runs weight gradients (W) apart from input gradients (B)."""
    return any(a.kind == WEIGHT for actions in schedule for a in actions)


def check_sizes(num_stages: int, num_microbatches: int) -> None:
    """Every schedule needs at least one stage and one micro-batch."""
    if num_stages < 1 or num_microbatches < 1:
        raise ScheduleError(
            f"a schedule needs num_stages >= 1 and num_microbatches >= 1, got {num_stages} and {num_microbatches}"
        )


def check_looped(what: str, num_ranks: int, num_stages: int, num_microbatches: int) -> None:
    """Looped placement needs several stages on every rank."""
    check_sizes(num_stages, num_microbatches)
    p = num_ranks
    if p < 1 or num_stages % p or num_stages == p:
        raise ScheduleError(
            f"{what} needs num_stages a multiple (>= 2x) of the {p} pipeline ranks, got "
            f"num_stages={num_stages}; use num_stages={2 * p} (2 stages per rank) or the '1f1b' schedule"
        )
