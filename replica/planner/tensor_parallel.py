"""What tensor parallelism inside a stage costs: the graph one tensor-parallel rank holds, and its collectives.

The planner cuts, for ``tp`` ranks per stage, the blocks of
:func:`replica.partition.tensor_parallel.find_blocks` that :meth:`~ShardedBlock.fits` ``tp``
and pay (:func:`blocks_for`): their shards save more compute than their collectives cost
(priced on the traced batch in one call, where the per-call latency weighs least), or they
hold at least ``MEMORY_SHARE`` (1%) of the model's parameter bytes (a vocabulary-parallel
embedding pays in memory, as in Megatron). Blocks that share a parameter (a tied embedding and
head) are cut together or not at all, so a parameter is never read whole by one op and cut by
another. One rank of the group then prices:

- compute: an op of a block does ``1 / tp`` of its FLOPs and bytes (or of its measured
  work), and pays its whole launch overhead (:class:`~replica.partition.cost.TensorParallelCosts`);
- memory: a cut parameter (and its gradient, optimizer state and autocast copy) is ``1 / tp``
  of its bytes; an output made inside a block, not leaving it, ``1 / tp`` (its activation,
  held for backward); everything else whole (:func:`sharded_graph`);
- collectives over the group, per micro-batch, on the critical path (added to the op's
  forward / backward, not overlapped): an exit's output all-reduced in forward (ring, 2
  passes), or all-gathered (1 pass, then whole) where the block ``gathers``; each floating
  entry's gradient all-reduced in backward (2 passes; in autocast's dtype where the block's
  linears read it so, :func:`entry_bytes`), Megatron's f / g operators; under
  recompute the forward's run again in backward (:func:`sharded_costs`);
- the pipeline never cuts inside a block (:func:`together`): a block's ops, parameters and
  collectives are one stage's; the tensors crossing a cut are whole, and every rank of the
  group sends its whole copy to its peer (no scatter-gather).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from replica.partition.cost import TensorParallelCosts
from replica.partition.graph import Graph, TensorInfo
from replica.partition.tensor_parallel import ShardedBlock

__all__ = ["MEMORY_SHARE", "linked", "blocks_for", "sharded_graph", "sharded_costs", "together",
           "tensor_parallel_choices", "sharded_modules", "entry_bytes"]


MEMORY_SHARE = 0.01  # a block holding this share of the model's parameter bytes is cut even where its time does not pay


def linked(blocks: Sequence[ShardedBlock]) -> list[list[ShardedBlock]]:
    """``blocks`` in groups that share parameters (through any chain), in graph order."""
    parent = list(range(len(blocks)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for i, b in enumerate(blocks):
        for p, _ in b.parameters:
            j = owner.setdefault(p, i)
            parent[root(i)] = root(j)
    groups: dict[int, list[ShardedBlock]] = {}
    for i, b in enumerate(blocks):
        groups.setdefault(root(i), []).append(b)
    return list(groups.values())


def blocks_for(blocks: Sequence[ShardedBlock], size: int,
               pays: Callable[[Sequence[ShardedBlock]], bool] | None = None) -> tuple[ShardedBlock, ...]:
    """The blocks cut ``size`` ways (none for ``size`` 1): each group of blocks sharing
    parameters (:func:`linked`) whose every block fits ``size`` and that ``pays`` (all, where
    not given), in the blocks' order."""
    if size <= 1:
        return ()
    kept = {id(b) for group in linked(blocks) if all(b.fits(size) for b in group) and (pays is None or pays(group))
            for b in group}
    return tuple(b for b in blocks if id(b) in kept)


