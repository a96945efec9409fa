"""The one ordered step that wraps a rank's stages: experts, TP, stage rewrites, checkpointing, compile, FSDP2.

torchtitan applies its parallelisms to a model in one explicit order; Replica does the same to
each stage this process runs, after the pipeline split:

0. **expert parallelism** (:mod:`replica.parallel.experts`): each MoE layer's experts spread
   over an expert group of replicas, tokens dispatched to them and back by all-to-all;
1. **tensor parallelism** (:mod:`replica.parallel.tensor_parallel`): the plan's blocks cut over
   the mesh's ``tp`` slice, parameters becoming DTensor shards;
2. **stage rewrites** (:mod:`replica.stage`): float8 linears where the plan asks
   (:mod:`replica.parallel.float8`), linears that defer their weight gradients (for a schedule's W
   actions, or to send input gradients first), norms whose outputs can be rebuilt;
3. **activation checkpointing** (:mod:`replica.stage.checkpoint`): each stage's blocks, as its
   plan says (every block, the first k, or selective); a stage without blocks whose plan
   checkpoints it runs whole under ``torch.utils.checkpoint`` in the runtime (``whole_stage``);
4. **compilation** (:mod:`replica.parallel.compile`, where the plan compiles): each stage's graph
   through ``torch.compile``, its checkpointed blocks compiled inside their checkpoint, FSDP2's
   root unit outside (a stage holding tensor-parallel blocks with static shapes, an expert-parallel
   layer eager between graphs; said in the summary);
5. **data parallelism**: FSDP2 (``fully_shard`` per block, then the stage) over the mesh's
   ``dp_shard`` slice, or ``(dp_replicate, dp_shard)`` under HSDP, for sharded replicas; whole
   replicas average their gradients in the runtime (:mod:`replica.parallel.gradsync`); FSDP2
   leaves the experts' shards alone (their gradients are reduced by expert parallelism).

It also decides, once, what the runtimes read about the stages (:class:`StageFlags`): whether a
backward sends its input gradient before computing its weight gradients, which stages defer
their linears' weight gradients, and whether the stage modules are FSDP2 roots.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
import torch.fx as fx

from replica.parallel.compile import check_cpu_compiler, compile_stage, runs_eagerly
from replica.parallel.experts import ExpertGroups, expert_groups, expert_parameters, place_experts
from replica.parallel.float8 import float8_stage
from replica.parallel.fsdp import shard_stage
from replica.parallel.mesh import ParallelMesh
from replica.parallel.tensor_parallel import shard_stage_tensors
from replica.partition.plan import Plan
from replica.partition.split import StageModule
from replica.precision import autocast_dtype
from replica.schedules.actions import placement, splits_backward
from replica.schedules.schedule import Schedule
from replica.stage.checkpoint import checkpoint_blocks
from replica.stage.remat import rebuildable_norms
from replica.stage.rewrite import node_module_path
from replica.stage.weightgrad import defer_linear_weight_grads

__all__ = ["StageFlags", "stage_flags", "parallelize", "sending_input_grads", "whole_stages", "checkpointed_blocks"]


@dataclass(frozen=True)
class StageFlags:
    """What the runtimes read about a rank's wrapped stages, decided once.

    ``sharded``: the stage modules are FSDP2 roots (told before each backward whether it is
    their last of the step). ``early_input_grads``: a backward that sends an input gradient to
    another process sends it before computing its weight gradients (never where FSDP reduces
    gradients inside the backward). ``deferring``: the stages whose linears leave their weight
    gradients for later (every stage under a schedule with W actions; with early input
    gradients, the stages that send one to another process). ``whole_stage``: the stages
    checkpointed whole, "full" or "selective" (those without blocks whose plan checkpoints them).
    ``every_microbatch``: the sharded stages whose plan reduce-scatters their gradients after
    every backward (``StagePlan.grad_sync == "microbatch"``), not once a step."""

    sharded: bool
    early_input_grads: bool
    deferring: frozenset[int]
    whole_stage: dict[int, str] = field(default_factory=dict)
    experts: ExpertGroups | None = None  # expert parallelism's groups, where the plan spreads experts
    every_microbatch: frozenset[int] = frozenset()


def sending_input_grads(stages: Sequence[StageModule], place: dict[int, int]) -> set[int]:
    """The stages that send an input gradient to a stage on another pipeline rank (``place``:
    stage -> rank): the only ones whose backward gains by sending it before the weight gradients."""
    return {s.stage_index for s in stages
            if any(place[src] != place[s.stage_index] for src in s.input_sources)}


def stage_flags(stages: Sequence[StageModule], plan: Plan, schedule: Schedule, distributed: bool) -> StageFlags:
    """The flags of ``plan``'s stages under ``schedule`` (in one process nothing is sent, so no
    backward sends early; a schedule with W actions defers every stage's weight gradients)."""
    sharded = distributed and plan.layout.sharded and plan.data_parallel_size > 1
    early = distributed and plan.sends_input_grads_early
    if splits_backward(schedule):
        deferring = frozenset(s.stage_index for s in stages)
    elif early:
        # a stage that sends no input gradient (the first) keeps autograd's own linears: the
        # rewrite would only cost it (about 3% of its step, benchmarks/RESULTS.md)
        deferring = frozenset(sending_input_grads(stages, placement(schedule)))
    else:
        deferring = frozenset()
    every = frozenset(s.stage_index for s in plan.stages if s.grad_sync == "microbatch") if sharded else frozenset()
    return StageFlags(sharded=sharded, early_input_grads=early, deferring=deferring,
                      whole_stage=whole_stages(plan), every_microbatch=every)


