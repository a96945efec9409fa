"""One rank's point-to-point messages of one pipeline step: posting, sending, receiving.

The messages and their order come from :mod:`replica.runtime.p2p`. Each pair posts them
in that agreed order (NCCL matches the ops between two ranks by order, not tag), every
tag 0: a receive as soon as the order allows, a send as soon as its value exists. A rank
blocks only on the receive its next action reads, with the runtime's timeout. (Posting
every gloo receive up front, matched by tag, measured no faster: benchmarks/RESULTS.md.)

A tensor whose size depends on the data (a dynamic :class:`TensorMeta`) travels as two
messages in the pair's order: its shape (int64), then itself. Its receiver posts the shape's
receive in the tensor's place and the tensor's once the shape is in; the pair's later ops
wait behind it, as the FIFO order wants. Before it blocks on a receive, a rank waits for the
shapes its made sends wait behind and posts those sends: their peer may need them to go on,
and each such shape is on its way (its producer comes before the send's in the order, and the
send's has run). Its gradient comes back in the shape the sender sent: no shape travels back.
A message whose posting fails (gloo refuses an op with a peer already gone) fails where it is
waited for, so the error names the peer as any wait's does.
"""

from __future__ import annotations

import hashlib
from collections import deque
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from replica.errors import PipelineError
from replica.runtime.p2p import BWD, FWD, Message
from replica.runtime.shapes import TensorMeta

__all__ = ["Mailbox", "greet_peers", "digest", "post"]

Key = tuple[str, int, int, int]  # (value, reading stage, micro-batch, direction)
SHAPE = 2  # a key's direction for the shape sent ahead of a dynamic tensor
Wait = Callable[[Any, str, int], None]  # (work, what, global peer rank): raises on a dead peer


class _FailedPost:
    """An ``isend``/``irecv`` that raised when posted: done, and raising that when waited for."""

    def __init__(self, failure: Exception) -> None:
        self.failure = failure

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: Any = None) -> bool:
        raise self.failure


def post(op: Callable[..., Any], tensor: torch.Tensor, peer: int, **tag: int) -> Any:
    """``op(tensor, peer)`` posted; a peer gone already (gloo raises at once) fails when waited for."""
    try:
        return op(tensor, peer, **tag)
    except RuntimeError as exc:
        return _FailedPost(exc)


