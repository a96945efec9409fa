"""What crosses each cut for a given micro-batch, worked out on fake tensors, never sent.

Every rank holds the same traced graph. Running it once on fake tensors (``FakeTensorMode``:
shapes and dtypes, no bytes) of the rank's device type, with the micro-batch's input shapes,
under the autocast the step runs in, gives the shape, dtype and ``requires_grad`` of every
tensor crossing a cut and the value of every Python value (a size, a device) crossing one, so
ranks allocate receive buffers and rebuild sizes without a shape handshake on the wire. Each
rank works it out alike, once per input shapes (cached): nothing is computed per step.

Ops inside a stage need not have data-independent shapes or a meta kernel:

- an op whose output size depends on the data (``nonzero``, ``torch.where(mask)``, masked
  selection) gets a symbolic size (torch's unbacked sizes, a ``ShapeEnv``) that flows on
  through the stage; a tensor crossing a cut whose size stays symbolic is marked *dynamic*
  (``None`` in its :class:`TensorMeta` shape): its sender sends the shape just before it
  (runtime/mailbox.py), as ``torch.distributed.pipelining`` does for dynamic shapes;
- an op whose meta kernel fails on its inputs (``grouped_mm`` in fp32: its meta kernel takes
  only bf16) runs for real, once, on zeros of its inputs' shapes, as ``FakeTensorMode`` does for
  ops with no meta kernel at all: its output's shape and dtype are the real kernel's; so does a
  module kept whole (``leaf_modules=``) whose forward branches or loops on the data, which
  fake tensors cannot follow (a loop over the experts that got tokens). Where such an output's
  size would follow the data after all, the sender finds it differs from the agreed shape and
  raises before sending (runtime/executor.py).

What cannot be followed is a ``PipelineError`` naming the op and its stage: a data-dependent
Python value (``.item()``) crossing a cut (which no rank can know before the step), or an op
that fails on fake and on zero inputs alike. Every rank raises it at the same point, before
any message of the step is posted: no peer is left waiting.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv, has_free_symbols
from torch.utils._pytree import tree_leaves, tree_map, tree_unflatten

from replica.errors import PipelineError
from replica.parallel.fsdp import drop_dtype_asserts
from replica.partition.crossing import HALF
from replica.partition.plan import StagePlan
from replica.precision import ambient_autocast

__all__ = ["TensorMeta", "ShapeOracle", "DATA_DEPENDENT"]

_DATA_DEPENDENT = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class _DataDependent:
    """A Python value of the model's output known only once the data is: its last stage has it."""

    def __repr__(self) -> str:
        return "<data-dependent>"