def whole_stages(plan: Plan) -> dict[int, str]:
    """The stages checkpointed whole ("full" or "selective"): those without blocks whose plan
    checkpoints them; every stage of a plan saved before per-block modes that recomputes."""
    if plan.recompute is True and all(s.recompute is False for s in plan.stages):
        return dict.fromkeys(range(plan.num_stages), "full")  # a plan from before per-stage modes
    return {s.stage_index: "selective" if s.recompute == "selective" else "full" for s in plan.stages
            if not s.blocks and (s.recompute is True or s.recompute == "selective")}


def in_blocks(blocks: Sequence[str]) -> Callable[[fx.Node], bool]:
    """Whether a node of a stage graph runs in one of ``blocks`` (module paths)."""
    def inside(n: fx.Node) -> bool:
        path = node_module_path(n)
        return any(path == b or path.startswith(b + ".") for b in blocks)
    return inside


def checkpointed_blocks(plan: Plan, stage_index: int) -> tuple[str, ...]:
    """The blocks stage ``stage_index`` checkpoints: all of them (True, "selective"), the first k, or none."""
    s = plan.stages[stage_index]
    if s.recompute is True or s.recompute == "selective":
        return s.blocks
    if isinstance(s.recompute, int) and not isinstance(s.recompute, bool):
        return s.blocks[:s.recompute]
    return ()


def parallelize(stages: Sequence[StageModule], plan: Plan, schedule: Schedule, mesh: ParallelMesh | None, *,
                canonical: dict[str, str], model: torch.nn.Module | None = None) -> StageFlags:
    """Wrap the stages this process runs, in place, in the module's order (see its docstring).
    ``mesh`` None: one process, every stage here, nothing cut or sharded. ``canonical``: a tied
    weight's aliases to its first name. ``model``: the user's, whose experts modules expert
    parallelism calls. Returns the :class:`StageFlags` the runtimes read."""
    flags = stage_flags(stages, plan, schedule, mesh is not None)
    place = placement(schedule)
    mine = [s for s in stages if mesh is None or place[s.stage_index] == mesh.pipeline_rank]
    # 0. expert parallelism: each MoE layer's experts spread over an expert group of replicas
    if mesh is not None and plan.layout.expert_parallel_size > 1 and plan.experts and model is not None:
        flags = replace(flags, experts=expert_groups(mesh, plan.layout.expert_parallel_size, mesh.mesh.device_type))
        place_experts(mine, plan.experts, model, flags.experts)
    # 1. tensor parallelism: one dict for every stage of this rank, so that a weight two of
    # them read (a tied embedding and head) stays one parameter
    if mesh is not None and plan.layout.tensor_parallel_size > 1 and plan.tensor_parallel:
        made: dict[int, torch.nn.Parameter] = {}
        for stage in mine:
            shard_stage_tensors(stage.module, plan.tensor_parallel, mesh.tensor_parallel_mesh, canonical, made,
                                fsdp_next=flags.sharded, sequence=plan.sequence_shards)
    # 2. stage rewrites: float8 linears (before any rewrite or region refers to the modules), then
    # every stage of the split (one process runs all of them)
    for stage in mine if plan.float8 else ():
        float8_stage(stage.module)
    for stage in stages:
        if stage.stage_index in flags.deferring:
            # a checkpointed block's linears compute their weight gradients in B: deferred to W,
            # they would keep the block's recomputed inputs alive until then
            defer_linear_weight_grads(stage.module, skip=in_blocks(checkpointed_blocks(plan, stage.stage_index)))
        # norms that note their eps, so that their outputs can be rebuilt; not where FSDP may free a
        # norm's weight between the B that keeps its input and the W that would rebuild it
        if (plan.pointwise_recompute or plan.rebuilds) and not (flags.sharded and stage.stage_index in flags.deferring
                                                                 and splits_backward(schedule)):
            rebuildable_norms(stage.module)
    # 3. activation checkpointing: each stage's blocks, as its plan says
    for stage in mine:
        blocks = checkpointed_blocks(plan, stage.stage_index)
        if blocks:
            checkpoint_blocks(stage.module, blocks, selective=plan.stages[stage.stage_index].recompute == "selective")
    # 4. compilation: each stage's graph (compiled at its first call), where the plan compiles it
    static = set(plan.static_shape_stages) if mesh is not None else set()  # cut over a mesh: DTensors
    compiling = [s for s in mine if not runs_eagerly(plan, s.stage_index)]
    check_cpu_compiler([s.module for s in compiling])
    for stage in compiling:
        compile_stage(stage.module, deferring=stage.stage_index in flags.deferring,
                      static=stage.stage_index in static)
    # 5. sharded replicas: FSDP2 over the shard slice; their parameters become DTensor shards
    if mesh is not None and flags.sharded:
        for stage in sorted(mine, key=lambda s: s.stage_index):
            shard_stage(stage.module, mesh.sharding_mesh, reshard_after_forward=plan.layout.sharding == "zero3",
                        gather_dtype=autocast_dtype(plan.precision), ignored=set(expert_parameters([stage.module])))
    return flags
