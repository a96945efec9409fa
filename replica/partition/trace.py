"""Capture an ``nn.Module`` as Replica's graph with ``torch.fx``: ops, shapes, FLOPs, parameters."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from replica.errors import ConfigError, TraceError
from replica.partition.export import DYNAMIC, ExportedInputs, drop_dtype_asserts, export_graph_module
from replica.partition.graph import INPUT, OP, OUTPUT, Graph, Node, ParameterInfo
from replica.partition.holding import hold_unused
from replica.partition.inputs import InputSpec, normalize_inputs
from replica.partition.modes import follow_mode
from replica.partition.mutation import make_writes_explicit, view_writes
from replica.partition.pure import untouched
from replica.partition.record import record, user_frame

__all__ = ["Traced", "trace", "normalize_inputs", "bytes_moved"]


# Ops that only re-label memory: they move no bytes worth pricing (by name; torch.export's
# graphs name the overload too, "view.default", "slice.Tensor": the name is the part before the dot)
_VIEW_OPS = frozenset(
    "getitem getattr size dim view reshape flatten unflatten squeeze unsqueeze transpose permute "
    "expand expand_as split chunk unbind narrow select t contiguous view_as type_as to float "
    "detach identity dropout slice alias unsafe_view as_strided split_with_sizes".split()
)


def bytes_moved(op: str, kind: str, read: float, written: float, weights: float) -> float:
    """Bytes an op moves through memory: the tensors it reads and writes and the weights and
    buffers it reads (an embedding reads only the rows it looks up, about what it writes).
    Views, the graph's inputs and its output move none."""
    name = op.partition(".")[0]
    if name in _VIEW_OPS or kind != OP:
        return 0.0
    if name == "embedding":
        return float(read + 2 * written)
    return float(read + written + weights)


@dataclass
class Traced:
    """The fx ``GraphModule`` (for splitting) and Replica's ``Graph`` (for pricing), node for node."""

    module: fx.GraphModule
    graph: Graph
    concrete_args: dict[str, Any]
    out_spec: Any = None  # with torch.export: the output's tree spec (stages return it flat)
    tracer: str = "fx"
    inputs: InputSpec | None = None  # how calls map to the graph's inputs
    training: bool = True  # the model's mode while tracing
    example: tuple[Any, ...] = ()  # the graph's inputs while tracing (example_inputs, then keyword tensors)
    dynamic_dims: tuple[tuple[int, ...], ...] = ()  # per graph input: the dims a call may change
    # the graph as it runs under an autocast, by (device type, precision, real): made once per trace
    # (replica.partition.autocast.autocast_graph; not copied by dataclasses.replace)
    autocast_graphs: dict[tuple[str, str, bool], Graph] = field(default_factory=dict, init=False, repr=False,
                                                                compare=False)



class _Tracer(fx.Tracer):
    """``fx.Tracer`` with user leaf modules and a record of where tracing failed."""

    def __init__(self, leaf_modules: Sequence[type | str | torch.nn.Module]) -> None:
        super().__init__()
        self.leaf_types = tuple(t for t in leaf_modules if isinstance(t, type))
        self.leaf_paths = {t for t in leaf_modules if isinstance(t, str)}
        self.leaf_ids = {id(t) for t in leaf_modules if isinstance(t, torch.nn.Module)}
        self.path: list[tuple[str, str]] = []
        self.failed_at: list[tuple[str, str]] | None = None

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, self.leaf_types) or module_qualified_name in self.leaf_paths or id(m) in self.leaf_ids:
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: torch.nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        self.path.append((self.path_of_module(m), type(m).__name__))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_at is None:
                self.failed_at = list(self.path)
            raise
        finally:
            self.path.pop()


def _check_leaf_modules(model: torch.nn.Module, leaf_modules: Sequence[Any]) -> None:
    names = dict(model.named_modules())
    ids = {id(m) for m in names.values()}
    for leaf in leaf_modules:
        if isinstance(leaf, type) and issubclass(leaf, torch.nn.Module):
            continue
        if isinstance(leaf, str):
            if leaf not in names:
                near = [n for n in names if n and (n.startswith(leaf.rsplit(".", 1)[0]) or leaf in n)][:5]
                raise ConfigError(
                    f"leaf_modules names {leaf!r}, which is no sub-module of {type(model).__name__}"
                    f"{f'; did you mean one of {near}' if near else ''}? Use qualified names as "
                    "model.named_modules() gives them, or module classes."
                )
            continue
        if isinstance(leaf, torch.nn.Module):
            if id(leaf) not in ids:
                raise ConfigError(f"leaf_modules holds a {type(leaf).__name__} that is not part of the model")
            continue
        raise ConfigError(
            f"leaf_modules entries must be module classes, qualified names or sub-modules; got {leaf!r}"
        )


