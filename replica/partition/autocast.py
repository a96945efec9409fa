"""The traced graph as it runs under autocast: each op's real output dtypes, the dtype its
FLOPs run in, and the weight copies autocast makes, for pricing a bf16 / fp16 run.

The graph runs once more on fake tensors (no bytes, no arithmetic, at any model size) inside
the autocast the stages will run in, rather than applying autocast's op lists to the traced
graph by rule: what autocast does to one op decides the dtypes of every op after it (a
residual add of an fp32 stream and a bf16 matmul output is fp32; a GELU of a bf16 matmul
is bf16; a softmax of bf16 scores is fp32 on a GPU), inside leaf modules and library code
too, and only running the ops settles torch's type promotion everywhere.

Autocast is the target device's: torch's own CPU autocast for a CPU, torch's CUDA autocast
on fake CUDA tensors where this torch has a GPU. Planning for a GPU without one (a laptop
planning a cluster, a CPU-only wheel) cannot use it: torch switches CUDA autocast off there,
and fake CUDA tensors can abort a CPU-only build. The graph then runs on fake CPU tensors
under :class:`_Watch`, which applies CUDA autocast's policy (``aten/src/ATen/autocast_mode.cpp``)
itself: the same lists, named as the aten ops a dispatch mode sees, below the composite ops
autocast wraps (``linear`` arrives as ``addmm``, ``layer_norm`` as ``native_layer_norm``),
and :class:`_Composites` casts the arguments of the composite matmuls and attention first,
as autocast does before they check their dtypes. Listed composite ops that break up into
unlisted ones (``l1_loss``, ``cosine_similarity``) end as their parts do, one dtype off at
worst on a loss. tests/test_precision_planning.py compares the two on a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

from replica.errors import TraceError
from replica.partition.cost import DeviceSpec
from replica.partition.graph import Graph
from replica.partition.pure import untouched
from replica.partition.record import Recorder, _fake_inputs, user_frame
from replica.partition.trace import Traced, _named_tensors, bytes_moved
from replica.precision import autocast_dtype

__all__ = ["autocast_graph", "target_device_type", "LOWER_PRECISION_OPS", "FP32_OPS", "FP32_UNLESS_DTYPE_OPS",
           "PROMOTE_OPS", "LOWER_PRECISION_FUNCTIONS"]

# CUDA autocast's lists as aten ops reach a dispatch mode. Lower precision: matmuls, convolutions,
# attention (and what linear, matmul, einsum and the multi-dots break up into).
LOWER_PRECISION_OPS = frozenset("""
    mm addmm bmm baddbmm addbmm mv addmv addr matmul linear convolution _convolution cudnn_convolution
    cudnn_convolution_transpose conv_tbc _prelu_kernel linalg_vecdot _thnn_fused_lstm_cell _thnn_fused_gru_cell
    _scaled_dot_product_flash_attention _scaled_dot_product_flash_attention_for_cpu
    _scaled_dot_product_efficient_attention _scaled_dot_product_cudnn_attention
""".split())
# fp32: pointwise ops that lose range in half precision, norms, reductions and losses
FP32_OPS = frozenset("""
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus
    native_layer_norm native_group_norm _fused_rms_norm nll_loss_forward nll_loss2d_forward mse_loss
    smooth_l1_loss huber_loss soft_margin_loss multi_margin_loss multilabel_margin_loss_forward
    binary_cross_entropy_with_logits kl_div dist _pdist_forward _cdist_forward renorm logsumexp norm
""".split())
# fp32 unless the call names its own output dtype
FP32_UNLESS_DTYPE_OPS = frozenset("_softmax _log_softmax sum prod cumsum cumprod linalg_vector_norm".split())
# the widest floating dtype among the arguments
PROMOTE_OPS = frozenset(
    "addcdiv addcmul atan2 linalg_cross dot vdot grid_sampler_2d grid_sampler_3d index_put scatter_add".split())
# the lower-precision ops that are composites, cast as autocast casts them: before they break up
# (attention checks its arguments' dtypes first), also when called as torch functions inside leaf modules
LOWER_PRECISION_FUNCTIONS = frozenset("""
    linear matmul einsum conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d prelu chain_matmul
    linalg_multi_dot linalg_vecdot scaled_dot_product_attention lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
""".split())


def target_device_type(spec: DeviceSpec) -> str:
    """The device type whose autocast a plan for ``spec`` prices: "cpu" for a CPU spec, "cuda"
    for the GPU presets and any other spec (Replica's runtimes know no other accelerator)."""
    return "cpu" if spec.name.startswith("cpu") else "cuda"


def _eligible(x: Any) -> bool:
    """What autocast casts: floating tensors but fp64."""
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


@dataclasses.dataclass
class _OpRecord:
    """What one node did under autocast."""

    flops: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)  # by dtype
    casts: dict[str, str] = dataclasses.field(default_factory=dict)  # parameter -> the dtype of its copy
    cast_bytes: int = 0  # bytes of every copy autocast made


