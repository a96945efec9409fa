"""Expert parallelism in the plan: which experts the layout spreads over how many replicas, priced and checked once.

:func:`plan_experts` finds the traced graph's expert blocks (:mod:`replica.partition.experts`),
prices spreading them (:func:`expert_costs`: the all-to-all's bytes and latency within or across
nodes, the routing's imbalance measured on the example batch, the experts' gradient all-reduce
and state saved), settles ``expert_parallel_size`` (the user's number; None: the fastest of
:func:`expert_choices` that fits, whole experts on a tie) and records it on the plan with its
figures. Every number that cannot work is a ``ConfigError`` here, before any rank starts: no
expert block, an expert count or a replica count it does not divide, a stage cut inside a block.

Weighed on the layout the tuner chose (its pipeline, tensor-parallel and data-parallel sizes), not
inside its search: the tuner's layouts are compared without expert parallelism. A size the user
fixes is partitioned on :func:`sharded_experts_graph` (each rank's share of the experts against
the memory budget), so experts that only fit spread are placed; None prices whole experts first.
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

__all__ = ["plan_experts", "expert_choices", "check_experts", "ExpertCosts", "expert_costs", "routing_counts",
           "imbalance", "sharded_experts_graph"]


def expert_choices(blocks: Sequence[ExpertBlock], data_parallel_size: int) -> tuple[int, ...]:
    """The expert-parallel sizes a layout of ``data_parallel_size`` replicas can run: the
    divisors of the replicas that divide every block's expert count."""
    if not blocks:
        return (1,)
    experts = math.gcd(*(b.num_experts for b in blocks))
    return tuple(e for e in range(1, data_parallel_size + 1) if data_parallel_size % e == 0 and experts % e == 0)


def check_experts(blocks: Sequence[ExpertBlock], plan: Plan, expert_parallel_size: int, model_name: str = "") -> None:
    """A ``ConfigError`` naming the numbers and the fix unless ``plan`` can spread every block's
    experts over ``expert_parallel_size`` replicas."""
    e, d = expert_parallel_size, plan.data_parallel_size
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
                f"MoE layer's experts and of the {d} data-parallel replicas)")
    if d % e:
        raise ConfigError(
            f"expert_parallel_size={e} does not divide the plan's {d} data-parallel replicas "
            f"({plan.layout.describe()}): the experts spread over groups of {e} replicas of each stage. Give "
            f"data_parallel_size= a multiple of {e} (or num_stages= that leaves one), or expert_parallel_size in "
            f"{list(expert_choices(blocks, d))}")
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

    def step_delta_s(self, plan: Plan) -> float:
        """The step's predicted change: the busiest stage's added time in every one of the
        pipeline's ``m + p - 1`` slots, less the data-parallel all-reduce it saves where exposed."""
        m, p = plan.num_microbatches, plan.pipeline_ranks
        return (self.alltoall_s + self.imbalance_s) * (m + p - 1) / m - min(self.saved_allreduce_s,
                                                                               plan.exposed_collective_s)


