"""Manipulation of micro-batches: split a batch along dim 0, weigh the losses, merge outputs."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from replica.errors import ConfigError
from replica.schedules.grading import sizes

__all__ = ["batch_size", "sizes", "split", "loss_weights", "merge"]


def batch_size(values: Sequence[Any], what: str = "inputs") -> int:
    """The common size of dim 0 over every tensor of at least one dimension in ``values``."""
    sizes = {int(v.shape[0]) for v in tree_flatten(list(values))[0] if isinstance(v, torch.Tensor) and v.dim() > 0}
    if not sizes:
        raise ConfigError(f"{what} have no tensor with a batch dimension (dim 0) to split into micro-batches")
    if len(sizes) > 1:
        raise ConfigError(
            f"{what} disagree on the batch size (dim 0): {sorted(sizes)}. Every batched tensor must have the "
            "same dim 0."
        )
    return sizes.pop()


def split(values: Sequence[Any], num_microbatches: int, what: str = "inputs",
          shares: Sequence[float] = ()) -> list[tuple[Any, ...]]:
    """Split every batched tensor of ``values`` into ``num_microbatches`` views along dim 0.

    Sizes follow :func:`sizes`: even by default (a batch that does not divide evenly gives
    sizes that differ by one), or graded by ``shares`` (a plan's ``microbatch_shares``);
    scalars and non-tensors are passed to every micro-batch.
    """
    n = batch_size(values, what)
    if not 1 <= num_microbatches <= n:
        raise ConfigError(
            f"num_microbatches={num_microbatches} but the {what} have a batch of {n}: each micro-batch needs "
            f"at least one sample. Use num_microbatches <= {n}, or a larger batch."
        )
    counts = sizes(n, num_microbatches, shares)
    leaves, spec = tree_flatten(list(values))
    pieces = [
        torch.split(v, counts, dim=0) if isinstance(v, torch.Tensor) and v.dim() > 0
        else (v,) * num_microbatches
        for v in leaves
    ]
    return [tuple(tree_unflatten([p[i] for p in pieces], spec)) for i in range(num_microbatches)]


def loss_weights(microbatches: Sequence[Sequence[Any]], reduction: str) -> list[float]:
    """Weights that make the micro-batch losses add up to the full-batch loss: each
    micro-batch's share of the batch for a mean, 1 for a sum."""
    if reduction == "sum":
        return [1.0] * len(microbatches)
    sizes = [batch_size(mb) for mb in microbatches]
    total = sum(sizes)
    return [s / total for s in sizes]


def merge(outputs: Sequence[Any]) -> Any:
    """Concatenate the micro-batch outputs along dim 0, keeping the model's output structure."""
    if len(outputs) == 1:
        return outputs[0]
    flat = [tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    merged = []
    for leaves in zip(*(f[0] for f in flat)):
        first = leaves[0]
        if isinstance(first, torch.Tensor):
            if first.dim() == 0:
                raise ConfigError(
                    "the model returns a 0-dim tensor, which cannot be re-assembled from micro-batches; "
                    "return per-sample values (reduce outside the model) or use num_microbatches=1"
                )
            merged.append(torch.cat(leaves, dim=0))
        else:
            merged.append(first)
    return tree_unflatten(merged, spec)
