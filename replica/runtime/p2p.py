"""The messages of a pipeline step, and one order in which both ends of each pair post them.

gloo matches a receive to its send by tag, so a rank may post every receive of a step
up front. NCCL ignores tags: the point-to-point ops between two ranks run in one stream,
in the order each rank posted them, and the k-th op on one side meets the k-th on the
other. A receive posted early blocks every later op to or from that peer until its send
arrives, so up-front receives would deadlock (each rank's sends queue behind receives
that wait for the other's sends).

Ordered posting fixes one global order of the step's actions (a linearization that
respects every rank's list and every dependency, ties broken by the plan's simulated
start times) and sorts each pair's messages by the position of the action that sends
them. Both ends derive the same list; each posts its share in that order, a send once its
value exists. No message can wait on a later one: whatever a message depends on was
produced by an earlier action, so it sits earlier in every list (see
:func:`check_fifo`, which plays a step under NCCL's rules).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from replica.errors import ScheduleError
from replica.schedules.schedule import BACKWARD, FORWARD, Action, placement

__all__ = ["Message", "step_messages", "linearize", "ordered", "check_fifo"]

FWD, BWD = 0, 1


@dataclass(frozen=True)
class Message:
    """Value ``name`` of micro-batch ``microbatch`` for stage ``reader``: forward, the
    activation from its source stage; backward (``direction`` 1), its gradient going back.
    ``producer`` sends it on pipeline rank ``source``; ``consumer`` reads it on ``dest``."""

    name: str
    reader: int
    microbatch: int
    direction: int
    producer: Action
    consumer: Action
    source: int
    dest: int

    @property
    def key(self) -> tuple[str, int, int, int]:
        return self.name, self.reader, self.microbatch, self.direction


def step_messages(edges: Iterable[tuple[str, int, int]], where: Mapping[int, int], num_microbatches: int,
                  *, train: bool) -> list[Message]:
    """Every cross-rank message of a step. ``edges`` are ``(value, source stage, reading
    stage)`` for the tensors that cross cuts; ``where`` maps a stage to its pipeline rank.
    Training adds each activation's gradient, sent back by the reader's B action."""
    out = []
    for name, src, reader in edges:
        if where[src] == where[reader]:
            continue
        for i in range(num_microbatches):
            out.append(Message(name, reader, i, FWD, Action(src, FORWARD, i), Action(reader, FORWARD, i),
                               where[src], where[reader]))
            if train:
                out.append(Message(name, reader, i, BWD, Action(reader, BACKWARD, i), Action(src, BACKWARD, i),
                                   where[reader], where[src]))
    return out


def linearize(schedule: Sequence[Sequence[Action]], messages: Sequence[Message],
              priority: Mapping[Action, float] | None = None) -> dict[Action, int]:
    """One global order of every action: each rank's list in its order, each message's
    producer before its consumer, earliest ``priority`` (a simulated start) first.
    Raises ``ScheduleError`` if no such order exists."""
    after: dict[Action, list[Action]] = {}
    waits: dict[Action, int] = {}
    for actions in schedule:
        for prev, a in zip(actions, actions[1:]):
            after.setdefault(prev, []).append(a)
            waits[a] = waits.get(a, 0) + 1
    for msg in messages:
        after.setdefault(msg.producer, []).append(msg.consumer)
        waits[msg.consumer] = waits.get(msg.consumer, 0) + 1
    where = placement(schedule)
    heap = [((priority or {}).get(a, 0.0), where[a.stage_index], a) for actions in schedule for a in actions[:1]
            if waits.get(a, 0) == 0]
    heapq.heapify(heap)
    order: dict[Action, int] = {}
    while heap:
        _, _, a = heapq.heappop(heap)
        order[a] = len(order)
        for b in after.get(a, ()):
            waits[b] -= 1
            if waits[b] == 0:
                heapq.heappush(heap, ((priority or {}).get(b, 0.0), where[b.stage_index], b))
    total = sum(len(actions) for actions in schedule)
    if len(order) != total:
        stuck = sorted(str(a) for actions in schedule for a in actions if a not in order)[:6]
        raise ScheduleError(f"the schedule's actions and messages form a cycle; never reached: {stuck}")
    return order


def ordered(messages: Iterable[Message], order: Mapping[Action, int]) -> list[Message]:
    """The messages in the one order every pair posts them: by their sending action's
    place in ``order``, then by value, reader and direction."""
    return sorted(messages, key=lambda m: (order[m.producer], m.name, m.reader, m.direction))


def check_fifo(schedule: Sequence[Sequence[Action]], messages: Sequence[Message]) -> None:
    """Play one step under NCCL's rules and raise ``ScheduleError`` if it would hang.

    Each pair of ranks has one FIFO stream per rank; each rank posts its ops on a pair in
    the order of ``messages`` (a receive at once, a send when its producer has run); the
    k-th op of one side completes with the k-th of the other (both ends read one list,
    so it is the message's other half), and only after the ops before it. An action
    runs when the receives it reads have completed. Both ends read their ops from the one
    list, so this checks that the agreed order cannot hang, not that two ranks agree on it
    (the runtime compares digests of each pair's list at set-up)."""
    queues: dict[tuple[int, int], list[tuple[str, Message]]] = {}
    for msg in messages:
        queues.setdefault((msg.source, msg.dest), []).append(("send", msg))
        queues.setdefault((msg.dest, msg.source), []).append(("recv", msg))
    posted = {pair: 0 for pair in queues}  # ops of rank pair[0] towards pair[1] posted so far
    done = {pair: 0 for pair in queues}  # ... and completed
    received: set[tuple[str, int, int, int]] = set()
    needs: dict[Action, list[Message]] = {}
    for msg in messages:
        needs.setdefault(msg.consumer, []).append(msg)
    ran: set[Action] = set()
    cursor = [0] * len(schedule)
    progress = True
    while progress:
        progress = False
        for (me, peer), ops in queues.items():  # post what may be posted
            while posted[(me, peer)] < len(ops):
                kind, msg = ops[posted[(me, peer)]]
                if kind == "send" and msg.producer not in ran:
                    break
                posted[(me, peer)] += 1
                progress = True
        for (me, peer), ops in queues.items():  # complete matched pairs, in order
            k = done[(me, peer)]
            if k < posted[(me, peer)] and k < posted[(peer, me)]:
                done[(me, peer)] = done[(peer, me)] = k + 1
                received.add(ops[k][1].key)
                progress = True
        for rank, actions in enumerate(schedule):
            while cursor[rank] < len(actions):
                a = actions[cursor[rank]]
                if any(msg.key not in received for msg in needs.get(a, ())):
                    break
                ran.add(a)
                cursor[rank] += 1
                progress = True
    stuck = [f"rank {r} at {actions[cursor[r]]}" for r, actions in enumerate(schedule) if cursor[r] < len(actions)]
    if stuck:
        raise ScheduleError(f"point-to-point ops in this order would hang under NCCL: {', '.join(stuck)}")
    unmatched = sorted(f"{a}->{b}" for (a, b), ops in queues.items() if done[(a, b)] < len(ops))
    if unmatched:  # every action ran, yet some message was never matched: it would hang the next step
        raise ScheduleError(f"point-to-point ops left unmatched between ranks {unmatched}")
