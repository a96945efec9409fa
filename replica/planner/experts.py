"""Expert parallelism in the plan: how many replicas each MoE layer's experts spread over, priced and checked.

:mod:`~replica.planner.pricing` prices a layout's ``expert_parallel_size`` e with the rest of it,
so the tuner weighs e with pipeline, tensor-parallel and data-parallel sizes, sharding,
micro-batches and recompute (its choices: :func:`expert_choices` of the layout's replicas; a
model without experts has only 1): the layout is cut on :func:`sharded_experts_graph` (each rank
holds ``num_experts / e`` of every layer's experts; under sharding FSDP2 leaves them whole,
:func:`expert_memory`), no cut falls inside an expert block, each stage's forward and backward
take its all-to-alls and the routing's imbalance measured on the example batch
(:func:`stage_expert_costs`, :func:`with_expert_times`), and the experts' gradients are reduced over
the ``D / e`` replicas holding the same experts. :func:`plan_experts` then records the chosen
size's blocks and figures on the plan. Every number that cannot work is a ``ConfigError`` before
any rank starts: no expert block, an expert count or a replica count it does not divide
(:func:`check_expert_size`), a stage cut inside a block (:func:`check_experts`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

from replica.errors import ConfigError
from replica.partition.cost import DeviceSpec
from replica.partition.experts import ExpertBlock, find_expert_blocks
from replica.partition.graph import Graph
from replica.partition.plan import Plan
from replica.partition.trace import Traced

__all__ = ["plan_experts", "expert_choices", "check_experts", "check_expert_size", "ExpertCosts", "expert_costs",
           "StageExperts", "stage_expert_costs", "expert_memory", "with_expert_times", "state_per_byte",
           "routing_counts", "imbalance", "sharded_experts_graph"]


def expert_choices(blocks: Sequence[ExpertBlock], data_parallel_size: int) -> tuple[int, ...]:
    """The expert-parallel sizes a layout of ``data_parallel_size`` replicas can run: the
    divisors of the replicas that divide every block's expert count."""
    if not blocks:
        return (1,)
    experts = math.gcd(*(b.num_experts for b in blocks))
    return tuple(e for e in range(1, data_parallel_size + 1) if data_parallel_size % e == 0 and experts % e == 0)


def check_expert_size(blocks: Sequence[ExpertBlock], expert_parallel_size: int, data_parallel_size: int | None,
                      where: str = "", model_name: str = "") -> None:
    """A ``ConfigError`` naming the numbers and the fix unless every block's experts spread over
    ``expert_parallel_size`` of ``data_parallel_size`` replicas (None: not known yet; ``where``
    describes the layout)."""
    e, d = expert_parallel_size, data_parallel_size
    if e == 1:
        return
    if not blocks:
        raise ConfigError(
            f"expert_parallel_size={e} spreads a mixture of experts' experts over ranks, but "
            f"{model_name or 'the model'} has no expert block (a module of weights stacked [num_experts, ...] "
            "called as experts(tokens, index, weights) after a top-k router); use expert_parallel_size=1 or None")
    for b in blocks:
        if b.num_experts % e:
            fits = [k for k in range(1, b.num_experts + 1) if b.num_experts % k == 0]
            raise ConfigError(
                f"expert_parallel_size={e} does not divide the {b.num_experts} experts of {b.path}: each rank holds "
                f"num_experts / expert_parallel_size of them. Use expert_parallel_size in {fits} (a divisor of every "
                "MoE layer's experts" + (f" and of the {d} data-parallel replicas)" if d else ")"))
    if d is not None and d % e:
        raise ConfigError(
            f"expert_parallel_size={e} does not divide the plan's {d} data-parallel replicas"
            + (f" ({where})" if where else "") + f": the experts spread over groups of {e} replicas of each stage. "
            f"Give data_parallel_size= a multiple of {e} (or num_stages= that leaves one), or expert_parallel_size in "
            f"{list(expert_choices(blocks, d))}")


