"""The second tracer: ``torch.export`` for what ``torch.fx`` cannot trace, lowered to a plain
``GraphModule`` of aten ops whose weights are the model's own, under their original names."""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch.export import Dim
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils._pytree import TreeSpec, tree_leaves, tree_map, tree_unflatten

from replica.errors import ConfigError
from replica.partition.inputs import InputSpec

__all__ = ["export_graph_module", "ExportedInputs", "DYNAMIC", "is_dtype_assert", "drop_dtype_asserts"]


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


def _fixed_dims(ep: Any, num_inputs: int) -> tuple[dict[int, int], ...]:
    """For each user input of ``ep``: the dims export specialised to a number (besides the batch)."""
    user = set(ep.graph_signature.user_inputs)
    out = []
    for n in ep.graph.nodes:
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
    from torch.export import export

    if dynamic not in DYNAMIC:
        raise ValueError(f"dynamic must be one of {DYNAMIC}, got {dynamic!r}")
    kwargs = dict(kwargs or {})
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
    if sig.buffers_to_mutate or getattr(sig, "user_inputs_to_mutate", None):
        raise RuntimeError(
            f"the model writes into buffers {sorted(sig.buffers_to_mutate.values())[:4]} while it runs (a "
            "BatchNorm in training mode, a cache); a pipeline cannot share such state across micro-batches"
        )
    weights = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    lifted = dict(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    root: dict[str, Any] = {}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in ep.graph.nodes:
        if n.op == "placeholder" and n.name in weights:
            name = weights[n.name]
            root[name] = _resolve(model, name)
            env[n] = graph.get_attr(name)
        elif n.op == "placeholder" and n.name in lifted:
            name = lifted[n.name].replace(".", "_")
            root[name] = ep.constants[lifted[n.name]]
            env[n] = graph.get_attr(name)
        elif n.op == "output":
            env[n] = graph.output(fx.map_arg(n.args[0], lambda a: env[a]))
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
        env[n].meta = dict(n.meta)
    graph.lint()
    gm = fx.GraphModule(root, graph, class_name=type(model).__name__)
    spec = ep.call_spec.out_spec
    gm.register_forward_hook(_unflatten_hook(spec))
    return gm, spec, _fixed_dims(ep, len(tree_leaves((args, kwargs))))


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
