"""The front door: ``plan`` and ``auto_parallel`` tie tracing, partitioning and the runtime."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from replica.errors import ConfigError, PipelineError
from replica.partition.cost import CostModel, DeviceSpec, device_spec
from replica.partition.partitioner import MemoryModel, fingerprint, partition, saves_activation
from replica.partition.plan import Plan
from replica.partition.profile import profile
from replica.partition.trace import Traced, trace
from replica.pipeline import microbatch
from replica.pipeline.grading import MIN_GAIN, grade
from replica.pipeline.remat import REBUILT_OPS
from replica.pipeline.schedule import (
    INTERLEAVED,
    SCHEDULES,
    Schedule,
    V_SHAPED,
    make_schedule,
    max_in_flight,
    placement,
    splits_backward,
    stages_per_rank,
)
from replica.pipeline.simulate import StageCosts, simulate, stage_costs_from_plan
from replica.pipeline_model import LossFn, PipelineModel, _distributed, plan_schedule
from replica.tuner import SCHEDULE_CHOICES, TIE, tune

__all__ = ["auto_parallel", "plan", "PipelineModel"]

DeviceLike = "str | DeviceSpec | None"


def _check_count(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{name} must be a positive int or None, got {value!r}")


def _check_schedule(schedule: str) -> str:
    if not isinstance(schedule, str):
        raise ConfigError(f"schedule must be a string, got {type(schedule).__name__}")
    name = schedule.lower()
    if name == "auto":
        return name
    if name not in SCHEDULES and name not in INTERLEAVED and name not in V_SHAPED:
        raise ConfigError(
            f"unknown schedule {schedule!r}; choose one of "
            f"{sorted([*SCHEDULES, *INTERLEAVED, *V_SHAPED]) + ['auto']}"
        )
    return name


def _check_recompute(recompute: Any) -> tuple[bool | None, bool]:
    """``recompute`` as (full activation recompute: True / False / None for the tuner's
    choice, pointwise recompute: GELU / SiLU outputs rebuilt in backward)."""
    if recompute == "pointwise":
        return False, True
    if recompute is None or isinstance(recompute, bool):
        return recompute, False
    raise ConfigError(
        f"recompute must be True (keep only stage inputs, run the forward again in backward), "
        f"'pointwise' (rebuild GELU / SiLU outputs in backward), False or None (let the tuner decide), "
        f"got {recompute!r}"
    )


def _pointwise(plan: Plan, pointwise: bool) -> Plan:
    """The plan, rebuilding GELU / SiLU outputs in backward when asked (not under full recompute)."""
    return dataclasses.replace(plan, pointwise_recompute=True) if pointwise and not plan.recompute else plan


def _default_device(model: torch.nn.Module) -> str:
    for p in model.parameters():
        if p.device.type == "cuda":
            gpu = torch.cuda.get_device_name(p.device).lower()
            return "h100-80gb" if "h100" in gpu or "h200" in gpu else "a100-80gb"
        break
    return "cpu"


def _model_dtype(model: torch.nn.Module) -> str:
    counts: collections.Counter[str] = collections.Counter()
    for p in model.parameters():
        counts[str(p.dtype).removeprefix("torch.")] += p.numel()
    return counts.most_common(1)[0][0] if counts else "float32"


def _default_microbatches(batch: int, num_stages: int) -> int:
    """The largest divisor of the batch up to 4 × num_stages (bubble under 20%); 1 without a pipeline."""
    if num_stages == 1:
        return 1
    return max(d for d in range(1, min(batch, 4 * num_stages) + 1) if batch % d == 0)


def _is_real(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> bool:
    tensors = [*tree_leaves(inputs), *model.parameters()]
    return all(t.device.type != "meta" and type(t).__name__ != "FakeTensor" for t in tensors)


# A rebuild taken "for free" (api._Planner.rebuilds) must fit its stage's idle time at this
# many times its profiled price. Measured on 2 CPU ranks: rebuilds cost 2% of the step where
# 0.7% was predicted, and in a step a GELU ran 2.1x its profiled time against 1.4x for the
# stage as a whole (the other rank's core shares the machine); benchmarks/RESULTS.md.
REBUILD_RISK = 3.0


class _Planner:
    """Prices one traced model once (device specs, measured op times) and partitions it on
    demand for any stage count, micro-batch count, schedule and data-parallel share."""

    def __init__(self, traced: Traced, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], *, device: Any,
                 cost: str, memory_budget: float | Sequence[float] | None, memory_model: MemoryModel,
                 num_microbatches: int | None, num_stages_hint: int, graded: bool = True) -> None:
        if cost not in ("auto", "analytic", "profile"):
            raise ConfigError(f"cost must be 'auto', 'analytic' or 'profile', got {cost!r}")
        real = _is_real(model, inputs)
        if cost == "profile" and not real:
            raise ConfigError(
                "cost='profile' times every op on real tensors, but the model or example_inputs are on the meta "
                "device (or fake). Use cost='analytic' to plan without weights, or pass real tensors."
            )
        self.traced, self.memory_model = traced, memory_model
        self.graded = graded
        self.batch = microbatch.batch_size(inputs, "example_inputs")
        self.devices = list(device) if isinstance(device, (list, tuple)) else None
        self.spec = device_spec(device if device is not None and self.devices is None else
                                (self.devices[0] if self.devices else _default_device(model)))
        self.dtype = _model_dtype(model)
        self.measured = {}
        self.measured_fraction = 1.0
        if cost == "profile" or (cost == "auto" and real and device is None and num_stages_hint > 1):
            # Time each op on one micro-batch where the model lives: what the stages will run.
            m = min(self.batch, num_microbatches or _default_microbatches(self.batch, num_stages_hint))
            sample = microbatch.split(inputs, m, "example_inputs")[0]
            self.measured = profile(traced.module, sample)
            self.measured_fraction = microbatch.batch_size(sample) / self.batch
        self.memory_budget = memory_budget
        if memory_budget is None and not self.measured:
            self.memory_budget = self.spec.memory_bytes  # planning for accelerators: they must fit

    def budget_per_device(self) -> float:
        b = self.memory_budget
        return float("inf") if b is None else float(min(b) if isinstance(b, (list, tuple)) else b)

    def _early_fits(self, plan: Plan, where: dict[int, int]) -> bool:
        """Whether every rank still fits its budget holding, besides the plan's estimate, one
        micro-batch's activations more: what a backward keeps for its weight gradients while
        its input gradient goes to another rank first (any stage but the first may send one)."""
        held: dict[int, float] = {}
        extra: dict[int, float] = {}
        for st in plan.stages:
            r = where[st.stage_index]
            held[r] = held.get(r, 0.0) + st.predicted_memory_bytes
            if st.stage_index > 0:
                extra[r] = max(extra.get(r, 0.0), st.activation_bytes / plan.num_microbatches)
        return all(held[r] + extra.get(r, 0.0) <= self.budget_per_device() for r in held)

    def partition_for(self, num_stages: int, num_microbatches: int, schedule: str, replicas: int = 1,
                      num_ranks: int | None = None, batch_fraction: float = 1.0, within_budget: bool = True,
                      recompute: bool = False, graded: bool | None = None, finish: bool = True,
                      rebuild: bool = True) -> Plan:
        """The plan of one configuration; ``graded`` (default: as the planner was made) lets
        the micro-batch sizes be graded, ``rebuild`` lets stages rebuild cheap outputs.
        ``finish=False`` (the tuner's candidates) skips both: only the chosen plan gets them
        (:meth:`finish`)."""
        m = num_microbatches
        if m > self.batch:
            raise ConfigError(
                f"num_microbatches={m} but example_inputs have a batch of {self.batch}: each micro-batch needs at "
                f"least one sample. Use num_microbatches <= {self.batch}, or trace with a larger batch."
            )
        if self.devices is not None:
            if len(self.devices) != num_stages:
                raise ConfigError(f"{len(self.devices)} devices for num_stages={num_stages}: give one device per stage")
            specs = [device_spec(d) for d in self.devices]
        else:
            specs = [self.spec] * num_stages
        by_spec: dict[int, CostModel] = {}
        models = [by_spec.setdefault(id(sp), CostModel(sp, dtype=self.dtype, measured=self.measured,
                                                       batch_fraction=batch_fraction,
                                                       measured_fraction=self.measured_fraction))
                  for sp in specs]
        schedule_data = make_schedule(schedule, num_stages, m, num_ranks)
        where = placement(schedule_data)
        budget = self.memory_budget if within_budget else None
        result = partition(self.traced.graph, models, num_stages=num_stages, num_microbatches=m, schedule=schedule,
                           memory_model=dataclasses.replace(self.memory_model, recompute=recompute),
                           memory_budget=budget,
                           in_flight=max_in_flight(schedule_data, num_stages),
                           stage_ranks=[where[k] for k in range(num_stages)])
        result = dataclasses.replace(result, early_input_grads=not recompute and self._early_fits(result, where))
        if splits_backward(schedule_data):  # order the zero-bubble actions by this plan's own times
            schedule_data = plan_schedule(result, num_ranks)
        timeline = simulate(schedule_data, stage_costs_from_plan(result, schedule_data, device=specs[0]))
        result = dataclasses.replace(
            result, data_parallel_size=replicas, predicted_step_time_s=timeline.step_time_s,
            simulated_bubble=timeline.bubble_fraction,
            pipeline_ranks=len(schedule_data),
            model_flops=3 * self.traced.graph.total_flops * batch_fraction * replicas,
            device_peak_flops=self.spec.datasheet_flops,  # 0 for a CPU: no utilisation figure
        )
        return self.finish(result, batch_fraction, graded, rebuild) if finish else result

    def finish(self, plan: Plan, batch_fraction: float = 1.0, graded: bool | None = None,
               rebuild: bool = True) -> Plan:
        """The chosen plan made final: micro-batches graded (unless ``graded`` is False, or
        the planner was made without), then rebuilds where they pay for the graded sizes'
        memory (:meth:`pay_for_grading`), then where they are as good as free in what time
        is left (:meth:`rebuilds`): needed memory first, unasked memory only from true idle
        time; unless ``rebuild`` is False: ``recompute=False`` keeps every activation."""
        graded = self.graded if graded is None else graded
        shaped = self.graded_plan(plan, batch_fraction) if graded else plan
        if not rebuild:
            return shaped
        paid = shaped if shaped is plan else self.pay_for_grading(shaped, plan, batch_fraction)
        return self.rebuilds(paid, batch_fraction)

    def rebuilds(self, plan: Plan, batch_fraction: float = 1.0) -> Plan:
        """``plan`` with ``rebuilds``: the (stage, kind) pairs whose op outputs (GELU / SiLU,
        LayerNorm) are rebuilt in backward (:mod:`replica.pipeline.remat`) instead of kept,
        where the rebuild fills time the stage would spend waiting for a slower one: a pair
        is taken if its stage, rebuild added, stays no slower than the plan's slowest stage
        and the simulated step within ``TIE`` of the plan's (predictions that close are a
        tie the least memory wins, as in the tuner). The stages with the most idle time go
        first, and on each the most bytes per second of rebuild. The slowest stage rebuilds
        nothing: measured, rebuilding GELU outputs there cost 2% of the step where the model
        predicted 0.7% (benchmarks/RESULTS.md). For the same reason a free rebuild must fit
        its stage's idle time at ``REBUILD_RISK`` times its price: a memory nobody asked for
        is not worth a bet on the model's idle time. A GELU's output is a quarter of a transformer
        layer's activations, each norm's a sixteenth. A taken pair adds its rebuild to the
        stage's predicted backward and takes its outputs off the stage's activations (held
        as often as the plan holds the stage's micro-batches)."""
        found = self._rebuild_candidates(plan, batch_fraction)
        if not found:
            return plan  # nothing kept to rebuild; rebuilt everywhere already; nobody waits
        step_time = self._step_time(plan)
        base = step_time(plan)
        # the rebuilds the plan has (paying for graded sizes) stay; risked: those taken here
        # priced at REBUILD_RISK times
        taken, best, risked = list(plan.rebuilds), plan, plan
        for k, kind in sorted(found, key=lambda key: (plan.stages[key[0]].predicted_time_s,
                                                      -found[key][1] / max(found[key][0], 1e-12))):
            seconds, nbytes = found[(k, kind)]
            trial = self._with_rebuild(risked, k, seconds * REBUILD_RISK, nbytes)
            if trial.stages[k].predicted_time_s > plan.bottleneck_s:
                continue  # it would not fill a wait but lengthen the slowest stage
            if step_time(trial) <= base * (1 + TIE):
                taken.append((k, kind))
                best, risked = self._with_rebuild(best, k, seconds, nbytes), trial
        if best is plan:
            return plan
        return dataclasses.replace(best, rebuilds=tuple(sorted(taken)),
                                   predicted_step_time_s=plan.predicted_step_time_s + step_time(best) - base)

    def pay_for_grading(self, plan: Plan, even: Plan, batch_fraction: float = 1.0) -> Plan:
        """``plan`` (graded, nothing rebuilt yet) with rebuilds where its graded micro-batches
        make a rank hold more than ``even`` (the same stages with even micro-batches, nothing
        rebuilt) would at its simulated peak, as far as the grading's time gain pays for
        them: the step stays at least ``MIN_GAIN`` shorter than even's.

        The larger middle micro-batches raise the peak of a rank that holds several at once
        (the first of 1F1B holds two on two ranks: 5 + 5 samples of 32 instead of 4 + 4).
        Such a rank rebuilds, most bytes per second first, on its stages but the plan's
        slowest (see :meth:`rebuilds`), even where that makes the stage a little slower than
        a free rebuild may. A rank that runs out of candidates keeps the rest of its peak."""
        found = self._rebuild_candidates(plan, batch_fraction)
        schedule = plan_schedule(plan)
        where = placement(schedule)
        costs = self._stage_costs(schedule)
        sizes = plan.relative_microbatch_sizes
        even_timeline = simulate(schedule, costs(even))
        limit, ceiling = even_timeline.peak_memory_bytes, even_timeline.step_time_s * (1 - MIN_GAIN)
        start = timeline = simulate(schedule, costs(plan), sizes=sizes)
        taken, best = list(plan.rebuilds), plan
        over = {r for r, peak in enumerate(timeline.peak_memory_bytes) if peak > limit[r]}
        options = [key for key in found if even.stages[key[0]].predicted_time_s < even.bottleneck_s]
        while over:
            options = [key for key in options if where[key[0]] in over]
            if not options:
                break
            key = max(options, key=lambda key: found[key][1] / max(found[key][0], 1e-12))
            options.remove(key)
            trial = self._with_rebuild(best, key[0], *found[key])
            t = simulate(schedule, costs(trial), sizes=sizes)
            if t.step_time_s > ceiling:
                continue  # the grading would no longer pay for itself
            best, timeline = trial, t
            taken.append(key)
            over = {r for r in over if timeline.peak_memory_bytes[r] > limit[r]}
        if best is plan:
            return plan
        return dataclasses.replace(best, rebuilds=tuple(sorted(taken)), predicted_step_time_s=(
            plan.predicted_step_time_s + timeline.step_time_s - start.step_time_s))

    def _rebuild_candidates(self, plan: Plan, batch_fraction: float) -> dict[tuple[int, str], tuple[float, int]]:
        """(stage, kind) -> (seconds per step, bytes per micro-batch) of rebuilding that kind's
        kept outputs on that stage; nothing under full or pointwise recompute, or on one stage."""
        found: dict[tuple[int, str], tuple[float, int]] = {}
        if plan.recompute or plan.pointwise_recompute or plan.num_stages == 1:
            return found
        by_name = {n.name: n for n in self.traced.graph.nodes}
        specs = [device_spec(d) for d in self.devices] if self.devices else [self.spec] * plan.num_stages
        for st, sp in zip(plan.stages, specs):
            cm = CostModel(sp, dtype=self.dtype, measured=self.measured, batch_fraction=batch_fraction,
                           measured_fraction=self.measured_fraction)
            for name in st.node_names:
                n = by_name[name]
                kind = REBUILT_OPS.get(n.target)
                if kind is not None and saves_activation(n) and (st.stage_index, kind) not in plan.rebuilds:
                    seconds, nbytes = found.get((st.stage_index, kind), (0.0, 0))
                    found[(st.stage_index, kind)] = (seconds + cm.forward_time(n, plan.num_microbatches),
                                                     nbytes + int(cm.scaled(n.output_bytes)))
        return found

    @staticmethod
    def _with_rebuild(plan: Plan, k: int, seconds: float, nbytes: int) -> Plan:
        """``plan`` with stage ``k`` rebuilding ``nbytes`` of outputs in ``seconds`` more backward."""
        st = plan.stages[k]
        received = sum(b.nbytes for b in st.inputs)
        held = nbytes * (st.memory.activations - received) / st.activation_bytes if st.activation_bytes else 0
        stage = dataclasses.replace(
            st, backward_time_s=st.backward_time_s + seconds, activation_bytes=st.activation_bytes - nbytes,
            memory=dataclasses.replace(st.memory, activations=int(st.memory.activations - held)))
        return dataclasses.replace(plan, stages=tuple(stage if s.stage_index == k else s for s in plan.stages))

    def _stage_costs(self, schedule: Schedule) -> Callable[[Plan], list[StageCosts]]:
        """A plan's per-micro-batch stage costs under ``schedule`` on this planner's device."""
        device = device_spec(self.devices[0]) if self.devices else self.spec
        return lambda p: stage_costs_from_plan(p, schedule, device=device)

    def _step_time(self, plan: Plan) -> Callable[[Plan], float]:
        """The simulated step of a plan like ``plan`` (same schedule and micro-batch sizes)."""
        schedule = plan_schedule(plan)
        costs = self._stage_costs(schedule)
        sizes = plan.relative_microbatch_sizes
        return lambda p: simulate(schedule, costs(p), sizes=sizes).step_time_s

    def graded_plan(self, plan: Plan, batch_fraction: float = 1.0) -> Plan:
        """``plan`` with graded micro-batch shares when the simulator says they beat even ones
        (its predicted step shortened by what they save), else ``plan`` itself."""
        m = plan.num_microbatches
        if plan.num_stages == 1 or m < 2:
            return plan
        schedule = plan_schedule(plan)
        device = device_spec(self.devices[0]) if self.devices else self.spec
        costs = stage_costs_from_plan(plan, schedule, device=device)
        batch = max(m, round(self.batch * batch_fraction))
        sizes, step, even = grade(schedule, costs, batch, m, memory_limit=self.budget_per_device())
        if len(set(sizes)) == 1:
            return plan
        timeline = simulate(schedule, costs, sizes=[s * m / batch for s in sizes])
        return dataclasses.replace(
            plan, microbatch_shares=tuple(s / batch for s in sizes), simulated_bubble=timeline.bubble_fraction,
            predicted_step_time_s=max(0.0, plan.predicted_step_time_s - (even - step)),
        )


def _wants_tuning(num_stages: int | None, num_microbatches: int | None, schedule: str | None) -> bool:
    return schedule == "auto" or num_stages is None or num_microbatches is None


def plan(
    model: torch.nn.Module,
    example_inputs: Any = (),
    *,
    example_kwargs: dict[str, Any] | None = None,
    world_size: int | None = None,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    schedule: str = "1f1b",
    device: Any = None,
    leaf_modules: Iterable[type | str | torch.nn.Module] = (),
    cost: str = "auto",
    memory_budget: float | Sequence[float] | None = None,
    optimizer: str = "adam",
    mixed_precision: bool = False,
    recompute: bool | str | None = None,
    tracer: str = "auto",
    graded_microbatches: bool = True,
) -> Plan:
    """Plan only: trace ``model`` (meta tensors welcome), price it on ``device`` and cut it.

    ``num_stages`` defaults to ``world_size`` (one stage per device), else 1; a
    ``num_stages`` that divides ``world_size`` leaves data-parallel replicas. ``device``
    is a preset name, a ``DeviceSpec``, or one per stage (heterogeneous pipelines).
    ``cost``: ``"profile"`` times every op here on real tensors, ``"analytic"`` prices
    FLOPs and bytes on ``device``'s spec; ``"auto"`` profiles when the model and inputs
    are real and no other ``device`` is named. ``memory_budget`` (bytes per device, or
    one per stage; default the device's memory when planning analytically) bounds
    weights + gradients + ``optimizer`` state (+ fp32 master weights with
    ``mixed_precision``) + in-flight activations of every stage; ``recompute`` keeps only
    stage inputs and recomputes activations in backward (None: the tuner decides, and
    stages rebuild GELU / SiLU / LayerNorm outputs in backward where the simulator finds
    that within 1% of the step, or where graded micro-batches raised a rank's peak and
    their time gain pays for it, ``Plan.rebuilds``; False: neither);
    ``recompute="pointwise"`` rebuilds them regardless of the time, on the stages
    that hold several micro-batches or send input gradients first (bitwise the same
    gradients; 3 MiB per layer per 4-sample micro-batch less on a d=256 GPT, under 1% more
    time; the memory estimate of this opt-in still counts those outputs).
    ``tracer``: ``"fx"``, ``"export"`` (``torch.export``, for what fx cannot trace) or
    ``"auto"`` (fx, then export). ``graded_microbatches`` lets the planner make the
    micro-batches where the pipeline fills and drains smaller (and the middle ones larger)
    when the simulator says the step gets at least 1% shorter (rebuilds paying for the
    memory the larger ones add, as far as that gain allows); gradients stay exact.
    """
    _check_count("world_size", world_size)
    _check_count("num_stages", num_stages)
    _check_count("num_microbatches", num_microbatches)
    schedule = _check_schedule(schedule)
    rebuild = recompute is not False  # False keeps every activation: no rebuilds either
    recompute, pointwise = _check_recompute(recompute)
    traced = trace(model, example_inputs, example_kwargs=example_kwargs, leaf_modules=leaf_modules, tracer=tracer)
    inputs = traced.example
    memory_model = MemoryModel(optimizer=optimizer, mixed_precision=mixed_precision)
    planner = _Planner(traced, model, inputs, device=device, cost=cost, memory_budget=memory_budget,
                       memory_model=memory_model, num_microbatches=num_microbatches,
                       num_stages_hint=num_stages or world_size or 1, graded=graded_microbatches)
    if world_size is not None and num_stages is not None and schedule != "auto":
        _layout(schedule, num_stages, None, world_size)  # num_stages must fit the world
    if world_size is not None and _wants_tuning(num_stages, num_microbatches, schedule):
        return _pointwise(_tuned(planner, world_size, global_batch=True, num_stages=num_stages,
                                 num_microbatches=num_microbatches, schedule=schedule, data_parallel_size=None,
                                 recompute=recompute, rebuild=rebuild), pointwise)
    name = "1f1b" if schedule == "auto" else schedule
    stages, ranks, replicas = num_stages or stages_per_rank(name), None, 1
    if world_size is not None:
        stages, ranks, replicas = _layout(name, num_stages, None, world_size)
    return _pointwise(_fixed(planner, stages, ranks, replicas, num_microbatches, name, global_batch=True,
                             recompute=bool(recompute), rebuild=rebuild), pointwise)


def _fixed(planner: _Planner, stages: int, ranks: int | None, replicas: int, num_microbatches: int | None,
           schedule: str, *, global_batch: bool, recompute: bool = False, rebuild: bool = True) -> Plan:
    """The plan of one given configuration."""
    share = planner.batch // replicas if global_batch else planner.batch
    if global_batch and planner.batch % replicas:
        raise ConfigError(f"a global batch of {planner.batch} does not split over {replicas} data-parallel replicas")
    m = num_microbatches or _default_microbatches(share, stages)
    if m > share:
        raise ConfigError(
            f"num_microbatches={m} but each replica has a batch of {share}: each micro-batch needs at least one "
            f"sample. Use num_microbatches <= {share}, or a larger batch."
        )
    return planner.partition_for(stages, m, schedule, replicas, num_ranks=ranks,
                                 batch_fraction=1 / replicas if global_batch else 1.0, recompute=recompute,
                                 rebuild=rebuild)


def _tuned(planner: _Planner, world_size: int, *, global_batch: bool, num_stages: int | None,
           num_microbatches: int | None, schedule: str, data_parallel_size: int | None,
           recompute: bool | None = None, rebuild: bool = True) -> Plan:
    """The fastest configuration of ``world_size`` devices that fits, by simulation."""
    schedules = SCHEDULE_CHOICES if schedule == "auto" else (schedule,)

    def partition_for(stages: int, m: int, name: str, replicas: int, within_budget: bool, again: bool) -> Plan:
        return planner.partition_for(stages, m, name, replicas, num_ranks=stages // stages_per_rank(name),
                                     batch_fraction=1 / replicas if global_batch else 1.0,
                                     within_budget=within_budget, recompute=again,
                                     finish=False)  # candidates even; the winner is finished below

    best, _ = tune(partition_for, world_size=world_size, batch=planner.batch, num_ops=len(planner.traced.graph.op_nodes),
                   device=planner.spec, memory_budget=planner.budget_per_device(), num_stages=num_stages,
                   num_microbatches=num_microbatches, schedules=schedules, data_parallel_size=data_parallel_size,
                   global_batch=global_batch, recompute=(False, True) if recompute is None else (recompute,))
    return planner.finish(best, 1 / best.data_parallel_size if global_batch else 1.0, rebuild=rebuild)


def _layout(
    schedule: str, num_stages: int | None, data_parallel_size: int | None, world_size: int
) -> tuple[int, int, int]:
    """``(num_stages, num_pipeline_ranks, data_parallel_size)`` for ``world_size`` processes."""
    v = stages_per_rank(schedule)
    if schedule in V_SHAPED:
        d = data_parallel_size or 1
        if world_size % d:
            raise ConfigError(f"data_parallel_size={d} does not divide the world size {world_size}")
        p = world_size // d
        if num_stages not in (None, 2 * p):
            raise ConfigError(
                f"schedule {schedule!r} puts two stages on each of the {p} pipeline ranks in a V: "
                f"num_stages must be {2 * p}, got {num_stages}"
            )
        return 2 * p, p, d
    if schedule in INTERLEAVED:
        d = data_parallel_size or 1
        if world_size % d:
            raise ConfigError(f"data_parallel_size={d} does not divide the world size {world_size}")
        p = world_size // d
        stages = num_stages or v * p
        if stages % p or stages == p:
            raise ConfigError(
                f"schedule {schedule!r} with {p} pipeline ranks needs num_stages a multiple of {p} larger "
                f"than {p} (several stages per rank), got {stages}; use num_stages={v * p}"
            )
        return stages, p, d
    if num_stages is None:
        d = data_parallel_size or 1
        if world_size % d:
            raise ConfigError(f"data_parallel_size={d} does not divide the world size {world_size}")
        return world_size // d, world_size // d, d
    if world_size % num_stages:
        raise ConfigError(
            f"num_stages={num_stages} does not divide the world size {world_size}: with one stage per rank, "
            f"world_size = num_stages × data-parallel replicas. Use num_stages in "
            f"{[k for k in range(1, world_size + 1) if world_size % k == 0]}"
        )
    d = world_size // num_stages
    if data_parallel_size not in (None, d):
        raise ConfigError(
            f"num_stages={num_stages} on {world_size} ranks leaves {d} data-parallel replicas, "
            f"not data_parallel_size={data_parallel_size}"
        )
    return num_stages, num_stages, d


def _use_the_model_device(model: torch.nn.Module) -> None:
    """Under NCCL, make the model's GPU this process's current one, so the set-up's object
    collectives (the plan, the graph's fingerprint) run there and not all on GPU 0; a model
    NCCL cannot carry is refused before any collective can hang on it."""
    if dist.get_backend() != "nccl":
        return
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ConfigError(
            f"the process group runs NCCL, which carries only CUDA tensors, but the model is on {device}. Move it "
            "to this rank's GPU first (model.to(torch.device('cuda', int(os.environ['LOCAL_RANK'])))), or start "
            "the group with init_process_group('gloo') to train on CPUs."
        )
    if device.index is not None:
        torch.cuda.set_device(device)


def _agree_on_plan(plan: Plan | None, traced: Traced) -> Plan:
    """Rank 0's plan, on every rank; every rank's traced graph must be the one it was made for."""
    payload = [plan.to_json() if plan is not None else None]
    dist.broadcast_object_list(payload, src=0)
    agreed = Plan.from_json(payload[0])
    mine = fingerprint(traced.graph)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    odd = [r for r, f in enumerate(everyone) if f != agreed.graph_fingerprint]
    if odd:
        raise ConfigError(
            f"ranks {odd} traced a different model (graph fingerprints {[everyone[r] for r in odd]}) than rank 0 "
            f"({agreed.graph_fingerprint}). Every rank must build the same model with the same example input "
            "shapes, leaf modules and seed-independent structure."
        )
    return agreed


def auto_parallel(
    model: torch.nn.Module,
    example_inputs: Any = (),
    *,
    example_kwargs: dict[str, Any] | None = None,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    schedule: str | None = None,
    loss_fn: LossFn | None = None,
    loss_reduction: str = "mean",
    data_parallel_size: int | None = None,
    device: "str | DeviceSpec | None" = None,
    leaf_modules: Iterable[type | str] = (),
    plan: Plan | None = None,
    cost: str = "auto",
    memory_budget: float | Sequence[float] | None = None,
    recompute: bool | str | None = None,
    tracer: str = "auto",
    graded_microbatches: bool = True,
    timeout_s: float = 300.0,
) -> "PipelineModel":
    """Trace, price, partition and split ``model`` into a pipeline.

    In one process every stage runs here (the reference runtime). Under
    ``torch.distributed`` (``torchrun``, or ``init_process_group``) every rank calls
    this alike: rank 0 plans, every rank checks it traced the same graph, and each
    keeps only its own stages; ``world_size = pipeline ranks × data_parallel_size``.

    ``loss_fn(output, target)`` must return the loss of a micro-batch reduced as
    ``loss_reduction`` says (``"mean"`` over the samples, as the default of torch's
    losses, or ``"sum"``); the pipeline weighs micro-batches so the gradient equals
    the whole batch's. ``plan`` reuses a plan (e.g. ``Plan.from_json``) instead of
    solving again; ``schedule`` defaults to ``"1f1b"`` (or the plan's). ``cost`` is as for
    :func:`plan`, and so are ``memory_budget``, ``recompute`` and ``tracer``. ``timeout_s`` bounds every wait on
    another rank.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not any(True for _ in model.parameters()):
        raise ConfigError(
            f"{type(model).__name__} has no parameters: there is nothing to train, so nothing to pipeline. "
            "Pass the model that owns the weights (or run it directly)."
        )
    _check_count("num_stages", num_stages)
    _check_count("num_microbatches", num_microbatches)
    _check_count("data_parallel_size", data_parallel_size)
    if getattr(model, "_replica_released", False):
        raise ConfigError(
            f"this {type(model).__name__} already went through a distributed auto_parallel on this rank, which "
            "freed the weights of the stages other ranks hold. Build (or load) the model again before "
            "pipelining it again, or keep using the first PipelineModel."
        )
    if plan is not None:
        for name, given, planned in (("num_stages", num_stages, plan.num_stages),
                                     ("num_microbatches", num_microbatches, plan.num_microbatches),
                                     ("schedule", schedule, plan.schedule)):
            if given is not None and given != planned:
                raise ConfigError(
                    f"{name}={given!r} disagrees with the plan passed in, which has {name}={planned!r}; "
                    f"leave {name} out to use the plan's, or re-plan"
                )
        schedule = plan.schedule
    schedule = _check_schedule("1f1b" if schedule is None else schedule)
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(f"loss_fn must be callable(output, target) -> scalar tensor, got {type(loss_fn).__name__}")
    if loss_reduction not in ("mean", "sum"):
        raise ConfigError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    if not timeout_s > 0:
        raise ConfigError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    rebuild = recompute is not False  # False keeps every activation: no rebuilds either
    recompute, pointwise = _check_recompute(recompute)
    traced = trace(model, example_inputs, example_kwargs=example_kwargs, leaf_modules=leaf_modules, tracer=tracer)
    inputs = traced.example
    world = dist.get_world_size() if _distributed() else 1
    if world > 1:
        _use_the_model_device(model)
    if plan is None and world > 1 and num_stages is not None and schedule != "auto":
        _layout(schedule, num_stages, data_parallel_size, world)  # on every rank: num_stages must fit the world
    if plan is None and (world == 1 or dist.get_rank() == 0):
        planner = _Planner(traced, model, inputs, device=device, cost=cost, memory_budget=memory_budget,
                           memory_model=MemoryModel(), num_microbatches=num_microbatches,
                           num_stages_hint=num_stages or world, graded=graded_microbatches)
        if world > 1 and _wants_tuning(num_stages, num_microbatches, schedule):
            plan = _tuned(planner, world, global_batch=False, num_stages=num_stages,
                          num_microbatches=num_microbatches, schedule=schedule,
                          data_parallel_size=data_parallel_size, recompute=recompute, rebuild=rebuild)
        elif world == 1 and schedule == "auto":
            plan = _tuned(planner, num_stages or 1, global_batch=False, num_stages=num_stages,
                          num_microbatches=num_microbatches, schedule=schedule, data_parallel_size=1,
                          recompute=recompute, rebuild=rebuild)
        else:
            name = "1f1b" if schedule == "auto" else schedule
            if world > 1:
                stages, ranks, replicas = _layout(name, num_stages, data_parallel_size, world)
            else:
                stages = num_stages or stages_per_rank(name)
                ranks, replicas = max(1, stages // stages_per_rank(name)), 1
            plan = _fixed(planner, stages, ranks, replicas, num_microbatches, name, global_batch=False,
                          recompute=bool(recompute), rebuild=rebuild)
    elif plan is not None and world > 1:
        _layout(plan.schedule, plan.num_stages, plan.data_parallel_size, world)  # the plan must fit this world
    if plan is not None:  # rank 0 (or every rank, given a plan): the others receive it
        plan = _pointwise(plan, pointwise)
    try:
        if world > 1:
            plan = _agree_on_plan(plan, traced)
        assert plan is not None
        ranks = plan.pipeline_ranks or max(1, plan.num_stages // stages_per_rank(plan.schedule))
        return PipelineModel(model, traced, plan, loss_fn=loss_fn,
                             loss_reduction=loss_reduction, num_pipeline_ranks=ranks, timeout_s=timeout_s)
    except RuntimeError as exc:  # a collective of the set-up failed: a peer died or hung
        raise PipelineError(
            f"setting up the pipeline on rank {dist.get_rank()} of {world} failed while the ranks exchanged the "
            f"plan and built their process groups: {type(exc).__name__}: {str(exc).splitlines()[0]}. Another "
            "rank died, hung, or never called auto_parallel."
        ) from exc
