"""One rank's point-to-point messages of one pipeline step: posting, sending, receiving.

The messages and their order come from :mod:`replica.runtime.p2p`. Each pair posts them
in that agreed order (NCCL matches the ops between two ranks by order, not tag), every
tag 0: a receive as soon as the order allows, a send as soon as its value exists. A rank
blocks only on the receive its next action reads, with the runtime's timeout. (Posting
every gloo receive up front, matched by tag, measured no faster: benchmarks/RESULTS.md.)
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

__all__ = ["Mailbox", "greet_peers", "digest"]

Key = tuple[str, int, int, int]  # (value, reading stage, micro-batch, direction)
Wait = Callable[[Any, str, int], None]  # (work, what, global peer rank): raises on a dead peer


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
        for msg in messages:
            sending = msg.source == me
            peer = msg.dest if sending else msg.source
            meta = metas[msg.microbatch][msg.name]
            if not isinstance(meta, TensorMeta) or (msg.direction == BWD and not meta.requires_grad):
                continue  # a Python value (worked out locally), or a gradient nobody needs
            self.peer[msg.key] = peer
            self.queues.setdefault(peer, deque()).append((sending, msg))
        for peer in self.queues:
            self._pump(peer)

    def send(self, key: Key, tensor: torch.Tensor) -> None:
        """Send ``tensor`` as message ``key`` (now, or when its turn in the pair's order comes)."""
        self._release()
        self.outbox[key] = tensor.detach().contiguous()
        self._pump(self.peer[key])

    def receive(self, key: Key, what: str) -> torch.Tensor:
        """Wait for message ``key``. A gradient coming back also means its activation's send
        is done: that payload is released."""
        if key not in self.recvs:
            raise PipelineError(
                f"this rank needs the {what} before it posted its receive: the message order disagrees with the "
                "action lists (a Replica bug)"
            )
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
        if unsent or self.recvs:
            raise PipelineError(
                f"a step ended with messages never posted {unsent[:4]} or never read {list(self.recvs)[:4]} "
                "(a Replica bug in the message order)"
            )

    def _release(self) -> None:
        """Let go of the payloads whose sends are done. A gradient sent upstream is read by
        nobody here, and kept to the step's end it would sit amid the next micro-batches'
        tensors, where the allocator could not reuse the space around it."""
        for key in [k for k, (work, *_) in self.sends.items() if work.is_completed()]:
            work, _, what, peer = self.sends.pop(key)
            self.wait(work, what, peer)  # done: returns at once, or raises if the send failed

    def _pump(self, peer: int) -> None:
        """Post ``peer``'s queue from its head, up to a send whose value is not made yet."""
        queue = self.queues[peer]
        while queue:
            sending, msg = queue[0]
            if sending:
                payload = self.outbox.pop(msg.key, None)
                if payload is None:
                    return
                self._isend(msg.key, payload)
            else:
                self._irecv(msg)
            queue.popleft()

    def _irecv(self, msg: Message) -> None:
        buf = self.metas[msg.microbatch][msg.name].empty(self.device)
        self.recvs[msg.key] = (dist.irecv(buf, self.global_rank(self.peer[msg.key])), buf)

    def _isend(self, key: Key, payload: torch.Tensor) -> None:
        peer = self.global_rank(self.peer[key])
        self.sends[key] = (dist.isend(payload, peer), payload, f"sending {key[0]!r} of micro-batch {key[2]}", peer)


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
        ops = [lambda: dist.isend(mine, other), lambda: dist.irecv(theirs, other)]
        for post in ops if me < peer else ops[::-1]:
            wait(post(), "the set-up handshake", other)
        if int(theirs.item()) != int(mine.item()):
            raise PipelineError(
                f"ranks {rank} and {other} derived different orders for the messages between them: they run "
                "different plans or schedules (every rank must call auto_parallel alike)"
            )


def digest(messages: Sequence[Message]) -> int:
    """A 63-bit fingerprint of a pair's messages in order, the same on both ends."""
    text = "|".join(f"{m.key}{m.source}>{m.dest}" for m in messages)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
