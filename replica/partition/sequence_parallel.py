"""Sequence parallelism's region in the traced graph: the values between tensor-parallel blocks that hold a shard.

Megatron's sequence parallelism (Korthikanti et al., 2022): between the blocks tensor
parallelism cuts, the norms, dropouts and residual adds are computed token by token, so each
rank of the group can hold ``1 / tp`` of the tokens instead of a whole copy. A block's exit
then reduce-scatters its partial sums along the sequence (instead of all-reducing them) and
a block's entry all-gathers the sequence (in backward: the other way round), the same bytes
as the all-reduce, in two halves.

:func:`sequence_region` reads Replica's graph IR and the blocks cut, and returns the values
that hold a sequence shard and the dim they are cut along: the blocks' exits whose outputs
flow into a block's entry through token-wise ops only (element-wise ops, casts, dropout,
layer / RMS norms over the last dim), and those ops. The sequence dim is a batch-first
graph's: dim 1 of a ``(batch, tokens, features)`` value, with every value of the region
keeping the exit's batch and token sizes there. A block whose exit has no such dim (a 2-D
MLP input, a sequence-first graph) keeps its all-reduce, so the region may be empty; the
runtime computes the region's ops on DTensors, which keeps any layout exact: the region only
says where the shard pays. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Sequence

from replica.partition.tensor_parallel import _ELEMENTWISE, ShardedBlock, _base

__all__ = ["SEQUENCE_DIM", "sequence_region", "TOKENWISE"]

SEQUENCE_DIM = 1  # batch-first: (batch, tokens, features)
# ops computed token by token (besides the element-wise ones): a norm over the last dim, a
# mean over it (RMS norm written out: the region checks that it keeps the token dims), dropout
TOKENWISE = frozenset({"layernorm", "layer_norm", "native_layer_norm", "rmsnorm", "rms_norm", "llamarmsnorm",
                       "mean", "dropout", "native_dropout", "identity"})


def _tokenwise(node: Any) -> bool:
    base = _base(node.target).lower()
    return base in _ELEMENTWISE or base in TOKENWISE or base.endswith(("rmsnorm", "layernorm"))


def _tokens(node: Any) -> tuple[int, int] | None:
    """``(batch, tokens)`` of a node's one 3-D tensor output, else None."""
    if node.value_kind != "tensor" or len(node.outputs) != 1 or len(node.outputs[0].shape) != 3:
        return None
    return node.outputs[0].shape[0], node.outputs[0].shape[1]


def sequence_region(graph: Any, blocks: Sequence[ShardedBlock], tensor_parallel_size: int
                    ) -> tuple[tuple[str, int], ...]:
    """``(node, dim)`` of every value of ``graph`` that holds a sequence shard between
    ``blocks`` (see the module's docstring), in graph order: the exits that reduce-scatter
    and the token-wise ops between them and the next blocks' entries. Empty where no exit
    has a sequence dim of at least ``tensor_parallel_size`` tokens."""
    inside = {n for b in blocks for n in b.nodes}
    entries = {e for b in blocks for e in b.entries}
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    exits = {}
    for b in blocks:
        if b.gathers:
            continue
        for e in b.exits:
            tokens = _tokens(graph[e])
            if tokens is not None and tokens[1] >= tensor_parallel_size:
                exits[e] = tokens
    # forward from the exits through token-wise ops keeping their (batch, tokens)
    reached: dict[str, tuple[int, int]] = {}
    frontier = sorted(exits, key=order.__getitem__)
    while frontier:
        name = frontier.pop()
        tokens = exits.get(name) or reached[name]
        for u in graph[name].users:
            user = graph[u]
            if u in inside or u in reached or user.kind != "op" or not _tokenwise(user) or _tokens(user) != tokens:
                continue
            reached[u] = tokens
            frontier.append(u)
    # keep the ops from which an entry is reached within the region (the rest would gather at once)
    useful: set[str] = set()
    for name in sorted(reached, key=order.__getitem__, reverse=True):
        if name in entries or any(u in useful for u in graph[name].users):
            useful.add(name)
    kept = {e for e in exits if e in entries or any(u in useful for u in graph[e].users)}
    return tuple((n, SEQUENCE_DIM) for n in sorted(kept | useful, key=order.__getitem__))