def _fx_trace(model: torch.nn.Module, concrete: dict[str, Any], leaf_modules: Sequence[Any],
              order: Sequence[str] = ()) -> fx.GraphModule:
    _check_leaf_modules(model, leaf_modules)
    tracer = _Tracer(leaf_modules)
    try:
        graph = tracer.trace(model, concrete_args=concrete or None)
    except Exception as exc:  # fx raises TraceError, TypeError, NotImplementedError, ...
        where = tracer.failed_at or [("", type(model).__name__)]
        path, cls = where[-1]
        module = f"'{path}' ({cls})" if path else f"the top-level {cls}"
        leaf_hint = f"leaf_modules=[{cls}]" if path else "leaf_modules=[...] on the offending sub-module"
        raise TraceError(
            f"torch.fx could not trace {module}: {type(exc).__name__}: {exc}\n"
            f"  at {user_frame(exc)}\n"
            f"Fix: remove Python control flow on tensor values or shapes in that forward "
            f"(`if`, `assert`, `int(x)`, loops over a tensor; use torch.where / masks instead), "
            f"or keep that module whole by passing {leaf_hint} to auto_parallel / plan."
        ) from exc
    # Fixed default arguments leave placeholders between the asserts fx adds for them: move
    # every placeholder to the front, the graph's inputs first in call order (positional, then
    # keywords as given), so inputs come first, as the graph IR promises.
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    rank = {name: i for i, name in enumerate(order)}
    placeholders.sort(key=lambda n: rank.get(str(n.target), len(rank)))
    for ph in placeholders:  # the fixed ones (fx names them `scale_1`) default to their traced value
        base = re.sub(r"_\d+$", "", str(ph.target))
        if str(ph.target) not in rank and base in concrete:
            ph.args = (concrete[base],)
    anchor = next(iter(graph.nodes))
    for ph in placeholders:
        if ph is not anchor:
            anchor.prepend(ph) if anchor.op != "placeholder" else anchor.append(ph)
        anchor = ph
    graph.lint()
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__)
    make_writes_explicit(gm)
    return gm


def _export_trace(model: torch.nn.Module, inputs: tuple[Any, ...], spec: InputSpec, fx_error: TraceError | None,
                  dynamic: str) -> tuple[fx.GraphModule, Any, tuple[torch.Tensor, ...], InputSpec]:
    """torch.export's graph of ``model`` (its inputs: every tensor leaf, flat), or a TraceError
    with both tracers' reasons; and ``spec`` recording how calls map to the flat inputs."""
    args, kwargs = inputs[: spec.positional], dict(zip(spec.keywords, inputs[spec.positional:]))
    try:
        gm, out_spec, fixed = export_graph_module(model, args, kwargs, spec.constants, dynamic)
    except Exception as exc:  # export raises many kinds (UserError, GuardOnDataDependent, ...)
        first = f"torch.fx: {fx_error}\n" if fx_error is not None else ""
        raise TraceError(
            f"neither tracer could capture {type(model).__name__}.\n{first}torch.export: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}\n  at {user_frame(exc)}\n" + _export_fix(model, exc)
        ) from exc
    make_writes_explicit(gm)
    # export's checks of the traced dtypes compute nothing, and autocast changes those dtypes on purpose
    drop_dtype_asserts(gm)
    if fixed and any(fixed):
        spec = ExportedInputs(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)})
    spec.flat = True
    spec.fixed_dims = fixed
    return gm, out_spec, tuple(tree_leaves(inputs)), spec


