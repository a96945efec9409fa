"""The second tracer: ``torch.export`` for what ``torch.fx`` cannot trace, lowered to a plain
``GraphModule`` of aten ops whose weights are the model's own, under their original names."""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple

import torch
import torch.fx as fx
from torch.export import Dim
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils._pytree import TreeSpec, tree_leaves, tree_map, tree_unflatten

from replica.errors import ConfigError
from replica.partition.inputs import InputSpec

__all__ = ["export_graph_module", "ExportedInputs", "DYNAMIC", "is_dtype_assert", "drop_dtype_asserts", "structure_key",
           "Kept"]


class ExportedInputs(InputSpec):
    """The inputs of an exported graph with dims fixed to their example's size: a call with
    another size there is told how to plan for it."""

    def _check_dims(self, packed: tuple[Any, ...], what: str) -> None:
        for i, (x, fixed) in enumerate(zip(packed, self.fixed_dims)):
            for dim, size in fixed.items():
                if isinstance(x, torch.Tensor) and dim < x.dim() and int(x.shape[dim]) != size:
                    raise ConfigError(
                        f"graph input {i} of {self.model_name} ({what}) has size {int(x.shape[dim])} in dimension "
                        f"{dim}, but torch.export fixed that dimension at {size} when tracing (the model's code "
                        f"depends on it, or it was not asked to keep it dynamic: dynamic_dims='auto' keeps an "
                        f"image's sides fixed). Pass inputs with dimension {dim} = {size}, "
                        "plan again with dynamic_dims='all' (every dim the code allows dynamic; slower to plan), "
                        "or with example inputs of the new shape."
                    )


def _resolve(model: torch.nn.Module, name: str) -> Any:
    obj: Any = model
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _unflatten_hook(spec: TreeSpec) -> Any:
    def hook(module: torch.nn.Module, args: Any, out: Any) -> Any:
        return tree_unflatten(list(out), spec)
    return hook


@contextmanager
def _fixed_keywords(model: torch.nn.Module, constants: dict[str, Any]) -> Iterator[None]:
    """Bind the non-tensor keywords to ``model.forward`` while exporting: export then never sees
    them as inputs (it cannot give dynamic shapes to a flag inside ``**kwargs``)."""
    if not constants:
        yield
        return
    model.forward = functools.partial(type(model).forward, model, **constants)  # type: ignore[method-assign]
    try:
        yield
    finally:
        del model.forward


def _widens(x: torch.Tensor, dynamic: str) -> bool:
    """Whether export may make ``x``'s dims past the batch dynamic too: every tensor's with
    ``"all"``; with ``"auto"`` those of inputs of up to 3 dims (token ids, masks, sequences
    of features: their length changes between calls), not an image's or a volume's (4 dims
    and more: their channels and sides make export reason about every window and padding)."""
    return dynamic == "all" or (dynamic == "auto" and x.dim() <= 3)


