"""The planner: one entry, :func:`make_plan`, behind both ``replica.plan`` and ``replica.auto_parallel``.

A request says what the user fixed (stages, micro-batches, schedule, replicas, recompute)
and what the planner may choose; :func:`make_plan` prices the traced model once
(:mod:`.pricing`), lays it out — one given layout, or the tuner's search (:mod:`.tuner`) —
and refines the chosen plan (:mod:`.refine`: graded micro-batches, rebuilds).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from replica.errors import ConfigError, PartitionError
from replica.layout import Layout, v_sharding_error
from replica.partition.blocks import find_blocks
from replica.partition.graph import fingerprint
from replica.partition.partitioner import MemoryModel
from replica.partition.plan import Plan
from replica.partition.recompute import needs_blocks
from replica.partition.trace import Traced
from replica.planner.costs import stage_costs_from_plan
from replica.planner.experts import check_expert_size, plan_experts
from replica.planner.options import PlannerOptions
from replica.planner.pricing import Pricing, default_microbatches
from replica.planner.refine import finish
from replica.planner.request import PlanningOptions, PlanRequest, check_count
from replica.planner.tuner import tune
from replica.schedules.schedule import plan_schedule
from replica.schedules.simulate import simulate

__all__ = ["PlanRequest", "PlanningOptions", "PlannerOptions", "make_plan", "check_count"]

def make_plan(traced: Traced, model: torch.nn.Module, request: PlanRequest) -> Plan:
    """The plan of ``traced`` (from ``model``) that ``request`` asks for."""
    r = request
    if "none" not in r.shardings:
        _check_shardable(r)
    scale = 1
    if r.batch == "per_rank":
        fixed = r.replicas_fixed()
        if fixed is None:
            raise ConfigError(
                f"batch='per_rank' means each replica is fed its own batch, so the number of replicas must be "
                f"fixed before planning: give data_parallel_size= (a divisor of {r.world_size}), or num_stages= "
                "with a named schedule (and tensor_parallel_size=); or pass the whole batch with batch='global' and "
                "let the planner choose"
            )
        scale = fixed
    pricing = _pricing(traced, model, r, scale, r.compile)
    if r.expert_parallel_size is not None:  # no expert block, experts it does not divide: before any search
        check_expert_size(pricing.experts, r.expert_parallel_size, r.replicas_fixed(),
                          model_name=traced.graph.model_name)
    # the mode every stage checkpoints by (None: the tuner's choice; "pointwise" checkpoints none)
    full = False if r.recompute == "pointwise" else r.recompute
    if needs_blocks(full) and not find_blocks([n.module_path for n in traced.graph]):
        raise ConfigError(
            f"recompute={full!r} checkpoints blocks (the repeated modules, as transformer.h.0, model.layers.0), but "
            f"{traced.graph.model_name or 'the model'} has none: its module paths repeat no indexed container. Use "
            "recompute=True (each stage checkpointed whole), 'pointwise', False or None")
    if pricing.compiled and r.recompute == "pointwise":
        raise ConfigError(
            "recompute='pointwise' rebuilds GELU / SiLU outputs in backward through autograd's saved-tensor hooks, "
            "which a compiled stage does not run: torch.compile's partitioner already recomputes cheap pointwise "
            "ops. Use compile=False with it, or recompute=None / True / 'selective' / False with compile=True")
    # False keeps every activation: no rebuilds either; nor in compiled stages, whose partitioner
    # chooses what to recompute (and whose graphs the rebuildable norms would break)
    rebuild = r.recompute is not False and not pricing.compiled
    if r.tuning:
        world = r.world_size if r.world_size is not None else (r.num_stages or 1)
        schedules = None if r.schedule == "auto" else (r.schedule,)
        sizes = _worth_cutting(pricing, r.tensor_parallel_choices(pricing.spec.devices_per_node),
                               r.tensor_parallel_size is not None)
        if r.sequence_parallel and max(sizes) == 1:
            raise ConfigError(
                f"sequence_parallel=True shards the tokens between tensor-parallel blocks, but on {pricing.spec.name} "
                f"({pricing.spec.devices_per_node} device(s) per node) the tuner may only use "
                f"tensor_parallel_size=1 here; give tensor_parallel_size=2 or more (a divisor of world_size={world}), "
                "or sequence_parallel=None / False")
        best, _ = tune(lambda layout, m, within, again, like=None: pricing.partition_for(
                           layout, m, within_budget=within, recompute=again, simulated=within, like=like),
                       pricing.lay_out,
                       world_size=world, batch=pricing.global_batch, num_ops=len(traced.graph.op_nodes),
                       device=pricing.spec, memory_budget=pricing.budget_per_device(), num_stages=r.num_stages,
                       num_microbatches=r.num_microbatches, data_parallel_size=r.replicas_fixed(),
                       recompute=(False, "selective", True) if full is None else (full,), shardings=r.shardings,
                       tensor_parallel_sizes=sizes,
                       shard_groups=lambda replicas, per_replica: r.shard_groups(replicas, per_replica,
                                                                                  pricing.spec.devices_per_node),
                       sequence_parallel=lambda t: _sequence_choices(pricing, r, t),
                       options=r.options, work_for=pricing.work,
                       expert_parallel=lambda replicas: pricing.expert_choices(replicas, r.expert_parallel_size),
                       **({} if schedules is None else {"schedules": schedules}))
        plan = best
    else:
        t = r.tensor_parallel_fixed() or 1
        if r.world_size is None:
            layout = Layout.for_stages(r.schedule, r.num_stages)
        else:
            layout = Layout.for_world(r.schedule, r.world_size, num_stages=r.num_stages,
                                      data_parallel_size=r.data_parallel_size, tensor_parallel_size=t)
        m = r.num_microbatches or default_microbatches(pricing.global_batch // layout.data_parallel_size,
                                                       layout.num_stages)
        if r.expert_parallel_size is not None:
            check_expert_size(pricing.experts, r.expert_parallel_size, layout.data_parallel_size, layout.describe(),
                              traced.graph.model_name)
        plan = _shard_fixed(pricing, layout, m, full or False, r, r.options.tie)
    _check_blocks(plan)
    plan = finish(pricing, plan, pricing.batch_fraction(plan.layout), rebuild=rebuild)
    if r.compile is None and pricing.compiled and not r.float8:
        plan = _compile_if_it_pays(traced, model, r, scale, plan)
    # each MoE layer's experts over the layout's ep replicas (the one asked, or the search's): its figures
    plan = plan_experts(traced, plan, r.expert_parallel_size, pricing.first_spec(), optimizer=r.optimizer,
                        counts=pricing.routing() if plan.layout.expert_parallel_size > 1 else None)
    if r.recompute == "pointwise" and not plan.recompute:
        plan = dataclasses.replace(plan, pointwise_recompute=True)
    # the action lists, once, from the final plan: every rank, the simulator and the report read
    # them; with each action's predicted start, by which the ranks order their messages
    schedule = plan_schedule(plan)
    costs = stage_costs_from_plan(plan, schedule, device=pricing.first_spec())
    starts = {e.action: e.start_s for e in simulate(schedule, costs, sizes=plan.relative_microbatch_sizes).events}
    actions = tuple(tuple(str(a) for a in rank) for rank in schedule)
    action_starts = tuple(tuple(starts[a] for a in rank) for rank in schedule)
    # which dims a call may change: torch.export fixes the others; an fx graph takes any shape its code allows
    dynamic = traced.dynamic_dims if traced.tracer == "export" else ()
    # the traced graph's own fingerprint (a tensor-parallel plan is priced on a copy with cut shapes)
    return dataclasses.replace(plan, dynamic_dims=dynamic, actions=actions, action_starts=action_starts,
                               graph_fingerprint=fingerprint(traced.graph))


def _pricing(traced: Traced, model: torch.nn.Module, r: PlanRequest, scale: int, compile: bool | None) -> Pricing:
    """The request's prices of ``traced``, its stages compiled or not as ``compile`` says."""
    pricing = Pricing(traced, model, device=r.device, cost=r.cost, memory_budget=r.memory_budget,
                      memory_model=MemoryModel(optimizer=r.optimizer), precision=r.precision,
                      num_microbatches=r.num_microbatches, num_stages_hint=r.num_stages or r.world_size or 1,
                      graded=r.graded_microbatches, options=r.options, batch_scale=scale, compile=compile,
                      float8=r.float8, grad_sync=r.grad_sync)
    return pricing