DATA_DEPENDENT = _DataDependent()


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and whether a gradient flows back through a tensor crossing a cut; a dim
    that depends on the data is ``None`` (its size travels with the tensor)."""

    shape: tuple[int | None, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def dynamic(self) -> bool:
        return None in self.shape

    def empty(self, device: torch.device, shape: Sequence[int] | None = None) -> torch.Tensor:
        """A buffer for it: of its own shape, or of ``shape`` (a dynamic one's, as received)."""
        size = tuple(self.shape if shape is None else shape)
        assert None not in size and self.agrees(size), (self.shape, size)
        return torch.empty(size, dtype=self.dtype, device=device)

    def agrees(self, shape: Sequence[int]) -> bool:
        """Whether a tensor of ``shape`` is this one: every fixed dim equal."""
        return len(shape) == len(self.shape) and all(a is None or a == b for a, b in zip(self.shape, shape))


def _fake_copy(gm: fx.GraphModule, device: torch.device,
               param_dtype: torch.dtype | None = None) -> tuple[fx.GraphModule, FakeTensorMode]:
    """A copy of ``gm`` whose parameters and buffers are fake tensors on ``device`` (what
    autocast acts on; no bytes are copied), with their fake mode, which gives data-dependent
    sizes symbols; floating parameters in ``param_dtype`` if given (the dtype sharded replicas
    gather them in)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True, static_shapes=True, shape_env=ShapeEnv())
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
    for m in fake.modules():  # momentum=None reads num_batches_tracked's value, which a fake tensor has not
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.momentum is None:
            m.momentum = 0.1
    # Devices written into the graph (export records `.to(device=cpu)`, `arange(device=cpu)`): this rank's.
    here = lambda v: device if isinstance(v, torch.device) else v  # noqa: E731
    for n in fake.graph.nodes:
        n.args = tree_map(here, n.args)
        n.kwargs = tree_map(here, n.kwargs)
    fake.recompile()
    return fake, mode


def _size(d: Any) -> int | None:
    """A dim as an int, or None where it depends on the data."""
    return int(d) if not isinstance(d, torch.SymInt) or not has_free_symbols(d) else None


def _sized_by_data(value: Any) -> bool:
    """Whether a value holds a tensor with a symbolic size."""
    return any(isinstance(t, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in t.shape)
               for t in tree_leaves(value))


def _symbolic(value: Any) -> bool:
    """Whether a Python value holds a number known only once the data is (a symbol)."""
    return any(isinstance(v, _SYMBOLIC) and has_free_symbols(v) for v in tree_leaves(value))


def _plain(value: Any, device: torch.device) -> Any:
    """A Python value as this rank uses it: symbol-free symbolic numbers made plain, a device its own."""
    if isinstance(value, torch.device):
        return device
    if isinstance(value, _SYMBOLIC):
        return {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(value)](value)
    if isinstance(value, (tuple, list)):
        items = [_plain(v, device) for v in value]
        if isinstance(value, torch.Size):
            return torch.Size(items)
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


class _QuietMetaFailures(logging.Filter):
    """FakeTensorMode logs every failing meta kernel with its traceback; the oracle reports what matters."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


@contextlib.contextmanager
def _quiet_meta_failures() -> Iterator[None]:
    logger, quiet = logging.getLogger("torch._subclasses.fake_tensor"), _QuietMetaFailures()
    logger.addFilter(quiet)  # while the oracle runs only
    try:
        yield
    finally:
        logger.removeFilter(quiet)


class _OpFailed(Exception):
    """An op of the graph the oracle could not follow, and why."""

    def __init__(self, node: fx.Node, reason: str, data_dependent: bool) -> None:
        super().__init__(reason)
        self.node, self.reason, self.data_dependent = node, reason, data_dependent


def _reason(exc: BaseException) -> str:
    text = str(exc).split("\n\n")[0].strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


class _Runner(fx.Interpreter):
    """Runs the fake graph, keeping the values named ``keep`` and the output; an op that fails
    on fake tensors runs for real on zeros (see the module's docstring)."""

    def __init__(self, module: fx.GraphModule, mode: FakeTensorMode, device: torch.device,
                 keep: frozenset[str]) -> None:
        super().__init__(module)
        self.mode, self.device, self.keep = mode, device, keep
        self.found: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except _DATA_DEPENDENT as exc:
            if n.op != "call_module":
                raise _OpFailed(n, _reason(exc), data_dependent=True) from exc
            # a module kept whole (leaf_modules=) whose inside branches or loops on the data (HF's
            # `for e in experts_hit`): it runs on zeros, its outputs' sizes checked on each step when sent
            result = self._on_zeros(n, exc)
        except Exception as exc:
            if n.op not in ("call_function", "call_method", "call_module"):
                raise _OpFailed(n, _reason(exc), data_dependent=False) from exc
            result = self._on_zeros(n, exc)
        if n.name in self.keep or n.op == "output":
            self.found[n.name] = result
        if self.mode.cache_enabled and _sized_by_data(result):
            self.mode.cache_enabled = False  # its op cache slows later ops down once sizes are symbols (3x, an MoE)
        return result

    def _on_zeros(self, n: fx.Node, failure: Exception) -> Any:
        """Op ``n`` run for real on zeros of its inputs' shapes (a leaf module's weights too);
        its outputs made fake again."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        module = self.fetch_attr(str(n.target)) if n.op == "call_module" else None
        state = {} if module is None else {**dict(module.named_parameters()), **dict(module.named_buffers())}
        fakes = [t for t in tree_leaves((args, kwargs, state)) if isinstance(t, torch.Tensor)]
        if any(_size(d) is None for t in fakes for d in (*t.shape, *t.stride())) or _symbolic((args, kwargs)):
            raise _OpFailed(n, f"{_reason(failure)} (and its inputs' sizes depend on the data, so it cannot "
                               "run on zeros instead)", data_dependent=False) from failure

        def real(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            zeros = torch.empty_strided(tuple(map(int, t.shape)), tuple(map(int, t.stride())), dtype=t.dtype,
                                        device=self.device).zero_()
            return zeros.requires_grad_(t.requires_grad)

        try:
            with unset_fake_temporarily():
                args, kwargs = tree_map(real, (args, kwargs))
                out = (getattr(self, n.op)(n.target, args, kwargs) if module is None else
                       torch.func.functional_call(module, tree_map(real, state), args, kwargs))
        except Exception as exc:
            raise _OpFailed(n, f"{_reason(failure)}; on zeros of its inputs' shapes: {_reason(exc)}",
                            data_dependent=False) from exc

        def fake(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            made = self.mode.from_tensor(t.detach(), static_shapes=True)
            return made.requires_grad_(True) if t.requires_grad else made

        return tree_map(fake, out)


class ShapeOracle:
    """``oracle(inputs)[name]``: a :class:`TensorMeta` or the Python value, per value crossing
    a cut of ``stages`` (the plan's); ``"output"``: the model's output, its tensors as metas."""

    def __init__(self, gm: fx.GraphModule, stages: Sequence[StagePlan], device: torch.device, out_spec: Any = None,
                 param_dtype: torch.dtype | None = None) -> None:
        # made now, while the weights are whole: shapes outlive the weights a rank releases;
        # ``param_dtype``: the weights' dtype under autocast, where FSDP gathers them cast
        self.module, self.mode = _fake_copy(gm, device, param_dtype)
        self._cache_ops = self.mode.cache_enabled  # torch's default, until a graph makes symbolic sizes
        self.out_spec = out_spec  # exported graphs return flat outputs: the model's structure
        self.boundary = {b.name: b for s in stages for b in s.outputs}
        self.stage_of = {name: s.stage_index for s in stages for name in s.node_names}
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
            self._cache[key] = self._infer(inputs)
        return self._cache[key]

    def _infer(self, inputs: Sequence[Any]) -> dict[str, Any]:
        runner = _Runner(self.module, self.mode, self.device, frozenset(self.boundary))
        self.mode.cache_enabled = self._cache_ops
        with self.mode:
            args = [torch.empty(x.shape, dtype=x.dtype, device=self.device).requires_grad_(x.requires_grad)
                    if isinstance(x, torch.Tensor) else x for x in inputs]
        try:
            with self.mode, torch.enable_grad(), _quiet_meta_failures():
                runner.run(*args)
        except _OpFailed as failed:
            raise self._op_error(failed, inputs) from failed.__cause__
        out: dict[str, Any] = {}
        for name, value in runner.found.items():
            if name == "output":  # the model's output structure, its tensors as metas
                value = value if self.out_spec is None else tree_unflatten(list(value), self.out_spec)
                out[name] = tree_map(self._output_meta, value)
            elif isinstance(value, torch.Tensor):
                out[name] = self._tensor_meta(value, self.boundary[name].dtype)
            elif _symbolic(value):
                raise self._value_error(name, value)
            else:
                out[name] = _plain(value, self.device)
        return out

    def _output_meta(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor_meta(value)
        return DATA_DEPENDENT if _symbolic(value) else _plain(value, self.device)

    @staticmethod
    def _tensor_meta(value: torch.Tensor, sent: str | None = None) -> TensorMeta:
        """``value``'s meta; ``sent``: the dtype the plan sends it in, where its stage casts it to
        autocast's (:mod:`replica.partition.crossing`)."""
        dtype = value.dtype
        if sent in HALF and dtype == torch.float32:
            dtype = getattr(torch, sent)
        return TensorMeta(tuple(_size(d) for d in value.shape), dtype,
                          value.requires_grad and value.dtype.is_floating_point)

    def _where(self, node: fx.Node) -> str:
        """``stage k (module path)`` for a node of the graph."""
        stage = self.stage_of.get(node.name)
        modules = node.meta.get("nn_module_stack") or {}
        path = next(reversed(modules.values()))[0] if modules else ""
        where = "its stage" if stage is None else f"stage {stage}"
        return f"{where}{f' (module {path!r})' if path else ''}"

    def _op_error(self, failed: _OpFailed, inputs: Sequence[Any]) -> PipelineError:
        n = failed.node
        target = getattr(n.target, "__name__", str(n.target))
        shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else x for x in inputs]
        fix = ("its output sizes depend on the data in a way the oracle cannot follow (a Python number read "
               "from a tensor, .item() / .tolist(), used as a size): compute them with tensor ops (masks, "
               "torch.where, index_add) instead" if failed.data_dependent else
               "give the op a fake kernel that accepts these inputs (torch.library.register_fake), or compute it "
               "with ops that have one")
        return PipelineError(
            f"the distributed runtime works out what crosses each cut by running the graph on fake tensors (no "
            f"data), and op {n.name!r} ({target}) in {self._where(n)} failed there for micro-batch inputs "
            f"{shapes}: {failed.reason}. Fix: {fix}."
        )

    def _value_error(self, name: str, value: Any) -> PipelineError:
        b = self.boundary[name]
        readers = list(b.destination_stages)
        return PipelineError(
            f"the Python value {name!r} ({value}) made in stage {b.source_stage} and read by stage(s) {readers} "
            "depends on the data (.item(), .tolist(), a size after nonzero), so no rank can know it before the "
            "step, and only tensors travel between processes. Fix: move the cut — keep the code that makes and "
            "reads it in one stage (auto_parallel(..., leaf_modules=[that module]) keeps a module whole) — or "
            "pass it on as a tensor."
        )
