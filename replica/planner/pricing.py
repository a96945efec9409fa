"""Prices a traced model once (its device, its dtype, measured op times) and cuts it for any layout."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_leaves

from replica.errors import ConfigError
from replica.layout import Layout
from replica.partition.autocast import autocast_graph, target_device_type
from replica.partition.cost import (
    CostModel,
    DeviceSpec,
    TensorParallelCosts,
    device_spec,
    float8_linears,
    fused_ops,
    preset_for_cuda_device,
    torch_device_of,
)
from replica.partition.experts import ExpertBlock, find_expert_blocks
from replica.partition.graph import Graph
from replica.partition.partitioner import MemoryModel, fsdp_unit, partition, reshard
from replica.partition.plan import Plan
from replica.partition.profile import profile
from replica.partition.sequence_parallel import sequence_region
from replica.partition.tensor_parallel import ShardedBlock, find_blocks
from replica.partition.trace import Traced
from replica.planner.compiling import FLOAT8_SPEEDUP, check_float8, compile_choice
from replica.planner.costs import rank_memory, stage_costs_from_plan
from replica.planner.dataparallel import StageWeights, with_collectives
from replica.planner.experts import (
    expert_choices,
    expert_memory,
    routing_counts,
    sharded_experts_graph,
    stage_expert_costs,
    state_per_byte,
    with_expert_times,
)
from replica.planner.options import PlannerOptions
from replica.planner.sequence_parallel import sequence_costs, sequence_graph
from replica.planner.tensor_parallel import (
    MEMORY_SHARE,
    blocks_for,
    sharded_costs,
    sharded_graph,
    together,
)
from replica.precision import autocast_dtype
from replica.runtime import microbatch
from replica.schedules.schedule import (
    Schedule,
    make_schedule,
    max_in_flight,
    placement,
    plan_schedule,
    splits_backward,
)
from replica.schedules.simulate import simulate
from replica.units import format_bytes

__all__ = ["Pricing", "default_microbatches"]


def default_device(model: torch.nn.Module) -> str:
    """The preset of the device the model's weights are on (a CPU, or a known GPU)."""
    for p in model.parameters():
        if p.device.type == "cuda":
            return preset_for_cuda_device(torch.cuda.get_device_name(p.device))
        break
    return "cpu"


def model_dtype(model: torch.nn.Module) -> str:
    """The dtype most of the model's parameter elements have."""
    counts: collections.Counter[str] = collections.Counter()
    for p in model.parameters():
        counts[str(p.dtype).removeprefix("torch.")] += p.numel()
    return counts.most_common(1)[0][0] if counts else "float32"


def default_microbatches(batch: int, num_stages: int) -> int:
    """The largest divisor of the batch up to 4 × num_stages (bubble under 20%); 1 without a pipeline."""
    if num_stages == 1:
        return 1
    return max(d for d in range(1, min(batch, 4 * num_stages) + 1) if batch % d == 0)


def is_real(model: torch.nn.Module, inputs: tuple[Any, ...]) -> bool:
    """Whether the model and inputs hold real data (not meta or fake tensors): what profiling needs."""
    tensors = [*tree_leaves(inputs), *model.parameters()]
    return all(t.device.type != "meta" and type(t).__name__ != "FakeTensor" for t in tensors)