class _Watch(TorchDispatchMode):
    """Below autocast, so every aten op arrives with autocast's casts done: records each op's
    FLOPs by the dtype they run in and every cast (of a weight: which one). With ``emulate``
    (autocast's dtype) it makes CUDA autocast's casts itself first, for a run without it."""

    def __init__(self, weights: dict[int, str], emulate: torch.dtype | None) -> None:
        super().__init__()
        self.weights = weights  # id of a parameter's fake tensor -> its canonical name
        self.emulate = emulate
        self.record = _OpRecord()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if self.emulate is not None and not func._schema.is_mutable:
            args, kwargs = self._policy(func.overloadpacket.__name__, args, kwargs)
        out = func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default:
            self._noted(args[0], out)
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            dtype = next((str(x.dtype) for x in tree_leaves((args, kwargs)) if _eligible(x)), "")
            self.record.flops[dtype.removeprefix("torch.")] += formula(*args, **kwargs, out_val=out)
        return out

    def _noted(self, source: Any, out: Any) -> Any:
        """``out``, a cast of ``source`` (a weight, or a view of one: ``linear``'s transpose), recorded."""
        if isinstance(out, torch.Tensor) and out.dtype != source.dtype and out.is_floating_point():
            self.record.cast_bytes += out.numel() * out.element_size()
            name = self.weights.get(id(source if source._base is None else source._base))
            if name is not None:
                self.record.casts[name] = str(out.dtype).removeprefix("torch.")
        return out

    def _policy(self, op: str, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """``args`` and ``kwargs`` cast as CUDA autocast casts them for ``op``."""
        to: torch.dtype | None = None
        copies = True  # casts are copies the op reads, but for ops told their output dtype
        if op in LOWER_PRECISION_OPS:
            to = self.emulate
        elif op in FP32_OPS:
            to = torch.float32
        elif op in FP32_UNLESS_DTYPE_OPS and kwargs.get("dtype") is None:
            to, copies = torch.float32, False  # softmax(x, dtype=float): one kernel reads half, writes fp32
        elif op in PROMOTE_OPS:
            widest = any(_eligible(x) and x.dtype == torch.float32 for x in tree_leaves((args, kwargs)))
            to = torch.float32 if widest else self.emulate
        if to is None:
            return args, kwargs

        def cast(x: Any) -> Any:
            if not _eligible(x) or x.dtype == to:
                return x
            return self._noted(x, x.to(to)) if copies else x.to(to)

        return tree_map(cast, args), tree_map(cast, kwargs)


class _Composites(TorchFunctionMode):
    """CUDA autocast's casts for the composite ops it runs in ``dtype``, at the level it makes
    them: the torch function, above the aten ops it breaks up into (:class:`_Watch` records
    each cast as it reaches aten)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "").split(".")[0] in LOWER_PRECISION_FUNCTIONS:

            def cast(x: Any) -> Any:
                return x.to(self.dtype) if _eligible(x) and x.dtype != self.dtype else x

            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return func(*args, **kwargs)


class _Rerun(Recorder):
    """The graph once more, on fake tensors on ``device`` (or real ones), each op inside ``watch``."""

    def __init__(self, gm: fx.GraphModule, names: dict[int, str], watch: _Watch, device: torch.device,
                 fake: bool) -> None:
        super().__init__(gm, names)
        self.watch, self.device, self.fake = watch, device, fake
        self.records: dict[str, _OpRecord] = {}

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        if self.fake and isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            # a constant of the graph (parameters and buffers are fake already): its kind, on the device
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=self.device)
        return value

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[Any, dict[str, Any]]:
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        if not self.fake:
            return args, kwargs

        def here(v: Any) -> Any:  # a device the graph names: meta when traced on meta
            return self.device if isinstance(v, torch.device) and v.type == "meta" else v

        return tree_map(here, args), tree_map(here, kwargs)

    def call(self, n: fx.Node) -> Any:
        self.watch.record = self.records[n.name] = _OpRecord()
        composites = _Composites(self.watch.emulate) if self.watch.emulate is not None else contextlib.nullcontext()
        with self.watch, composites:
            return fx.Interpreter.run_node(self, n)


def _rerun(traced: Traced, names: dict[int, str], device_type: str, precision: str, real: bool) -> _Rerun:
    """Run ``traced`` under ``precision``'s autocast for ``device_type`` on fake tensors; where fake
    tensors cannot run it (a value read out of a tensor), for real if the model is real and
    on that device type, as :func:`~replica.partition.record.record` would."""
    gm, dtype = traced.module, autocast_dtype(precision)
    native = device_type == "cpu" or torch.cuda.is_available()
    device = torch.device(device_type if native else "cpu")
    amp = functools.partial(torch.autocast, device.type, dtype=dtype) if native else contextlib.nullcontext
    held = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    try:
        return _fake_rerun(traced, names, held, device, None if native else dtype, amp)
    except Exception as first:
        exc = first
    if not native:  # a GPU's autocast emulated: on meta kernels, where a CPU kernel lacks a dtype (int32 histc)
        try:
            return _fake_rerun(traced, names, held, torch.device("meta"), dtype, amp)
        except Exception:
            pass
    on_device = all(t.device.type == device_type for _, t in held)
    if not (real and native and on_device):
        raise TraceError(
            f"Running the traced graph of {type(gm).__name__} on fake tensors under {precision} autocast failed: "
            f"{type(exc).__name__}: {exc}\n  at {user_frame(exc)}\nFix: plan it in the weights' dtype "
            "(mixed_precision=None), or with real weights and inputs on the device it will train on."
        ) from exc
    rerun = _Rerun(gm, names, _Watch({id(t): names[id(t)] for _, t in held if id(t) in names}, None), device,
                   fake=False)
    with untouched(gm), torch.no_grad(), amp():
        rerun.run(*traced.example)
    return rerun


def _fake_rerun(traced: Traced, names: dict[int, str], held: list[tuple[str, torch.Tensor]], device: torch.device,
                emulate: torch.dtype | None, amp: Any) -> _Rerun:
    """``traced`` run once on fake tensors on ``device``, its weights' and inputs' kinds, under ``amp``
    (or, ``emulate``, autocast to that dtype emulated by :class:`_Watch`)."""
    gm = traced.module
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    copies: dict[int, torch.Tensor] = {}
    with mode:
        fakes = {name: copies.setdefault(id(t), torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                                    device=device)) for name, t in held}
    weights = {id(copies[id(t)]): names[id(t)] for _, t in held if id(t) in names}
    rerun = _Rerun(gm, names, _Watch(weights, emulate), device, fake=True)
    with untouched(gm), _reparametrize_module(gm, fakes), mode, torch.no_grad(), amp():
        rerun.run(*_fake_inputs(traced.example, device, mode))
    return rerun


def autocast_graph(traced: Traced, model: torch.nn.Module, device_type: str, precision: str,
                   *, real: bool = False) -> Graph:
    """``traced.graph`` (of ``model``) as it runs under ``precision``'s autocast on
    ``device_type``: node for node, each op's outputs in the dtypes autocast gives them, the
    bytes it moves then (casts included: each writes a copy that the op reads), the dtype
    most of its FLOPs run in and the weights it casts. ``real``: the model and inputs hold
    real tensors, so a graph fake tensors cannot run may run for real (without grad). Made once
    per trace and kept on it (``Traced.autocast_graphs``): a plan priced compiled and eager reruns
    nothing."""
    if autocast_dtype(precision) is None:
        return traced.graph
    key = (device_type, precision, real)
    if key not in traced.autocast_graphs:
        traced.autocast_graphs[key] = _autocast_graph(traced, model, device_type, precision, real)
    return traced.autocast_graphs[key]


def _autocast_graph(traced: Traced, model: torch.nn.Module, device_type: str, precision: str, real: bool) -> Graph:
    names, _ = _named_tensors(model)
    rerun = _rerun(traced, names, device_type, precision, real)
    graph = traced.graph
    outputs = {x.name: rerun.outputs.get(x.name, x.outputs) for x in graph.nodes}
    nodes = []
    for x in graph.nodes:
        record = rerun.records.get(x.name, _OpRecord())
        out = outputs[x.name]
        moved = bytes_moved(x.target, x.kind, sum(t.nbytes for a in x.inputs for t in outputs[a]),
                            sum(t.nbytes for t in out),
                            sum(graph.parameters[p].nbytes for p in dict.fromkeys(x.parameters + x.buffers)))
        if record.flops:
            compute = record.flops.most_common(1)[0][0]
        else:  # FLOPs counted on meta that this device's kernel hides from the counter (CPU attention)
            compute = next((t.dtype for t in out if t.is_floating), "") if x.flops else ""
        nodes.append(dataclasses.replace(
            x, outputs=out, bytes_accessed=moved + 2 * record.cast_bytes if moved else 0.0, compute_dtype=compute,
            weight_casts=tuple(sorted(record.casts.items())), users=[]))
    return Graph(nodes, graph.parameters, model_name=graph.model_name)
