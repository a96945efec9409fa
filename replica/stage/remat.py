"""Selective recompute: keep the input of a cheap op, not its output.

A GPT block's MLP is ``fc2(gelu(fc1(x)))``. Autograd keeps both ``h = fc1(x)`` (GELU's
backward needs it) and ``gelu(h)`` (fc2's weight gradient needs it): two tensors four
times the model width, per token, per layer, per micro-batch in flight. The same goes for
a LayerNorm before a linear: the norm keeps its input, the linear the norm's output.
Inside :func:`pointwise_recompute`, a saved tensor that is the output of GELU, SiLU or
LayerNorm (or a view of one) is packed as a recipe instead: the op's own saved input,
which autograd keeps anyway, and how to run the op again. Backward runs it on that
input. The same kernel on the same bits gives the same bits, so gradients are unchanged;
the output's memory is freed once the forward moves on. Together that is 6 of a GPT
layer's 16 model-width tensors per token; the price is one cheap op per use in backward,
under 1% of a layer's time. torch.compile's default partitioner makes the same choice for
pointwise ops.

A LayerNorm's autograd node does not keep its ``eps``, so only a norm run through
:func:`layer_norm` (stage modules are rewritten to it by :func:`rebuildable_norms`), which
notes it on the node, can be rebuilt.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Collection, Iterator

import torch
import torch.fx as fx
import torch.nn.functional as F

from replica.errors import ConfigError
from replica.scoped import Scoped
from replica.stage.rewrite import rewrite_calls

__all__ = ["pointwise_recompute", "rebuildable", "materialize", "layer_norm", "rebuildable_norms", "KINDS",
           "REBUILT_OPS"]

# what can be rebuilt, by kind: activations (GELU, SiLU) and norms (LayerNorm)
KINDS = ("activation", "norm")
# the traced graph's names of those ops (partition/trace.py), with their kind
REBUILT_OPS = {"gelu": "activation", "silu": "activation", "layernorm": "norm", "layer_norm": "norm"}

_kinds = Scoped(frozenset())  # the kinds of ops whose outputs are rebuilt
_EPS = "replica.layer_norm_eps"  # where layer_norm notes its eps on the output's autograd node


Op = Callable[[torch.Tensor], torch.Tensor]
_Finder = Callable[[Any], "tuple[torch.Tensor, Op] | None"]


def _gelu(node: Any) -> tuple[torch.Tensor, Op]:
    approximate = node._saved_approximate
    return node._saved_self, lambda h: F.gelu(h, approximate=approximate)


def _silu(node: Any) -> tuple[torch.Tensor, Op]:
    return node._saved_self, F.silu


def _layer_norm(node: Any) -> tuple[torch.Tensor, Op] | None:
    eps = node.metadata.get(_EPS)
    if eps is None:  # not run through layer_norm: its eps is unknown
        return None
    shape, weight, bias = node._saved_normalized_shape, node._saved_weight, node._saved_bias
    return node._saved_input, lambda x: F.layer_norm(x, shape, weight, bias, eps)


# autograd node name -> (kind, how to find the op's saved input and run the op again; None: it can't)
_RECIPES: dict[str, tuple[str, _Finder]] = {
    "GeluBackward0": ("activation", _gelu),
    "SiluBackward0": ("activation", _silu),
    "NativeLayerNormBackward0": ("norm", _layer_norm),
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
    is an untouched output of an op it rebuilds, else None. A custom autograd function can
    keep this instead of ``t`` and :func:`materialize` it when it needs the values, which
    may be later than its backward (a deferred weight gradient)."""
    if not _kinds.get():
        return None
    packed = _pack(t)
    return packed if isinstance(packed, _Recipe) else None


def materialize(x: Any) -> torch.Tensor:
    """``x`` itself, or the tensor its recipe rebuilds."""
    return x.rebuild() if isinstance(x, _Recipe) else x


def _pack(t: torch.Tensor) -> Any:
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return t  # a tensor subclass (a tensor-parallel DTensor): views of it are not strided storage
    base = t._base if t._base is not None else t
    node = base.grad_fn
    kind, recipe = _RECIPES.get(type(node).__name__, ("", None)) if node is not None else ("", None)
    # Only an untouched, contiguous output of the op itself (version 0: nothing wrote into it
    # since, so running the op again gives exactly what was saved).
    if recipe is None or kind not in _kinds.get() or base._version != 0 or not base.is_contiguous() or base.is_sparse:
        return t
    found = recipe(node)
    if found is None:
        return t
    source, op = found
    if source.shape != base.shape or source.dtype != base.dtype or source.device != base.device:
        return t
    return _Recipe(source, op, t.size(), t.stride(), t.storage_offset())


_unpack = materialize


@contextlib.contextmanager
def pointwise_recompute(kinds: bool | Collection[str] = True) -> Iterator[None]:
    """While active, saved outputs of the ops of ``kinds`` (True: every kind in ``KINDS``;
    False or empty: none) are rebuilt in backward from the op's input instead of being kept."""
    chosen = frozenset(KINDS if kinds is True else kinds or ())
    unknown = chosen - set(KINDS)
    if unknown:
        raise ConfigError(f"unknown kinds of rebuilt ops {sorted(unknown)}; choose from {list(KINDS)}")
    if not chosen or not torch.is_grad_enabled():
        yield
        return
    with _kinds.using(chosen), torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield


def layer_norm(input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,  # noqa: A002
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` (same arguments), noting ``eps`` on the output's autograd node so
    that a :func:`pointwise_recompute` can rebuild the output from the norm's saved input."""
    out = F.layer_norm(input, normalized_shape, weight, bias, eps)
    if out.grad_fn is not None and "norm" in _kinds.get():
        out.grad_fn.metadata[_EPS] = eps
    return out


torch.fx.wrap("layer_norm")  # one node if a rewritten module is ever traced again


def rebuildable_norms(module: fx.GraphModule) -> int:
    """Route every ``nn.LayerNorm`` and ``F.layer_norm`` of ``module`` through
    :func:`layer_norm`. Returns how many."""

    def replace(graph: fx.Graph, n: fx.Node) -> fx.Node | None:
        if n.op == "call_module" and type(module.get_submodule(str(n.target))) is torch.nn.LayerNorm:
            norm = module.get_submodule(str(n.target))
            weight = graph.get_attr(f"{n.target}.weight") if norm.weight is not None else None
            bias = graph.get_attr(f"{n.target}.bias") if norm.bias is not None else None
            return graph.call_function(layer_norm, (n.args[0], tuple(norm.normalized_shape), weight, bias, norm.eps))
        if n.op == "call_function" and n.target is F.layer_norm:
            return graph.call_function(layer_norm, n.args, dict(n.kwargs))
        return None

    return rewrite_calls(module, replace)