class Mailbox:
    """The messages of one step for this rank (``messages``, in the agreed order), those of
    them that carry tensors in this step (``metas[i][name]``) posted as described above.
    ``me`` is this rank's pipeline rank; ``global_rank`` maps a pipeline rank to its process."""

    def __init__(self, messages: Sequence[Message], metas: Sequence[dict[str, Any]], *, me: int,
                 global_rank: Callable[[int], int], device: torch.device, wait: Wait) -> None:
        self.metas, self.device, self.wait = metas, device, wait
        self.global_rank = global_rank
        self.recvs: dict[Key, tuple[Any, torch.Tensor]] = {}
        self.sends: dict[Key, tuple[Any, torch.Tensor, str, int]] = {}
        self.queues: dict[int, deque[tuple[bool, Message]]] = {}  # per peer: ops not yet posted
        self.outbox: dict[Key, torch.Tensor] = {}  # values made whose send waits for its turn
        self.peer: dict[Key, int] = {}
        self.place: dict[Key, int] = {}  # a message's place in its pair's queue
        self.posted: dict[int, int] = {}  # per peer: how many of its queue's ops are posted
        self.shapes: dict[Key, tuple[Any, torch.Tensor]] = {}  # dynamic receives: the shape's, posted
        self.sent: dict[tuple[str, int], tuple[int, ...]] = {}  # (value, micro-batch): the shape sent
        for msg in messages:
            sending = msg.source == me
            peer = msg.dest if sending else msg.source
            meta = metas[msg.microbatch][msg.name]
            if not isinstance(meta, TensorMeta) or (msg.direction == BWD and not meta.requires_grad):
                continue  # a Python value (worked out locally), or a gradient nobody needs
            self.peer[msg.key] = peer
            queue = self.queues.setdefault(peer, deque())
            self.place[msg.key] = len(queue)
            queue.append((sending, msg))
        for peer in self.queues:
            self.posted[peer] = 0
            self._pump(peer)

    def send(self, key: Key, tensor: torch.Tensor) -> None:
        """Send ``tensor`` as message ``key`` (now, or when its turn in the pair's order comes)."""
        self._release()
        self.outbox[key] = tensor.detach().contiguous()
        if key[3] == FWD:
            self.sent[(key[0], key[2])] = tuple(tensor.shape)
        self._pump(self.peer[key])

    def receive(self, key: Key, what: str) -> torch.Tensor:
        """Wait for message ``key``. A gradient coming back also means its activation's send
        is done: that payload is released."""
        if key not in self.recvs and key in self.peer:  # behind a dynamic tensor's shape: wait for it
            self._pump(self.peer[key], until=key)
        if key not in self.recvs:
            raise PipelineError(
                f"this rank needs the {what} before it posted its receive: the message order disagrees with the "
                "action lists (a Replica bug)"
            )
        self._post_made_sends()
        work, buf = self.recvs.pop(key)
        self.wait(work, what, self.global_rank(self.peer[key]))
        self._release()
        if key[3] == BWD:
            sent = self.sends.pop((key[0], key[1], key[2], FWD), None)
            if sent is not None:
                self.wait(sent[0], sent[2], sent[3])
        return buf

    def finish(self) -> None:
        """Wait for the remaining sends; every message must have been posted and read."""
        for work, _, what, peer in self.sends.values():
            self.wait(work, what, peer)
        self.sends.clear()
        unsent = [msg.key for q in self.queues.values() for _, msg in q] + list(self.outbox)
        unread = list(self.recvs) + list(self.shapes)
        if unsent or unread:
            raise PipelineError(
                f"a step ended with messages never posted {unsent[:4]} or never read {unread[:4]} "
                "(a Replica bug in the message order)"
            )

    def _release(self) -> None:
        """Let go of the payloads whose sends are done. A gradient sent upstream is read by
        nobody here, and kept to the step's end it would sit amid the next micro-batches'
        tensors, where the allocator could not reuse the space around it."""
        for key in [k for k, (work, *_) in self.sends.items() if work.is_completed()]:
            work, _, what, peer = self.sends.pop(key)
            self.wait(work, what, peer)  # done: returns at once, or raises if the send failed

    def _pump(self, peer: int, until: Key | None = None) -> None:
        """Post ``peer``'s queue from its head, up to a send whose value is not made yet, or a
        dynamic tensor whose shape is not in yet: waited for while ``until`` is not posted."""
        queue = self.queues[peer]
        while queue:
            sending, msg = queue[0]
            if sending:
                payload = self.outbox.pop(msg.key, None)
                if payload is None:
                    return
                self._isend(msg.key, payload)
            elif self._shape_in(msg, wait=until is not None and self.posted[peer] <= self.place[until]):
                self._irecv(msg)
            else:
                return
            queue.popleft()
            self.posted[peer] += 1

    def _post_made_sends(self) -> None:
        """Post the sends made but waiting behind a dynamic tensor's shape, waiting for those shapes."""
        last: dict[int, Key] = {}
        for key in self.outbox:
            peer = self.peer[key]
            if peer not in last or self.place[key] > self.place[last[peer]]:
                last[peer] = key
        for peer, key in last.items():
            self._pump(peer, until=key)

    def _shape_in(self, msg: Message, wait: bool) -> bool:
        """Whether a receive can be posted: a dynamic activation's once its shape has arrived
        (that receive posted first, then waited for if ``wait``)."""
        meta = self.metas[msg.microbatch][msg.name]
        if msg.direction != FWD or not meta.dynamic:
            return True
        peer = self.global_rank(self.peer[msg.key])
        if msg.key not in self.shapes:
            size = torch.empty(len(meta.shape), dtype=torch.int64, device=self.device)
            self.shapes[msg.key] = (post(dist.irecv, size, peer), size)
        work = self.shapes[msg.key][0]
        if not (wait or work.is_completed()):
            return False
        self.wait(work, f"the shape of {msg.name!r} of micro-batch {msg.microbatch} (its size depends on the data)",
                  peer)
        return True

    def _irecv(self, msg: Message) -> None:
        meta = self.metas[msg.microbatch][msg.name]
        shape = None
        if msg.key in self.shapes:  # a dynamic activation: its shape came first
            shape = self.shapes.pop(msg.key)[1].tolist()
        elif meta.dynamic:  # a dynamic activation's gradient: in the shape this rank sent it
            shape = self.sent[(msg.name, msg.microbatch)]
        buf = meta.empty(self.device, shape)
        self.recvs[msg.key] = (post(dist.irecv, buf, self.global_rank(self.peer[msg.key])), buf)

    def _isend(self, key: Key, payload: torch.Tensor) -> None:
        peer = self.global_rank(self.peer[key])
        what = f"sending {key[0]!r} of micro-batch {key[2]}"
        if key[3] == FWD and self.metas[key[2]][key[0]].dynamic:  # its shape first, in the pair's order
            size = torch.tensor(payload.shape, dtype=torch.int64, device=self.device)
            self.sends[(*key[:3], SHAPE)] = (post(dist.isend, size, peer), size, f"{what} (its shape)", peer)
        self.sends[key] = (post(dist.isend, payload, peer), payload, what, peer)


def greet_peers(messages: Sequence[Message], *, me: int, rank: int, global_rank: Callable[[int], int],
                device: torch.device, wait: Wait) -> None:
    """Greet every peer once, lowest rank first, and check that both ends derived the same
    message order. NCCL creates a pair's communicator at the pair's first
    ``isend``/``irecv`` and blocks until both ends are there; taken in the pipeline's own
    order, three ranks could each wait on another (0 on 2, 2 on 1, 1 on 0). With every
    rank going through its pairs in ascending (low, high) order no such cycle can form.
    Plain ``isend``/``irecv`` (not ``batch_isend_irecv``, which NCCL may run on another
    communicator), the lower rank sending first on both sides. A missing peer, or one that
    ordered the pair's messages differently, fails here, at set-up."""
    pairs: dict[int, list[Message]] = {}
    for msg in messages:
        pairs.setdefault(msg.dest if msg.source == me else msg.source, []).append(msg)
    for peer in sorted(pairs):
        other = global_rank(peer)
        mine = torch.tensor([digest(pairs[peer])], dtype=torch.int64, device=device)
        theirs = torch.empty(1, dtype=torch.int64, device=device)
        ops = [lambda: post(dist.isend, mine, other), lambda: post(dist.irecv, theirs, other)]
        for op in ops if me < peer else ops[::-1]:
            wait(op(), "the set-up handshake", other)
        if int(theirs.item()) != int(mine.item()):
            raise PipelineError(
                f"ranks {rank} and {other} derived different orders for the messages between them: they run "
                "different plans or schedules (every rank must call auto_parallel alike)"
            )


def digest(messages: Sequence[Message]) -> int:
    """A 63-bit fingerprint of a pair's messages in order, the same on both ends."""
    text = "|".join(f"{m.key}{m.source}>{m.dest}" for m in messages)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
