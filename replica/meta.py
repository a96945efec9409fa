"""A model built on meta, made ready for its pipeline: each rank materializes its own stages'
tensors, and the traced graph is pointed at them."""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from replica.materialize import materialize_modules
from replica.partition.holding import rebind_tensors
from replica.partition.plan import Plan
from replica.partition.trace import Traced
from replica.schedules.schedule import placement, plan_schedule

__all__ = ["materialize_own_stages", "ready_for_runtime", "stage_device"]


def _devices_from_meta(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """An exported graph writes the device it was traced on into its ops (``arange(device=)``,
    ``to(device=)``, metadata asserts): a meta model's graph runs on ``device`` instead."""
    to_device = lambda v: device if isinstance(v, torch.device) and v.type == "meta" else v  # noqa: E731
    for n in gm.graph.nodes:
        n.args = tree_map(to_device, n.args)
        n.kwargs = tree_map(to_device, n.kwargs)
    gm.recompile()


def stage_device(world: int) -> torch.device:
    """Where a rank materializes its stages of a meta model: under NCCL its current GPU
    (``torch.cuda.set_device(LOCAL_RANK)`` first), else (gloo, one process) the CPU. The
    Trainer asks before building, to move its batches there."""
    if world > 1 and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def materialize_own_stages(model: torch.nn.Module, plan: Plan, world: int,
                            init: Callable[[torch.nn.Module], None] | None, weights: str | os.PathLike[str] | None,
                            seed: int) -> torch.device:
    """Allocate and initialize (or load) the tensors of this rank's stages (in one process: every
    stage's) in ``model``; returns the device they are on."""
    device = stage_device(world)
    if world > 1:
        rank = plan.layout.coordinates(dist.get_rank()).pipeline_rank
        where = placement(plan_schedule(plan))
        mine = [s for s in plan.stages if where[s.stage_index] == rank]
    else:
        mine = list(plan.stages)
    paths = list(dict.fromkeys(name.rpartition(".")[0] for s in mine for name in s.parameter_names))
    materialize_modules(model, paths, init, device, seed=seed, weights=weights)
    return device


def ready_for_runtime(traced: Traced, model: torch.nn.Module, device: torch.device,
                      trace_again: Callable[[], Traced]) -> Traced:
    """The traced graph the runtime splits, once this rank's tensors are real: an fx graph is
    traced again (fx folds what the forward computes from buffers, a causal mask's ``== 0``,
    into constants: meta ones on a meta model); an exported graph reads every weight by name
    and export cannot run a model partly on meta, so it is pointed at the new tensors and at
    their device."""
    if traced.tracer == "fx":
        return trace_again()
    rebind_tensors(traced.module, model)
    _devices_from_meta(traced.module, device)
    return traced
