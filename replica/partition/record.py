"""Running a traced graph once, on fake or meta tensors (really only as a fallback), to record
each node's output shapes, dtypes and FLOPs, leaving the model as it was."""

from __future__ import annotations

import contextlib
import os
import traceback
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode

from replica.errors import TraceError
from replica.partition.export import Kept, structure_key
from replica.partition.graph import TensorInfo
from replica.partition.pure import untouched, written_parameters

__all__ = ["Recorder", "record", "user_frame"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_REPLICA_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_frame(exc: BaseException) -> str:
    """``file:line: code`` of the innermost frame outside torch and Replica."""
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith((_TORCH_DIR, _REPLICA_DIR)) and "<eval_with_key>" not in f.filename
    ]
    if not frames:
        return "(no user frame in the traceback)"
    f = frames[-1]
    return f"{f.filename}:{f.lineno}: {(f.line or '').strip()}"


def _tensor_info(value: Any) -> tuple[TensorInfo, ...]:
    return tuple(
        TensorInfo(tuple(int(d) for d in t.shape), str(t.dtype).removeprefix("torch."))
        for t in tree_leaves(value)
        if isinstance(t, torch.Tensor)
    )


class Recorder(fx.Interpreter):
    """Runs the graph once (really, or on meta/fake tensors) and records shapes and FLOPs."""

    def __init__(self, gm: fx.GraphModule, param_names: dict[int, str], on_meta: bool = False) -> None:
        super().__init__(gm)
        self.param_names = param_names
        self.on_meta = on_meta  # constants (and any real tensor attribute) read as meta copies
        self.outputs: dict[str, tuple[TensorInfo, ...]] = {}
        self.flops: dict[str, float] = {}
        self.kinds: dict[str, str] = {}
        self.on_values = False  # run on real tensors: what it recorded may depend on their values

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        return _meta(value) if self.on_meta else value

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("call_function", "call_method", "call_module"):
            result = self.call(n)
        else:
            result = super().run_node(n)
            self.flops[n.name] = 0.0
        self.outputs[n.name] = _tensor_info(result)
        self.kinds[n.name] = (
            "tensor" if isinstance(result, torch.Tensor) else "container" if self.outputs[n.name] else "value"
        )
        return result

    def call(self, n: fx.Node) -> Any:
        """Run the op ``n``, counting its FLOPs."""
        with FlopCounterMode(display=False) as counter:
            result = super().run_node(n)
        self.flops[n.name] = float(counter.get_total_flops())
        return result


def _fake_inputs(inputs: tuple[Any, ...], device: torch.device, mode: FakeTensorMode) -> tuple[Any, ...]:
    with mode:
        return tree_map(lambda x: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
                        if isinstance(x, torch.Tensor) else x, inputs)


def _meta(x: Any) -> Any:
    """A meta tensor of ``x``'s shape, dtype and strides (``x`` itself when not a real tensor)."""
    if not isinstance(x, torch.Tensor) or x.is_meta:
        return x
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=x.requires_grad)
    return out.requires_grad_(x.requires_grad) if x.is_leaf and x.dtype.is_floating_point else out


@contextlib.contextmanager
def _on_meta(gm: fx.GraphModule) -> Iterator[None]:
    """Swap every real parameter and buffer of ``gm`` for a meta copy (tied ones stay tied), restoring
    them after: a model partly on meta (``deferred_init``'s real buffers, a rank's own stages
    materialized) records shapes without mixing devices."""
    real = {name: t for name, t in [*gm.named_parameters(remove_duplicate=False),
                                    *gm.named_buffers(remove_duplicate=False)] if not t.is_meta}
    if not real:
        yield
        return
    copies: dict[int, torch.Tensor] = {}
    swapped = {name: copies.setdefault(id(t), _meta(t)) for name, t in real.items()}
    with _reparametrize_module(gm, swapped):
        yield


def record(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...], names: dict[int, str]) -> Recorder:
    """Propagate shapes on fake tensors: nothing is computed or allocated, whatever the
    inputs and weights are (meta, fake or real). A graph that fake tensors cannot run (an
    op without a fake kernel, a value read out of a tensor) runs once for real, without grad.

    Real is the fallback, not the rule: a full-batch forward allocates every activation
    once, and the allocator keeps the holes they leave among the set-up's long-lived
    objects (tens of MiB of resident memory per rank that training never reuses). Either
    way, the model is left as it was (buffers such as a BatchNorm's statistics, RNG, modes)."""
    tensors = list(gm.parameters()) + list(gm.buffers())
    device = tensors[0].device if tensors else (inputs[0].device if inputs else torch.device("cpu"))
    if any(t.is_meta for t in tensors):  # a model (partly) on meta: shapes and dtypes on meta, all of them
        device = torch.device("meta")
    real = device.type != "meta" and not any(
        x.device.type == "meta" or type(x).__name__ == "FakeTensor" for x in tree_leaves(inputs))
    key = _record_key(gm, inputs, device, real)
    kept = _RECORDS.get(key)
    if kept is not None:
        recorder = Recorder(gm, names)
        recorder.outputs, recorder.flops, recorder.kinds = (dict(d) for d in kept)
        return recorder
    # a training-mode BatchNorm counts batches even on fake tensors (and, run for real,
    # updates its statistics); recording a shape must not
    with untouched(gm, written_parameters(gm)):
        recorder = _run_recorder(gm, inputs, names, device, real)
    if not recorder.on_values:
        _RECORDS.put(key, (dict(recorder.outputs), dict(recorder.flops), dict(recorder.kinds)))
    return recorder


# What fake (or meta) tensors recorded of the newest graphs of this process, by what decides it
# (:func:`_record_key`): a model built alike again (a re-plan, every rank's or test's same model) is not
# run again. Shapes on fake tensors depend on the code and the tensors' shapes, never on their values;
# a graph run on real values (the fallback) is not kept.
_RECORDS = Kept(16)  # (outputs, flops, kinds) by _record_key


def _record_key(gm: fx.GraphModule, inputs: tuple[Any, ...], device: torch.device, real: bool) -> Any:
    """The graph's code, its modules (a leaf module runs its own code: its attributes) and weights'
    shapes, the inputs' shapes, and the root's tensor constants by value (:func:`structure_key`)."""
    constants = {k: v for k, v in vars(gm).items() if isinstance(v, torch.Tensor)}
    structure = structure_key(gm, inputs, device.type, real, root_attributes=False, constants=constants)
    return None if structure is None else (gm.code, structure)


def _run_recorder(gm: fx.GraphModule, inputs: tuple[Any, ...], names: dict[int, str], device: torch.device,
                  real: bool) -> Recorder:
    try:
        if device.type == "meta":  # every tensor on meta: real inputs, buffers and constants too
            recorder = Recorder(gm, names, on_meta=True)
            with _on_meta(gm):
                recorder.run(*tree_map(_meta, inputs))
            return recorder
        try:
            recorder = Recorder(gm, names)
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            args = _fake_inputs(inputs, device, mode)
            with mode, torch.no_grad():
                recorder.run(*args)
            return recorder
        except Exception:
            if not real:
                raise
        recorder = Recorder(gm, names)
        recorder.on_values = True
        with torch.no_grad():
            recorder.run(*inputs)
        return recorder
    except Exception as exc:
        raise TraceError(
            f"Running the traced graph of {gm.__class__.__name__} on the example inputs failed: "
            f"{type(exc).__name__}: {exc}\n  at {user_frame(exc)}\n"
            "Fix: check that example_inputs have the shapes and dtypes model.forward expects."
        ) from exc
