"""Batch norm across micro-batches: the running statistics of the whole batch, updated once a step.

A pipeline runs each stage once per micro-batch, so a batch norm in training mode
normalizes every micro-batch with that micro-batch's own mean and variance (as every
micro-batched pipeline does; the gradients are those of the plain model run on each
micro-batch). Left alone it would also update its running statistics once per
micro-batch: ``num_microbatches`` small steps of momentum on small-batch statistics a
step, and ``num_batches_tracked`` counting micro-batches. :func:`defer_batchnorm`
makes it keep the running statistics of the plain model run on the whole batch instead
(as torchgpipe's DeferredBatchNorm does): each call adds its micro-batch's count, mean
and sum of squared deviations (merged exactly, Chan et al.), and the last micro-batch
of the step updates ``running_mean`` / ``running_var`` (unbiased over the whole batch)
and ``num_batches_tracked`` once. Forwards run again inside backward (activation
recompute) count nothing: their micro-batch was counted when it first ran.

Covered: ``nn.BatchNorm1d/2d/3d`` as ``torch.fx`` keeps them (modules), and the
``aten.batch_norm`` ops ``torch.export`` lowers them to. A functional ``F.batch_norm``
traced by fx updates its statistics per micro-batch as before.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from replica.errors import PipelineError
from replica.scoped import Scoped

__all__ = ["DeferredBatchNorm", "defer_batchnorm", "recompute_context"]

_recomputing = Scoped(False)  # a checkpoint's recomputation: counts no statistics


def recompute_context() -> tuple[ContextManager[None], ContextManager[None]]:
    """``context_fn`` for ``torch.utils.checkpoint``: its recomputation counts no statistics."""
    return nullcontext(), _recomputing.using(True)


class _Moments:
    """Count, mean and sum of squared deviations per channel of the micro-batches seen so far."""

    def __init__(self) -> None:
        self.calls = 0
        self.count = 0
        self.mean: torch.Tensor | None = None
        self.m2: torch.Tensor | None = None

    def add(self, x: torch.Tensor) -> None:
        dims = [0, *range(2, x.dim())]
        n = x.numel() // x.shape[1]
        with torch.no_grad():
            var, mean = torch.var_mean(x.detach().float(), dims, correction=0)
            if self.mean is None or self.m2 is None:
                self.count, self.mean, self.m2 = n, mean, var * n
            else:  # Chan et al.: merge two groups' moments without a second pass
                total = self.count + n
                delta = mean - self.mean
                self.mean = self.mean + delta * (n / total)
                self.m2 = self.m2 + var * n + delta * delta * (self.count * n / total)
                self.count = total
        self.calls += 1


class DeferredBatchNorm(torch.nn.Module):
    """Stands in for one batch norm call of a stage. It owns no parameter or buffer: it reads
    the model's own (``norm``, a BatchNorm module, or the tensors passed by an exported graph),
    so names, ``state_dict`` and checkpoints stay the model's."""

    def __init__(self, num_microbatches: int, norm: torch.nn.Module | None = None, *, momentum: float | None = None,
                 eps: float = 1e-5, num_batches_tracked: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_microbatches = num_microbatches
        self._refs = (norm, num_batches_tracked)  # a tuple: not registered as a sub-module or buffer
        self.momentum, self.eps = momentum, eps
        self.moments = _Moments()

    def forward(self, x: torch.Tensor, *tensors: Any) -> torch.Tensor:
        norm, num_batches_tracked = self._refs
        if norm is not None:  # torch.fx kept the module: follow its mode and settings as it would
            if not norm.training or norm.running_mean is None:
                return norm(x)
            norm._check_input_dim(x)  # type: ignore[operator]
            weight, bias, running_mean, running_var = norm.weight, norm.bias, norm.running_mean, norm.running_var
            momentum, eps, num_batches_tracked = norm.momentum, norm.eps, norm.num_batches_tracked
        else:  # torch.export's aten.batch_norm, traced in training mode
            weight, bias, running_mean, running_var = tensors
            momentum, eps = self.momentum, self.eps
        if x.numel() // x.shape[1] < 2:
            raise PipelineError(
                f"a micro-batch of shape {tuple(x.shape)} reaches a batch norm in training mode, which needs more "
                "than one value per channel to normalize with its own statistics. Use fewer micro-batches "
                "(num_microbatches) or a larger batch."
            )
        if not _recomputing.get():
            self.moments.add(x)
            if self.moments.calls >= self.num_microbatches:
                self._commit(running_mean, running_var, num_batches_tracked, momentum)
        return F.batch_norm(x, None, None, weight, bias, True, 0.0, eps)

    def _commit(self, running_mean: torch.Tensor, running_var: torch.Tensor,
                num_batches_tracked: torch.Tensor | None, momentum: float | None) -> None:
        """One update of the running statistics with the whole batch's, as the plain model makes."""
        moments, self.moments = self.moments, _Moments()
        assert moments.mean is not None and moments.m2 is not None
        with torch.no_grad():
            if num_batches_tracked is not None:
                num_batches_tracked.add_(1)
            # momentum None: a cumulative average over the steps, as torch's BatchNorm keeps it
            factor = momentum if momentum is not None else 1.0 / max(1, int(num_batches_tracked or 0))
            var = moments.m2 / max(moments.count - 1, 1)  # unbiased, as torch keeps it
            running_mean.mul_(1 - factor).add_(moments.mean.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1 - factor).add_(var.to(running_var.dtype), alpha=factor)


def _attr(gm: fx.GraphModule, target: str) -> Any:
    owner, _, field = target.rpartition(".")
    return getattr(gm.get_submodule(owner), field)


def _counter_writes(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """An exported graph's ``num_batches_tracked.add_(1)`` nodes, by their module's path."""
    out = {}
    for n in gm.graph.nodes:
        if (n.op == "call_function" and n.target is torch.ops.aten.add_.Tensor and not n.users
                and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr"
                and str(n.args[0].target).endswith("num_batches_tracked")):
            out[str(n.args[0].target).rpartition(".")[0]] = n
    return out


def defer_batchnorm(stages: Sequence[Any], num_microbatches: int) -> int:
    """Make the batch norms of ``stages`` (:class:`~replica.partition.split.StageModule`)
    update their running statistics once per step of ``num_microbatches`` micro-batches, with
    the whole batch's statistics; returns how many calls were rewritten (none for one
    micro-batch, where nothing changes)."""
    if num_microbatches < 2:
        return 0
    count = 0
    for stage in stages:
        gm: fx.GraphModule = stage.module
        counters = _counter_writes(gm)
        before = count
        for n in list(gm.graph.nodes):
            deferred: DeferredBatchNorm | None = None
            if n.op == "call_module":
                norm = gm.get_submodule(str(n.target))
                if (isinstance(norm, torch.nn.modules.batchnorm._BatchNorm)
                        and not isinstance(norm, torch.nn.SyncBatchNorm) and norm.track_running_stats):
                    deferred = DeferredBatchNorm(num_microbatches, norm)
                    args: tuple[Any, ...] = (*n.args, *n.kwargs.values())
            elif n.op == "call_function" and n.target is torch.ops.aten.batch_norm.default:
                x, weight, bias, mean, var, training, momentum, eps = n.args[:8]
                path = str(getattr(mean, "target", "")).rpartition(".")[0]
                if training is True and getattr(mean, "op", "") == "get_attr" and path in counters:
                    deferred = DeferredBatchNorm(num_microbatches, momentum=momentum, eps=eps,
                                                 num_batches_tracked=_attr(gm, f"{path}.num_batches_tracked"))
                    args = (x, weight, bias, mean, var)
                    gm.graph.erase_node(counters.pop(path))  # the step counts once, in DeferredBatchNorm
            if deferred is None:
                continue
            name = f"replica_deferred_batchnorm_{count}"
            gm.add_submodule(name, deferred)
            with gm.graph.inserting_after(n):
                new = gm.graph.call_module(name, args)
            new.meta = dict(n.meta)
            n.replace_all_uses_with(new)
            gm.graph.erase_node(n)
            count += 1
        if count > before:
            gm.graph.lint()
            gm.recompile()
    return count
