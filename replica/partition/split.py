"""Split a traced model into one ``fx.GraphModule`` per stage, following a plan.

Each stage module takes the values it receives (in the order of the plan's
``inputs``) and returns a tuple of the values later stages read (the plan's
``outputs``; under autocast, a value every reader casts leaves cast:
:mod:`replica.partition.crossing`); the last stage returns the model's own output. Sub-modules and
parameters are shared by reference with the user's model, under their original
names, so ``stage.named_parameters()`` yields ``transformer.h.0.attn.c_attn.weight``
and a tied weight held by two stages is the same ``Parameter``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_unflatten

from replica.errors import ConfigError
from replica.partition.crossing import HALF
from replica.partition.graph import Node, fingerprint
from replica.partition.holding import hold_tensor
from replica.partition.modes import uses_rng
from replica.partition.mutation import mutated_inputs
from replica.partition.plan import BoundaryTensor, Plan
from replica.partition.trace import Traced

__all__ = ["StageModule", "split"]


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
    uses_rng: bool = False  # has random ops (dropout): run seeded per micro-batch
    device: torch.device | None = None


def _unflatten(spec: Any) -> Any:
    def hook(module: torch.nn.Module, args: Any, out: Any) -> Any:
        return tree_unflatten(list(out), spec)
    return hook


def _hold_from(gm: fx.GraphModule, stage: fx.GraphModule, name: str, held: set[int]) -> None:
    """Give ``stage`` the tensor ``gm`` holds at ``name``, unless it holds it (by any name)."""
    path, _, field = name.rpartition(".")
    owner = gm.get_submodule(path)
    tensor = getattr(owner, field)
    if id(tensor) not in held:
        hold_tensor(stage, name, tensor, field not in owner._non_persistent_buffers_set)


def _as_sent(g: fx.Graph, value: fx.Node, node: Node, b: BoundaryTensor) -> fx.Node:
    """``value`` cast to the dtype the plan sends it in, where that is autocast's and not its own
    (every reader would cast it: :mod:`replica.partition.crossing`)."""
    own = node.outputs[0].dtype if len(node.outputs) == 1 else None
    if b.dtype in HALF and own == "float32":
        return g.call_method("to", (value, getattr(torch, b.dtype)))
    return value


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
        mutated = mutated_inputs(mine, received, gm)
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
            g.output(tuple(_as_sent(g, env[b.name], traced.graph[b.name], b) for b in s.outputs))
        g.lint()
        module = fx.GraphModule(gm, g, class_name=f"Stage{k}")
        reads = {id(t) for t in [*module.parameters(), *module.buffers()]}
        for name in s.parameter_names:  # what no op reads (an unused mask_token) joins its stage too
            _hold_from(gm, module, name, reads)
        if is_last and traced.out_spec is not None:  # exported graphs return flat outputs
            module.register_forward_hook(_unflatten(traced.out_spec))
        stages.append(StageModule(
            stage_index=k,
            module=module,
            input_names=tuple(b.name for b in s.inputs),
            input_sources=tuple(b.source_stage for b in s.inputs),
            output_names=tuple(b.name for b in s.outputs),
            output_destinations=tuple(b.destination_stages for b in s.outputs),
            is_first=k == 0,
            is_last=is_last,
            uses_rng=uses_rng(module),
            device=next((t.device for t in [*module.parameters(), *module.buffers()]), None),
        ))
    return stages
