"""The second tracer: ``torch.export`` for what ``torch.fx`` cannot trace, lowered to a plain
``GraphModule`` of aten ops whose weights are the model's own, under their original names."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import TreeSpec, tree_unflatten

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


def export_graph_module(model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> tuple[fx.GraphModule, TreeSpec]:
    """Export ``model`` (non-strict, batch dimension dynamic) and rebuild its graph so that
    weights are ``get_attr`` reads of the model's parameters and buffers by original name
    (tied ones once) and only the user's inputs are placeholders. Returns the module and the
    output's tree spec; the module's outputs come back in the model's own structure."""
    from torch.export import Dim, export

    batch = Dim("batch", min=1)
    dynamic = tuple({0: batch} if isinstance(x, torch.Tensor) and x.dim() > 0 else None for x in inputs)
    ep = export(model, tuple(inputs), dynamic_shapes=dynamic, strict=False)
    sig = ep.graph_signature
    if sig.buffers_to_mutate or getattr(sig, "user_inputs_to_mutate", None):
        raise RuntimeError(
            f"the model writes into buffers {sorted(sig.buffers_to_mutate.values())[:4]} while it runs (a "
            "BatchNorm in training mode, a cache); a pipeline cannot share such state across micro-batches"
        )
    weights = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    constants = dict(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    root: dict[str, Any] = {}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in ep.graph.nodes:
        if n.op == "placeholder" and n.name in weights:
            name = weights[n.name]
            root[name] = _resolve(model, name)
            env[n] = graph.get_attr(name)
        elif n.op == "placeholder" and n.name in constants:
            name = constants[n.name].replace(".", "_")
            root[name] = ep.constants[constants[n.name]]
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
    return gm, spec