def check_experts(blocks: Sequence[ExpertBlock], plan: Plan, expert_parallel_size: int, model_name: str = "") -> None:
    """A ``ConfigError`` naming the numbers and the fix unless ``plan`` can spread every block's
    experts over ``expert_parallel_size`` replicas."""
    e = expert_parallel_size
    check_expert_size(blocks, e, plan.data_parallel_size, plan.layout.describe(), model_name)
    if e == 1:
        return
    stage_of = {n: s.stage_index for s in plan.stages for n in s.node_names}
    for b in blocks:
        stages = sorted({stage_of[n] for n in b.nodes if n in stage_of})
        if len(stages) > 1:
            raise ConfigError(
                f"the plan cuts expert block {b.path} between stages {stages}: its experts' all-to-all runs inside "
                "one stage. Use another num_stages, or expert_parallel_size=1")


def routing_counts(traced: Traced, blocks: Sequence[ExpertBlock]) -> dict[str, list[int]]:
    """Per block (by path), the token slots each expert gets on the example batch: the traced graph
    run once (no gradients, the RNG restored) with each block's ``index`` read. Empty where the
    graph cannot run here (a model on meta)."""
    import torch
    import torch.fx as fx

    wanted = {b.index: b for b in blocks}
    if not wanted or not traced.example or any(t.is_meta for t in traced.module.parameters()):
        return {}
    counts: dict[str, list[int]] = {}

    class _Routing(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            out = super().run_node(n)
            block = wanted.get(n.name)
            if block is not None and isinstance(out, torch.Tensor):
                counts[block.path] = torch.bincount(out.reshape(-1), minlength=block.num_experts).tolist()
            return out

    try:
        with torch.no_grad(), torch.random.fork_rng():
            _Routing(traced.module).run(*traced.example)
    except Exception:  # noqa: BLE001 - a graph that cannot run eagerly here: balanced routing assumed
        return {}
    return counts


def imbalance(counts: Sequence[int], expert_parallel_size: int) -> float:
    """The busiest rank's token slots over the mean, its experts ``num_experts / ep`` consecutive
    ones (1.0: balanced; every rank computes its own tokens' experts at ep = 1)."""
    e = expert_parallel_size
    if e <= 1 or not counts or sum(counts) == 0:
        return 1.0
    per = len(counts) // e
    loads = [sum(counts[r * per:(r + 1) * per]) for r in range(e)]
    return max(loads) / (sum(loads) / e)


@dataclass(frozen=True)
class ExpertCosts:
    """What spreading the experts over ``expert_parallel_size`` replicas costs and saves, per step,
    on the busiest pipeline rank: the all-to-all (``alltoall_bytes`` sent by each rank, in
    ``alltoall_s``, not overlapped), the routing's ``imbalance`` (its busiest rank's extra expert
    compute, ``imbalance_s``), the gradient all-reduce the experts no longer take part in
    (``saved_allreduce_s``) and the expert state each rank no longer holds (``saved_bytes``)."""

    expert_parallel_size: int
    alltoall_bytes: float = 0.0
    alltoall_s: float = 0.0
    imbalance: float = 1.0
    imbalance_s: float = 0.0
    saved_allreduce_s: float = 0.0
    saved_bytes: float = 0.0


@dataclass(frozen=True)
class StageExperts:
    """One stage's expert-parallel price over a step (all its micro-batches): the all-to-alls
    its forwards and backwards wait for (``forward_s``, ``backward_s``: the counts' exchange and
    the token rows there and back in forward, the rows' gradients back and there in backward),
    the routing imbalance's extra expert compute in each, the bytes a rank sends, and the
    all-reduce and state of its experts that expert parallelism leaves out."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    alltoall_s: float = 0.0
    alltoall_bytes: float = 0.0
    imbalance_s: float = 0.0
    imbalance: float = 1.0
    saved_allreduce_s: float = 0.0
    saved_bytes: float = 0.0


def stage_expert_costs(graph: Graph, plan: Plan, blocks: Sequence[ExpertBlock], expert_parallel_size: int,
                       spec: DeviceSpec, counts: dict[str, list[int]],
                       state_per_byte: float = 4.0) -> dict[int, StageExperts]:
    """Per stage holding an expert block, its :class:`StageExperts` in ``plan`` at
    ``expert_parallel_size`` on ``spec`` (stage times read: ``plan``'s, without expert parallelism).

    Per MoE layer, micro-batch and rank, with ``S = tokens × top_k`` slots of a replica's
    micro-batch: the counts' all-to-all (latency only), then the token rows there and back in
    forward and again in backward, 4 all-to-alls of ``S (ep - 1) / ep`` rows each way, each
    paying ``ep - 1`` link latencies plus its bytes at the group's bandwidth (the node's links
    while the group's ranks fit one node, else the network: an expert group spans ``ep ×
    pipeline ranks × tensor-parallel size`` consecutive ranks). The imbalance: the block's share
    of its stage's time (by FLOPs) times the busiest rank's load over the mean, less one. Saved:
    the experts' gradient ring all-reduce over ``D`` replicas becomes one over ``D / ep``, and each
    rank holds ``1 / ep`` of their weights, gradients and optimizer state (``state_per_byte``
    times the weights: Adam's 4)."""
    e, d, m = expert_parallel_size, plan.data_parallel_size, plan.num_microbatches
    if e <= 1 or not blocks:
        return {}
    layout = plan.layout
    bandwidth = spec.collective_bandwidth(e * layout.pipeline_ranks * layout.tensor_parallel_size)
    stage_of = {n: s.stage_index for s in plan.stages for n in s.node_names}
    rows: dict[int, list[float]] = {}  # stage -> [fwd s, bwd s, a2a s, bytes, imbalance s, worst, saved s, saved b]
    for b in blocks:
        k = stage_of.get(b.exit)
        if k is None:
            continue
        stage = plan.stages[k]
        row = rows.setdefault(k, [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0])
        slots = b.num_tokens * b.top_k / d / m  # one replica's micro-batch
        half = plan.precision in ("bf16", "fp16")
        token_bytes = b.token_bytes // 2 if half and b.token_bytes % 2 == 0 else b.token_bytes
        sent = slots * (e - 1) / e * token_bytes
        one = (e - 1) * spec.link_latency_s + sent / bandwidth  # one all-to-all of token rows
        counts_s = m * (e - 1) * spec.link_latency_s
        flops = sum(graph[n].flops for n in stage.node_names if n in graph._index) or 1.0
        worse = imbalance(counts.get(b.path, ()), e)
        extra = b.flops / flops * (worse - 1)  # the busiest rank's extra share of its stage's time
        row[0] += counts_s + 2 * m * one + extra * stage.forward_time_s
        row[1] += 2 * m * one + extra * stage.backward_time_s
        row[2] += counts_s + 4 * m * one
        row[3] += 4 * sent * m
        row[4] += extra * (stage.forward_time_s + stage.backward_time_s)
        row[5] = max(row[5], worse)
        weights = sum(graph.parameters[p].nbytes for p in b.parameters)
        ring = lambda n: 2 * (n - 1) / n * weights / spec.collective_bandwidth(d * layout.pipeline_ranks)  # noqa: E731
        row[6] += ring(d) - ring(d // e)
        row[7] += weights * state_per_byte * (1 - 1 / e)
    return {k: StageExperts(*r) for k, r in rows.items()}


def expert_costs(graph: Graph, plan: Plan, blocks: Sequence[ExpertBlock], expert_parallel_size: int,
                 spec: DeviceSpec, counts: dict[str, list[int]], state_per_byte: float = 4.0) -> ExpertCosts:
    """The :class:`ExpertCosts` of ``plan`` at ``expert_parallel_size`` on ``spec``: the busiest
    stage's of :func:`stage_expert_costs` (its all-to-all and imbalance), the least state saved."""
    e = expert_parallel_size
    per_stage = stage_expert_costs(graph, plan, blocks, e, spec, counts, state_per_byte)
    if not per_stage:
        return ExpertCosts(expert_parallel_size=max(1, e) if blocks else 1)
    busiest = max(per_stage.values(), key=lambda r: r.alltoall_s + r.imbalance_s)
    return ExpertCosts(expert_parallel_size=e, alltoall_bytes=busiest.alltoall_bytes, alltoall_s=busiest.alltoall_s,
                       imbalance=max(r.imbalance for r in per_stage.values()), imbalance_s=busiest.imbalance_s,
                       saved_allreduce_s=busiest.saved_allreduce_s,
                       saved_bytes=min(r.saved_bytes for r in per_stage.values()))


def sharded_experts_graph(graph: Graph, expert_parallel_size: int) -> Graph:
    """``graph`` as a rank holds it at ``expert_parallel_size``: every expert block's stacked
    weights ``[num_experts / ep, ...]`` (what the partitioner weighs against the memory budget
    when the size is fixed). ``graph`` itself at 1, or where a block's experts do not divide."""
    e = expert_parallel_size
    blocks = find_expert_blocks(graph) if e > 1 else ()
    if not blocks or any(not b.fits(e) for b in blocks):
        return graph
    cut = {p for b in blocks for p in b.parameters}
    parameters = {name: dataclasses.replace(info, shape=(info.shape[0] // e, *info.shape[1:])) if name in cut else info
                  for name, info in graph.parameters.items()}
    nodes = [dataclasses.replace(n, users=[]) for n in graph.nodes]
    return Graph(nodes, parameters, model_name=graph.model_name)


def expert_memory(graph: Graph, plan: Plan, blocks: Sequence[ExpertBlock], state_per_byte: float) -> Plan:
    """``plan`` (its memory counted on ``graph``, :func:`sharded_experts_graph` at its layout's
    size) with each stage's experts held whole by every rank of a sharded layout: FSDP2 leaves
    the experts' shards alone (``ignored_params``), so a rank holds ``1 / ep`` of them, not the
    ``1 / (ep × shard group)`` the sharded memory model counted. Unchanged unsharded or at ep 1."""
    layout = plan.layout
    g = layout.dp_shard if layout.sharded else 1
    if layout.expert_parallel_size <= 1 or g <= 1 or not blocks:
        return plan
    cut = {p for b in blocks for p in b.parameters}
    stages = []
    for st in plan.stages:
        held = sum(graph.parameters[p].nbytes for p in st.parameter_names if p in cut)
        delta = held - held / g  # per copy (weights, gradients, each optimizer state)
        if delta:
            memory = dataclasses.replace(st.memory, parameters=int(st.memory.parameters + delta),
                                         gradients=int(st.memory.gradients + delta),
                                         optimizer=int(st.memory.optimizer + delta * (state_per_byte - 2)))
            st = dataclasses.replace(st, memory=memory)
        stages.append(st)
    return dataclasses.replace(plan, stages=tuple(stages))


def with_expert_times(plan: Plan, per_stage: dict[int, StageExperts]) -> Plan:
    """``plan`` with each stage's all-to-alls and routing imbalance in its forward and backward
    times (over the step: the simulator spreads them over the stage's micro-batches)."""
    if not per_stage:
        return plan
    stages = tuple(dataclasses.replace(st, forward_time_s=st.forward_time_s + per_stage[st.stage_index].forward_s,
                                       backward_time_s=st.backward_time_s + per_stage[st.stage_index].backward_s)
                   if st.stage_index in per_stage else st for st in plan.stages)
    return dataclasses.replace(plan, stages=stages)


def state_per_byte(optimizer: str) -> float:
    """Copies of a weight's bytes a rank keeps: the weight, its gradient and the optimizer's states."""
    return 4.0 if optimizer == "adam" else 3.0 if optimizer in ("sgd_momentum", "momentum") else 2.0


def plan_experts(traced: Traced, plan: Plan, expert_parallel_size: int | None, spec: DeviceSpec, *,
                 optimizer: str = "adam", counts: dict[str, list[int]] | None = None) -> Plan:
    """``plan`` with the traced graph's expert blocks and the figures of its layout's
    ``expert_parallel_size`` (the user's, or the one the search chose: the layout priced it,
    :class:`~replica.planner.pricing.Pricing` adds the all-to-alls and imbalance to the stages'
    times and counts each rank's share of the experts): the busiest stage's all-to-all, its bytes
    and the routing imbalance, from :func:`expert_costs` on the example batch's routing. A size
    asked is checked (:func:`check_experts`). ``counts``: the routing already read (else read here)."""
    graph = traced.graph
    blocks = find_expert_blocks(graph)
    e = plan.layout.expert_parallel_size
    if expert_parallel_size is not None or e > 1:
        check_experts(blocks, plan, expert_parallel_size or e, graph.model_name)
    plan = dataclasses.replace(plan, experts=tuple(blocks))
    if e <= 1 or not blocks:
        return plan
    counts = routing_counts(traced, blocks) if counts is None else counts
    costs = expert_costs(graph, plan, blocks, e, spec, counts, state_per_byte(optimizer))
    return dataclasses.replace(plan, expert_parallel_s=costs.alltoall_s,
                               expert_parallel_bytes=int(costs.alltoall_bytes), expert_imbalance=costs.imbalance)