class Pricing:
    """Prices one traced model once (device specs, measured op times) and partitions it on
    demand for any layout and micro-batch count. ``batch`` is the traced batch; the global
    batch is ``batch_scale`` times that (each replica's batch was traced: ``batch="per_rank"``).
    Under a ``precision`` of "bf16" / "fp16" the graph priced is the traced one as it runs
    under the device's autocast (:func:`~replica.partition.autocast.autocast_graph`), and a
    profile times each op under that autocast too. Sharded replicas gather the weights in
    that half precision (FSDP's ``MixedPrecisionPolicy.param_dtype``). A layout with
    ``tensor_parallel_size`` t > 1 is priced on the graph one rank of its group holds, with
    its blocks' collectives (:mod:`replica.planner.tensor_parallel`): :meth:`graph_for`,
    :meth:`cost_model`; the blocks are found once, when a layout first asks for them. ``compile``
    (True, False, or None: :func:`~replica.planner.compiling.compile_choice`'s rule) prices
    compiled stages: their fused pointwise ops free (:func:`~replica.partition.cost.fused_ops`);
    ``float8`` prices the linears at an SM90 GPU's float8 rate (refused on any other device).
    ``grad_sync`` (sharded replicas: "step", "microbatch", or None: :meth:`sync_grads` chooses per
    pipeline rank) says when a sharded stage reduce-scatters its gradients."""

    def __init__(self, traced: Traced, model: torch.nn.Module, *, device: Any, cost: str,
                 memory_budget: float | Sequence[float] | None, memory_model: MemoryModel,
                 num_microbatches: int | None, num_stages_hint: int, graded: bool = True,
                 options: PlannerOptions = PlannerOptions(), batch_scale: int = 1, precision: str = "fp32",
                 compile: bool | None = False, float8: bool = False, grad_sync: str | None = None) -> None:
        if cost not in ("auto", "analytic", "profile"):
            raise ConfigError(f"cost must be 'auto', 'analytic' or 'profile', got {cost!r}")
        inputs = traced.example
        real = is_real(model, inputs)
        if cost == "profile" and not real:
            raise ConfigError(
                "cost='profile' times every op on real tensors, but the model or example_inputs are on the meta "
                "device (or fake). Use cost='analytic' to plan without weights, or pass real tensors."
            )
        half = autocast_dtype(precision)
        self.traced = traced
        self.memory_model = dataclasses.replace(
            memory_model, gather_dtype=None if half is None else str(half).removeprefix("torch."))
        self._weights: dict[tuple[int, int, int, tuple[str, ...]], StageWeights] = {}
        self._blocks: list[ShardedBlock] | None = None
        self._experts: tuple[ExpertBlock, ...] | None = None
        self._routing: dict[str, list[int]] | None = None
        self._graphs: dict[tuple[int, bool, int], Graph] = {}
        self._tp_costs: dict[tuple[int, bool], TensorParallelCosts | None] = {}
        self._cut: dict[int, tuple[ShardedBlock, ...]] = {}
        self._sequence: dict[int, tuple[tuple[str, int], ...]] = {}
        self._models: dict[tuple[DeviceSpec, float, int, bool], CostModel] = {}
        self._work: dict[tuple[int, int, int, bool, bool], float] = {}
        self._positions: dict[tuple[int, bool], dict[str, int]] = {}
        self._shapes: dict[tuple[str, int, int, int], tuple[dict[int, int], list[int]]] = {}
        self.graded, self.options = graded, options
        self.grad_sync = grad_sync
        self.batch = microbatch.batch_size(inputs, "example_inputs")
        self.batch_scale = batch_scale
        self.global_batch = self.batch * batch_scale
        self.devices = list(device) if isinstance(device, (list, tuple)) else None
        self.spec: DeviceSpec = device_spec(device if device is not None and self.devices is None else
                                            (self.devices[0] if self.devices else default_device(model)))
        self.dtype = model_dtype(model)
        self.precision = precision
        # compiled stages: priced with their fused pointwise ops (cost.fused_ops)
        weights_on = next((p.device.type for p in model.parameters()), "cpu")
        check_float8(float8, self.spec)
        self.compiled, self.compile_note = compile_choice(compile, self.spec, weights_on, float8)
        self.float8 = float8
        self.graph = autocast_graph(traced, model, target_device_type(self.spec), precision, real=real)
        self.measured: dict[Any, Any] = {}
        self.measured_fraction = 1.0
        here = device is None or torch_device_of(device) is not None  # priced as the device the model runs on
        # "auto" times ops on a CPU only: on a GPU, benchmarks/gpu_check.py measured op-by-op timing
        # 1.3-2.3x over the real step (each op timed alone pays its launch and autograd's overhead,
        # which a stage's stream of kernels hides), the GPU's preset within 11% in fp32
        on_cpu = target_device_type(self.spec) == "cpu"
        if cost == "profile" or (cost == "auto" and real and here and on_cpu and num_stages_hint > 1):
            # Time each op on one micro-batch where the model lives: what the stages will run.
            m = min(self.batch, num_microbatches or default_microbatches(self.batch, num_stages_hint))
            sample = microbatch.split(inputs, m, "example_inputs")[0]
            self.measured = profile(traced.module, sample, precision=precision)
            self.measured_fraction = microbatch.batch_size(sample) / self.batch
        self.memory_budget = memory_budget
        if memory_budget is None and not self.measured:
            self.memory_budget = self.spec.memory_bytes  # planning for accelerators: they must fit

    def budget_per_device(self) -> float:
        b = self.memory_budget
        return float("inf") if b is None else float(min(b) if isinstance(b, (list, tuple)) else b)

    def specs(self, num_stages: int) -> list[DeviceSpec]:
        """One device spec per stage."""
        if self.devices is None:
            return [self.spec] * num_stages
        if len(self.devices) != num_stages:
            raise ConfigError(f"{len(self.devices)} devices for num_stages={num_stages}: give one device per stage")
        return [device_spec(d) for d in self.devices]

    def first_spec(self) -> DeviceSpec:
        """The spec the simulator prices transfers with: the first stage's device."""
        return device_spec(self.devices[0]) if self.devices else self.spec

    def batch_fraction(self, layout: Layout) -> float:
        """A replica's batch over the traced one: what the cost models scale the graph by."""
        return self.batch_scale / layout.data_parallel_size

    # --- tensor parallelism ----------------------------------------------------------
    @property
    def blocks(self) -> list[ShardedBlock]:
        """Every structure of the graph that tensor parallelism can cut
        (:func:`~replica.partition.tensor_parallel.find_blocks`), found once."""
        if self._blocks is None:
            self._blocks = find_blocks(self.traced.graph, self.traced.module)
        return self._blocks

    def blocks_for(self, tensor_parallel_size: int) -> tuple[ShardedBlock, ...]:
        """The blocks cut across ``tensor_parallel_size`` ranks: those that fit it and pay
        (:func:`replica.planner.tensor_parallel.blocks_for`), chosen once per size."""
        t = tensor_parallel_size
        if t <= 1:
            return ()
        if t not in self._cut:
            self._cut[t] = blocks_for(self.blocks, t, lambda group: self._pays(group, t))
        return self._cut[t]

    def _pays(self, group: Sequence[ShardedBlock], t: int) -> bool:
        """Whether cutting ``group`` ``t`` ways saves compute (on the traced batch, one call)
        or holds at least ``MEMORY_SHARE`` of the model's parameter bytes."""
        names = {self.graph.canonical(p) for b in group for p, _ in b.parameters}
        held = sum(self.graph.parameters[p].nbytes for p in names)
        if held >= MEMORY_SHARE * max(1, self.graph.parameter_bytes):
            return True
        whole = self.cost_model(self.spec, 1.0)
        cut = CostModel(self.spec, dtype=self.dtype, measured=self.measured, measured_fraction=self.measured_fraction,
                        tensor_parallel=sharded_costs(self.graph, group, t))
        nodes = [self.graph[n] for b in group for n in b.nodes]
        return sum(cut.forward_time(n) + cut.backward_time(n) for n in nodes) \
            < sum(whole.forward_time(n) + whole.backward_time(n) for n in nodes)

    def graph_for(self, tensor_parallel_size: int = 1, sequence_parallel: bool = False,
                  expert_parallel_size: int = 1) -> Graph:
        """The priced graph as one rank of a ``tensor_parallel_size`` group holds it (with the
        tokens between blocks cut where ``sequence_parallel``), its experts' stacked weights
        ``[num_experts / expert_parallel_size, ...]`` (:func:`sharded_experts_graph`)."""
        t, sp, e = tensor_parallel_size, sequence_parallel and tensor_parallel_size > 1, expert_parallel_size
        if (t, sp, e) not in self._graphs:
            if e > 1:
                self._graphs[t, sp, e] = sharded_experts_graph(self.graph_for(t, sp), e)
            elif sp:
                self._graphs[t, sp, e] = sequence_graph(self.graph_for(t), self.blocks_for(t), self.region(t), t)
            else:
                self._graphs[t, sp, e] = sharded_graph(self.graph, self.blocks_for(t), t) if t > 1 else self.graph
        return self._graphs[t, sp, e]

    # --- expert parallelism ----------------------------------------------------------
    @property
    def experts(self) -> tuple[ExpertBlock, ...]:
        """The graph's expert blocks (:func:`~replica.partition.experts.find_expert_blocks`), found once."""
        if self._experts is None:
            self._experts = find_expert_blocks(self.graph)
        return self._experts

    def expert_choices(self, replicas: int, asked: int | None = None) -> tuple[int, ...]:
        """The expert-parallel sizes a layout of ``replicas`` replicas may take: ``asked`` where
        it divides them (none where not), else every divisor of the replicas that divides each
        MoE layer's experts (1 alone in a model without experts: no search over it)."""
        if asked is not None:
            return (asked,) if replicas % asked == 0 else ()
        return expert_choices(self.experts, replicas)

    def routing(self) -> dict[str, list[int]]:
        """Per expert block, the token slots each expert gets on the example batch, read once
        (:func:`~replica.planner.experts.routing_counts`; empty on meta: balanced)."""
        if self._routing is None:
            self._routing = routing_counts(self.traced, self.experts) if self.experts else {}
        return self._routing

    def _with_experts(self, plan: Plan, layout: Layout) -> Plan:
        """``plan`` (cut on :meth:`graph_for` at ``layout``'s expert-parallel size) with its
        stages' all-to-alls and routing imbalance in their times and, where ``layout`` shards,
        each rank's whole share of the experts (FSDP2 leaves them unsharded)."""
        e = layout.expert_parallel_size
        if e <= 1 or not self.experts:
            return plan
        state = state_per_byte(self.memory_model.optimizer)
        per_stage = stage_expert_costs(self.graph, plan, self.experts, e, self.first_spec(), self.routing(), state)
        return self._expert_memory(with_expert_times(plan, per_stage), layout)

    def _expert_memory(self, plan: Plan, layout: Layout) -> Plan:
        graph = self.graph_for(layout.tensor_parallel_size, layout.sequence_parallel, layout.expert_parallel_size)
        return expert_memory(graph, plan, self.experts, state_per_byte(self.memory_model.optimizer))

    def tensor_parallel_costs(self, tensor_parallel_size: int,
                              sequence_parallel: bool = False) -> TensorParallelCosts | None:
        t, sp = tensor_parallel_size, sequence_parallel and tensor_parallel_size > 1
        if (t, sp) not in self._tp_costs:
            if sp:
                self._tp_costs[t, sp] = sequence_costs(self.graph, self.blocks_for(t), t, self.region(t))
            else:
                self._tp_costs[t, sp] = sharded_costs(self.graph, self.blocks_for(t), t) if t > 1 else None
        return self._tp_costs[t, sp]

    def sequence_shards(self, layout: Layout) -> tuple[tuple[str, int], ...]:
        """The values held as sequence shards between the blocks ``layout`` cuts (none without
        ``layout.sequence_parallel``), found once per tensor-parallel size."""
        if not layout.sequence_parallel or layout.tensor_parallel_size <= 1:
            return ()
        return self.region(layout.tensor_parallel_size)

    def region(self, tensor_parallel_size: int) -> tuple[tuple[str, int], ...]:
        """The values sequence parallelism holds on token shards at ``tensor_parallel_size``."""
        t = tensor_parallel_size
        if t not in self._sequence:
            self._sequence[t] = sequence_region(self.graph, self.blocks_for(t), t)
        return self._sequence[t]

    def cost_model(self, spec: DeviceSpec, batch_fraction: float, tensor_parallel_size: int = 1,
                   sequence_parallel: bool = False, expert_parallel_size: int = 1) -> CostModel:
        """The cost model of ``spec`` at ``batch_fraction`` for one rank of ``tensor_parallel_size``
        (``sequence_parallel`` or not), made once: it prices each op once per micro-batch count,
        for every cut the tuner makes. Compiled, the ops of experts spread over ``expert_parallel_size``
        > 1 ranks fuse nothing: their layer runs eagerly between graphs (replica.parallel.compile)."""
        spread = expert_parallel_size > 1 and self.compiled and bool(self.experts)
        key = (spec, batch_fraction, tensor_parallel_size, sequence_parallel and tensor_parallel_size > 1, spread)
        if key not in self._models:
            eager = {n for b in self.experts for n in b.nodes} if spread else set()
            self._models[key] = CostModel(spec, dtype=self.dtype, measured=self.measured, batch_fraction=batch_fraction,
                                          measured_fraction=self.measured_fraction,
                                          tensor_parallel=self.tensor_parallel_costs(tensor_parallel_size,
                                                                                     sequence_parallel),
                                          fused=fused_ops(self.graph_for(tensor_parallel_size, sequence_parallel))
                                          - eager if self.compiled else frozenset(), compiled=self.compiled,
                                          float8=float8_linears(self.graph_for(tensor_parallel_size, sequence_parallel))
                                          if self.float8 else frozenset(), float8_speedup=FLOAT8_SPEEDUP)
        return self._models[key]

    def work(self, layout: Layout, num_microbatches: int, recompute: bool | str | int) -> float:
        """Seconds of compute one replica of ``layout`` does in a step at ``num_microbatches``
        (every op's forward and backward, on one tensor-parallel rank): what its pipeline ranks
        share, however it is cut (0 where stages run on different devices). Recompute is left
        out: a mode reruns only its blocks' forwards (or their cheap ops), so counting it whole
        could put this bound above the cut's."""
        if self.devices is not None:
            return 0.0
        t, m, sp = layout.tensor_parallel_size, num_microbatches, layout.sequence_parallel
        key = (layout.data_parallel_size, t, m, sp, layout.expert_parallel_size)
        if key not in self._work:
            cm = self.cost_model(self.spec, self.batch_fraction(layout), t, sp, layout.expert_parallel_size)
            self._work[key] = sum(cm.forward_time(n, m) + cm.backward_time(n, m)
                                  for n in self.graph_for(t, sp).op_nodes)
        return self._work[key]

    def memory_model_for(self, layout: Layout, recompute: bool | str | int) -> MemoryModel:
        """What a stage of ``layout`` keeps: sharded over its shard group where the layout shards
        (every replica, or ``shard_group_size`` of them under HSDP), its gradients reduce-scattered
        as the request says, or, where it leaves that open, every micro-batch (the leaner: what the
        solver cuts within the budget by; :meth:`sync_grads` then keeps "step" where it fits)."""
        return dataclasses.replace(self.memory_model, recompute=recompute, sharding=layout.sharding,
                                   shards=layout.dp_shard,
                                   grad_sync="step" if self.grad_sync == "step" or not layout.sharded else "microbatch",
                                   split_backward=layout.sharded and layout.kind.splits_backward)

    def reshard(self, plan: Plan, layout: Layout) -> Plan:
        """``plan``, cut unsharded, laid out as ``layout``: its stages' memory as that sharding
        holds it, and ``layout`` its own (what it sends early, how it reduces, follows from it)."""
        held = reshard(self.graph_for(layout.tensor_parallel_size, layout.sequence_parallel,
                                      layout.expert_parallel_size), plan, self.memory_model_for(layout, plan.recompute))
        return self._expert_memory(dataclasses.replace(held, layout=layout), layout)

    def lay_out(self, plan: Plan, layout: Layout, schedule: Schedule) -> tuple[Plan, list[float]]:
        """``plan`` (cut unsharded) in ``layout`` under ``schedule``: its memory as the sharding holds
        it, each stage's gradient reduction chosen (:meth:`sync_grads`) and its collectives priced;
        and the seconds each rank waits for them (the tuner's ``lay_out``)."""
        return self.collectives(self.sync_grads(self.reshard(plan, layout), schedule), layout, schedule)

    def sync_grads(self, plan: Plan, schedule: Schedule) -> Plan:
        """``plan`` (laid out sharded) with each stage's ``grad_sync`` where the request leaves it to
        the planner: "step" (one reduce-scatter a step) on every pipeline rank that fits the memory
        budget so, by the walk of its actions (:func:`replica.planner.costs.rank_memory`);
        "microbatch" (sharded accumulation, m reduce-scatters) on the stages of every rank that does
        not. One micro-batch, or a request that names it: the plan as it is."""
        layout = plan.layout
        if not layout.sharded:
            return plan
        if self.grad_sync is not None:
            return dataclasses.replace(plan, grad_sync_note=f"grad_sync={self.grad_sync!r} asked")
        graph = self.graph_for(layout.tensor_parallel_size, layout.sequence_parallel, layout.expert_parallel_size)
        model = self.memory_model_for(layout, plan.recompute)
        step = self._expert_memory(reshard(graph, plan, model, ["step"] * plan.num_stages), layout)
        if plan.num_microbatches == 1:
            return dataclasses.replace(step, grad_sync_note="")
        where = placement(schedule)
        peaks = rank_memory(stage_costs_from_plan(step, schedule, device=self.first_spec()), schedule)
        budget = self.budget_per_device()
        over = {r: b for r, b in enumerate(peaks) if b > budget}
        if not over:
            room = f"the {format_bytes(budget, '.2f')} budget" if budget < float("inf") else "no memory budget"
            return dataclasses.replace(step, grad_sync_note=(
                f"accumulating unsharded gradients over the step fits {room} on every rank (at most "
                f"{format_bytes(max(peaks), '.2f')}): one reduce-scatter a step"))
        syncs = ["microbatch" if where[k] in over else "step" for k in range(plan.num_stages)]
        mixed = self._expert_memory(reshard(graph, plan, model, syncs), layout)
        after = rank_memory(stage_costs_from_plan(mixed, schedule, device=self.first_spec()), schedule)
        note = "; ".join(
            f"rank {r} (stages {[k for k in range(plan.num_stages) if where[k] == r]}) would hold "
            f"{format_bytes(b, '.2f')} accumulating unsharded gradients over the step, over the "
            f"{format_bytes(budget, '.2f')} budget: {format_bytes(after[r], '.2f')} reduce-scattering every micro-batch"
            for r, b in sorted(over.items()))
        return dataclasses.replace(mixed, grad_sync_note=note)

    def stage_weights(self, parameter_names: tuple[str, ...], tensor_parallel_size: int = 1,
                      expert_parallel_size: int = 1, data_parallel_size: int = 1) -> StageWeights:
        """What a stage holding ``parameter_names`` moves in its collectives: one
        tensor-parallel rank's shards of the parameters its blocks cut, the others whole. At
        ``expert_parallel_size`` e > 1 of ``data_parallel_size`` D replicas a rank's share of
        the experts (``1 / e``) is all-reduced over the D / e replicas holding the same experts,
        counted as the bytes whose ring over D takes as long ((D - e) / (D - 1) of them: none at
        e = D), and FSDP gathers none of it (it leaves the experts alone)."""
        e = expert_parallel_size
        d = data_parallel_size if e > 1 else 1
        key = (tensor_parallel_size, e, d, parameter_names)
        if key not in self._weights:
            graph = self.graph_for(tensor_parallel_size, expert_parallel_size=e)
            experts = {p for b in self.experts for p in b.parameters} if e > 1 else set()
            infos = [graph.parameters[p] for p in parameter_names]
            weights = [p for p in infos if not p.is_buffer]
            scale = (d - e) / (d - 1) if d > 1 else 0.0
            self._weights[key] = StageWeights(
                nbytes=sum(p.nbytes * (scale if p.name in experts else 1.0) for p in weights),
                gathered_bytes=sum(self.memory_model.gathered_bytes(p) for p in weights if p.name not in experts),
                units=len({fsdp_unit(p.name) for p in weights}))
        return self._weights[key]

    def collectives(self, plan: Plan, layout: Layout, schedule: Schedule) -> tuple[Plan, list[float]]:
        """``plan`` with its data-parallel collectives in ``layout`` priced
        (:mod:`replica.planner.dataparallel`), and the seconds each rank waits for them."""
        weights = [self.stage_weights(st.parameter_names, layout.tensor_parallel_size, layout.expert_parallel_size,
                                      layout.data_parallel_size) for st in plan.stages]
        return with_collectives(plan, layout, schedule, self.first_spec(), weights)

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

    def _bounds_of(self, plan: Plan, layout: Layout) -> list[int]:
        """The node positions ``plan``'s stages start at, in the graph ``layout`` cuts."""
        key = (layout.tensor_parallel_size, layout.sequence_parallel)
        graph = self.graph_for(*key)
        if key not in self._positions:
            self._positions[key] = {n.name: i for i, n in enumerate(graph.nodes)}
        index = self._positions[key]
        return [0, *(index[st.node_names[0]] for st in plan.stages[1:]), len(graph.nodes)]

    def _placement(self, layout: Layout, num_microbatches: int) -> tuple[dict[int, int], list[int]]:
        """Where ``layout``'s schedule puts each stage and the micro-batches each holds at once, at
        ``num_microbatches``: made once per shape (the tuner cuts many layouts of the same shape)."""
        key = (layout.schedule, layout.num_stages, num_microbatches, layout.pipeline_ranks)
        if key not in self._shapes:
            actions = make_schedule(*key, check=False)
            self._shapes[key] = (placement(actions), max_in_flight(actions, layout.num_stages))
        return self._shapes[key]

    def partition_for(self, layout: Layout, num_microbatches: int, *, within_budget: bool = True,
                      recompute: bool | str | int | tuple[bool | str | int, ...] = False, simulated: bool = True,
                      like: Plan | None = None) -> Plan:
        """The plan of ``layout`` with ``num_microbatches`` micro-batches per replica, priced
        at each replica's share of the batch (even micro-batches, nothing rebuilt: see
        :func:`replica.planner.refine.finish`). ``simulated=False`` leaves out the step's
        simulation and the replicas' collectives (``predicted_step_time_s`` stays the cut's
        estimate): the tuner's cuts, which it simulates in each layout itself. ``like``: a plan
        of as many stages whose cuts to keep (priced again, not solved again: the tuner's cut of
        the same stages at another micro-batch count). ``recompute``: every stage's mode, or a tuple
        of one per stage (the plan's own ``recompute`` is then True where any stage checkpoints)."""
        m = num_microbatches
        replicas = layout.data_parallel_size
        share = self.global_batch // replicas
        if self.global_batch % replicas:
            raise ConfigError(
                f"a global batch of {self.global_batch} does not split over {replicas} data-parallel replicas; "
                f"use a batch that is a multiple of {replicas}, or another data_parallel_size"
            )
        if m > share:
            raise ConfigError(
                f"num_microbatches={m} but each of the {replicas} replicas has a batch of {share}: each "
                f"micro-batch needs at least one sample. Use num_microbatches <= {share}, or a larger batch."
            )
        batch_fraction = self.batch_fraction(layout)
        specs = self.specs(layout.num_stages)
        t, e = layout.tensor_parallel_size, layout.expert_parallel_size
        by_spec: dict[int, CostModel] = {}
        models = [by_spec.setdefault(id(sp), self.cost_model(sp, batch_fraction, t, layout.sequence_parallel, e))
                  for sp in specs]
        blocks = self.blocks_for(t)
        # an expert block's all-to-all runs inside one stage: no cut falls inside it where spread
        experts = tuple(b.nodes for b in self.experts if len(b.nodes) > 1) if e > 1 else ()
        if simulated:
            schedule_data = make_schedule(layout.schedule, layout.num_stages, m, layout.pipeline_ranks)
            where, flights = placement(schedule_data), max_in_flight(schedule_data, layout.num_stages)
        else:
            where, flights = self._placement(layout, m)
        per_stage = recompute if isinstance(recompute, tuple) else None
        if per_stage is not None:
            recompute = per_stage[0] if len(set(map(repr, per_stage))) == 1 else \
                any(x is not False and x != 0 for x in per_stage)
        result = partition(self.graph_for(t, layout.sequence_parallel, e), models, num_stages=layout.num_stages,
                           num_microbatches=m, stage_recompute=per_stage,
                           schedule=layout.schedule, memory_model=self.memory_model_for(layout, recompute),
                           memory_budget=self.memory_budget if within_budget else None,
                           in_flight=flights,
                           stage_ranks=[where[k] for k in range(layout.num_stages)],
                           together=together(blocks) + experts,
                           bounds=None if like is None else self._bounds_of(like, layout))
        result = dataclasses.replace(result, layout=layout, tensor_parallel=blocks,
                                     sequence_shards=self.sequence_shards(layout),
                                     early_input_grads=recompute is False and self._early_fits(result, where),
                                     compile=self.compiled, compile_note=self.compile_note, float8=self.float8,
                                     precision=self.precision)
        result = self._with_experts(result, layout)
        if not simulated:
            return dataclasses.replace(result, precision=self.precision,
                                       model_flops=3 * self.graph.total_flops * batch_fraction * replicas,
                                       device_peak_flops=self.spec.datasheet_flops)
        if splits_backward(schedule_data):  # order the zero-bubble actions by this plan's own times
            schedule_data = plan_schedule(result)
        result, waits = self.collectives(self.sync_grads(result, schedule_data), layout, schedule_data)
        timeline = simulate(schedule_data, stage_costs_from_plan(result, schedule_data, device=specs[0]),
                            allreduce_s=waits)
        return dataclasses.replace(
            result, precision=self.precision, predicted_step_time_s=timeline.step_time_s,
            simulated_bubble=timeline.bubble_fraction,
            model_flops=3 * self.graph.total_flops * batch_fraction * replicas,
            device_peak_flops=self.spec.datasheet_flops,  # 0 for a CPU: no utilisation figure
        )
