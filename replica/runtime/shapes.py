"""What crosses each cut for a given micro-batch, worked out on meta tensors, never sent.

Every rank holds the same traced graph. Running it once on ``meta`` copies of the
weights with the micro-batch's input shapes gives the shape, dtype and
``requires_grad`` of every tensor crossing a cut, and the value of every Python
value (a size, a device) crossing one — so ranks allocate receive buffers and
rebuild sizes without a shape handshake on the wire.

Under ``torch.autocast`` (the run's ``mixed_precision``, or the caller's own) the dtypes
are autocast's, which meta tensors do not see: the graph then runs on fake tensors of the
rank's own device type (``FakeTensorMode``: no bytes either), inside the same autocast.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map, tree_unflatten

from replica.errors import PipelineError
from replica.parallel.fsdp import drop_dtype_asserts
from replica.precision import ambient_autocast

__all__ = ["TensorMeta", "ShapeOracle"]


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and whether a gradient flows back through a tensor crossing a cut."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def _meta_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose parameters and buffers live on ``meta``: no bytes are copied."""
    memo: dict[int, Any] = {}
    for p in gm.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in gm.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    meta = copy.deepcopy(gm, memo)
    for m in meta.modules():  # momentum=None reads num_batches_tracked's value, which meta has not
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.momentum is None:
            m.momentum = 0.1
    # Devices written into the graph (export records `.to(device=cpu)`, `arange(device=cpu)`)
    # would pull meta tensors back to a real device: make them meta too.
    to_meta = lambda v: torch.device("meta") if isinstance(v, torch.device) else v  # noqa: E731
    for n in meta.graph.nodes:
        n.args = tree_map(to_meta, n.args)
        n.kwargs = tree_map(to_meta, n.kwargs)
    meta.recompile()
    return meta


def _fake_copy(gm: fx.GraphModule, device: torch.device,
               param_dtype: torch.dtype | None = None) -> tuple[fx.GraphModule, Any]:
    """A copy of ``gm`` (the meta copy) whose parameters and buffers are fake tensors on
    ``device`` (what autocast acts on; meta tensors it ignores), with their fake mode;
    floating parameters in ``param_dtype`` if given (the dtype sharded replicas gather them in)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, Any] = {}
    with mode:
        for p in gm.parameters():
            dtype = param_dtype if param_dtype is not None and p.is_floating_point() else p.dtype
            memo[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device),
                                             requires_grad=p.requires_grad)
        for b in gm.buffers():
            memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device=device)
    fake = copy.deepcopy(gm, memo)
    if param_dtype is not None:
        drop_dtype_asserts(fake)  # as the sharded stages do (parallel/fsdp.py)
    here = lambda v: device if isinstance(v, torch.device) and v.type == "meta" else v  # noqa: E731
    for n in fake.graph.nodes:  # the meta copy names meta where the graph named a device: this rank's
        n.args = tree_map(here, n.args)
        n.kwargs = tree_map(here, n.kwargs)
    fake.recompile()
    return fake, mode


def _localize(value: Any, device: torch.device) -> Any:
    """Python values computed on meta name the meta device; a rank uses its own."""
    if isinstance(value, torch.device):
        return device
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        return type(value)(_localize(v, device) for v in value)
    return value


class ShapeOracle:
    """``oracle(inputs)[name]``: a :class:`TensorMeta` or the Python value, per boundary value."""

    def __init__(self, gm: fx.GraphModule, names: Sequence[str], device: torch.device, out_spec: Any = None,
                 param_dtype: torch.dtype | None = None) -> None:
        self.param_dtype = param_dtype  # the weights' dtype under autocast, where FSDP gathers them cast
        self.meta_module = _meta_copy(gm)
        self._fake: tuple[fx.GraphModule, Any] | None = None  # made the first time autocast is on
        self.out_spec = out_spec  # exported graphs return flat outputs: the model's structure
        self.names = frozenset(names)
        self.device = device
        self._cache: dict[tuple[Any, ...], dict[str, Any]] = {}

    @staticmethod
    def _signature(inputs: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(
            (tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else ("value", repr(x))
            for x in inputs
        )

    def __call__(self, inputs: Sequence[Any]) -> dict[str, Any]:
        """Under the autocast in force for this rank's device type, as the step will run."""
        autocast = ambient_autocast(self.device.type)
        key = (self._signature(inputs), autocast)
        if key not in self._cache:
            self._cache[key] = self._infer(inputs, autocast)
        return self._cache[key]

    def _infer(self, inputs: Sequence[Any], autocast: torch.dtype | None) -> dict[str, Any]:
        found: dict[str, Any] = {}
        names = self.names
        device = self.device

        class Recorder(fx.Interpreter):
            def run_node(self, n: fx.Node) -> Any:
                result = super().run_node(n)
                if n.name in names or n.op == "output":
                    found[n.name] = result
                return result

        if autocast is None:
            module, mode = self.meta_module, contextlib.nullcontext()
            args = [x.detach().to("meta").requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                    for x in inputs]
        else:
            if self._fake is None:
                self._fake = _fake_copy(self.meta_module, device, self.param_dtype)  # shapes outlive released weights
            module, mode = self._fake
            with mode:
                args = [torch.empty(x.shape, dtype=x.dtype, device=device).requires_grad_(x.requires_grad)
                        if isinstance(x, torch.Tensor) else x for x in inputs]
        try:
            with mode, torch.enable_grad():
                Recorder(module).run(*args)
        except Exception as exc:
            raise PipelineError(
                f"could not work out the shapes crossing the cuts for inputs "
                f"{[tuple(x.shape) if isinstance(x, torch.Tensor) else x for x in inputs]}: "
                f"{type(exc).__name__}: {exc}. The distributed runtime needs every value crossing a cut to "
                "depend only on input shapes (no .item() / data-dependent Python values at a cut)."
            ) from exc
        out: dict[str, Any] = {}
        for name, value in found.items():
            if name == "output":  # the model's output structure, as meta tensors
                out[name] = value if self.out_spec is None else tree_unflatten(list(value), self.out_spec)
            elif isinstance(value, torch.Tensor):
                out[name] = TensorMeta(tuple(value.shape), value.dtype,
                                       value.requires_grad and value.dtype.is_floating_point)
            else:
                out[name] = _localize(value, device)
        return out