def _export_fix(model: torch.nn.Module, exc: Exception) -> str:
    """What to do about torch.export's failure ``exc``."""
    unknown = re.search(r"Found <class '([\w.]+)'> in output, which is not a known type", str(exc))
    if unknown and "cache" in unknown.group(1).lower():  # a Hugging Face model with use_cache on (the default)
        return (f"Fix: {type(model).__name__} returns a key/value cache ({unknown.group(1).rsplit('.', 1)[-1]}: "
                "use_cache is on in its config), which training does not need: set model.config.use_cache = False "
                "before planning (or pass example_kwargs={'use_cache': False}).")
    if unknown:
        return (f"Fix: {type(model).__name__} returns a {unknown.group(1)}, which torch.export cannot take apart: "
                "return tensors (a tuple, dict or dataclass of them), or register that type as a pytree node "
                "(torch.utils._pytree.register_pytree_node).")
    return ("Fix: remove control flow that depends on tensor values (torch.where / masks instead of `if`), "
            "or keep the offending sub-module whole with leaf_modules=[...] (fx keeps leaves opaque).")


def _op_name(node: fx.Node, module: torch.nn.Module | None) -> str:
    if node.op == "call_module":
        return type(module).__name__.lower() if module is not None else str(node.target)
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target)).lstrip("_")


def _named_tensors(model: torch.nn.Module) -> tuple[dict[int, str], dict[str, ParameterInfo]]:
    """Canonical name of every parameter and buffer by object id, and their infos with aliases."""
    canonical: dict[int, str] = {}
    aliases: dict[int, list[str]] = {}
    kinds: dict[int, tuple[torch.Tensor, bool]] = {}
    for is_buffer, items in ((False, model.named_parameters(remove_duplicate=False)),
                             (True, model.named_buffers(remove_duplicate=False))):
        for name, t in items:
            if t is None:
                continue
            key = id(t)
            if key not in canonical:
                canonical[key] = name
                aliases[key] = []
                kinds[key] = (t, is_buffer)
            elif name != canonical[key]:
                aliases[key].append(name)
    infos = {
        canonical[k]: ParameterInfo(
            canonical[k], tuple(kinds[k][0].shape), str(kinds[k][0].dtype).removeprefix("torch."),
            tuple(aliases[k]), kinds[k][1],
        )
        for k in canonical
    }
    return canonical, infos


