"""From a priced graph to a plan: price every candidate stage, solve, describe the cuts.

A stage ``[i, j)`` of the graph's topological order costs its ops' forward and
backward time plus every tensor it sends or receives (once per hop, activation
and gradient), plus a message latency per neighbour; it holds its weights,
gradients, optimizer state and the activations of the micro-batches the schedule
keeps in flight there. Graphs of up to ``MAX_EXACT_POSITIONS`` ops are cut exactly
at every op boundary; larger ones are first coarsened to the cheapest cut points
(module boundaries and the other local minima of the bytes crossing), exactly
solved over those, and the plan reports the gap to a lower bound.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from replica.errors import ConfigError, PartitionError
from replica.layout import GRAD_SYNCS, SHARDINGS, Layout, schedule_kind
from replica.partition.blocks import block_of, find_blocks, repeated_containers
from replica.partition.cost import CostModel
from replica.partition.crossing import crossing_bytes, crossing_dtype
from replica.partition.graph import INPUT, OP, Graph, Node, ParameterInfo, TensorInfo, fingerprint
from replica.partition.plan import BoundaryTensor, MemoryBreakdown, Plan, StagePlan
from replica.partition.recompute import (
    Activations,
    check_mode,
    defers_weight_grad,
    kept_by_selective,
    regions,
    saves_activation,
    stage_activations,
    weight_grad_bytes,
)
from replica.partition.solver import Transfer, add_rectangle, balance_groups, interval_costs, solve
from replica.units import format_bytes

__all__ = ["MemoryModel", "partition", "in_flight_microbatches", "weight_copy_bytes", "fsdp_unit",
           "units_in_flight", "reshard", "MAX_EXACT_POSITIONS", "saves_activation", "held_activations"]

MAX_EXACT_POSITIONS = 1200
INF = float("inf")

_OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1, "adagrad": 1, "rmsprop": 1, "none": 0}


@dataclass(frozen=True)
class MemoryModel:
    """What training keeps on a stage, counted as torch keeps it.

    Per parameter: the weight, its gradient and the optimizer's states (Adam: two moments),
    all three in the parameter's own dtype, since torch accumulates a gradient in its
    parameter's dtype and its optimizers make their states with ``zeros_like(param)``: 16
    bytes a parameter for an fp32 model under Adam, 8 for a model cast to bf16 (torch's
    optimizers keep no fp32 master copy). Autocast (bf16 / fp16) leaves all of that as it
    is and adds copies of the weights its ops read in half precision (2 bytes a parameter;
    the graph's ``Node.weight_casts``): each micro-batch's stage forward is an autocast region
    of its own, whose cast cache makes a fresh copy, and autograd keeps that copy until the
    micro-batch's backward, so a stage holds one set per micro-batch in flight, counted with
    its activations. (Under a schedule that splits backward, the linear layers defer their
    weight gradients and cast those weights again in backward instead of keeping them: their
    copies are not counted; stages that defer only to send input gradients early still count
    them, which errs towards fitting.) Activations are the ops' saved outputs in their dtypes: autocast's, in a graph
    of :func:`replica.partition.autocast.autocast_graph`.

    ``recompute`` is the mode of every stage (:mod:`replica.partition.recompute`): ``True``
    checkpoints each block (a stage without blocks: the whole stage), so a stage keeps each
    block's inputs for the micro-batches in flight and one micro-batch's largest block at a
    time, for one more forward of the blocks; ``"selective"`` keeps their matmul and attention
    outputs too, and runs only the rest again; ``k`` does the first ``k`` blocks fully.
    Received inputs are held per micro-batch in flight, and one more (the next receive, posted
    ahead: :func:`held_activations`).

    ``sharding`` ("zero3" / "zero2", :attr:`replica.layout.Layout.sharding`) shards weights,
    gradients and optimizer state over ``shards`` data-parallel replicas (torch's FSDP2, as
    :mod:`replica.parallel.fsdp` runs it), each a ``1/shards`` slice; buffers stay whole.
    FSDP gathers the weights in ``gather_dtype`` (its ``MixedPrecisionPolicy.param_dtype``:
    "bfloat16" under bf16 autocast; None: their own dtype), which autocast then reads without
    copying, so a sharded stage holds no autocast weight copies. What the step keeps gathered:

    - with one micro-batch, under zero3, the units in flight (:func:`units_in_flight`: the
      stage's root unit and two blocks, the running one and the one prefetched), weights and
      unsharded gradients (these until their reduce-scatter ends); under zero2 the whole
      stage's gathered weights (kept from forward to backward) and the units' gradients;
    - with several micro-batches and ``grad_sync`` "step", under both, the whole stage's
      gathered weights and unsharded gradients: every backward but the step's last keeps the
      weights gathered and accumulates unsharded gradients, so that a step reduce-scatters each
      gradient once (the gradients' slice is made as the unsharded ones are freed, unit by unit,
      in the last backward: the gradients count the whole stage's, not the slice on top);
    - with several micro-batches and ``grad_sync`` "microbatch", as with one: every backward
      reduce-scatters its gradients and frees the gathered weights, so the gradients accumulate
      in the ``1/shards`` slice and only the units in flight hold unsharded ones, for a moment;
    - under a split backward (``split_backward``: zero-bubble's W actions), the stage's linears
      read their weights by ``get_attr`` (:func:`replica.stage.weightgrad.defer_linear_weight_grads`),
      so FSDP holds them in the stage's root unit, gathered with their unsharded gradients from a
      B to its W, which overlap for the whole steady state: the whole stage, either way (reducing
      every micro-batch then only adds the slice).
    """

    optimizer: str = "adam"
    recompute: bool | str | int = False
    sharding: str = "none"
    shards: int = 1
    gather_dtype: str | None = None
    grad_sync: str = "step"
    split_backward: bool = False

    def __post_init__(self) -> None:
        check_mode(self.recompute)
        if self.grad_sync not in GRAD_SYNCS:
            raise ConfigError(f"grad_sync must be one of {list(GRAD_SYNCS)}, got {self.grad_sync!r}")
        if self.optimizer not in _OPTIMIZER_STATES:
            raise ConfigError(f"unknown optimizer {self.optimizer!r} for memory; one of {sorted(_OPTIMIZER_STATES)}")
        if self.sharding not in SHARDINGS:
            raise ConfigError(f"sharding must be one of {list(SHARDINGS)}, got {self.sharding!r}")
        if isinstance(self.shards, bool) or not isinstance(self.shards, int) or self.shards < 1:
            raise ConfigError(f"shards must be a positive int, got {self.shards!r}")

    @property
    def sharded(self) -> bool:
        return self.sharding != "none"

    def optimizer_bytes(self, weight_bytes: int) -> int:
        """The optimizer's states for weights of ``weight_bytes``: each state the size of its weights."""
        return _OPTIMIZER_STATES[self.optimizer] * weight_bytes

    def gathered_bytes(self, info: ParameterInfo) -> int:
        """Bytes of one parameter as FSDP gathers it (in ``gather_dtype`` if it is floating)."""
        if self.gather_dtype is None or info.is_buffer or not TensorInfo((), info.dtype).is_floating:
            return info.nbytes
        return TensorInfo(info.shape, self.gather_dtype).nbytes

    def held(self, weights: Any, gathered: Any, buffers: Any, units: tuple[float, float],
             accumulating: bool) -> tuple[Any, Any, Any]:
        """(weights and buffers, gradients, optimizer state) a stage of ``weights`` bytes of
        weights (``gathered`` as FSDP gathers them) and ``buffers`` holds over a step; numbers
        or numpy arrays of them. ``units`` (gathered weights, gradients) is what the units in
        flight hold at most, ``accumulating`` whether the step has several micro-batches (which
        only keeps unsharded gradients where ``grad_sync`` is "step")."""
        optimizer = self.optimizer_bytes(weights)
        if not self.sharded:
            return weights + buffers, weights, optimizer
        d = self.shards
        if self.split_backward:  # every linear in the root unit, gathered with its gradients from B to W
            units = (np.inf, np.inf)
        if accumulating and self.grad_sync == "step":
            # the whole stage's unsharded gradients through the step; their slice is made as each
            # unit's are reduce-scattered in the last backward and freed: it never adds to them
            return weights / d + gathered + buffers, weights, optimizer / d
        kept_weights = gathered if self.sharding == "zero2" else np.minimum(units[0], gathered)
        kept_grads = np.minimum(units[1], weights)
        return weights / d + kept_weights + buffers, weights / d + kept_grads, optimizer / d


def weight_copy_bytes(graph: Graph, nodes: Sequence[Node]) -> int:
    """Bytes of the weight copies autocast makes for ``nodes`` in one forward: each
    (parameter, dtype) once, however many of the ops read it."""
    copies = dict.fromkeys(c for n in nodes for c in n.weight_casts)
    return sum(TensorInfo(graph.parameters[p].shape, dtype).nbytes for p, dtype in copies)


_BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")  # as replica.parallel.fsdp groups leaves into units


# Two cuts within 1% of the optimal bottleneck cost about the same: the one at a block boundary wins
# (a stage of whole transformer layers, not one ending after a layer's first norm); benchmarks/RESULTS.md
BLOCK_TIE = 0.01


def fsdp_unit(name: str) -> str:
    """The FSDP unit the runtime puts parameter ``name`` in: its block (the first
    ``<container>.<index>`` of its path, ``model.layers.3``), else "" for the stage's root unit."""
    m = _BLOCK.match(name)
    return m[1] if m else ""


def units_in_flight(graph: Graph, memory_model: MemoryModel) -> tuple[float, float]:
    """(gathered weights, unsharded gradients) in bytes of the FSDP units a zero3 stage holds
    at once: its root unit (gathered for the whole forward) and two blocks (the one running
    and the one prefetched). Counted on the whole model, the largest block twice and every
    root parameter: exact for one stage, a little over for a pipeline stage's share. Counted
    once per graph and memory model (the tuner asks for every cut and layout)."""
    known = graph.__dict__.setdefault("_units_in_flight", {})
    key = (memory_model, len(graph.parameters))
    if key not in known:
        known[key] = _count_units(graph, memory_model)
    return known[key]


def _count_units(graph: Graph, memory_model: MemoryModel) -> tuple[float, float]:
    gathered: dict[str, float] = {}
    grads: dict[str, float] = {}
    for info in graph.parameters.values():
        if not info.is_buffer:
            unit = fsdp_unit(info.name)
            gathered[unit] = gathered.get(unit, 0) + memory_model.gathered_bytes(info)
            grads[unit] = grads.get(unit, 0) + info.nbytes
    blocks = [u for u in gathered if u]
    block = max(blocks, key=lambda u: grads[u], default=None)
    return (gathered.get("", 0) + (2 * gathered[block] if block else 0),
            grads.get("", 0) + (2 * grads[block] if block else 0))


def _state_bytes(graph: Graph, names: Sequence[str], memory_model: MemoryModel, units: tuple[float, float],
                 accumulating: bool) -> tuple[int, int, int]:
    """(weights and buffers, gradients, optimizer state) of a stage holding parameters ``names``,
    once per stage and memory model of a graph (the tuner lays the same stages out many ways)."""
    known = graph.__dict__.setdefault("_state_bytes", {})
    key = (tuple(names), memory_model, units, accumulating)
    if key not in known:
        known[key] = _count_state(graph, names, memory_model, units, accumulating)
    return known[key]


def _count_state(graph: Graph, names: Sequence[str], memory_model: MemoryModel, units: tuple[float, float],
                 accumulating: bool) -> tuple[int, int, int]:
    infos = [graph.parameters[p] for p in names]
    weights = sum(p.nbytes for p in infos if not p.is_buffer)
    gathered = sum(memory_model.gathered_bytes(p) for p in infos if not p.is_buffer)
    buffers = sum(p.nbytes for p in infos if p.is_buffer)
    held = memory_model.held(weights, gathered, buffers, units, accumulating)
    return int(held[0]), int(held[1]), int(held[2])


def _activations(graph: Graph, members: Sequence[Node], blocks: Sequence[str], mode: object) -> tuple[Activations, int]:
    """:func:`~replica.partition.recompute.stage_activations` of ``members`` (a run of ``graph``'s
    nodes), and the autocast weight copies of its largest checkpointed region: once per run,
    blocks and mode of a graph (the tuner describes and reshards the same stages for every
    micro-batch count and layout)."""
    known = graph.__dict__.setdefault("_stage_activations", {})
    key = (members[0].name, members[-1].name, len(members), tuple(blocks), type(mode).__name__, mode) \
        if members else None
    if key is None or key not in known:
        act = stage_activations(members, blocks, mode)
        largest = max((weight_copy_bytes(graph, region) for region in regions(members, blocks)
                       if region and region[0].name in act.inside), default=0) if act.inside else 0
        if key is None:
            return act, largest
        known[key] = (act, largest)
    return known[key]


def _stage_activations(graph: Graph, members: Sequence[Node], blocks: Sequence[str], cm: CostModel, m: int,
                       memory_model: MemoryModel, deferring: bool = False) -> tuple[int, int, frozenset[str], int]:
    """What the whole batch's forwards keep on a stage of ``members`` (each micro-batch's
    activations under the recompute mode, and autocast's weight copies where FSDP does not
    gather the weights already cast), the bytes its largest recomputed block rebuilds at once,
    and the ops run again (:func:`replica.partition.recompute.stage_activations`)."""
    act, largest = _activations(graph, members, blocks, memory_model.recompute)
    # autocast's weight copies: kept per micro-batch outside checkpointed regions, made again inside
    # them (one region's at a time; a stage without blocks is its one region)
    outside = [n for n in members if n.name not in act.inside and not (deferring and defers_weight_grad(n))]
    copies = 0 if memory_model.sharded else m * weight_copy_bytes(graph, outside)
    rebuilt = 0 if memory_model.sharded or not act.inside else m * largest
    # k blocks: the first ones, rebuilt last, when the later blocks' kept activations are freed;
    # every block: priced at the largest, as the solver prices any cut (the tuner's choice must
    # fit again when it is cut within the budget)
    k = memory_model.recompute
    extra = act.extra if isinstance(k, int) and not isinstance(k, bool) else act.peak
    # a split backward holds each deferred linear's input and output gradient from B to W
    held = int(cm.scaled(weight_grad_bytes(members, graph, act.inside))) if deferring else 0
    return int(cm.scaled(act.kept + _cast_outputs(graph, members, act))) + copies, int(cm.scaled(extra)) + rebuilt, \
        act.again, held


def _cast_outputs(graph: Graph, members: Sequence[Node], act: Any) -> int:
    """What ``act`` over-counts of the fp32 values every reader casts under autocast (a norm's
    output read by linears, :mod:`replica.partition.crossing`): autograd keeps each reader's
    cast copy on the stage, and of one that leaves the stage the cast that crosses the cut, not
    the fp32 value. Bytes to add (<= 0)."""
    names = {n.name for n in members}
    change = 0
    assert act.by_node is not None
    for n in members:
        if n.name not in act.by_node or not n.users:
            continue
        readers = [graph[u] for u in n.users]
        cast = crossing_bytes(n, readers)
        if cast < n.output_bytes:
            copies = sum(u in names for u in n.users) + any(u not in names for u in n.users)
            change += min(cast * copies, act.by_node[n.name]) - act.by_node[n.name]
    return change


def reshard(graph: Graph, plan: Plan, memory_model: MemoryModel, grad_sync: Sequence[str] | None = None) -> Plan:
    """``plan`` with every stage's memory as ``memory_model`` shards it: the state slices and
    what stays gathered, and, from a plan described unsharded, no autocast weight copies. The
    cuts and times stay: sharding moves no op. ``grad_sync``: each stage's (default: the memory
    model's for every stage)."""
    if not memory_model.sharded:
        return plan
    units = units_in_flight(graph, memory_model)
    m = plan.num_microbatches
    syncs = list(grad_sync) if grad_sync is not None else [memory_model.grad_sync] * plan.num_stages
    stages = []
    for st, sync in zip(plan.stages, syncs):
        model = memory_model if sync == memory_model.grad_sync else dataclasses.replace(memory_model, grad_sync=sync)
        parameters, gradients, optimizer = _state_bytes(graph, st.parameter_names, model, units, m > 1)
        received = sum(b.nbytes for b in st.inputs)
        kept, rebuilt = st.activation_bytes, st.recompute_bytes
        if not plan.layout.sharded:  # FSDP gathers the weights already cast: no autocast copies
            members = [graph[n] for n in st.node_names]
            act, largest = _activations(graph, members, st.blocks, st.recompute)
            kept -= m * weight_copy_bytes(graph, [n for n in members if n.name not in act.inside])
            if act.inside:
                rebuilt -= m * largest
        activations = int(held_activations(kept, rebuilt, received, st.in_flight, m))
        stages.append(dataclasses.replace(
            st, activation_bytes=kept, recompute_bytes=rebuilt, grad_sync=sync,
            memory=MemoryBreakdown(parameters=parameters, gradients=gradients, optimizer=optimizer,
                                   activations=activations)))
    return dataclasses.replace(plan, stages=tuple(stages))


def in_flight_microbatches(schedule: str, stage_index: int, num_stages: int, num_microbatches: int) -> int:
    """Micro-batches whose activations a stage holds at once: all of them under GPipe,
    ``num_stages - stage_index`` under 1F1B (the default when the schedule's own
    replayed counts are not given)."""
    if schedule == "gpipe":
        return num_microbatches
    return min(num_microbatches, num_stages - stage_index)


def _cut_candidates(graph: Graph, allowed: list[bool], limit: int) -> list[int]:
    """:func:`_candidates`, once per graph, allowed positions and limit (the tuner cuts the same
    graph for many layouts)."""
    known = graph.__dict__.setdefault("_cut_candidates", {})
    key = (np.packbits(np.asarray(allowed, dtype=bool)).tobytes(), len(allowed), limit)
    if key not in known:
        known[key] = _candidates(graph, allowed, limit)
    return list(known[key])


def _candidates(graph: Graph, allowed: list[bool], limit: int) -> list[int]:
    """Positions worth cutting at when there are too many: module boundaries, then the local
    minima of the bytes crossing a cut, cheapest first, at most ``limit`` of them. Boundaries
    come first, and positions crossed by the same bytes (a residual stream) are taken spread
    over the graph: ties taken in graph order left the last blocks of a deep model no place to
    cut (Llama 3.1 405B's last 26 of 126 layers on one stage, 4x the step).""" 
    nodes = graph.nodes
    n = len(nodes)
    index = {x.name: i for i, x in enumerate(nodes)}
    delta = np.zeros(n + 2)
    for i, x in enumerate(nodes):
        if x.users:
            delta[i + 1] += x.output_bytes + 1  # +1: a Python value still costs a message
            delta[max(index[u] for u in x.users) + 1] -= x.output_bytes + 1
    crossing = np.cumsum(delta)[: n + 1]
    positions = [p for p in range(n + 1) if allowed[p]]
    top = [x.module_path.split(".")[:3] for x in nodes]
    boundary = {p for p in positions if 0 < p < n and top[p - 1] != top[p]}
    minima = {p for p in positions if crossing[p] <= crossing[max(p - 1, 0)] and crossing[p] <= crossing[min(p + 1, n)]}
    ordered = sorted(boundary | minima)
    bits = max(1, (len(ordered) - 1).bit_length())
    # ties in an order that spreads over the graph (bit-reversed ranks: first, middle, quarters, ...)
    spread = {p: int(format(i, f"0{bits}b")[::-1], 2) for i, p in enumerate(ordered)}
    chosen = sorted(ordered, key=lambda p: (p not in boundary, crossing[p], spread[p]))[:limit]
    return sorted(chosen)


def partition(
    graph: Graph,
    cost_model: CostModel | Sequence[CostModel],
    *,
    num_stages: int,
    num_microbatches: int,
    schedule: str,
    memory_model: MemoryModel = MemoryModel(),
    memory_budget: float | Sequence[float] | None = None,
    in_flight: Sequence[int] | None = None,
    bounds: Sequence[int] | None = None,
    stage_ranks: Sequence[int] | None = None,
    together: Sequence[Sequence[str]] = (),
    stage_recompute: Sequence[bool | str | int] | None = None,
) -> Plan:
    """Cut ``graph`` into ``num_stages`` contiguous stages (in its topological order) so that
    the slowest stage — its compute plus everything it sends and receives — is as fast as
    possible, with every stage within its memory budget.

    ``cost_model`` may be one per stage (heterogeneous devices); ``memory_budget`` bytes
    per device (one number or one per stage; default: the device's memory); ``in_flight``
    the micro-batches each stage keeps activations for (default: 1F1B's, or all for
    GPipe). Raises ``PartitionError`` with the memory needed and the smallest feasible
    ``num_stages`` when no partition fits. ``bounds`` (node positions ``0 = b0 < ... <
    bK = len(graph)``) imposes the cuts instead of solving: hand splits, for comparison.
    ``stage_ranks[k]`` is the rank stage k runs on: where a rank holds several stages
    (interleaved, V), the cuts then move to balance each rank's sum, not only each stage.
    ``together``: groups of node names no cut may fall between (the first and the last of
    each), as the structures cut across tensor-parallel ranks. ``stage_recompute``: each stage's
    recompute mode, where they differ (default: ``memory_model.recompute`` for every stage).
    """
    models = list(cost_model) if isinstance(cost_model, (list, tuple)) else [cost_model] * num_stages
    if len(models) != num_stages:
        raise ConfigError(f"{len(models)} device cost models for num_stages={num_stages}; give one per stage")
    nodes = graph.nodes
    num_ops = len(graph.op_nodes)
    if num_stages > num_ops:
        raise PartitionError(
            f"num_stages={num_stages} is more than the {num_ops} ops of {graph.model_name or 'the model'}: "
            f"every stage needs at least one op. Use num_stages <= {num_ops}."
        )
    m = num_microbatches
    flights = list(in_flight) if in_flight is not None else [
        in_flight_microbatches(schedule, k, num_stages, m) for k in range(num_stages)
    ]
    budgets = _budgets(memory_budget, models, num_stages)
    if stage_recompute is not None and len(stage_recompute) != num_stages:
        raise ConfigError(f"stage_recompute has {len(stage_recompute)} modes for num_stages={num_stages}; "
                          "give one per stage")
    mode_of = [check_mode(x) for x in stage_recompute] if stage_recompute is not None else \
        [memory_model.recompute] * num_stages
    index = {n.name: i for i, n in enumerate(nodes)}

    if bounds is not None:
        bounds = [int(b) for b in bounds]
        if len(bounds) != num_stages + 1 or bounds[0] != 0 or bounds[-1] != len(nodes) or \
                any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ConfigError(f"bounds must rise strictly from 0 to {len(nodes)} in {num_stages} steps, got {bounds}")
        lat = [2 * cm.transfer_time(0, num_messages=m) for cm in models]
        worst = max(sum(models[k].forward_time(n, m) + models[k].backward_time(n, m)
                        for n in nodes[bounds[k]:bounds[k + 1]]) for k in range(num_stages))
        plan = _describe(graph, models, bounds, worst, m, schedule, flights, memory_model, lat, True, 0.0,
                         stage_ranks, mode_of)
        step = max(st.predicted_time_s for st in plan.stages) * (m + num_stages - 1) / m
        return dataclasses.replace(plan, predicted_step_time_s=step)

    # --- where cuts may fall ---------------------------------------------------------------
    first_op = sum(1 for n in nodes if n.kind == INPUT)
    allowed = [first_op < p < len(nodes) - 1 for p in range(len(nodes) + 1)]
    for i, n in enumerate(nodes):
        if n.value_kind == "container" and n.users:  # tuples of tensors stay with their readers
            for p in range(i + 1, max(index[u] for u in n.users) + 1):
                allowed[p] = False
        if n.writes_into is not None:  # a write through a view happens where its base lives
            for p in range(index[n.writes_into] + 1, i + 1):
                allowed[p] = False
    for group in together:  # a tensor-parallel block lives on one stage
        where = [index[name] for name in group]
        for p in range(min(where) + 1, max(where) + 1):
            allowed[p] = False
    exact = sum(allowed) <= MAX_EXACT_POSITIONS
    cuts = [p for p in range(len(nodes) + 1) if allowed[p]] if exact else \
        _cut_candidates(graph, allowed, min(MAX_EXACT_POSITIONS, max(400, 8 * num_stages)))
    if len(cuts) < num_stages - 1:
        raise PartitionError(
            f"{graph.model_name or 'the model'} has only {len(cuts)} places to cut (tuples of tensors and "
            f"in-place writes through views keep their ops together), too few for num_stages={num_stages}. "
            f"Use num_stages <= {len(cuts) + 1}."
        )
    # Segments: the ops between two consecutive candidate cuts, priced as one item.
    edges = [0, *cuts, len(nodes)]
    seg_of = np.zeros(len(nodes), dtype=np.int64)
    for s in range(len(edges) - 1):
        seg_of[edges[s]:edges[s + 1]] = s
    num_seg = len(edges) - 1

    # --- time: compute + communication per device kind --------------------------------------
    transfers_by_model: dict[tuple[int, str], np.ndarray] = {}
    latency = [2 * cm.transfer_time(0, num_messages=m) for cm in models]

    def time_matrix(k: int) -> np.ndarray:
        """Stage k's time matrix (a fresh copy: the caller may write infinities into it)."""
        cm = models[k]
        key = (id(cm), repr(mode_of[k]))
        if key not in transfers_by_model:
            again = modes_of(mode_of[k]).again
            items = np.zeros(num_seg)
            for i, n in enumerate(nodes):
                items[seg_of[i]] += (1 + again[i]) * cm.forward_time(n, m) + cm.backward_time(n, m)
            transfers = []
            for i, n in enumerate(nodes):
                readers = tuple(sorted({int(seg_of[index[u]]) for u in n.users} - {int(seg_of[i])}))
                if readers:
                    directions = 2 if any(t.is_floating for t in n.outputs) else 1
                    sent = crossing_bytes(n, [graph[u] for u in n.users])  # as cast for all its readers
                    transfers.append(Transfer(int(seg_of[i]), readers,
                                              directions * cm.transfer_time(cm.scaled(sent), num_messages=0)))
            c = interval_costs(items, transfers)
            c[1:, :] += latency[k]  # every stage but the first receives (and returns gradients)
            c[:, :-1] += latency[k]  # every stage but the last sends
            transfers_by_model[key] = c
        return transfers_by_model[key].copy()

    # --- memory ---------------------------------------------------------------------------
    fraction = models[0].batch_fraction
    deferred = frozenset(x.name for x in nodes if defers_weight_grad(x)) if schedule_kind(schedule).splits_backward \
        else frozenset()
    by_mode: dict[str, _Priced] = {}
    modes_by: dict[str, Any] = {}

    def modes_of(mode: bool | str | int) -> Any:
        """A mode's per-node prices (what the time matrices read; memory is priced on first use)."""
        if repr(mode) not in modes_by:
            modes_by[repr(mode)] = _modes(graph, mode)
        return modes_by[repr(mode)]

    def priced(mode: bool | str | int) -> _Priced:
        """A mode's per-node prices and its ``[i, j)`` memory matrices (one micro-batch's), made on
        first use: a cut without a budget (the tuner's) never reads them."""
        if repr(mode) not in by_mode:
            modes = modes_of(mode)
            static, copies, recv = _memory_matrices(graph, seg_of, num_seg, memory_model, m, fraction,
                                                    modes.inside | deferred)
            kept = _segment_sums(modes.kept * fraction / m, seg_of, num_seg) + copies  # a micro-batch's
            blocks_in = _segment_sums(modes.block_start, seg_of, num_seg)
            if modes.whole:  # no blocks: a stage is its one block, its whole saved activations rebuilt at once
                rebuilt = _segment_sums(modes.saved * fraction / m, seg_of, num_seg) + copies - kept
            else:
                rebuilt = np.where(blocks_in > 0, modes.peak * fraction / m, 0.0)
                if modes.k:
                    kept = kept - np.minimum(blocks_in, modes.k) * modes.saving * fraction / m
            by_mode[repr(mode)] = _Priced(modes, static, kept, rebuilt, recv)
        return by_mode[repr(mode)]

    def memory_matrix(k: int) -> np.ndarray:
        # kept activations per micro-batch in flight, one micro-batch's recomputed block, and
        # the received inputs of the micro-batches in flight and the next (held_activations)
        p = priced(mode_of[k])
        return p.static + held_activations(p.kept * m, p.rebuilt * m, p.recv, flights[k], m)

    def stage_cost(k: int) -> np.ndarray:
        c = time_matrix(k)
        if budgets[k] < INF:
            c[memory_matrix(k) > budgets[k]] = INF
        return c

    # no budget and one device kind: every stage's matrix is the same, made once (the tuner's cuts)
    alike = all(b == INF for b in budgets) and len({id(cm) for cm in models}) == 1 \
        and len({repr(x) for x in mode_of}) == 1
    costs = time_matrix(0) if alike else stage_cost

    units = [fsdp_unit(x.module_path or "") for x in nodes]  # a node's block: model.layers.3, or ""
    at_block = np.array([0 < edges[s] < len(nodes) and units[edges[s] - 1] != units[edges[s]]
                         for s in range(num_seg + 1)])
    try:
        result = solve(costs, num_stages, preferred_cuts=at_block if at_block.any() else None, tie=BLOCK_TIE)
    except ValueError:
        p = priced(mode_of[0])
        raise _infeasible(graph, num_stages, budgets, (p.static, p.kept * m, p.rebuilt * m, p.recv), schedule, m,
                          num_seg) from None

    seg_bounds, bottleneck = list(result.bounds), result.bottleneck
    if stage_ranks is not None and len(set(stage_ranks)) < num_stages:
        groups = [[k for k in range(num_stages) if stage_ranks[k] == r] for r in sorted(set(stage_ranks))]
        for k in range(num_stages):
            time_matrix(k)  # fills the per-device cache read below

        def cost_at(k: int, i: int, j: int) -> float:
            if budgets[k] < INF and memory_model_at(k, i, j) > budgets[k]:
                return INF
            return float(transfers_by_model[id(models[k]), repr(mode_of[k])][i, j])

        def memory_model_at(k: int, i: int, j: int) -> float:
            p = priced(mode_of[k])
            return float(p.static[i, j] + held_activations(p.kept[i, j] * m, p.rebuilt[i, j] * m, p.recv[i, j],
                                                           flights[k], m))

        seg_bounds = balance_groups(cost_at, seg_bounds, groups)
        bottleneck = max(cost_at(k, seg_bounds[k], seg_bounds[k + 1]) for k in range(num_stages))
    bounds = [edges[b] for b in seg_bounds]
    again = np.min([priced(x).modes.again for x in mode_of], axis=0)  # no stage reruns less
    work = [(1 + again[i]) * models[0].forward_time(n, m) + models[0].backward_time(n, m)
            for i, n in enumerate(nodes)]
    lower_bound = max(sum(work) / num_stages, max(work)) if len({id(x) for x in models}) == 1 else 0.0
    return _describe(graph, models, bounds, bottleneck, m, schedule, flights, memory_model, latency,
                     exact, lower_bound, stage_ranks, mode_of)


def _budgets(memory_budget: float | Sequence[float] | None, models: list[CostModel], k: int) -> list[float]:
    if memory_budget is None:
        return [INF] * k
    if isinstance(memory_budget, (int, float)):
        values = [float(memory_budget)] * k
    else:
        values = [float(b) for b in memory_budget]
        if len(values) != k:
            raise ConfigError(f"memory_budget has {len(values)} entries for num_stages={k}; give one per stage")
    if any(v <= 0 for v in values):
        raise ConfigError(f"memory_budget must be > 0 bytes, got {values}")
    return values


def _add_reads(d: np.ndarray, first: int, reads: list[int], n: int, amount: float) -> None:
    """Add ``amount`` to every stage [i, j) (i > first) holding one of the sorted ``reads``,
    once, in the 2-D difference array ``d``: split by the first read at or after i."""
    prev = first
    for s in reads:
        add_rectangle(d, prev + 1, s, s + 1, n, amount)
        prev = s


def _memory_matrices(
    graph: Graph, seg_of: np.ndarray, num_seg: int, memory_model: MemoryModel, m: int, fraction: float,
    rebuilt: frozenset[str] = frozenset(),
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per stage ``[i, j)`` of segments: bytes of weights + gradients + optimizer state (each
    parameter once, wherever it is read; as ``memory_model`` shards them), per micro-batch in
    flight (activations and autocast's weight copies), and of the receive buffers (every
    micro-batch's inputs, posted up front)."""
    nodes = graph.nodes
    n = num_seg
    # per parameter read in [i, j): its bytes as a weight, as FSDP gathers it, as a buffer
    reads = {kind: np.zeros((n + 2, n + 2)) for kind in ("weights", "gathered", "buffers")}
    copies_d = np.zeros((n + 2, n + 2))
    uses: dict[str, list[int]] = {}
    casts: dict[tuple[str, str], list[int]] = {}
    for i, x in enumerate(nodes):
        for p in (*x.parameters, *x.buffers):
            uses.setdefault(p, []).append(int(seg_of[i]))
        for cast in x.weight_casts if x.name not in rebuilt else ():  # a checkpointed op's are made again
            casts.setdefault(cast, []).append(int(seg_of[i]))
    for name, where in uses.items():
        info = graph.parameters[name]
        where = sorted(set(where))  # held by [i, j) iff some use falls inside
        if info.is_buffer:
            _add_reads(reads["buffers"], -1, where, n, info.nbytes)
        else:
            _add_reads(reads["weights"], -1, where, n, info.nbytes)
            _add_reads(reads["gathered"], -1, where, n, memory_model.gathered_bytes(info))
    if not memory_model.sharded:  # FSDP gathers the weights already cast: autocast copies none
        for (name, dtype), where in casts.items():
            _add_reads(copies_d, -1, sorted(set(where)), n, TensorInfo(graph.parameters[name].shape, dtype).nbytes)
    weights, gathered, buffers = (np.cumsum(np.cumsum(d, axis=0), axis=1)[: n + 1, : n + 1] for d in reads.values())
    static = sum(memory_model.held(weights, gathered, buffers, units_in_flight(graph, memory_model), m > 1))
    copies = np.cumsum(np.cumsum(copies_d, axis=0), axis=1)[: n + 1, : n + 1]
    index = {x.name: i for i, x in enumerate(nodes)}
    recv_d = np.zeros((n + 2, n + 2))
    for i, x in enumerate(nodes):
        readers = sorted({int(seg_of[index[u]]) for u in x.users} - {int(seg_of[i])})
        # received by [i, j) iff the producer is before i and a reader inside
        _add_reads(recv_d, int(seg_of[i]), readers, n, crossing_bytes(x, [graph[u] for u in x.users]) * fraction)
    recv = np.cumsum(np.cumsum(recv_d, axis=0), axis=1)[: n + 1, : n + 1]
    return static, copies, recv


def _segment_sums(per_node: np.ndarray, seg_of: np.ndarray, num_seg: int) -> np.ndarray:
    """``[i, j)`` -> the sum of ``per_node`` over the nodes of segments i to j - 1."""
    per_seg = np.bincount(seg_of, weights=per_node, minlength=num_seg)[:num_seg]
    prefix = np.concatenate([[0.0], np.cumsum(per_seg)])
    return np.maximum(prefix[None, :] - prefix[:, None], 0.0)


def held_activations(kept: Any, rebuilt: Any, received: Any, in_flight: int, m: int) -> Any:
    """Bytes of activations a stage holds at its fullest (numbers or numpy arrays), from the whole
    batch's (``m`` micro-batches'): what its forwards keep (``kept``) for each of the ``in_flight``
    micro-batches; one micro-batch's recomputed block (``rebuilt``, its largest); its received
    inputs for the micro-batches in flight and the next one, whose receive the runtime posts
    while the last backward runs (at most all ``m``)."""
    return (kept * in_flight + rebuilt + received * min(in_flight + 1, m)) / m


@dataclass(frozen=True)
class _Priced:
    """A recompute mode's per-node prices and the solver's ``[i, j)`` memory matrices under it."""

    modes: "_Modes"
    static: np.ndarray
    kept: np.ndarray
    rebuilt: np.ndarray
    recv: np.ndarray


@dataclass(frozen=True)
class _Modes:
    """A recompute mode priced per node of the whole graph, for the solver (the plan's stages are
    then priced exactly, :func:`replica.partition.recompute.stage_activations`)."""

    saved: np.ndarray  # per node: the bytes autograd keeps of its output (whole batch)
    kept: np.ndarray  # the bytes kept under the mode
    again: np.ndarray  # 1.0 where its forward runs again in backward
    block_start: np.ndarray  # 1.0 at the first op of each block
    peak: float = 0.0  # the largest recomputed block's bytes
    whole: bool = False  # a mode that checkpoints, on a model without blocks: a stage is its one block
    k: int = 0  # int k: the blocks checkpointed per stage, each saving ``saving`` bytes
    saving: float = 0.0
    inside: frozenset[str] = frozenset()  # the ops in checkpointed regions: their weight casts are not kept


def _modes(graph: Graph, mode: object) -> _Modes:
    """The mode's prices per node, once per graph and mode (every cut of the tuner asks)."""
    known = graph.__dict__.setdefault("_modes", {})
    key = (type(mode).__name__, mode)
    if key not in known:
        known[key] = _price_modes(graph, mode)
    return known[key]


def _price_modes(graph: Graph, mode: object) -> _Modes:
    nodes = graph.nodes
    saved = np.array([float(x.output_bytes) if saves_activation(x) else 0.0 for x in nodes])
    zeros = np.zeros(len(nodes))
    paths = [x.module_path for x in nodes]
    containers = repeated_containers(paths)
    blocks = find_blocks(paths, containers)
    firsts: dict[str, int] = {}
    for i, x in enumerate(nodes):
        if x.kind == OP and (b := block_of(x.module_path, containers)) is not None:
            firsts.setdefault(b, i)
    starts = zeros.copy()
    starts[list(firsts.values())] = 1.0
    if mode is False or mode == 0:
        return _Modes(saved, saved, zeros, starts)
    ops = np.array([1.0 if x.kind == OP else 0.0 for x in nodes])
    if not blocks:
        if mode == "selective":
            keep = np.array([1.0 if kept_by_selective(x) else 0.0 for x in nodes])
            return _Modes(saved, np.array([float(x.output_bytes) for x in nodes]) * keep, ops * (1 - keep), starts,
                          whole=True, inside=frozenset(x.name for x in nodes if x.kind == OP))
        return _Modes(saved, zeros, ops, starts, whole=True, inside=frozenset(x.name for x in nodes if x.kind == OP))
    k = mode if isinstance(mode, int) and not isinstance(mode, bool) else 0
    act = stage_activations(nodes, blocks, True if k else mode)
    assert act.by_node is not None
    kept = np.array([float(act.by_node.get(x.name, 0)) for x in nodes])
    again = np.array([1.0 if x.name in act.again else 0.0 for x in nodes])
    if k:  # the first k blocks of a stage: priced as k blocks' average saving, their time as none
        return _Modes(saved, saved, zeros, starts, peak=float(act.peak), k=k,
                      saving=float(saved.sum() - kept.sum()) / len(blocks))
    return _Modes(saved, kept, again, starts, peak=float(act.peak), inside=act.inside)


def _infeasible(graph: Graph, num_stages: int, budgets: list[float],
                memory: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], schedule: str, m: int,
                num_seg: int) -> PartitionError:
    """How much memory the best partition needs, and how many stages would fit."""
    static, kept, rebuilt, recv = memory
    lower = np.tril_indices(num_seg + 1)

    def need(k: int) -> float:
        def matrix(s: int) -> np.ndarray:
            mm = static + held_activations(kept, rebuilt, recv, in_flight_microbatches(schedule, s, k, m), m)
            mm[lower] = INF
            return mm
        return solve(matrix, k).bottleneck

    budget = min(budgets)
    fits = next((k for k in range(num_stages + 1, min(num_seg, 4 * num_stages + 64) + 1) if need(k) <= budget),
                None)
    hint = f"the smallest num_stages that fits is {fits}" if fits else \
        "no stage count up to the number of cut points fits"
    return PartitionError(
        f"{graph.model_name or 'the model'} does not fit in {num_stages} stage{'s' if num_stages != 1 else ''} of "
        f"{format_bytes(budget)}: the best partition needs {format_bytes(need(num_stages))} on its fullest stage "
        "(weights, gradients, "
        f"optimizer state and in-flight activations); {hint}. Use more stages (or ranks), fewer micro-batches "
        "in flight (schedule='1f1b'), recompute=True, a lighter optimizer, or a larger memory_budget."
    )


def held_tensors(graph: Graph, members: Sequence[Sequence[Node]]) -> list[list[str]]:
    """The parameters and buffers each stage holds: those its ops read, and those no op reads
    (a ViT's ``mask_token``, used only when masks are passed), each on the first stage that
    holds a tensor of its module, else of its nearest ancestor module's (the first stage at
    the root). The plain model never gives such a tensor a ``.grad``; neither does its stage,
    which still lists, saves and loads it."""
    held = [list(dict.fromkeys(p for n in nodes for p in n.parameters + n.buffers)) for nodes in members]
    owner: dict[str, int] = {}  # module path -> the first stage holding a tensor under it
    for k in reversed(range(len(held))):
        for name in held[k]:
            path = name
            while path:
                path = path.rpartition(".")[0]
                owner[path] = k
    used = {p for names in held for p in names}
    for name in graph.parameters:
        if name not in used:
            path = name.rpartition(".")[0]
            while path and path not in owner:
                path = path.rpartition(".")[0]
            held[owner.get(path, 0)].append(name)
    return held


def _fingerprint(graph: Graph) -> str:
    """:func:`~replica.partition.graph.fingerprint`, hashed once per graph (every cut's plan carries it)."""
    known = graph.__dict__.get("_fingerprint")
    if known is None or known[0] != len(graph.nodes):
        known = graph.__dict__["_fingerprint"] = (len(graph.nodes), fingerprint(graph))
    return known[1]


def _describe(
    graph: Graph, models: list[CostModel], bounds: list[int], bottleneck: float, m: int, schedule: str,
    flights: list[int], memory_model: MemoryModel, latency: list[float], exact: bool, lower_bound: float,
    stage_ranks: Sequence[int] | None = None, mode_of: Sequence[bool | str | int] | None = None,
) -> Plan:
    nodes = graph.nodes
    num_stages = len(bounds) - 1
    index = {n.name: i for i, n in enumerate(nodes)}
    stage_of = [k for k in range(num_stages) for _ in range(bounds[k], bounds[k + 1])]
    outgoing: list[list[BoundaryTensor]] = [[] for _ in range(num_stages)]
    incoming: list[list[BoundaryTensor]] = [[] for _ in range(num_stages)]
    for i, n in enumerate(nodes):
        later = sorted({stage_of[index[u]] for u in n.users} - {stage_of[i]})
        if not later:
            continue
        t = n.outputs[0] if len(n.outputs) == 1 else None
        # under autocast a value every reader casts crosses cast (replica.partition.crossing)
        readers = [graph[u] for u in n.users if stage_of[index[u]] != stage_of[i]]
        b = BoundaryTensor(
            n.name, stage_of[i], tuple(later), t.shape if t else None, crossing_dtype(n, readers) if t else None,
            int(models[stage_of[i]].scaled(crossing_bytes(n, readers))),
        )
        outgoing[stage_of[i]].append(b)
        for k in later:
            incoming[k].append(b)

    held = held_tensors(graph, [nodes[bounds[k]:bounds[k + 1]] for k in range(num_stages)])
    units = units_in_flight(graph, memory_model)
    containers = repeated_containers(n.module_path for n in nodes)
    deferring = schedule_kind(schedule).splits_backward  # every stage's linears defer their weight gradients
    stages = []
    for k in range(num_stages):
        cm = models[k]
        members = nodes[bounds[k]:bounds[k + 1]]
        params = held[k]
        parameters, gradients, optimizer = _state_bytes(graph, params, memory_model, units, m > 1)
        blocks = find_blocks([n.module_path for n in members], containers)
        mode = mode_of[k] if mode_of is not None else memory_model.recompute
        held_model = memory_model if repr(mode) == repr(memory_model.recompute) else \
            dataclasses.replace(memory_model, recompute=mode)
        saved, rebuilt, again, weight_held = _stage_activations(graph, members, blocks, cm, m, held_model, deferring)
        received = sum(b.nbytes for b in incoming[k])
        # the per-call part: what a call costs whatever the micro-batch size
        fixed_fwd = sum(cm.call_overhead(n) for n in members)
        fixed_bwd = sum(cm.call_overhead(n, backward=True) for n in members)
        fwd = sum(cm.forward_time(n, m) for n in members)
        bwd = sum(cm.backward_time(n, m) for n in members) + sum(cm.forward_time(n, m) for n in members
                                                                 if n.name in again)
        tensor_parallel, tensor_parallel_bytes = 0.0, 0.0
        if cm.tensor_parallel is not None:  # in fwd and bwd already: said apart for the summary
            tensor_parallel = sum((1 + (n.name in again)) * cm.collective_time(n, m)
                                  + cm.collective_time(n, m, backward=True) for n in members)
            tensor_parallel_bytes = sum((1 + (n.name in again)) * cm.collective_bytes(n)
                                        + cm.collective_bytes(n, backward=True) for n in members)
        comm = sum(
            (2 if b.dtype is not None and TensorInfo((), b.dtype).is_floating else 1)
            * cm.transfer_time(b.nbytes, num_messages=0)
            for b in (*incoming[k], *outgoing[k])
        ) + latency[k] * ((k > 0) + (k < num_stages - 1))
        stages.append(StagePlan(
            stage_index=k,
            node_names=tuple(n.name for n in members),
            parameter_names=tuple(params),
            forward_time_s=fwd,
            backward_time_s=bwd,
            communication_time_s=comm,
            memory=MemoryBreakdown(
                parameters=parameters,
                gradients=gradients,
                optimizer=optimizer,
                activations=int(held_activations(saved, rebuilt, received, flights[k], m)),
            ),
            inputs=tuple(incoming[k]),
            outputs=tuple(outgoing[k]),
            module_paths=tuple(dict.fromkeys(n.module_path for n in members if n.module_path)),
            num_ops=sum(1 for n in members if n.kind == OP),
            device=cm.device.name,
            activation_bytes=saved,
            fixed_forward_s=fixed_fwd,
            fixed_backward_s=fixed_bwd + sum(cm.call_overhead(n) for n in members if n.name in again),
            tensor_parallel_s=tensor_parallel,
            tensor_parallel_bytes=int(tensor_parallel_bytes),
            recompute=mode,
            blocks=blocks,
            recompute_bytes=rebuilt,
            in_flight=flights[k],
            weight_grad_bytes=weight_held,
            grad_sync=memory_model.grad_sync if memory_model.sharded else "step",
        ))
    step = bottleneck * (m + num_stages - 1) / m
    tied = {p.name: p.aliases for p in graph.parameters.values() if p.aliases}
    devices = list(dict.fromkeys(cm.device.name for cm in models))
    # the ranks the stages were balanced over (3 stages a rank, interleaved), else the schedule's
    # default; the planner lays out the plan it keeps
    ranks = len(set(stage_ranks)) if stage_ranks is not None else schedule_kind(schedule).pipeline_ranks(num_stages)
    return Plan(
        model_name=graph.model_name, layout=Layout(schedule=schedule, num_stages=num_stages, pipeline_ranks=ranks),
        num_microbatches=m,
        device=devices[0] if len(devices) == 1 else "+".join(devices), stages=tuple(stages),
        predicted_step_time_s=step, tied_parameters=tied, graph_fingerprint=_fingerprint(graph),
        exact=exact, lower_bound_s=lower_bound, recompute=memory_model.recompute,
    )