def expert_costs(graph: Graph, plan: Plan, blocks: Sequence[ExpertBlock], expert_parallel_size: int,
                 spec: DeviceSpec, counts: dict[str, list[int]], state_per_byte: float = 4.0) -> ExpertCosts:
    """The :class:`ExpertCosts` of ``plan`` at ``expert_parallel_size`` on ``spec``.

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
        return ExpertCosts(expert_parallel_size=1)
    layout = plan.layout
    bandwidth = spec.collective_bandwidth(e * layout.pipeline_ranks * layout.tensor_parallel_size)
    stage_of = {n: s.stage_index for s in plan.stages for n in s.node_names}
    per_stage: dict[int, list[float]] = {}  # stage -> [bytes, seconds, imbalance seconds, saved s, saved bytes]
    worst = 1.0
    for b in blocks:
        k = stage_of.get(b.exit)
        if k is None:
            continue
        stage = plan.stages[k]
        row = per_stage.setdefault(k, [0.0] * 5)
        slots = b.num_tokens * b.top_k / d / m  # one replica's micro-batch
        half = 2 if plan.precision in ("bf16", "fp16") else 0
        token_bytes = b.token_bytes // 2 if half and b.token_bytes % 2 == 0 else b.token_bytes
        sent = slots * (e - 1) / e * token_bytes
        row[0] += 4 * sent * m
        row[1] += m * (e - 1) * spec.link_latency_s + 4 * m * ((e - 1) * spec.link_latency_s + sent / bandwidth)
        flops = sum(graph[n].flops for n in stage.node_names if n in graph._index) or 1.0
        share = b.flops / flops * (stage.forward_time_s + stage.backward_time_s)
        worse = imbalance(counts.get(b.path, ()), e)
        worst = max(worst, worse)
        row[2] += share * (worse - 1)
        weights = sum(graph.parameters[p].nbytes for p in b.parameters)
        ring = lambda n: 2 * (n - 1) / n * weights / spec.collective_bandwidth(d * layout.pipeline_ranks)  # noqa: E731
        row[3] += ring(d) - ring(d // e)
        row[4] += weights * state_per_byte * (1 - 1 / e)
    if not per_stage:
        return ExpertCosts(expert_parallel_size=e)
    busiest = max(per_stage.values(), key=lambda r: r[1] + r[2])
    return ExpertCosts(expert_parallel_size=e, alltoall_bytes=busiest[0], alltoall_s=busiest[1], imbalance=worst,
                       imbalance_s=busiest[2], saved_allreduce_s=busiest[3],
                       saved_bytes=min(r[4] for r in per_stage.values()))


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


def _priced(plan: Plan, costs: ExpertCosts, blocks: Sequence[ExpertBlock], graph: Graph,
            state_per_byte: float, held_already: bool = False) -> Plan:
    """``plan`` at ``costs``' size, its step and each stage's expert state priced: each rank holds
    ``1 / ep`` of the experts' weights, gradients and optimizer state, which sharded replicas'
    FSDP2 leaves whole (``held_already``: the partition was priced on :func:`sharded_experts_graph`,
    its memory holds ``1 / ep`` already, then ``1 / replicas`` of that where sharded)."""
    e = costs.expert_parallel_size
    d = plan.data_parallel_size if plan.layout.sharded else 1
    priced = (e if held_already else 1) * d  # the experts' share of a rank the partition counted
    stages = []
    for st in plan.stages:
        whole = sum(graph.parameters[p].nbytes for b in blocks for p in b.parameters if p in st.parameter_names)
        delta = whole / e - whole / priced if e > 1 else 0.0  # per copy (weights, gradients, each optimizer state)
        memory = dataclasses.replace(st.memory, parameters=int(st.memory.parameters + delta),
                                     gradients=int(st.memory.gradients + delta),
                                     optimizer=int(st.memory.optimizer + delta * (state_per_byte - 2)))
        stages.append(dataclasses.replace(st, memory=memory))
    layout = dataclasses.replace(plan.layout, expert_parallel_size=e)
    return dataclasses.replace(plan, layout=layout, experts=tuple(blocks), stages=tuple(stages),
                               predicted_step_time_s=plan.predicted_step_time_s + costs.step_delta_s(plan),
                               expert_parallel_s=costs.alltoall_s, expert_parallel_bytes=int(costs.alltoall_bytes),
                               expert_imbalance=costs.imbalance)


def plan_experts(traced: Traced, plan: Plan, expert_parallel_size: int | None, spec: DeviceSpec, *,
                 budget: float = float("inf"), tie: float = 0.01, optimizer: str = "adam") -> Plan:
    """``plan`` with the traced graph's expert blocks and its layout's ``expert_parallel_size``:
    the one asked (checked), or for None the fastest of :func:`expert_choices` whose busiest
    stage fits ``budget``, within ``tie`` the smallest (whole experts: nothing spreads them unless
    it pays). Priced by :func:`expert_costs` on the example batch's routing."""
    graph = traced.graph
    blocks = find_expert_blocks(graph)
    state = 4.0 if optimizer == "adam" else 3.0 if optimizer in ("sgd_momentum", "momentum") else 2.0
    if expert_parallel_size is not None:
        check_experts(blocks, plan, expert_parallel_size, graph.model_name)
        sizes: tuple[int, ...] = (expert_parallel_size,)
    else:
        sizes = expert_choices(blocks, plan.data_parallel_size)
        stage_of = {n: s.stage_index for s in plan.stages for n in s.node_names}
        if any(len({stage_of.get(n) for n in b.nodes}) > 1 for b in blocks):
            sizes = (1,)  # a block cut between stages cannot run its all-to-all
    counts = routing_counts(traced, blocks) if blocks and max(sizes) > 1 else {}
    # a fixed size was partitioned on the sharded experts already (sharded_experts_graph)
    plans = [_priced(plan, expert_costs(graph, plan, blocks, e, spec, counts, state), blocks, graph, state,
                     held_already=expert_parallel_size is not None) for e in sizes]
    fits = [p for p in plans if max(s.predicted_memory_bytes for s in p.stages) <= budget] or plans
    fastest = min(p.predicted_step_time_s for p in fits)
    near = [p for p in fits if p.predicted_step_time_s <= fastest * (1 + tie)]
    return min(near, key=lambda p: (p.layout.expert_parallel_size, p.predicted_step_time_s))  # whole on a tie
