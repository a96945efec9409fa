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

__all__ = ["export_graph_module"]


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


def _dynamic_shapes(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], seq: bool) -> Any:
    """Dim 0 of every tensor is the batch (one symbol for all); with ``seq`` the other dims are
    left to export (dynamic where the code allows it, fixed where it does not)."""
    batch = Dim("batch", min=1)

    def dims(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return None
        return {0: batch, **({i: Dim.AUTO for i in range(1, x.dim())} if seq else {})}

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


def export_graph_module(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                        constants: dict[str, Any] | None = None
                        ) -> tuple[fx.GraphModule, TreeSpec, tuple[dict[int, int], ...]]:
    """Export ``model(*args, **kwargs, **constants)`` (non-strict; the batch dimension dynamic,
    and the others where the code allows) and rebuild its graph so that weights are
    ``get_attr`` reads of the model's parameters and buffers by original name (tied ones
    once) and only the user's tensors are placeholders, flat. Returns the module, the
    output's tree spec (the module's outputs come back in the model's own structure) and,
    per input, the dims export fixed."""
    from torch.export import export

    kwargs = dict(kwargs or {})
    with _fixed_keywords(model, dict(constants or {})):
        try:
            ep = export(model, tuple(args), kwargs, dynamic_shapes=_dynamic_shapes(model, args, kwargs, True),
                        strict=False)
        except Exception:  # noqa: BLE001 - some models only export with their other dims fixed
            ep = export(model, tuple(args), kwargs, dynamic_shapes=_dynamic_shapes(model, args, kwargs, False),
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
