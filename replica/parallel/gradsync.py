"""Data-parallel gradient averaging, bucket by bucket, overlapped with the last backward.

Each stage's parameters (those it reduces: a weight shared with a later local stage is
reduced with that one, a weight tied across ranks by its own group) are cut into buckets
of about ``bucket_bytes``, in reverse order of registration, which is about the order
backward finishes them. While a stage runs its last backward action of the step, a
post-accumulate hook counts the gradients autograd has finished; a bucket whose every
gradient is done starts its all-reduce at once, on the communication thread, while
backward goes on. Whatever is left (unused parameters; and every bucket when the action
defers weight gradients, whose hooks fire before W has run) starts right after the action,
in bucket order.

Every replica runs the same graph in the same order, so they start the same all-reduces in
the same order, which collectives need.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from replica.parallel.fsdp import local_tensor

__all__ = ["ReplicaReducer", "BUCKET_BYTES"]

BUCKET_BYTES = 4 * 2**20


class ReplicaReducer:
    """Averages gradients over the data-parallel ``group`` of ``size`` replicas."""

    def __init__(self, params_by_stage: dict[int, list[torch.nn.Parameter]], group: Any, size: int,
                 wait: Callable[[Any, str, str], None], bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group, self.size, self.wait = group, size, wait
        self.buckets: dict[int, list[list[torch.nn.Parameter]]] = {}
        self.where: dict[int, tuple[int, int]] = {}  # id(param) -> (stage, bucket)
        for stage, params in params_by_stage.items():
            buckets: list[list[torch.nn.Parameter]] = []
            size_now = bucket_bytes
            for p in reversed(params):
                if size_now >= bucket_bytes:
                    buckets.append([])
                    size_now = 0
                buckets[-1].append(p)
                size_now += local_tensor(p).numel() * p.element_size()
                self.where[id(p)] = (stage, len(buckets) - 1)
            self.buckets[stage] = buckets
        self.armed: int | None = None
        self.ready: dict[int, set[int]] = {}
        self.started: dict[int, bool] = {}
        self.works: list[tuple[Any, torch.Tensor, list[torch.nn.Parameter]]] = []
        self.hooks = [p.register_post_accumulate_grad_hook(self._accumulated)
                      for params in self.buckets.values() for bucket in params for p in bucket]

    def new_step(self) -> None:
        """Forget what a step that failed half-way left behind."""
        self.armed, self.works = None, []

    def arm(self, stage: int, listen: bool = True) -> None:
        """``stage``'s last backward action of the step is about to run. ``listen`` only when
        autograd accumulates every gradient in it: a linear whose weight gradient is deferred
        still runs its (empty) accumulation and its hook, with the gradient not yet final."""
        self.armed = stage if listen else None
        self.ready = {b: set() for b in range(len(self.buckets.get(stage, ())))}
        self.started = {b: False for b in self.ready}

    def flush(self, stage: int) -> None:
        """The action ran: start every bucket of ``stage`` not started yet, in order."""
        for b in range(len(self.buckets.get(stage, ()))):
            if not self.started[b]:
                self._start(stage, b)
        self.armed = None

    def finish(self) -> None:
        """Wait for every all-reduce of the step and write the averages into ``.grad``."""
        works, self.works = self.works, []
        for work, flat, params in works:
            self.wait(work, "the data-parallel gradient all-reduce", "the other replicas")
            flat /= self.size
            offset = 0
            for p in params:
                grad = local_tensor(p.grad)  # a tensor-parallel shard: this rank's part
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def _accumulated(self, p: torch.Tensor) -> None:
        stage_bucket = self.where.get(id(p))
        if stage_bucket is None or stage_bucket[0] != self.armed:
            return
        b = stage_bucket[1]
        ready = self.ready[b]
        ready.add(id(p))
        if len(ready) == len(self.buckets[self.armed][b]) and not self.started[b]:
            self._start(self.armed, b)

    def _start(self, stage: int, b: int) -> None:
        self.started[b] = True
        params = [p for p in self.buckets[stage][b] if p.grad is not None]
        if not params:
            return
        flat = torch.cat([local_tensor(p.grad).reshape(-1) for p in params])
        self.works.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, params))
