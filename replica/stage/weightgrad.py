"""Split backward for zero-bubble schedules: input gradients now (B), weight gradients later (W).

A stage module rewritten by :func:`defer_linear_weight_grads` computes every linear
layer through :class:`_Linear`. Its backward always returns the input gradient; while
a :class:`WeightGrads` collector is active it only records ``(x, dy)`` for the weight
and bias instead of computing them, and :meth:`WeightGrads.apply` later accumulates
``dy^T x`` and ``sum(dy)`` into ``.grad`` — the same arithmetic autograd would do,
just at another time. Other ops keep their weight gradients in B. A collector made with
``now=True`` accumulates each one at once, in B, into ``.grad`` (``addmm_``: no
temporary gradient for autograd to add).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
import torch.nn.functional as F

from replica.precision import ambient_autocast
from replica.scoped import Scoped
from replica.stage import remat
from replica.stage.rewrite import rewrite_calls

__all__ = ["WeightGrads", "defer_linear_weight_grads", "collecting"]

_sink: Scoped[WeightGrads | None] = Scoped(None)  # where linear backwards put weight gradients


Pending = tuple[torch.Tensor, torch.Tensor | None, Any, torch.Tensor, bool]


class WeightGrads:
    """The deferred weight-gradient work of one (stage, micro-batch) backward; ``now``: no
    deferring, each linear's weight gradient accumulates into ``.grad`` in its backward,
    without the temporary and the extra pass over memory of autograd's accumulation (a
    backward whose W runs inside it, where no gradient hook needs to see it)."""

    def __init__(self, now: bool = False) -> None:
        # (weight, bias, layer input or its recipe, output gradient, transposed)
        self.pending: list[Pending] = []
        self.now = now

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, work: Pending) -> None:
        if self.now:
            _apply(*work)
        else:
            self.pending.append(work)

    def apply(self) -> None:
        """Accumulate every recorded weight and bias gradient into ``.grad``."""
        for work in self.pending:
            _apply(*work)
        self.pending.clear()


@torch.no_grad()
def _apply(weight: torch.Tensor, bias: torch.Tensor | None, x: Any, dy: torch.Tensor, transposed: bool) -> None:
    """One linear's weight and bias gradient into ``.grad`` (a weight's straight into its
    existing gradient: no temporary, one pass less over memory). Without grad mode: the
    saved inputs require grad, and a recorded graph would keep every micro-batch's inputs
    and output gradients alive until ``.grad`` is reset."""
    a, b, dy2 = _operands(remat.materialize(x), dy, transposed)
    if weight.requires_grad:
        if weight.grad is not None and weight.grad.dtype == a.dtype:
            weight.grad.addmm_(a, b)
        else:  # computed in autocast's dtype (or the weight's), kept in the gradient's
            _accumulate(weight, a.mm(b))
    if bias is not None and bias.requires_grad:
        _accumulate(bias, dy2.sum(0))


def _weight_grads(x: torch.Tensor, dy: torch.Tensor, transposed: bool, weight: bool,
                  bias: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``dW`` (``dy^T x``, or ``x^T dy`` for an (in, out) weight) and ``db`` (``sum dy``)."""
    a, b, dy2 = _operands(x, dy, transposed)
    return a.mm(b) if weight else None, dy2.sum(0) if bias else None


def _operands(x: torch.Tensor, dy: torch.Tensor, transposed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a, b, dy2)``: the weight gradient is ``a @ b``, the bias gradient ``dy2.sum(0)``."""
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    a, b = (x2.t(), dy2) if transposed else (dy2.t(), x2)
    return a, b, dy2


def grad_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype ``p``'s gradient accumulates in: its ``grad_dtype`` where torch has one
    (fp32 gradients of bf16 weights), else its own."""
    return getattr(p, "grad_dtype", None) or p.dtype


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    """``g`` into ``p.grad``, in the gradient's dtype: a gradient computed in autocast's half
    precision is cast as autograd casts it back through autocast's weight cast."""
    if p.grad is None:
        p.grad = g.to(grad_dtype(p))
    else:
        p.grad += g


