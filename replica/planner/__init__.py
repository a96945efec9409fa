"""The planner: one entry, :func:`make_plan`, behind both ``replica.plan`` and ``replica.auto_parallel``.

A request says what the user fixed (stages, micro-batches, schedule, replicas, recompute)
and what the planner may choose; :func:`make_plan` prices the traced model once
(:mod:`.pricing`), lays it out — one given layout, or the tuner's search (:mod:`.tuner`) —
and refines the chosen plan (:mod:`.refine`: graded micro-batches, rebuilds).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from replica.errors import ConfigError, PartitionError
from replica.layout import SHARDINGS, Layout, schedule_kind
from replica.partition.graph import fingerprint
from replica.partition.partitioner import MemoryModel
from replica.partition.plan import Plan
from replica.partition.trace import Traced
from replica.planner.costs import stage_costs_from_plan
from replica.planner.options import PlannerOptions
from replica.planner.pricing import Pricing, default_microbatches
from replica.planner.refine import finish
from replica.planner.tensor_parallel import tensor_parallel_choices
from replica.planner.tuner import tune
from replica.precision import precision_name
from replica.schedules.schedule import plan_schedule
from replica.schedules.simulate import simulate

__all__ = ["PlanRequest", "PlannerOptions", "make_plan", "check_count"]

BATCH_MEANINGS = ("global", "per_rank")


def check_count(name: str, value: object) -> None:
    """A positive int or None, else a ``ConfigError`` naming ``name``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{name} must be a positive int or None, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What the user asked of a plan; None leaves a choice to the planner.

    ``world_size`` None plans for one process that runs every pipeline rank itself (no
    replicas); ``schedule`` "auto" lets the tuner pick it (None: "1f1b"); ``recompute``
    True / False / None (the tuner's choice) / "pointwise"; ``batch`` says what the
    example inputs are: "global" (the batch the plain model would take; each replica
    trains its slice) or "per_rank" (each replica's own batch, as from a loader that
    already shards per rank: then the number of replicas must be fixed by the request).
    ``precision`` is what the stages compute in (:mod:`replica.precision`): "fp32" (the
    weights' own dtype) or "bf16" / "fp16" (autocast); any name ``precision_name`` takes.
    ``sharded_data_parallel``: whether the data-parallel replicas shard their stages (FSDP2,
    :attr:`replica.layout.Layout.sharding`): None lets the planner weigh "none", "zero3" and
    "zero2" like the rest of the layout; True shards (zero3 or zero2, whichever it predicts
    faster within memory); False never does; a name of :data:`~replica.layout.SHARDINGS` fixes it.
    ``tensor_parallel_size``: the ranks that shard each stage's blocks (Megatron-style tensor
    parallelism, :mod:`replica.planner.tensor_parallel`); an int fixes it (it must divide
    ``world_size``); None lets the tuner choose among the divisors of the device's
    ``devices_per_node`` that divide the world (one group within a node's links), where it
    tunes; a fixed layout (named schedule, stage and micro-batch counts given) and one process
    (``world_size`` None) keep 1. Not with sharded replicas (FSDP2 over a 2-D mesh is not built).
    """

    world_size: int | None = None
    num_stages: int | None = None
    num_microbatches: int | None = None
    schedule: str | None = None
    data_parallel_size: int | None = None
    tensor_parallel_size: int | None = None
    device: Any = None
    cost: str = "auto"
    memory_budget: float | Sequence[float] | None = None
    recompute: bool | str | None = None
    graded_microbatches: bool = True
    optimizer: str = "adam"
    precision: str = "fp32"
    sharded_data_parallel: bool | str | None = None
    batch: str = "global"
    options: PlannerOptions = dataclasses.field(default_factory=PlannerOptions)

    def __post_init__(self) -> None:
        for name in ("world_size", "num_stages", "num_microbatches", "data_parallel_size", "tensor_parallel_size"):
            check_count(name, getattr(self, name))
        name = "1f1b" if self.schedule is None else self.schedule
        if not (isinstance(name, str) and name.lower() == "auto"):
            name = schedule_kind(name).name
        object.__setattr__(self, "schedule", name.lower())
        object.__setattr__(self, "precision", precision_name(self.precision, argument="precision"))
        if not (self.sharded_data_parallel in (None, True, False) or self.sharded_data_parallel in SHARDINGS):
            raise ConfigError(f"sharded_data_parallel must be True, False, None (the planner decides) or one of "
                              f"{list(SHARDINGS)}, got {self.sharded_data_parallel!r}")
        if not (self.recompute is None or isinstance(self.recompute, bool) or self.recompute == "pointwise"):
            raise ConfigError(
                f"recompute must be True (keep only stage inputs, run the forward again in backward), "
                f"'pointwise' (rebuild GELU / SiLU outputs in backward), False or None (let the tuner decide), "
                f"got {self.recompute!r}"
            )
        if self.batch not in BATCH_MEANINGS:
            raise ConfigError(
                f"batch={self.batch!r}; use 'global' (example inputs and train_step take the whole batch, every "
                "replica trains its slice) or 'per_rank' (each replica is fed its own batch)"
            )
        if not isinstance(self.options, PlannerOptions):
            raise ConfigError(f"options must be a replica.PlannerOptions, got {type(self.options).__name__}")
        if self.world_size is None and self.data_parallel_size not in (None, 1):
            raise ConfigError(
                f"data_parallel_size={self.data_parallel_size} needs a world of processes: give world_size= to "
                "replica.plan, or run auto_parallel under torchrun"
            )
        self._check_tensor_parallel()
        if self.world_size is not None and self.num_stages is not None and self.schedule != "auto":
            t = self.tensor_parallel_fixed()
            if t is not None:
                Layout.for_world(self.schedule, self.world_size, num_stages=self.num_stages,
                                 data_parallel_size=self.data_parallel_size, tensor_parallel_size=t)
            else:  # the tuner picks t: the stages must fit the world with one of them
                errors = []
                for t in [k for k in range(1, self.world_size + 1) if self.world_size % k == 0]:
                    try:
                        Layout.for_world(self.schedule, self.world_size, num_stages=self.num_stages,
                                         data_parallel_size=self.data_parallel_size, tensor_parallel_size=t)
                        break
                    except ConfigError as exc:
                        errors.append(exc)
                else:
                    raise errors[0]

    def _check_tensor_parallel(self) -> None:
        t = self.tensor_parallel_size
        if t is None or t == 1:
            return
        if self.world_size is None:
            raise ConfigError(
                f"tensor_parallel_size={t} needs a world of processes (each stage's blocks sharded over {t} "
                f"ranks): give world_size= to replica.plan, or run auto_parallel under torchrun")
        if self.world_size % t:
            raise ConfigError(
                f"tensor_parallel_size={t} does not divide world_size={self.world_size}: world_size = "
                f"data_parallel_size × pipeline ranks × tensor_parallel_size. Use tensor_parallel_size in "
                f"{[k for k in range(1, self.world_size + 1) if self.world_size % k == 0]}, or a world_size "
                f"that is a multiple of {t}")
        if self.sharded_data_parallel not in (None, False, "none"):
            raise ConfigError(
                f"tensor_parallel_size={t} with sharded_data_parallel={self.sharded_data_parallel!r}: sharded "
                "replicas over tensor-parallel stages (FSDP2 on a 2-D mesh) are not built yet; use "
                "sharded_data_parallel=None / False with tensor parallelism, or tensor_parallel_size=1")

    def tensor_parallel_fixed(self) -> int | None:
        """The tensor-parallel size the request fixes, or None where the tuner picks it:
        one process, a layout the request fixes (see :attr:`tuning`), replicas that must
        shard, and a per-rank batch whose replicas the request does not fix keep 1."""
        if self.tensor_parallel_size is not None:
            return self.tensor_parallel_size
        if self.world_size is None or not self.tuning or "none" not in self.shardings:
            return 1
        if self.batch == "per_rank" and self.data_parallel_size is None:
            return 1
        return None

    def tensor_parallel_choices(self, devices_per_node: int) -> tuple[int, ...]:
        """The tensor-parallel sizes the planner may use on a device of ``devices_per_node``."""
        t = self.tensor_parallel_fixed()
        if t is not None:
            return (t,)
        assert self.world_size is not None
        return tuple(tensor_parallel_choices(self.world_size, devices_per_node))

    @property
    def tuning(self) -> bool:
        """Whether the tuner searches: the schedule is "auto", or in a world the stage or
        micro-batch count is left open."""
        if self.schedule == "auto":
            return True
        return self.world_size is not None and (self.num_stages is None or self.num_microbatches is None)

    @property
    def shardings(self) -> tuple[str, ...]:
        """The shardings of the replicas the planner may choose from."""
        asked = self.sharded_data_parallel
        if asked is None:
            return SHARDINGS
        if isinstance(asked, str):
            return (asked,)
        return ("zero3", "zero2") if asked else ("none",)

    def replicas_fixed(self) -> int | None:
        """The data-parallel replicas the request fixes, or None where the tuner picks them."""
        if self.world_size is None:
            return 1
        if self.data_parallel_size is not None:
            return self.data_parallel_size
        t = self.tensor_parallel_fixed()
        if self.schedule != "auto" and self.num_stages is not None and t is not None:
            return Layout.for_world(self.schedule, self.world_size, num_stages=self.num_stages,
                                    tensor_parallel_size=t).data_parallel_size
        return None


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
    pricing = Pricing(traced, model, device=r.device, cost=r.cost, memory_budget=r.memory_budget,
                      memory_model=MemoryModel(optimizer=r.optimizer), precision=r.precision,
                      num_microbatches=r.num_microbatches, num_stages_hint=r.num_stages or r.world_size or 1,
                      graded=r.graded_microbatches, options=r.options, batch_scale=scale)
    full = r.recompute if isinstance(r.recompute, bool) or r.recompute is None else False
    rebuild = r.recompute is not False  # False keeps every activation: no rebuilds either
    if r.tuning:
        world = r.world_size if r.world_size is not None else (r.num_stages or 1)
        schedules = None if r.schedule == "auto" else (r.schedule,)
        best, _ = tune(lambda layout, m, within, again: pricing.partition_for(layout, m, within_budget=within,
                                                                                recompute=again, simulated=within),
                       lambda plan, layout, schedule: pricing.collectives(pricing.reshard(plan, layout), layout,
                                                                          schedule),
                       world_size=world, batch=pricing.global_batch, num_ops=len(traced.graph.op_nodes),
                       device=pricing.spec, memory_budget=pricing.budget_per_device(), num_stages=r.num_stages,
                       num_microbatches=r.num_microbatches, data_parallel_size=r.replicas_fixed(),
                       recompute=(False, True) if full is None else (full,), shardings=r.shardings,
                       tensor_parallel_sizes=_worth_cutting(pricing, r.tensor_parallel_choices(
                           pricing.spec.devices_per_node), r.tensor_parallel_size is not None),
                       options=r.options, **({} if schedules is None else {"schedules": schedules}))
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
        plan = _shard_fixed(pricing, layout, m, bool(full), r.shardings, r.options.tie)
    plan = finish(pricing, plan, pricing.batch_fraction(plan.layout), rebuild=rebuild)
    if r.recompute == "pointwise" and not plan.recompute:
        plan = dataclasses.replace(plan, pointwise_recompute=True)
    # the action lists, once, from the final plan: every rank, the simulator and the report read
    # them; with each action's predicted start, by which the ranks order their messages
    schedule = plan_schedule(plan)
    costs = stage_costs_from_plan(plan, schedule, device=pricing.first_spec())
    starts = {e.action: e.start_s for e in simulate(schedule, costs, sizes=plan.relative_microbatch_sizes).events}
    actions = tuple(tuple(str(a) for a in rank) for rank in schedule)
    action_starts = tuple(tuple(starts[a] for a in rank) for rank in schedule)
    # the traced graph's own fingerprint (a tensor-parallel plan is priced on a copy with cut shapes)
    return dataclasses.replace(plan, dynamic_dims=traced.dynamic_dims, actions=actions, action_starts=action_starts,
                               graph_fingerprint=fingerprint(traced.graph))


def _worth_cutting(pricing: Pricing, sizes: Sequence[int], asked: bool) -> tuple[int, ...]:
    """The tensor-parallel sizes worth pricing: 1, and those that cut at least one block
    (without one a tensor-parallel group only replicates its stage); all of them where the
    request fixed the size."""
    if asked:
        return tuple(sizes)
    return tuple(t for t in sizes if t == 1 or pricing.blocks_for(t))


def _check_shardable(r: PlanRequest) -> None:
    """A request that must shard names a layout sharding can run: replicas, and a schedule
    that does not split backward."""
    if r.schedule != "auto" and schedule_kind(r.schedule).splits_backward:
        raise ConfigError(
            f"sharded data parallelism (sharded_data_parallel={r.sharded_data_parallel!r}) cannot run the zero-bubble "
            f"schedule {r.schedule!r} yet: FSDP reduces a weight's gradient when autograd makes it, before a deferred "
            "W action. Use gpipe, 1f1b or interleaved with sharding, or schedule='auto'")
    if r.replicas_fixed() == 1:
        raise ConfigError(
            f"sharded_data_parallel={r.sharded_data_parallel!r} shards each stage over its data-parallel replicas, "
            "but this layout has one: give world_size= (and num_stages= or data_parallel_size=) that leaves "
            "replicas, or sharded_data_parallel=None / False")


def _shard_fixed(pricing: Pricing, layout: Layout, m: int, recompute: bool, shardings: Sequence[str],
                 tie: float) -> Plan:
    """The plan of a layout the request fixed, with the fastest of ``shardings`` it allows
    that fits (predictions within ``tie`` of it: whole replicas if among them, then the one
    holding least memory, as the tuner takes). Where none fits, the error of the leanest
    (zero3's, where it was tried)."""
    kind = schedule_kind(layout.schedule)
    allowed = [s for s in shardings if s == "none" or (layout.data_parallel_size > 1 and not kind.splits_backward
                                                      and layout.tensor_parallel_size == 1)]
    plans: list[Plan] = []
    errors: dict[str, PartitionError] = {}
    for sharding in allowed:
        try:
            plans.append(pricing.partition_for(dataclasses.replace(layout, sharding=sharding), m,
                                               recompute=recompute))
        except PartitionError as exc:
            errors[sharding] = exc
    if not plans:
        raise errors.get("zero3", next(iter(errors.values())))
    fastest = min(p.predicted_step_time_s for p in plans)
    near = [p for p in plans if p.predicted_step_time_s <= fastest * (1 + tie)]
    return min(near, key=lambda p: (p.layout.sharded, max(s.predicted_memory_bytes for s in p.stages),
                                    p.predicted_step_time_s))