def _dynamic_shapes(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic: str) -> Any:
    """Dim 0 of every tensor is the batch (one symbol for all); the other dims of the tensors
    :func:`_widens` picks are left to export (dynamic where the code allows, fixed where not)."""
    batch = Dim("batch", min=1)

    def dims(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return None
        return {0: batch, **({i: Dim.AUTO for i in range(1, x.dim())} if _widens(x, dynamic) else {})}

    bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    return {name: tree_map(dims, value) for name, value in bound.arguments.items()}


def _fixed_dims(graph: fx.Graph, user_inputs: Any, num_inputs: int) -> tuple[dict[int, int], ...]:
    """For each user input of an exported ``graph``: the dims export specialised to a number (besides the batch)."""
    user = set(user_inputs)
    out = []
    for n in graph.nodes:
        if n.op == "placeholder" and n.name in user:
            val = n.meta.get("val")
            shape = getattr(val, "shape", ())
            out.append({d: int(s) for d, s in enumerate(shape) if d > 0 and is_concrete_int(s)})
    return tuple(out[:num_inputs])


DYNAMIC = ("auto", "batch", "all")


def export_graph_module(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                        constants: dict[str, Any] | None = None, dynamic: str = "auto"
                        ) -> tuple[fx.GraphModule, TreeSpec, tuple[dict[int, int], ...]]:
    """Export ``model(*args, **kwargs, **constants)`` (non-strict) and rebuild its graph so that
    weights are ``get_attr`` reads of the model's parameters and buffers by original name (tied
    ones once) and only the user's tensors are placeholders, flat. Returns the module, the
    output's tree spec (the module's outputs come back in the model's own structure) and,
    per input, the dims fixed to their example's size.

    ``dynamic`` says which dims past the batch (dim 0, always dynamic) export may keep
    dynamic, where the code allows (:func:`_widens`): ``"all"``, those of inputs of up to 3
    dims (``"auto"``: not an image's sides), or none (``"batch"``). Each dynamic dim costs export time: a Swin
    with its image's sides dynamic took 30-90 s to export, 1 s with only the batch; where
    the wider export fails, the batch-only one is tried."""
    if dynamic not in DYNAMIC:
        raise ValueError(f"dynamic must be one of {DYNAMIC}, got {dynamic!r}")
    kwargs = dict(kwargs or {})
    key = _export_key(model, args, kwargs, constants, dynamic)
    ep = _EXPORTS.get(key)
    if ep is None:
        ep = _EXPORTS.put(key, _export(model, args, kwargs, constants, dynamic))
    if ep.mutated:
        raise RuntimeError(
            f"the model writes into buffers {ep.mutated[:4]} while it runs (a "
            "BatchNorm in training mode, a cache); a pipeline cannot share such state across micro-batches"
        )
    root: dict[str, Any] = {}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in ep.graph.nodes:
        if n.op == "placeholder" and n.name in ep.weights:
            name = ep.weights[n.name]
            root[name] = _resolve(model, name)
            env[n] = graph.get_attr(name)
        elif n.op == "placeholder" and n.name in ep.constants:
            name, value = ep.constants[n.name]
            root[name] = value
            env[n] = graph.get_attr(name)
        elif n.op == "output":
            env[n] = graph.output(fx.map_arg(n.args[0], lambda a: env[a]))
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
        env[n].meta = dict(n.meta)
    graph.lint()
    gm = fx.GraphModule(root, graph, class_name=type(model).__name__)
    gm.register_forward_hook(_unflatten_hook(ep.out_spec))
    return gm, ep.out_spec, _fixed_dims(ep.graph, ep.user_inputs, len(tree_leaves((args, kwargs))))


class _Exported(NamedTuple):
    """What Replica reads of an ``ExportedProgram``: its graph (placeholders named by the signature) and
    signature, not its state dict (the first model's weights: a later model's own are looked up by name)."""

    graph: fx.Graph
    weights: dict[str, str]  # placeholder -> parameter or buffer name
    constants: dict[str, tuple[str, torch.Tensor]]  # placeholder -> (attribute name, lifted tensor constant)
    user_inputs: tuple[str, ...]
    mutated: list[str]  # buffers (or inputs) the model writes into
    out_spec: TreeSpec


def _export(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], constants: dict[str, Any] | None,
            dynamic: str) -> _Exported:
    from torch.export import export

    wide = dynamic != "batch" and any(
        _widens(x, dynamic) and x.dim() > 1 for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor))
    with _fixed_keywords(model, dict(constants or {})):
        ep = None
        if wide:
            try:
                ep = export(model, tuple(args), kwargs, dynamic_shapes=_dynamic_shapes(model, args, kwargs, dynamic),
                            strict=False)
            except Exception:  # noqa: BLE001 - some models only export with their other dims fixed
                ep = None
        if ep is None:
            ep = export(model, tuple(args), kwargs, dynamic_shapes=_dynamic_shapes(model, args, kwargs, "batch"),
                        strict=False)
    sig = ep.graph_signature
    lifted = dict(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    return _Exported(
        graph=ep.graph, weights={**sig.inputs_to_parameters, **sig.inputs_to_buffers},
        constants={p: (fqn.replace(".", "_"), ep.constants[fqn]) for p, fqn in lifted.items()},
        user_inputs=tuple(sig.user_inputs),
        mutated=sorted(sig.buffers_to_mutate.values()) + sorted(getattr(sig, "user_inputs_to_mutate", {}) or {}),
        out_spec=ep.call_spec.out_spec)


# The newest exports of this process by what decides them (:func:`_export_key`): planning the same model
# again (plan, then auto_parallel; the tuner; every case a test builds alike) does not export it again.
# torch.export takes 1-4 CPU-seconds for a 2-layer Hugging Face model, minutes for a large one.
class Kept:
    """The ``size`` newest values by key, the least recently read dropped first; a None key keeps nothing
    (:func:`structure_key`'s answer where it cannot tell two models apart)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._values: dict[Any, Any] = {}

    def get(self, key: Any) -> Any:
        value = self._values.pop(key, None) if key is not None else None
        if value is not None:
            self._values[key] = value  # read: the newest again
        return value

    def put(self, key: Any, value: Any) -> Any:
        if key is not None:
            self._values[key] = value
            while len(self._values) > self.size:
                del self._values[next(iter(self._values))]
        return value

    def __len__(self) -> int:
        return len(self._values)


_EXPORTS = Kept(8)


class _Unkeyable(Exception):
    """A value whose effect on the export cannot be told from what it holds: that export is not kept."""


_MODULE_BOOKKEEPING = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training")


def _export_key(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                constants: dict[str, Any] | None, dynamic: str) -> Any:
    """What decides ``model``'s export (:func:`structure_key`), with the constant keywords and the dynamic dims."""
    return structure_key(model, (tuple(args), kwargs, dict(constants or {})), dynamic)


def structure_key(model: torch.nn.Module, inputs: Any, *extra: Any, root_attributes: bool = True,
                  constants: dict[str, torch.Tensor] | None = None) -> Any:
    """What decides how ``model`` traces and what shapes its ops make: each module's class, mode and
    forward (a class patched in between is another), attributes (a config's values, a flag, a hook,
    a plain tensor attribute's contents: a trace bakes those in; the root's own left out with
    ``root_attributes=False``), each weight's name, shape,
    dtype, strides, device, kind and aliases (not its values: they are graph inputs), the
    ``inputs``' shapes, dtypes, strides and devices (their non-tensor values by value), ``extra``,
    the tensors in ``constants`` by value, torch's global modes, and the module-level names each
    forward reads, through the helpers it calls (:func:`_globals_key`). None where some attribute
    cannot be told apart by value (an object of an unknown kind): whatever was computed from it
    is not kept."""
    try:
        aliases: dict[int, int] = {}
        tensors = tuple(
            (name, _tensor_key(t), isinstance(t, torch.nn.Parameter), t.requires_grad,
             aliases.setdefault(id(t), len(aliases)))
            for name, t in (*model.named_parameters(remove_duplicate=False),
                            *model.named_buffers(remove_duplicate=False)))
        modules = tuple(
            (name, type(m), type(m).forward, m.training,
             _value_key({k: v for k, v in vars(m).items() if k not in _MODULE_BOOKKEEPING}, module=True))
            if name or root_attributes else m.training  # a GraphModule's class is its own
            for name, m in model.named_modules(remove_duplicate=False))
        values = _value_key(inputs), _value_key(extra), _value_key(constants or {}, module=True)
    except _Unkeyable:
        return None
    modes = (torch.is_grad_enabled(), torch.get_default_dtype(), torch.is_autocast_enabled("cpu"),
             torch.are_deterministic_algorithms_enabled())
    read = _globals_key(type(m).forward for m in model.modules())
    return None if read is None else (modes, tensors, modules, values, read)


_GLOBALS_WALK_LIMIT = 512  # functions read at most: past it the key is None (nothing kept)


def _globals_key(functions: Iterator[Any]) -> Any:
    """The module-level names ``functions`` read, and their closures' cells, by value: a trace bakes
    in ``if FLAG:`` or ``x * SCALE`` read from a module's globals as it bakes in an attribute.
    Followed through the Python functions read (a helper's own globals), a wrapper's
    ``__wrapped__`` and the functions nested in their code; torch's own code is not walked (its
    modes are keyed apart). A value of an unknown kind counts by identity; past
    ``_GLOBALS_WALK_LIMIT`` functions the key is None, as for an unknown attribute."""
    out: list[Any] = []
    seen: set[int] = set()
    stack = list(functions)
    while stack:
        f = stack.pop()
        f = getattr(f, "__func__", f)  # a bound or class method: its function
        code, names = getattr(f, "__code__", None), getattr(f, "__globals__", None)
        if code is None or names is None or id(f) in seen:  # by function: closures sharing code differ in cells
            continue
        if str(names.get("__name__", "")).split(".")[0] == "torch":
            continue
        seen.add(id(f))
        if len(seen) > _GLOBALS_WALK_LIMIT:
            return None
        wrapped = getattr(f, "__wrapped__", None)
        if wrapped is not None:
            stack.append(wrapped)
        cells = tuple(c.cell_contents for c in (f.__closure__ or ()) if _filled(c))
        read = []
        for name in _names_read(code):
            if name in names:
                read.append((name, _global_value(names[name], stack)))
        out.append((code, tuple(read), tuple(_global_value(v, stack) for v in cells)))
    return tuple(out)


def _names_read(code: Any) -> Iterator[str]:
    """Every name ``code`` and the functions nested in it look up (globals and attributes alike)."""
    yield from code.co_names
    for const in code.co_consts:
        if inspect.iscode(const):
            yield from _names_read(const)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell: a name not yet bound
        return False
    return True


def _global_value(v: Any, stack: list[Any]) -> Any:
    """A global's key: its value where it has one, a Python function's identity (and the function
    walked in turn), anything else's identity."""
    if inspect.isfunction(v) or inspect.ismethod(v):
        stack.append(v)
        return v
    if inspect.ismodule(v) or isinstance(v, type):
        return v
    try:
        return _value_key(v, module=True)
    except _Unkeyable:
        return type(v), id(v)


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    return type(t), tuple(t.shape), t.dtype, t.device.type, t.stride() if t.layout == torch.strided else None


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
          torch.memory_format, torch.Size, range, slice)


