"""Mixture-of-experts structures in the traced graph: the expert blocks expert parallelism places.

:func:`find_expert_blocks` reads Replica's graph IR and returns each :class:`ExpertBlock`: a
module whose own weights are stacked along a first dim of ``num_experts`` (``w1`` ``[E, dim,
hidden]``, Hugging Face's ``gate_up_proj`` ``[E, 2 * inter, hidden]``, GPT-OSS's biases ``[E,
hidden]``), called as Hugging Face's and torchtitan-style experts are::

    experts(tokens (N, dim), index (N, top_k) ints, weights (N, top_k)) -> (N, dim)

each token the sum of its ``top_k`` experts' outputs weighed by ``weights``. The ops of the
module (by module path: fx and exported graphs alike) are the block: the *dispatch* (which
token goes to which expert: a ``nonzero`` loop, a sort and ``grouped_mm``...), the experts
and the *combine* (the weighted sum, an ``index_add``). Its three entries are found by shape
and dtype; ``index`` traces back to the router's ``topk``, whose scored dim is ``num_experts``.
A module called any other way, or whose stacked weights other ops read, is no expert block:
it stays replicated (correct, only not placed). Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ExpertBlock", "find_expert_blocks"]

_PASS_THROUGH = frozenset({"getitem", "getattr", "view", "reshape", "to", "to_copy", "_to_copy", "clone", "contiguous",
                           "long", "int", "type", "alias", "detach"})
_INTEGER = ("int", "uint")


def _base(target: str) -> str:
    """``"topk.default"`` (an exported aten op) and ``"topk"`` alike -> ``"topk"``."""
    return target.split(".")[0]


@dataclass(frozen=True)
class ExpertBlock:
    """One layer's experts, as the traced graph holds them.

    ``path``: the experts module (``model.layers.0.mlp.experts``); ``parameters``: its stacked
    weights by canonical name, each ``[num_experts, ...]``; ``nodes``: the block's ops, in graph
    order; ``tokens``, ``index``, ``weights``: the nodes outside it whose values it takes
    (``(N, dim)``, ``(N, top_k)`` ints, ``(N, top_k)``); ``exit``: its one op read outside
    (``(N, dim)``); ``router``: the ``topk`` that chose ``index``; ``num_tokens``: N on the
    example batch; ``flops``: the block's forward FLOPs there (the experts' share of it is
    what expert parallelism divides); ``token_bytes``: one token's row (``dim`` × its dtype's size)."""

    path: str
    num_experts: int
    top_k: int
    parameters: tuple[str, ...]
    nodes: tuple[str, ...]
    tokens: str
    index: str
    weights: str
    exit: str
    router: str
    num_tokens: int
    flops: float
    token_bytes: int

    def fits(self, expert_parallel_size: int) -> bool:
        """Whether ``expert_parallel_size`` ranks can each hold the same number of its experts."""
        return self.num_experts % expert_parallel_size == 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ExpertBlock":
        return cls(path=str(d["path"]), num_experts=int(d["num_experts"]), top_k=int(d["top_k"]),
                   parameters=tuple(d["parameters"]), nodes=tuple(d["nodes"]), tokens=str(d["tokens"]),
                   index=str(d["index"]), weights=str(d["weights"]), exit=str(d["exit"]), router=str(d["router"]),
                   num_tokens=int(d["num_tokens"]), flops=float(d["flops"]), token_bytes=int(d["token_bytes"]))


def _stacked(graph: Any) -> dict[str, tuple[int, list[str]]]:
    """Module path -> (E, its parameters) for each module whose own parameters all have a first
    dim E >= 2, one of them at least 3-D (a stack of matrices)."""
    owned: dict[str, list[Any]] = {}
    for p in graph.parameters.values():
        if not p.is_buffer:
            owned.setdefault(p.name.rpartition(".")[0], []).append(p)
    found = {}
    for path, params in owned.items():
        firsts = {p.shape[0] if p.shape else 0 for p in params}
        if len(firsts) == 1 and min(firsts) >= 2 and any(len(p.shape) >= 3 for p in params):
            found[path] = (firsts.pop(), sorted(p.name for p in params))
    return found


def _router(graph: Any, name: str) -> Any | None:
    """The ``topk`` op whose indices reach node ``name`` through getitems, views and casts."""
    node = graph[name]
    for _ in range(8):
        if _base(node.target) == "topk":
            return node
        if _base(node.target) not in _PASS_THROUGH or not node.inputs:
            return None
        node = graph[node.inputs[0]]
    return None


def _block(graph: Any, path: str, num_experts: int, params: list[str]) -> ExpertBlock | None:
    inside = [n for n in graph.op_nodes if n.module_path == path or n.module_path.startswith(path + ".")]
    names = {n.name for n in inside}
    readers = {n.name for n in graph.op_nodes for p in n.parameters if graph.canonical(p) in params}
    if not inside or not readers <= names:
        return None
    entries = list(dict.fromkeys(a for n in inside for a in n.inputs if a not in names))
    tensors = [graph[a] for a in entries if graph[a].outputs and graph[a].value_kind == "tensor"]
    # a size computed inside and read outside too (an exported graph shares its symbols) stays where it is
    exits = [n for n in inside if n.outputs and n.value_kind == "tensor" and any(u not in names for u in n.users)]
    if len(tensors) != 3 or len(exits) != 1 or len(exits[0].outputs) != 1:
        return None
    index = [t for t in tensors if t.outputs[0].dtype.startswith(_INTEGER)]
    floats = [t for t in tensors if t.outputs[0].is_floating]
    if len(index) != 1 or len(floats) != 2 or len(index[0].outputs[0].shape) != 2:
        return None
    n, k = index[0].outputs[0].shape
    tokens = [t for t in floats if len(t.outputs[0].shape) == 2 and t.outputs[0].shape[0] == n
              and t.outputs[0].shape != (n, k)]
    weights = [t for t in floats if t.outputs[0].shape == (n, k)]
    if len(tokens) != 1 or len(weights) != 1 or exits[0].outputs[0].shape != tokens[0].outputs[0].shape:
        return None
    router = _router(graph, index[0].name)
    if router is None or router.inputs and graph[router.inputs[0]].outputs[0].shape[-1] != num_experts:
        return None
    out = tokens[0].outputs[0]
    return ExpertBlock(path=path, num_experts=num_experts, top_k=k, parameters=tuple(params),
                       nodes=tuple(n.name for n in inside), tokens=tokens[0].name, index=index[0].name,
                       weights=weights[0].name, exit=exits[0].name, router=router.name, num_tokens=n,
                       flops=sum(x.flops for x in inside), token_bytes=out.nbytes // max(n, 1))


def find_expert_blocks(graph: Any) -> tuple[ExpertBlock, ...]:
    """Every expert block of ``graph`` (Replica's IR), in graph order of their first op."""
    blocks = [b for path, (e, params) in _stacked(graph).items() if (b := _block(graph, path, e, params)) is not None]
    return tuple(sorted(blocks, key=lambda b: graph.index(b.nodes[0])))
