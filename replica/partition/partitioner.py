"""From a priced graph to a plan: price every candidate stage, solve, describe the cuts."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from replica.errors import PartitionError
from replica.partition.cost import CostModel
from replica.partition.graph import INPUT, OP, Graph, TensorInfo
from replica.partition.plan import BoundaryTensor, MemoryBreakdown, Plan, StagePlan
from replica.partition.solver import Transfer, interval_costs, solve

__all__ = ["MemoryModel", "partition", "fingerprint", "in_flight_microbatches"]


@dataclass(frozen=True)
class MemoryModel:
    """Bytes of optimizer state per parameter byte (Adam keeps two fp32 moments: 2.0)."""

    optimizer_state_factor: float = 2.0


def fingerprint(graph: Graph) -> str:
    """A hash of the ops, their wiring and shapes: a plan only applies to the graph it was made for."""
    h = hashlib.sha256()
    for n in graph:
        h.update(f"{n.name}|{n.kind}|{n.target}|{','.join(n.inputs)}|{[t.shape for t in n.outputs]}\n".encode())
    return h.hexdigest()[:16]


def in_flight_microbatches(schedule: str, stage_index: int, num_stages: int, num_microbatches: int) -> int:
    """Micro-batches whose activations a stage holds at once: all of them under GPipe,
    ``num_stages - stage_index`` under 1F1B."""
    if schedule == "gpipe":
        return num_microbatches
    return min(num_microbatches, num_stages - stage_index)


def partition(
    graph: Graph,
    cost_model: CostModel,
    *,
    num_stages: int,
    num_microbatches: int,
    schedule: str,
    memory_model: MemoryModel = MemoryModel(),
) -> Plan:
    """Cut ``graph`` into ``num_stages`` contiguous stages (in its topological order) so that
    the slowest stage — its compute plus everything it sends and receives — is as fast as
    possible. Exact over every cut between two ops."""
    nodes = graph.nodes
    num_ops = len(graph.op_nodes)
    if num_stages > num_ops:
        raise PartitionError(
            f"num_stages={num_stages} is more than the {num_ops} ops of {graph.model_name or 'the model'}: "
            f"every stage needs at least one op. Use num_stages <= {num_ops}."
        )
    m = num_microbatches
    index = {n.name: i for i, n in enumerate(nodes)}
    item_costs = [cost_model.forward_time(n, m) + cost_model.backward_time(n, m) for n in nodes]
    transfers = []
    for i, n in enumerate(nodes):
        if not n.users:
            continue
        directions = 2 if any(t.is_floating for t in n.outputs) else 1  # activation, then its gradient
        cost = directions * cost_model.transfer_time(n.output_bytes, num_messages=0)
        transfers.append(Transfer(i, tuple(index[u] for u in n.users), cost))
    first_op = sum(1 for n in nodes if n.kind == INPUT)
    allowed = [first_op < p < len(nodes) - 1 for p in range(len(nodes) + 1)]
    for i, n in enumerate(nodes):
        if n.value_kind == "container" and n.users:  # tuples of tensors stay with their readers
            for p in range(i + 1, max(index[u] for u in n.users) + 1):
                allowed[p] = False
        if n.writes_into is not None:  # a write through a view happens where its base lives
            for p in range(index[n.writes_into] + 1, i + 1):
                allowed[p] = False
    cost = interval_costs(item_costs, transfers)
    # Everything a stage sends to its neighbours in one direction travels as one message per
    # micro-batch: every stage but the first pays the latency of receiving (and sending back
    # the gradients), every stage but the last that of sending.
    latency = 2 * cost_model.transfer_time(0, num_messages=m)
    cost[1:, :] += latency
    cost[:, :-1] += latency
    try:
        result = solve(cost, num_stages, allowed_cuts=allowed)
    except ValueError as exc:  # pragma: no cover - every finite graph has a partition
        raise PartitionError(f"could not partition {graph.model_name}: {exc}") from exc

    bounds = result.bounds
    stage_of = [k for k in range(num_stages) for _ in range(bounds[k], bounds[k + 1])]
    boundaries: list[list[BoundaryTensor]] = [[] for _ in range(num_stages)]
    incoming: list[list[BoundaryTensor]] = [[] for _ in range(num_stages)]
    for i, n in enumerate(nodes):
        later = sorted({stage_of[index[u]] for u in n.users} - {stage_of[i]})
        if not later:
            continue
        t = n.outputs[0] if len(n.outputs) == 1 else None
        b = BoundaryTensor(
            n.name, stage_of[i], tuple(later), t.shape if t else None, t.dtype if t else None, n.output_bytes
        )
        boundaries[stage_of[i]].append(b)
        for k in later:
            incoming[k].append(b)

    stages = []
    for k in range(num_stages):
        members = nodes[bounds[k]:bounds[k + 1]]
        params = list(dict.fromkeys(p for n in members for p in n.parameters + n.buffers))
        weight_bytes = sum(graph.parameters[p].nbytes for p in params if not graph.parameters[p].is_buffer)
        buffer_bytes = sum(graph.parameters[p].nbytes for p in params if graph.parameters[p].is_buffer)
        saved = sum(n.output_bytes for n in members if n.kind == OP and any(t.is_floating for t in n.outputs))
        held = in_flight_microbatches(schedule, k, num_stages, m)
        fwd = sum(cost_model.forward_time(n, m) for n in members)
        bwd = sum(cost_model.backward_time(n, m) for n in members)
        comm = sum(
            (2 if b.dtype is not None and TensorInfo((), b.dtype).is_floating else 1)
            * cost_model.transfer_time(b.nbytes, num_messages=0)
            for b in (*incoming[k], *boundaries[k])
        ) + latency * ((k > 0) + (k < num_stages - 1))
        stages.append(StagePlan(
            stage_index=k,
            node_names=tuple(n.name for n in members),
            parameter_names=tuple(params),
            forward_time_s=fwd,
            backward_time_s=bwd,
            communication_time_s=comm,
            num_ops=sum(1 for n in members if n.kind == OP),
            memory=MemoryBreakdown(
                parameters=weight_bytes + buffer_bytes,
                gradients=weight_bytes,
                optimizer=int(memory_model.optimizer_state_factor * weight_bytes),
                activations=int(saved * held / m),
            ),
            inputs=tuple(incoming[k]),
            outputs=tuple(boundaries[k]),
            module_paths=tuple(dict.fromkeys(n.module_path for n in members if n.module_path)),
        ))
    step = result.bottleneck * (m + num_stages - 1) / m
    tied = {p.name: p.aliases for p in graph.parameters.values() if p.aliases}
    return Plan(
        model_name=graph.model_name, num_stages=num_stages, num_microbatches=m, schedule=schedule,
        device=cost_model.device.name, stages=tuple(stages), predicted_step_time_s=step,
        tied_parameters=tied, graph_fingerprint=fingerprint(graph),
    )