def _value_key(v: Any, module: bool = False) -> Any:
    if isinstance(v, _PLAIN):
        return type(v), v
    if isinstance(v, torch.Tensor):  # a graph input (its values are not baked in) or, on a module, a constant
        if not module:
            return _tensor_key(v), v.requires_grad
        if v.is_meta or type(v) is not torch.Tensor or v.numel() > 1 << 16:
            raise _Unkeyable
        return _tensor_key(v), bytes(v.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy())
    if isinstance(v, (tuple, list, set, frozenset)):
        items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
        return type(v), tuple(_value_key(x, module) for x in items)
    if isinstance(v, dict):
        return type(v), tuple((_value_key(k), _value_key(x, module)) for k, x in v.items())
    if isinstance(v, torch.nn.Module):  # a module held outside the tree (in a dict): its weights are constants
        return type(v), v.training, _value_key({k: x for k, x in vars(v).items() if k not in _MODULE_BOOKKEEPING},
                                               True), \
            tuple((n, _value_key(t, True)) for n, t in (*v.named_parameters(), *v.named_buffers()))
    if isinstance(v, type) or inspect.isfunction(v) or inspect.isbuiltin(v):  # by identity: a closure made per
        return v  # model is another function, and so another export
    if isinstance(v, enum.Enum):
        return type(v), v.value
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return type(v), _value_key(vars(v), module)
    to_dict = getattr(v, "to_dict", None)  # a Hugging Face config: every field by value
    if callable(to_dict) and type(v).__module__.startswith("transformers."):
        return type(v), _value_key(to_dict(), module)
    raise _Unkeyable


def is_dtype_assert(n: fx.Node) -> bool:
    """Whether ``n`` is one of the dtype and device checks ``torch.export`` writes into a graph
    (``aten._assert_tensor_metadata``): it asserts the traced dtype of a value, which autocast
    and weights gathered in half precision change on purpose, and computes nothing."""
    target = getattr(torch.ops.aten, "_assert_tensor_metadata", None)
    return target is not None and n.op == "call_function" and n.target in (target, getattr(target, "default", None)) \
        and not n.users


def drop_dtype_asserts(module: fx.GraphModule) -> int:
    """Remove ``module``'s :func:`is_dtype_assert` checks; how many."""
    checks = [n for n in module.graph.nodes if is_dtype_assert(n)]
    for n in checks:
        module.graph.erase_node(n)
    if checks:
        module.recompile()
    return len(checks)
