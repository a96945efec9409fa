"""Selective recompute: keep the input of a cheap pointwise op, not its output.

A GPT block's MLP is ``fc2(gelu(fc1(x)))``. Autograd keeps both ``h = fc1(x)`` (GELU's
backward needs it) and ``gelu(h)`` (fc2's weight gradient needs it): two tensors four
times the model width, per token, per layer, per micro-batch in flight. Inside
:func:`pointwise_recompute`, a saved tensor that is the output of GELU or SiLU (or a view
of one) is packed as a recipe instead: the op's own saved input, which autograd keeps
anyway, and the op's name. Backward runs the op again on that input. The same kernel on
the same bits gives the same bits, so gradients are unchanged; the output's memory is
freed once the forward moves on. The price is one pointwise op per use in backward, about
1% of a transformer layer's time. torch.compile's default partitioner makes the same
choice for pointwise ops.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

__all__ = ["pointwise_recompute", "rebuildable", "materialize"]

_state = threading.local()


def _gelu(node: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    approximate = node._saved_approximate
    return node._saved_self, lambda h: F.gelu(h, approximate=approximate)


def _silu(node: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    return node._saved_self, F.silu


# autograd node name -> how to find the op's saved input and run the op again
_RECIPES: dict[str, Callable[[Any], tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]] = {
    "GeluBackward0": _gelu,
    "SiluBackward0": _silu,
}


class _Recipe:
    """How to rebuild a saved tensor: ``op(source)``, then the saved view of it."""

    __slots__ = ("source", "op", "size", "stride", "offset")

    def __init__(self, source: torch.Tensor | None, op: Callable[[torch.Tensor], torch.Tensor],
                 size: torch.Size, stride: tuple[int, ...], offset: int) -> None:
        self.source, self.op, self.size, self.stride, self.offset = source, op, size, stride, offset

    def with_source(self, source: torch.Tensor | None) -> "_Recipe":
        """The same recipe on another source (None: the op and the view alone, for an
        autograd function that saves the source itself so autograd frees it in time)."""
        return _Recipe(source, self.op, self.size, self.stride, self.offset)

    def rebuild(self) -> torch.Tensor:
        assert self.source is not None
        with torch.no_grad():
            out = self.op(self.source)
        if out.size() == self.size and out.stride() == self.stride and self.offset == 0:
            return out
        return out.as_strided(self.size, self.stride, self.offset)


def rebuildable(t: torch.Tensor) -> "_Recipe | None":
    """The recipe for ``t`` if a :func:`pointwise_recompute` is active and ``t`` (or its base)
    is an untouched output of a rebuildable op, else None. A custom autograd function can
    keep this instead of ``t`` and :func:`materialize` it when it needs the values, which
    may be later than its backward (a deferred weight gradient)."""
    if not getattr(_state, "active", False):
        return None
    packed = _pack(t)
    return packed if isinstance(packed, _Recipe) else None


def materialize(x: Any) -> torch.Tensor:
    """``x`` itself, or the tensor its recipe rebuilds."""
    return x.rebuild() if isinstance(x, _Recipe) else x


def _pack(t: torch.Tensor) -> Any:
    base = t._base if t._base is not None else t
    node = base.grad_fn
    recipe = _RECIPES.get(type(node).__name__) if node is not None else None
    # Only an untouched, contiguous output of the op itself (version 0: nothing wrote into it
    # since, so running the op again gives exactly what was saved).
    if recipe is None or base._version != 0 or not base.is_contiguous() or base.is_sparse:
        return t
    source, op = recipe(node)
    if source.shape != base.shape or source.dtype != base.dtype or source.device != base.device:
        return t
    return _Recipe(source, op, t.size(), t.stride(), t.storage_offset())


_unpack = materialize


@contextlib.contextmanager
def pointwise_recompute(enabled: bool = True) -> Iterator[None]:
    """While active (and ``enabled``), saved outputs of GELU / SiLU are rebuilt in backward
    from the op's input instead of being kept."""
    if not enabled or not torch.is_grad_enabled():
        yield
        return
    previous = getattr(_state, "active", False)
    _state.active = True
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _state.active = previous
