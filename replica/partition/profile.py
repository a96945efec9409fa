"""Measured costs: time every op's forward and backward on this device with real shapes."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["OpTimes", "profile"]


@dataclass(frozen=True)
class OpTimes:
    """Seconds for one call of an op on one micro-batch: forward, and backward (input and
    weight gradients together)."""

    forward_s: float
    backward_s: float


def _best(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
        return x.detach().requires_grad_(True)
    return x


class _Profiler(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, repeats: int) -> None:
        super().__init__(gm)
        self.repeats = repeats
        self.times: dict[str, OpTimes] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in ("call_function", "call_method", "call_module"):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        call = getattr(self, n.op)
        forward_s = _best(lambda: call(n.target, args, kwargs), self.repeats)
        backward_s = 0.0
        if torch.is_grad_enabled():
            backward_s = self._backward(n, call, args, kwargs)
        self.times[n.name] = OpTimes(forward_s, backward_s)
        with torch.no_grad():
            return call(n.target, args, kwargs)

    def _backward(self, n: fx.Node, call: Callable[..., Any], args: Any, kwargs: Any) -> float:
        leaf_args, leaf_kwargs = tree_map(_leaf, args), tree_map(_leaf, kwargs)
        wrt = [x for x in tree_flatten((leaf_args, leaf_kwargs))[0]
               if isinstance(x, torch.Tensor) and x.requires_grad]
        if n.op == "call_module":
            wrt += [p for p in self.module.get_submodule(str(n.target)).parameters() if p.requires_grad]
        wrt += [self.fetch_attr(str(a.target)) for a in n.all_input_nodes if a.op == "get_attr"]
        wrt = [w for w in wrt if isinstance(w, torch.Tensor) and w.requires_grad]
        if not wrt:
            return 0.0
        try:
            out = call(n.target, leaf_args, leaf_kwargs)
        except RuntimeError:  # an in-place op on a leaf: price its backward like its forward
            return -1.0
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        if not outs:
            return 0.0
        grads = [torch.ones_like(o) for o in outs]
        return _best(lambda: torch.autograd.grad(outs, wrt, grads, retain_graph=True, allow_unused=True),
                     self.repeats)


def profile(gm: fx.GraphModule, inputs: Sequence[Any], *, repeats: int = 3) -> dict[str, OpTimes]:
    """Run ``gm`` once op by op on ``inputs`` (one micro-batch, real tensors on the device the
    model lives on), timing each op's forward and backward as the best of ``repeats``.

    Gradients are computed with ``torch.autograd.grad``: nothing accumulates into ``.grad``.
    """
    profiler = _Profiler(gm, repeats)
    with torch.enable_grad():
        profiler.run(*inputs)
    return {
        name: OpTimes(t.forward_s, t.forward_s * 2 if t.backward_s < 0 else t.backward_s)
        for name, t in profiler.times.items()
    }
