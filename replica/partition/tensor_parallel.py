"""Tensor parallelism's structures in the traced graph: what can be cut inside a stage.

:func:`find_blocks` reads Replica's graph IR and returns each :class:`ShardedBlock` it can
shard across ``tp`` ranks, Megatron-style:

- ``"mlp"`` / ``"attention"`` / ``"pair"``: one or more column-parallel linears (weight cut
  along its output features, dim 0; bias too), element-wise, view and batched-matmul ops
  that keep the cut dim a batch-like dim (heads, hidden features), then row-parallel
  linears (weight cut along its input features, dim 1; bias whole) whose outputs are
  all-reduced. The block's entries (the replicated tensors its column linears read) get
  their gradient all-reduced in backward.
- ``"embedding"``: a vocabulary-parallel embedding (weight cut along the vocabulary, dim 0),
  its output all-reduced.
- ``"head"``: a column-parallel linear whose output leaves the graph (an LM head), its
  output all-gathered.

Everything else stays replicated: correctness never depends on a pattern being found (the
runtime computes the blocks on torch's DTensor, which makes any layout exact); a block only
says where sharding pays. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ShardedBlock", "BLOCK_KINDS", "find_blocks"]

BLOCK_KINDS = ("mlp", "attention", "pair", "embedding", "head")


@dataclass(frozen=True)
class ShardedBlock:
    """One structure computed on shards across the tensor-parallel group.

    ``nodes``: the graph's nodes (Replica IR / fx names) that compute on shards, in graph
    order, the linears and embeddings included. ``parameters``: ``(canonical name, dim)``
    of each parameter cut along ``dim`` (the rest the block reads stay whole). ``exits``:
    the nodes whose outputs leave the block (all-reduced, or all-gathered where
    ``gathers``). ``entries``: the nodes outside whose tensor outputs the block reads (in
    backward their gradient is all-reduced, if floating). ``units``: the tensor-parallel
    size must divide it (the heads, kv heads, features or vocabulary the cut runs along).
    """

    kind: str
    nodes: tuple[str, ...]
    parameters: tuple[tuple[str, int], ...]
    exits: tuple[str, ...]
    entries: tuple[str, ...]
    units: int
    gathers: bool = False
    # (parameter, k) of a fused projection (q, k and v in one linear, split in k equal parts
    # along the cut dim after it): each rank holds its share of every part (Megatron's layout)
    strided: tuple[tuple[str, int], ...] = ()

    def fits(self, tensor_parallel_size: int) -> bool:
        """Whether this block can be cut ``tensor_parallel_size`` ways."""
        return tensor_parallel_size > 1 and self.units % tensor_parallel_size == 0

    @classmethod
    def from_dict(cls, d: dict) -> "ShardedBlock":
        return cls(kind=str(d["kind"]), nodes=tuple(d["nodes"]),
                   parameters=tuple((str(n), int(k)) for n, k in d["parameters"]), exits=tuple(d["exits"]),
                   entries=tuple(d["entries"]), units=int(d["units"]), gathers=bool(d.get("gathers", False)),
                   strided=tuple((str(n), int(k)) for n, k in d.get("strided", ())))


# --- finding them ----------------------------------------------------------------------
# Ops whose output keeps a cut dim where their (right-aligned, broadcast) input had it.
_ELEMENTWISE = frozenset({
    "add", "sub", "rsub", "mul", "div", "truediv", "neg", "pow", "exp", "log", "sqrt", "rsqrt", "abs", "square",
    "gelu", "silu", "relu", "tanh", "sigmoid", "softplus", "erf", "mish", "hardswish", "leaky_relu", "elu",
    "newgeluactivation", "geluactivation", "siluactivation", "relu6", "dropout", "native_dropout", "masked_fill",
    "where", "to", "type", "float", "half", "bfloat16", "_to_copy", "to_copy", "contiguous", "clone", "alias",
    "detach", "type_as", "clamp", "minimum", "maximum", "cos", "sin",
})
_RESHAPES = frozenset({"view", "reshape", "unflatten", "flatten", "_unsafe_view", "unsafe_view", "unsqueeze",
                       "squeeze", "view_as", "reshape_as"})
_SLICES = frozenset({"split", "chunk", "getitem", "slice", "narrow", "split_with_sizes", "unbind", "select",
                     "unsafe_split"})
_LINEAR = frozenset({"linear", "addmm"})
_ATTENTION = frozenset({"matmul", "bmm", "softmax", "scaled_dot_product_attention", "baddbmm"})


def _base(target: str) -> str:
    """``"mul.Tensor"`` (an exported aten op) and ``"mul"`` alike -> ``"mul"``."""
    return target.split(".")[0].lstrip("_") if not target.startswith("_to_copy") else "to_copy"


def _prod(xs: "tuple[int, ...] | list[int]") -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


class _Found(Exception):
    """A structure that does not shard: its candidate stays replicated."""


def _linear_of(node: Any, graph: Any) -> tuple[str, str | None, int] | None:
    """``(weight, bias, output features dim of the weight)`` of a linear layer node (``linear``:
    an (out, in) weight; ``addmm``: GPT-2's Conv1D, an (in, out) weight), else None."""
    base = _base(node.target)
    if base not in _LINEAR or not node.outputs:
        return None
    weights = [p for p in node.parameters if len(graph.parameters[graph.canonical(p)].shape) == 2]
    biases = [p for p in node.parameters if len(graph.parameters[graph.canonical(p)].shape) == 1]
    if len(weights) != 1 or len(biases) > 1 or len(node.parameters) != len(weights) + len(biases):
        return None
    if base == "linear" and len([i for i in node.inputs]) != 1:
        return None
    w = graph.canonical(weights[0])
    b = graph.canonical(biases[0]) if biases else None
    out_dim = 0 if base == "linear" else 1
    if graph.parameters[w].shape[out_dim] != node.outputs[0].shape[-1]:
        return None
    return w, b, out_dim


def _fx_args(fx_node: Any) -> tuple[Any, ...]:
    return tuple(fx_node.args) if fx_node is not None else ()


def _int_arg(fx_node: Any, index: int, key: str, default: Any = None) -> Any:
    if fx_node is None:
        return default
    if key in fx_node.kwargs:
        return fx_node.kwargs[key]
    args = fx_node.args
    return args[index] if len(args) > index else default


def _propagate(node: Any, d: int, src: Any, fx_node: Any) -> tuple[int, int]:
    """Where ``node``'s output has the cut dim its input ``src`` has at ``d``, and the size
    of that dim (the tensor-parallel size must divide it). Raises :class:`_Found` where the
    op mixes the cut dim or is not known to keep it."""
    base = _base(node.target)
    if not node.outputs:
        raise _Found(node.name)
    src_shape = src.outputs[0].shape if src.value_kind != "container" else None
    out = node.outputs[0].shape
    if base == "getitem":  # an element of a split along another dim
        return d, out[d]
    if src_shape is None:
        raise _Found(node.name)
    size = src_shape[d]
    if base in _ELEMENTWISE or base in ("expand", "expand_as", "repeat_interleave") and len(out) == len(src_shape):
        k = d + len(out) - len(src_shape)
        if base == "softmax" or k < 0 or out[k] != size:
            raise _Found(node.name)
        return k, size
    if base in ("softmax", "log_softmax"):
        dim = _int_arg(fx_node, 1, "dim")
        if dim is None or out != src_shape or dim % len(out) == d:
            raise _Found(node.name)
        return d, size
    if base in _RESHAPES:
        before = _prod(src_shape[:d])
        acc = 1
        for j, n in enumerate(out):
            if acc == before and n != 1:
                if n == size:
                    return j, size
                if n > size and n % size == 0 and _prod(src_shape[d:d + 1]) == size:
                    return j, size  # merged with the dims after it: the cut one outermost
                if n < size and size % n == 0:
                    return j, n  # split: the cut goes to its outer part
                raise _Found(node.name)
            acc *= n
        raise _Found(node.name)
    if base in ("transpose", "permute", "t", "swapaxes"):
        nd = len(src_shape)
        if base == "t":
            perm = list(range(nd))[::-1]
        elif base == "permute":
            a = _fx_args(fx_node)[1:]
            perm = list(a[0]) if len(a) == 1 and isinstance(a[0], (list, tuple)) else list(a)
        else:
            i, j = _int_arg(fx_node, 1, "dim0"), _int_arg(fx_node, 2, "dim1")
            if i is None or j is None:
                raise _Found(node.name)
            perm = list(range(nd))
            perm[i % nd], perm[j % nd] = perm[j % nd], perm[i % nd]
        if len(perm) != nd or not all(isinstance(p, int) for p in perm):
            raise _Found(node.name)
        return [p % nd for p in perm].index(d), size
    if base in _SLICES:
        if node.value_kind == "container":
            if any(len(t.shape) != len(src_shape) or t.shape[d] != size for t in node.outputs):
                raise _Found(node.name)
            return d, size
        if len(out) == len(src_shape) and out[d] == size:
            return d, size
        raise _Found(node.name)
    if base == "cat":
        dim = _int_arg(fx_node, 1, "dim", 0)
        if len(out) != len(src_shape) or dim % len(out) == d:
            raise _Found(node.name)
        return d, size
    if base in ("matmul", "bmm"):
        # a batched product: the cut dim must be a batch dim of both operands
        if d >= len(src_shape) - 2:
            raise _Found(node.name)
        k = d + len(out) - len(src_shape)
        if out[k] != size:
            raise _Found(node.name)
        return k, size
    if base == "scaled_dot_product_attention":
        if d != len(src_shape) - 3:  # (batch, heads, tokens, head size): cut along heads
            raise _Found(node.name)
        return d, size
    raise _Found(node.name)


def _fused_split(user: Any, d: int, src: Any) -> int:
    """``k`` where ``user`` splits ``src`` in ``k > 1`` equal parts along its cut dim ``d``
    (a fused q/k/v projection's output), else 0."""
    if _base(user.target) not in ("split", "chunk", "split_with_sizes", "unsafe_split") \
            or user.value_kind != "container" or src.value_kind == "container":
        return 0
    shape = src.outputs[0].shape
    parts = [t.shape for t in user.outputs]
    if len(parts) < 2 or any(len(p) != len(shape) or p[d] != parts[0][d] for p in parts) \
            or parts[0][d] * len(parts) != shape[d]:
        return 0
    return len(parts)


def _grow(start: Any, graph: Any, fx_nodes: dict[str, Any], linears: dict[str, tuple[str, str | None, int]]
          ) -> tuple[dict[str, int], set[str], int, int]:
    """The nodes a column-parallel ``start`` cuts (name -> cut dim of its output), the row-
    parallel linears that end it, the units, and ``k`` where its output is split in ``k`` equal
    parts along the cut (a fused projection; else 1). Raises :class:`_Found` where it cannot end."""
    cut: dict[str, int] = {start.name: len(start.outputs[0].shape) - 1}
    rows: set[str] = set()
    units = start.outputs[0].shape[-1]
    factor = 1
    plain = {start.name}  # the start's output, and reshapes of it keeping the cut dim's size
    frontier = [start.name]
    while frontier:
        name = frontier.pop()
        node = graph[name]
        d = cut[name]
        for user_name in node.users:
            user = graph[user_name]
            lin = linears.get(user_name)
            if lin is not None and user.inputs[:1] == (name,) and node.value_kind != "container" \
                    and d == len(node.outputs[0].shape) - 1:
                rows.add(user_name)  # contracts the cut dim: row-parallel, its output all-reduced
                continue
            if user.kind != "op" or lin is not None:
                raise _Found(user_name)
            parts = _fused_split(user, d, node) if name in plain and factor == 1 else 0
            if parts:
                factor = parts
                k, size = d, user.outputs[0].shape[d]
            else:
                k, size = _propagate(user, d, node, fx_nodes.get(user_name))
                if name in plain and _base(user.target) in _RESHAPES and size == node.outputs[0].shape[d]:
                    plain.add(user_name)
            units = _gcd(units, size)
            if user_name in cut:
                if cut[user_name] != k:
                    raise _Found(user_name)
                continue
            cut[user_name] = k
            frontier.append(user_name)
    if not rows:
        raise _Found(start.name)
    return cut, rows, units, factor


def _token_ids(node: Any, graph: Any) -> bool:
    """Whether an embedding's indices come from a graph input (through views): tokens, not
    positions made by ``arange`` or read from a buffer."""
    while node.inputs:
        src = graph[node.inputs[0]]
        if src.kind == "input":
            return True
        if _base(src.target) not in _RESHAPES and _base(src.target) not in ("to", "contiguous"):
            return False
        node = src
    return False


def find_blocks(graph: Any, module: Any = None) -> list[ShardedBlock]:
    """Every structure of ``graph`` (Replica's IR) that can be cut across tensor-parallel
    ranks, in graph order. ``module``: the traced ``fx.GraphModule`` the graph was made from,
    whose op arguments (a transpose's dims, a softmax's dim) make the search exact; without
    it those ops end a structure. A parameter appears in at most one cut dim; a parameter
    read outside any block keeps its block from being cut."""
    fx_nodes = {n.name: n for n in module.graph.nodes} if module is not None else {}
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    linears = {n.name: lin for n in graph.op_nodes if (lin := _linear_of(n, graph)) is not None}
    # column-parallel candidates grown into regions; overlapping regions are one structure
    regions: list[tuple[set[str], dict[str, int], set[str], int]] = []  # (columns, cut, rows, units)
    factors: dict[str, int] = {}  # a fused column's split
    heads: list[str] = []
    for name in linears:
        node = graph[name]
        if node.users and all(graph[u].kind == "output" for u in node.users):
            heads.append(name)
            continue
        try:
            cut, rows, units, factors[name] = _grow(node, graph, fx_nodes, linears)
        except _Found:
            continue
        regions.append(({name}, cut, rows, units))
    merged: list[tuple[set[str], dict[str, int], set[str], int]] = []
    for cols, cut, rows, units in regions:
        for other in [m for m in merged if m[1].keys() & cut.keys() or m[2] & rows]:
            merged.remove(other)
            if any(other[1].get(k, v) != v for k, v in cut.items()):
                cols = set()  # the same node cut two ways: not a structure
            cols, cut, rows, units = cols | other[0] if cols else set(), {**other[1], **cut}, rows | other[2], \
                _gcd(units, other[3])
        merged.append((cols, cut, rows, units))
    blocks: list[ShardedBlock] = []
    for cols, cut, rows, units in merged:
        if not cols or rows & cut.keys() or any(r in linears and graph[r].inputs[0] not in cut for r in rows):
            continue
        params: list[tuple[str, int]] = []
        strided: list[tuple[str, int]] = []
        for c in sorted(cols, key=order.__getitem__):
            w, b, out_dim = linears[c]
            params += [(w, out_dim)] + ([(b, 0)] if b is not None else [])
            if factors.get(c, 1) > 1:
                strided += [(w, factors[c])] + ([(b, factors[c])] if b is not None else [])
        for r in sorted(rows, key=order.__getitem__):
            w, _, out_dim = linears[r]
            params.append((w, 1 - out_dim))  # the bias stays whole: added once, after the sum
        nodes = sorted(cut.keys() | rows, key=order.__getitem__)
        entries = sorted({graph[c].inputs[0] for c in cols}, key=order.__getitem__)
        attention = any(_base(graph[n].target) in _ATTENTION for n in nodes)
        blocks.append(ShardedBlock(kind="attention" if attention else "mlp" if len(rows) == 1 else "pair",
                                   nodes=tuple(nodes), parameters=tuple(params),
                                   exits=tuple(sorted(rows, key=order.__getitem__)), entries=tuple(entries),
                                   units=units, strided=tuple(strided)))
    for n in graph.op_nodes:  # vocabulary-parallel token embeddings
        if _base(n.target) == "embedding" and len(n.parameters) == 1 and n.outputs and _token_ids(n, graph):
            w = graph.canonical(n.parameters[0])
            if len(graph.parameters[w].shape) == 2:
                blocks.append(ShardedBlock(kind="embedding", nodes=(n.name,), parameters=((w, 0),), exits=(n.name,),
                                           entries=(), units=graph.parameters[w].shape[0]))
    rows = {r for b in blocks for r in b.exits}
    for name in [h for h in heads if h not in rows]:  # a column-parallel head: its logits gathered
        w, b, out_dim = linears[name]
        params = [(w, out_dim)] + ([(b, 0)] if b is not None else [])
        blocks.append(ShardedBlock(kind="head", nodes=(name,), parameters=tuple(params), exits=(name,),
                                   entries=(graph[name].inputs[0],), units=graph.parameters[w].shape[out_dim],
                                   gathers=True))
    return _consistent(blocks, graph, order)


def _consistent(blocks: list[ShardedBlock], graph: Any, order: dict[str, int]) -> list[ShardedBlock]:
    """Keep, in graph order, each block whose parameters no kept block cuts another way (a
    linear both a row of one candidate and a column of the next goes with the first); then
    drop blocks whose parameters an op outside every block reads, until none does."""
    blocks = sorted(blocks, key=lambda b: order[b.nodes[0]])
    claimed: dict[str, int] = {}
    kept: list[ShardedBlock] = []
    for b in blocks:
        if all(claimed.get(p, k) == k for p, k in b.parameters):
            kept.append(b)
            claimed.update(b.parameters)
    while True:
        inside = {n for b in kept for n in b.nodes}
        outside = {graph.canonical(p) for n in graph.op_nodes if n.name not in inside for p in n.parameters}
        keep = [b for b in kept if not any(p in outside for p, _ in b.parameters)]
        if len(keep) == len(kept):
            return keep
        kept = keep