@contextlib.contextmanager
def collecting(sink: WeightGrads | None) -> Iterator[None]:
    """While active, linear backwards record their weight gradients into ``sink``."""
    with _sink.using(sink):
        yield


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                transposed: bool) -> torch.Tensor:
        # The output of a rebuildable op (GELU) is kept as the op's input and a recipe, rebuilt
        # when W runs. The input is saved the usual way, so autograd frees it after backward.
        # Under autocast the layer computes as autocast would (its matmul in autocast's dtype,
        # inputs, weight and bias cast to it) and keeps the cast input, as autocast's own
        # linear saves; backward then casts the weight again and hands gradients back in that
        # dtype, which autograd and W cast to each parameter's gradient dtype.
        cast = ambient_autocast(x.device.type)
        ctx.cast = cast if cast is not None and torch.is_floating_point(x) else None
        if ctx.cast is not None:
            x, w, b = (None if t is None else t.to(ctx.cast) for t in (x, weight, bias))
        else:
            w, b = weight, bias
        recipe = remat.rebuildable(x)
        ctx.recipe = None if recipe is None else recipe.with_source(None)
        ctx.save_for_backward(x if recipe is None else recipe.source)
        # The parameters themselves, not saved-tensor copies: under activation checkpointing a
        # saved tensor comes back as a recomputed alias, and W must accumulate into the Parameter.
        ctx.weight, ctx.bias, ctx.transposed = weight, bias, transposed
        with torch.autocast(x.device.type, enabled=False) if ctx.cast is not None else contextlib.nullcontext():
            if transposed:  # (in, out) weight, as GPT-2's Conv1D: addmm(bias, x, weight)
                return torch.addmm(b, x, w) if b is not None else x.mm(w)
            return F.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (saved,) = ctx.saved_tensors
        x = saved if ctx.recipe is None else ctx.recipe.with_source(saved)
        weight, bias, transposed = ctx.weight, ctx.bias, ctx.transposed
        dx = None
        if ctx.needs_input_grad[0]:
            w = weight if ctx.cast is None else weight.to(ctx.cast)
            dx = dy.mm(w.t()) if transposed else dy.matmul(w)
        sink = _sink.get()
        if sink is not None:
            sink.add((weight, bias, x, dy, transposed))
            return dx, None, None, None
        dw, db = _weight_grads(remat.materialize(x), dy, transposed, ctx.needs_input_grad[1],
                               bias is not None and ctx.needs_input_grad[2])
        return dx, dw, db, None  # autograd casts each to its input's dtype


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose weight gradient can be deferred; plain ``F.linear`` when no grad is needed."""
    if not torch.is_grad_enabled() or not (weight.requires_grad or x.requires_grad):
        return F.linear(x, weight, bias)
    return _Linear.apply(x, weight, bias, False)


def addmm(bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.addmm(bias, x, weight)`` (a linear with an (in, out) weight) whose weight
    gradient can be deferred."""
    if not torch.is_grad_enabled() or not (weight.requires_grad or x.requires_grad):
        return torch.addmm(bias, x, weight)
    return _Linear.apply(x, weight, bias, True)


torch.fx.wrap("linear")  # keep them one node if a rewritten module is ever traced again
torch.fx.wrap("addmm")


def defer_linear_weight_grads(module: fx.GraphModule, skip: Callable[[fx.Node], bool] | None = None) -> int:
    """Route every ``nn.Linear`` and ``F.linear`` of ``module`` through :func:`linear`, and every
    ``addmm(bias, x, weight)`` of two parameters through :func:`addmm`, but those ``skip`` names
    (a checkpointed block's: deferring them would keep its recomputed inputs until W). Returns how many."""

    def replace(graph: fx.Graph, n: fx.Node) -> fx.Node | None:
        if skip is not None and skip(n):
            return None
        if n.op == "call_module" and type(module.get_submodule(str(n.target))) is torch.nn.Linear:
            weight = graph.get_attr(f"{n.target}.weight")
            bias = graph.get_attr(f"{n.target}.bias") if module.get_submodule(str(n.target)).bias is not None \
                else None
            return graph.call_function(linear, (n.args[0], weight, bias))
        if n.op == "call_function" and n.target in (F.linear, torch._C._nn.linear, torch.ops.aten.linear.default):
            return graph.call_function(linear, n.args, dict(n.kwargs))
        params = len(n.args) == 3 and all(isinstance(a, fx.Node) and a.op == "get_attr" for a in (n.args[0], n.args[2]))
        if n.op == "call_function" and n.target in (torch.addmm, torch.ops.aten.addmm.default) and not n.kwargs \
                and params:
            return graph.call_function(addmm, n.args)  # bias + x @ weight with both weights parameters
        return None

    return rewrite_calls(module, replace)
