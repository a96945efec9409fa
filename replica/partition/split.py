"""Split a traced model into one ``fx.GraphModule`` per stage, following a plan.

Each stage module takes the values it receives (in the order of the plan's
``inputs``) and returns a tuple of the values later stages read (the plan's
``outputs``); the last stage returns the model's own output. Sub-modules and
parameters are shared by reference with the user's model, under their original
names, so ``stage.named_parameters()`` yields ``transformer.h.0.attn.c_attn.weight``
and a tied weight held by two stages is the same ``Parameter``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from replica.errors import ConfigError
from replica.partition.partitioner import fingerprint
from replica.partition.plan import Plan
from replica.partition.trace import Traced

__all__ = ["StageModule", "split"]

_INPLACE_FUNCTIONS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul, operator.setitem,
}


@dataclass
class StageModule:
    """One stage, ready to run: ``module(*inputs) -> tuple(outputs)`` (or the model output)."""

    stage_index: int
    module: fx.GraphModule
    input_names: tuple[str, ...]
    input_sources: tuple[int, ...]
    output_names: tuple[str, ...]
    output_destinations: tuple[tuple[int, ...], ...]
    is_first: bool
    is_last: bool


def _mutates_first_argument(n: fx.Node, gm: fx.GraphModule) -> bool:
    if n.op == "call_module":
        return bool(getattr(gm.get_submodule(str(n.target)), "inplace", False))
    if n.op == "call_method":
        name = str(n.target)
        return name.endswith("_") and not name.startswith("_")
    if n.op == "call_function":
        if n.target in _INPLACE_FUNCTIONS or n.kwargs.get("inplace", False):
            return True
        name = getattr(n.target, "__name__", "")
        return name.endswith("_") and not name.startswith("_")
    return False


_VIEWS = frozenset(
    "view view_as reshape transpose permute expand expand_as narrow select squeeze unsqueeze flatten "
    "unflatten t split chunk unbind getitem as_strided diagonal movedim swapaxes unfold".split()
)


def _mutated_inputs(nodes: list[fx.Node], received: set[str], gm: fx.GraphModule) -> set[str]:
    """Received values that an in-place op writes into, directly or through views of them."""
    root: dict[str, str] = {name: name for name in received}  # alias -> received value
    mutated: set[str] = set()
    for n in nodes:
        first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if first is None or first.name not in root:
            continue
        name = str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", "")
        if _mutates_first_argument(n, gm):
            mutated.add(root[first.name])
        elif n.op in ("call_method", "call_function") and name in _VIEWS:
            root[n.name] = root[first.name]
    return mutated


def split(traced: Traced, plan: Plan) -> list[StageModule]:
    """Build the stage modules of ``plan`` from ``traced`` (the graph it was made for)."""
    if plan.graph_fingerprint and plan.graph_fingerprint != fingerprint(traced.graph):
        raise ConfigError(
            f"this plan was made for a different graph (fingerprint {plan.graph_fingerprint}, "
            f"the traced model has {fingerprint(traced.graph)}). Re-plan with replica.plan(model, "
            "example_inputs) for this model, leaf modules and input shapes."
        )
    gm = traced.module
    stage_of = {name: s.stage_index for s in plan.stages for name in s.node_names}
    fx_nodes = [n for n in gm.graph.nodes if n.op != "get_attr"]
    missing = [n.name for n in fx_nodes if n.name not in stage_of]
    if missing:
        raise ConfigError(f"the plan places no stage for nodes {missing[:5]}; re-plan this model")

    stages = []
    for s in plan.stages:
        k = s.stage_index
        g = fx.Graph()
        env: dict[str, fx.Node] = {}
        mine = [n for n in fx_nodes if stage_of[n.name] == k]
        received = {b.name for b in s.inputs}
        mutated = _mutated_inputs(mine, received, gm)
        for b in s.inputs:
            env[b.name] = g.placeholder(b.name)
            if b.name in mutated:  # an in-place op must not write into a received leaf tensor
                env[b.name] = g.call_function(torch.clone, (env[b.name],))

        def lookup(a: fx.Node) -> fx.Node:
            if a.op == "get_attr" and a.name not in env:
                env[a.name] = g.get_attr(str(a.target))
            return env[a.name]

        for n in mine:
            if n.op == "output":
                g.output(fx.map_arg(n.args[0], lookup))
            else:
                env[n.name] = g.node_copy(n, lookup)
        is_last = k == plan.num_stages - 1
        if not is_last:
            g.output(tuple(env[b.name] for b in s.outputs))
        g.lint()
        module = fx.GraphModule(gm, g, class_name=f"Stage{k}")
        stages.append(StageModule(
            stage_index=k,
            module=module,
            input_names=tuple(b.name for b in s.inputs),
            input_sources=tuple(b.source_stage for b in s.inputs),
            output_names=tuple(b.name for b in s.outputs),
            output_destinations=tuple(b.destination_stages for b in s.outputs),
            is_first=k == 0,
            is_last=is_last,
        ))
    return stages