def _compile_if_it_pays(traced: Traced, model: torch.nn.Module, r: PlanRequest, scale: int, compiled: Plan) -> Plan:
    """``compile=None`` where the rule turns compilation on (a GPU): ``compiled``, the chosen
    layout priced compiled, against the same layout priced eager (its own cut and rebuilds); the
    compiled plan where it is faster by more than the planner's tie (the compile seconds are then
    repaid within a run), else the eager one. A model with no pointwise chains to fuse gains
    nothing; a compiled backward runs whole, so a pipeline of few micro-batches can lose more early
    input-gradient sends than the fusions gain."""
    where = compiled.device or r.device
    pricing = _pricing(traced, model, r, scale, False)
    try:
        eager = pricing.partition_for(compiled.layout, compiled.num_microbatches,
                                      recompute=tuple(s.recompute for s in compiled.stages))
        eager = finish(pricing, eager, pricing.batch_fraction(compiled.layout), rebuild=r.recompute is not False)
    except (PartitionError, ConfigError):  # the same layout eager does not fit: compiled it stays
        return compiled
    gain = eager.predicted_step_time_s / compiled.predicted_step_time_s
    if gain > 1 + r.options.tie:
        return dataclasses.replace(compiled, compile_note=(
            f"compile=None on {where}: on, priced {gain:.3f}x the same layout's eager step"))
    return dataclasses.replace(eager, compile_note=(
        f"compile=None on {where}: off, the same layout compiled is priced {gain:.3f}x as fast as eager, "
        f"on needs over {1 + r.options.tie:.2f}x; compile=True compiles anyway"))


