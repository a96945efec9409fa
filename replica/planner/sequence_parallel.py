"""What sequence parallelism costs and saves: one tensor-parallel rank's graph and collectives with the tokens cut.

With the plan's sequence region (:func:`replica.partition.sequence_parallel.sequence_region`)
one rank of a ``tp`` group prices, on top of :mod:`replica.planner.tensor_parallel`:

- memory: each value of the region (the exits reduce-scattered and the norms, dropouts and
  residuals after them) ``1 / tp`` of its bytes: the activations between blocks that tensor
  parallelism alone keeps whole on every rank; but a block's entry (a norm's output), whose
  gathered copy the block's linears keep whole for backward (:func:`sequence_graph`);
- compute: the region's ops work on ``1 / tp`` of the tokens;
- collectives, per micro-batch, on the critical path: an exit's all-reduce (2 passes) becomes
  a reduce-scatter in forward (1 pass) and an all-gather of its gradient in backward (1); an
  entry in the region is all-gathered in forward (1) and its gradient reduce-scattered in
  backward (1) instead of all-reduced (2). The bytes are the all-reduce's, split in two
  halves, one each way (:func:`sequence_costs`). An entry cast to autocast's dtype moves
  half-precision bytes (:func:`~replica.planner.tensor_parallel.entry_bytes`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from replica.partition.cost import TensorParallelCosts
from replica.partition.graph import Graph
from replica.partition.tensor_parallel import ShardedBlock
from replica.planner.tensor_parallel import _shard, entry_bytes

__all__ = ["sequence_graph", "sequence_costs"]


def sequence_graph(graph: Graph, blocks: Sequence[ShardedBlock], sequence: Sequence[tuple[str, int]],
                   size: int) -> Graph:
    """``graph`` (one tensor-parallel rank's, :func:`~replica.planner.tensor_parallel.sharded_graph`)
    with the region's values ``1 / size``, but the blocks' entries: a block's linears keep their
    gathered input, whole, for backward; ``graph`` itself for an empty region."""
    held = {n for n, _ in sequence} - {e for b in blocks for e in b.entries}
    if size == 1 or not held:
        return graph
    nodes = [dataclasses.replace(n, users=[], outputs=tuple(_shard(t, size) for t in n.outputs)
                                 if n.name in held else n.outputs) for n in graph.nodes]
    return Graph(nodes, graph.parameters, model_name=graph.model_name)


def sequence_costs(graph: Graph, blocks: Sequence[ShardedBlock], size: int,
                   sequence: Sequence[tuple[str, int]]) -> TensorParallelCosts | None:
    """The ops' prices on one rank of ``size`` with the region cut (see the module's
    docstring); None for no blocks."""
    if size == 1 or not blocks:
        return None
    held = {n for n, _ in sequence}
    forward: dict[str, list[tuple[float, int]]] = {}
    backward: dict[str, list[tuple[float, int]]] = {}
    for b in blocks:
        for e in b.exits:
            nbytes = float(graph[e].output_bytes)
            if e in held:  # reduce-scattered, its gradient all-gathered
                forward.setdefault(e, []).append((nbytes, 1))
                backward.setdefault(e, []).append((nbytes, 1))
            else:  # whole after the collective: all-reduced (2 passes) or gathered (1)
                forward.setdefault(e, []).append((nbytes, 1 if b.gathers else 2))
        first = b.nodes[0]
        for e in b.entries:
            node = graph[e]
            if not any(t.is_floating for t in node.outputs):
                continue
            nbytes = float(entry_bytes(graph, b, e))
            if e in held:  # all-gathered, its gradient reduce-scattered
                forward.setdefault(first, []).append((nbytes, 1))
                backward.setdefault(first, []).append((nbytes, 1))
            else:
                backward.setdefault(first, []).append((nbytes, 2))
    return TensorParallelCosts(size=size, sharded=frozenset(n for b in blocks for n in b.nodes) | held,
                               forward={k: tuple(v) for k, v in forward.items()},
                               backward={k: tuple(v) for k, v in backward.items()})