def _cut_shape(shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    if not shape:
        return shape
    d = dim % len(shape)
    return shape[:d] + (-(-shape[d] // size),) + shape[d + 1:]


def _shard(info: TensorInfo, size: int) -> TensorInfo:
    """``info`` as one of ``size`` shards: its last dim that ``size`` divides cut (the graph
    does not record which dim a block cuts; only the bytes are priced), else its first."""
    shape = info.shape
    dims = [d for d in range(len(shape)) if shape[d] % size == 0 and shape[d] >= size]
    return TensorInfo(_cut_shape(shape, dims[-1] if dims else 0, size), info.dtype) if shape else info


def sharded_graph(graph: Graph, blocks: Sequence[ShardedBlock], size: int) -> Graph:
    """``graph`` as one rank of a ``size``-way tensor-parallel group holds it: the blocks' cut
    parameters and the outputs made inside them (not the exits', whole after their
    collective) ``1 / size``. Names, FLOPs and bytes moved stay (the cost model divides
    those, :class:`~replica.partition.cost.TensorParallelCosts`). ``graph`` itself for none."""
    if size == 1 or not blocks:
        return graph
    cut: dict[str, int] = {}
    for b in blocks:
        for p, dim in b.parameters:
            cut[graph.canonical(p)] = dim
    inside = {n for b in blocks for n in b.nodes} - {n for b in blocks for n in b.exits}
    parameters = {name: dataclasses.replace(info, shape=_cut_shape(info.shape, cut[name], size))
                  if name in cut else info for name, info in graph.parameters.items()}
    nodes = [dataclasses.replace(n, users=[], outputs=tuple(_shard(t, size) for t in n.outputs)
                                 if n.name in inside else n.outputs) for n in graph.nodes]
    return Graph(nodes, parameters, model_name=graph.model_name)


def sharded_costs(graph: Graph, blocks: Sequence[ShardedBlock], size: int) -> TensorParallelCosts | None:
    """The ops' prices on one rank of ``size`` (see the module's docstring); None for none."""
    if size == 1 or not blocks:
        return None
    forward: dict[str, list[tuple[float, int]]] = {}
    backward: dict[str, list[tuple[float, int]]] = {}
    for b in blocks:
        for e in b.exits:  # whole after the collective: all-reduced (2 passes) or gathered (1)
            forward.setdefault(e, []).append((float(graph[e].output_bytes), 1 if b.gathers else 2))
        first = b.nodes[0]  # the block is one stage's: its entries' gradients reduced there
        for e in b.entries:
            node = graph[e]
            if any(t.is_floating for t in node.outputs):
                backward.setdefault(first, []).append((float(entry_bytes(graph, b, e)), 2))
    return TensorParallelCosts(size=size, sharded=frozenset(n for b in blocks for n in b.nodes),
                               forward={k: tuple(v) for k, v in forward.items()},
                               backward={k: tuple(v) for k, v in backward.items()})


def entry_bytes(graph: Graph, block: ShardedBlock, entry: str) -> int:
    """The bytes of ``block``'s ``entry`` as it crosses the group: cast to autocast's half
    precision where the block's linears read it in it (the runtime casts it on entering, so its
    gradient's reduction moves half the bytes of an fp32 one), else its own."""
    node = graph[entry]
    half = {graph[u].compute_dtype for u in node.users if u in block.nodes} & {"bfloat16", "float16"}
    if half:
        return sum(t.numel * 2 if t.is_floating and t.dtype in ("float32", "float64") else t.nbytes
                   for t in node.outputs)
    return node.output_bytes


def together(blocks: Sequence[ShardedBlock]) -> tuple[tuple[str, ...], ...]:
    """The groups of nodes the pipeline must not cut apart: each block's."""
    return tuple(b.nodes for b in blocks if len(b.nodes) > 1)


def tensor_parallel_choices(world_size: int, devices_per_node: int) -> list[int]:
    """The tensor-parallel sizes the tuner tries: the divisors of a node's devices (one
    group within one node's links) that divide the world, smallest first."""
    return [t for t in range(1, max(1, devices_per_node) + 1) if devices_per_node % t == 0 and world_size % t == 0]


def sharded_modules(graph_or_nodes: "Graph | None", block: ShardedBlock) -> tuple[str, ...]:
    """The module paths of ``block``'s ops (its nodes' names where the graph is not at hand)."""
    if graph_or_nodes is None:
        return block.nodes
    return tuple(dict.fromkeys(graph_or_nodes[n].module_path or n for n in block.nodes))