def _worth_cutting(pricing: Pricing, sizes: Sequence[int], asked: bool) -> tuple[int, ...]:
    """The tensor-parallel sizes worth pricing: 1, and those that cut at least one block
    (without one a tensor-parallel group only replicates its stage); all of them where the
    request fixed the size."""
    if asked:
        return tuple(sizes)
    return tuple(t for t in sizes if t == 1 or pricing.blocks_for(t))


def _sequence_choices(pricing: Pricing, r: PlanRequest, tensor_parallel_size: int) -> tuple[bool, ...]:
    """The sequence-parallel settings worth pricing at ``tensor_parallel_size``: the request's
    choices, but only without where the graph has no value to hold on token shards (the same plan)."""
    choices = r.sequence_parallel_choices(tensor_parallel_size)
    if r.sequence_parallel is None and len(choices) > 1 and not pricing.region(tensor_parallel_size):
        return (False,)
    return choices


def _check_shardable(r: PlanRequest) -> None:
    """A request that must shard names a layout sharding can run: replicas, not zb-v's V."""
    if r.schedule == "zb-v":
        raise v_sharding_error(f"sharded_data_parallel={r.sharded_data_parallel!r}", r.schedule,
                               ", or schedule='auto'")
    if r.replicas_fixed() == 1:
        where = ("this plans for one process (no world_size=, no process group): run auto_parallel or the Trainer "
                 "under torchrun (torchrun --nproc_per_node N), or give replica.plan world_size=N; in one process use"
                 if r.world_size is None else
                 f"this layout of world_size={r.world_size} has one: give num_stages= or data_parallel_size= that "
                 "leaves replicas, or")
        raise ConfigError(
            f"sharded_data_parallel={r.sharded_data_parallel!r} shards each stage over its data-parallel replicas, "
            f"but {where} sharded_data_parallel=None / False")


def _check_blocks(plan: Plan) -> None:
    """``recompute=k`` checkpoints the first k blocks of each stage: a stage holding blocks, but
    fewer than k, is a ConfigError naming it, its blocks and the fix."""
    k = plan.recompute
    if not isinstance(k, int) or isinstance(k, bool):
        return
    short = [s for s in plan.stages if s.blocks and len(s.blocks) < k]
    if short:
        s = short[0]
        fewest = min(len(t.blocks) for t in plan.stages if t.blocks)
        raise ConfigError(
            f"recompute={k} checkpoints the first {k} blocks of each stage, but stage {s.stage_index} holds "
            f"{len(s.blocks)}: {', '.join(s.blocks)}. Use recompute={fewest} (the fewest blocks a stage holds), "
            "True (every block of every stage), 'selective', or fewer stages")


def _shard_fixed(pricing: Pricing, layout: Layout, m: int, recompute: bool | str | int, r: PlanRequest,
                 tie: float) -> Plan:
    """The plan of a layout the request fixed, with the fastest of the shardings it allows
    that fits (predictions within ``tie`` of it: whole replicas if among them, then the one
    holding least memory, as the tuner takes), each in the shard groups the request allows, with
    and without sequence parallelism where the request leaves it open (without on a tie).
    Where none fits, the error of the leanest (zero3's, where it was tried)."""
    d = layout.data_parallel_size
    per_replica = layout.pipeline_ranks * layout.tensor_parallel_size
    allowed = [(s, None) if s == "none" else (s, None if g == d else g)
               for s in r.shardings if s == "none" or (d > 1 and layout.kind.placement != "v")
               for g in ((d,) if s == "none" else r.shard_groups(d, per_replica, pricing.spec.devices_per_node))]
    plans: list[Plan] = []
    errors: dict[str, PartitionError] = {}
    for (sharding, group), sp, ep in ((a, sp, ep) for a in allowed
                                      for sp in _sequence_choices(pricing, r, layout.tensor_parallel_size)
                                      for ep in pricing.expert_choices(d, r.expert_parallel_size)):
        try:
            plans.append(pricing.partition_for(dataclasses.replace(layout, sharding=sharding, shard_group_size=group,
                                                                   sequence_parallel=sp, expert_parallel_size=ep),
                                               m, recompute=recompute))
        except PartitionError as exc:
            errors[sharding] = exc
    if not plans:
        raise errors.get("zero3", next(iter(errors.values())))
    fastest = min(p.predicted_step_time_s for p in plans)
    near = [p for p in plans if p.predicted_step_time_s <= fastest * (1 + tie)]
    return min(near, key=lambda p: (p.layout.sharded, p.layout.sequence_parallel, p.layout.expert_parallel_size,
                                    max(s.predicted_memory_bytes for s in p.stages),
                                    p.predicted_step_time_s))