def _resolve(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def trace(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    example_kwargs: dict[str, Any] | None = None,
    leaf_modules: Iterable[type | str | torch.nn.Module] = (),
    tracer: str = "auto",
    dynamic_dims: str = "auto",
) -> Traced:
    """Trace ``model`` with ``torch.fx`` (or, where fx fails, ``torch.export``) and build
    Replica's :class:`Graph`. ``tracer`` is ``"fx"``, ``"export"`` or ``"auto"`` (fx first).

    ``dynamic_dims`` (torch.export only; an fx graph takes any shape its code allows): which
    dims besides the batch a later call may change, where the code allows: ``"auto"`` those
    of inputs of up to 3 dims (token ids, masks: another sequence length), ``"all"`` every
    input's (an image's sides too: export then takes many times longer, 30-90 s against
    1 s on a Swin), ``"batch"`` none. A call that changes a fixed dim is refused
    with the fix. ``Traced.dynamic_dims`` records, per graph input, the dims a call may change.
    An export is kept for this process's next trace of a model built alike (the same classes,
    configuration, attributes and modes, weights and inputs of the same shapes; other weight values):
    planning the same model again (or another built alike) does not run torch.export again.

    ``example_kwargs`` are keyword inputs: tensors become graph inputs after the positional
    ones, anything else (``use_cache=False``) is fixed in the graph. ``leaf_modules`` are
    module classes, qualified names or sub-modules kept whole (not traced into). Inputs on
    the ``meta`` device (or fake tensors) propagate shapes without computing or allocating
    anything, so any model size can be traced. Tracing leaves ``model`` as it was: its
    parameters, buffers, modes and torch's random generators.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if tracer not in ("auto", "fx", "export"):
        raise ConfigError(f"tracer must be 'auto', 'fx' or 'export', got {tracer!r}")
    if dynamic_dims not in DYNAMIC:
        raise ConfigError(
            f"dynamic_dims must be 'auto' (the batch, and every dim of inputs of up to 3 dims such as token "
            f"ids; an image's sides stay fixed), 'batch' (only the batch: quickest to export) or 'all' (every "
            f"dim the code allows: slowest), got {dynamic_dims!r}"
        )
    leaf_modules = () if leaf_modules is None else leaf_modules  # None: no module kept whole, as the other options
    if isinstance(leaf_modules, (str, type, torch.nn.Module)) or not isinstance(leaf_modules, Iterable):
        raise ConfigError(f"leaf_modules must be a list of module classes, qualified names or sub-modules, got "
                          f"{leaf_modules!r}; e.g. leaf_modules=[{getattr(leaf_modules, '__name__', 'MyBlock')}]")
    with untouched(model):  # tracing runs the model's code (export: on fake tensors; the shapes: maybe real)
        return _trace(model, example_inputs, example_kwargs, tuple(leaf_modules), tracer, dynamic_dims)


def _trace(model: torch.nn.Module, example_inputs: Any, example_kwargs: dict[str, Any] | None,
           leaf_modules: tuple[Any, ...], tracer: str, dynamic_dims: str) -> Traced:
    inputs, concrete, spec = normalize_inputs(model, example_inputs, example_kwargs)
    out_spec = None
    used = "fx"
    if tracer == "export":
        gm, out_spec, inputs, spec = _export_trace(model, inputs, spec, None, dynamic_dims)
        used = "export"
    else:
        try:
            gm = _fx_trace(model, concrete, leaf_modules, [*spec.arg_names, *spec.keywords])
        except TraceError as fx_error:
            if tracer == "fx":
                raise
            gm, out_spec, inputs, spec = _export_trace(model, inputs, spec, fx_error, dynamic_dims)
            used = "export"
    hold_unused(gm, model)
    follow_mode(gm)  # dropout obeys model.train() / .eval() after tracing, per module
    names, infos = _named_tensors(model)
    recorder = record(gm, inputs, names)
    pinned = view_writes(gm)

    def owned(obj: Any, prefix: str) -> tuple[list[str], list[str]]:
        params, bufs = [], []
        tensors: list[tuple[str, torch.Tensor]] = []
        if isinstance(obj, torch.nn.Module):
            tensors = list(obj.named_parameters(prefix, remove_duplicate=False)) + [
                (n, b) for n, b in obj.named_buffers(prefix, remove_duplicate=False) if b is not None
            ]
        elif isinstance(obj, torch.Tensor):
            tensors = [(prefix, obj)]
        for _, t in tensors:
            name = names.get(id(t))
            if name is None:
                continue
            (bufs if infos[name].is_buffer else params).append(name)
        return params, bufs

    nodes: list[Node] = []
    fx_nodes = list(gm.graph.nodes)
    attr_nodes = {n.name: n for n in fx_nodes if n.op == "get_attr"}
    for n in fx_nodes:
        if n.op == "get_attr":
            continue
        module = gm.get_submodule(str(n.target)) if n.op == "call_module" else None
        params: list[str] = []
        bufs: list[str] = []
        if module is not None:
            params, bufs = owned(module, str(n.target))
        inputs_: list[str] = []
        for a in n.all_input_nodes:
            if a.name in attr_nodes:
                p, b = owned(_resolve(gm, str(a.target)), str(a.target))
                params += p
                bufs += b
            else:
                inputs_.append(a.name)
        outputs = recorder.outputs.get(n.name, ())
        op = _op_name(n, module)
        kind = INPUT if n.op == "placeholder" else OUTPUT if n.op == "output" else OP
        moved = bytes_moved(op, kind, sum(t.nbytes for a in inputs_ for t in recorder.outputs.get(a, ())),
                            sum(t.nbytes for t in outputs), sum(infos[p].nbytes for p in dict.fromkeys(params + bufs)))
        stack = n.meta.get("nn_module_stack") or {}
        path = str(n.target) if n.op == "call_module" else (next(reversed(stack.values()))[0] if stack else "")
        path = "" if path.startswith("_") else path
        nodes.append(Node(
            name=n.name, kind=kind, target=op, module_path=path, inputs=tuple(dict.fromkeys(inputs_)),
            outputs=outputs, value_kind=recorder.kinds.get(n.name, "value"), writes_into=pinned.get(n.name),
            flops=recorder.flops.get(n.name, 0.0), bytes_accessed=moved,
            parameters=tuple(dict.fromkeys(params)), buffers=tuple(dict.fromkeys(bufs)),
        ))
    fixed = spec.fixed_dims if spec.flat else ()
    dynamic = tuple(
        tuple(d for d in range(x.dim()) if d not in (fixed[i] if i < len(fixed) else {}))
        if isinstance(x, torch.Tensor) else () for i, x in enumerate(inputs))
    return Traced(gm, Graph(nodes, infos, model_name=type(model).__name__), concrete, out_spec, used, spec,
                  model.training, inputs, dynamic)
