"""Tensor parallelism inside a stage, on torch's DTensor.

The plan names the structures to cut (:class:`~replica.partition.tensor_parallel.ShardedBlock`:
the graph nodes that compute on shards, the parameters cut and along which dim). On each
rank of a stage's tensor-parallel group, :func:`shard_stage_tensors`:

1. replaces each cut parameter by a ``DTensor`` sharded along its dim over the group's mesh
   (each rank keeps only its slice; every rank starts from the same whole weight, so no
   message is needed), under its original name: a tied embedding and head share one;
2. rewrites the stage's graph so that the block's nodes compute on DTensors: every value
   that enters a block from outside becomes a replicated DTensor (a no-op on data; its
   gradient is all-reduced in backward where DTensor finds it partial), and every value
   that leaves one becomes a plain tensor again, replicated — DTensor all-reduces a
   row-parallel output (partial sums) and all-gathers a column-parallel head's logits there.
   Under autocast a value entering a block's linears is cast to autocast's dtype first (as
   the linears would cast it), so its gradient's all-reduce moves half-precision bytes.

With the plan's sequence-parallel region (``sequence``: Megatron-SP, see
:mod:`replica.partition.sequence_parallel`), the exits it names are reduce-scattered along the
tokens instead (:class:`ToSequence`), the token-wise ops after them (norms, residual adds,
dropout) run on those ``Shard(1)`` DTensors (their parameters replicated DTensors), and a
block's entry all-gathers them (:class:`ToReplicated`); a region value read anywhere else (a
stage output, the loss) is gathered whole. Everything else outside the blocks runs on plain
tensors, replicated on each rank of the group.
DTensor propagates the shardings through the ops inside a block (views keep the model's own
head counts: shapes stay global), so the result and every gradient are the plain model's
whatever the plan cuts; the plan only decides what is worth cutting. A stage's inputs and
outputs are plain, whole tensors: the pipeline sends the same bytes between ranks of the same
tensor-parallel coordinate as without tensor parallelism.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from replica.errors import ConfigError
from replica.parallel.fsdp import drop_dtype_asserts
from replica.partition.tensor_parallel import ShardedBlock
from replica.precision import ambient_autocast

__all__ = ["shard_stage_tensors", "match_grad_placements", "split"]

try:
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # older torch: a fused projection cut whole; DTensor then gathers at the split (exact, slower)
    _StridedShard = None  # type: ignore[assignment,misc]

_IN, _IN_CAST, _OUT = "_replica_tp_in", "_replica_tp_in_cast", "_replica_tp_out"


def _dtensor() -> Any:
    try:
        from torch.distributed import tensor as dt
        return dt
    except ImportError:  # torch < 2.5 keeps it under _tensor
        from torch.distributed import _tensor as dt  # type: ignore[no-redef]
        return dt


def _is_dtensor(x: Any) -> bool:
    return isinstance(x, _dtensor().DTensor)


class ToReplicated(torch.nn.Module):
    """A value entering a block: the same data as a replicated DTensor (a plain tensor wrapped,
    no message; a sequence shard all-gathered, its gradient reduce-scattered in backward;
    Python values pass). ``cast``: the value feeds linears, so under autocast it enters in
    autocast's dtype, as the linears would cast it: its gradient's all-reduce (or
    reduce-scatter) then moves half-precision bytes, not fp32's."""

    def __init__(self, mesh: Any, cast: bool = False) -> None:
        super().__init__()
        self.mesh = mesh
        self.cast = cast

    def forward(self, x: Any) -> Any:
        dt = _dtensor()
        half = ambient_autocast(self.mesh.device_type) if self.cast else None

        def wrap(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            if half is not None and v.dtype == torch.float32:  # what autocast casts (not fp64)
                v = v.to(half)
            if not isinstance(v, dt.DTensor):
                return dt.DTensor.from_local(v, self.mesh, [dt.Replicate()], run_check=False)
            if any(not p.is_replicate() for p in v.placements):
                return v.redistribute(self.mesh, [dt.Replicate()])
            return v
        return tree_map(wrap, x)


class ToSequence(torch.nn.Module):
    """A block's exit that stays between blocks as a sequence shard: its partial sums
    reduce-scattered along ``dim`` (the tokens), a DTensor the token-wise ops after it run on."""

    def __init__(self, mesh: Any, dim: int) -> None:
        super().__init__()
        self.mesh = mesh
        self.dim = dim

    def forward(self, x: Any) -> Any:
        dt = _dtensor()

        def scatter(v: Any) -> Any:
            if isinstance(v, dt.DTensor):
                return v.redistribute(self.mesh, [dt.Shard(self.dim)])
            return v
        return tree_map(scatter, x)


class ToPlain(torch.nn.Module):
    """A DTensor leaving a block: made whole and replicated (an all-reduce of partial sums,
    an all-gather of shards), then its local tensor."""

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, x: Any) -> Any:
        dt = _dtensor()

        def unwrap(v: Any) -> Any:
            if isinstance(v, dt.DTensor):
                if any(not p.is_replicate() for p in v.placements):
                    v = v.redistribute(self.mesh, [dt.Replicate()])
                return v.to_local()
            return v
        return tree_map(unwrap, x)


def _strided(dim: int, parts: int) -> Any:
    """Each rank's share of every one of ``parts`` parts along ``dim`` (``_StridedShard``:
    Megatron's layout of a fused q/k/v weight); None where torch has no such placement."""
    return None if _StridedShard is None else _StridedShard(dim, split_factor=parts)


def _placement(dim: int, parts: int) -> Any:
    """``Shard(dim)``; for a fused projection of ``parts`` parts, :func:`_strided`'s, where torch has it."""
    strided = _strided(dim, parts) if parts > 1 else None
    return _dtensor().Shard(dim) if strided is None else strided


def split(x: Any, split_size: Any, dim: int = 0) -> Any:
    """``torch.split`` of a block's value; a fused projection's output held part by part
    (``_StridedShard`` along ``dim``) split in as many equal parts gives each rank its share of
    each part, ``Shard(dim)``, without a message (DTensor's own split would gather it whole).
    The placement is compared whole, not read field by field: dynamo traces the comparison
    (a compiled stage keeps its split in the graph) but not ``_StridedShard.split_factor``."""
    dt = _dtensor()
    if isinstance(x, dt.DTensor) and len(x.placements) == 1:
        nd = x.dim()
        size = x.shape[dim]
        sections = [split_size] * (size // split_size) if isinstance(split_size, int) else list(split_size)
        parts = len(sections)
        strided = _strided(dim % nd, parts) if parts > 1 and len(set(sections)) == 1 and sum(sections) == size else None
        if strided is not None and x.placements[0] == strided:
            pieces = x.to_local().chunk(parts, dim)
            return tuple(dt.DTensor.from_local(piece, x.device_mesh, [dt.Shard(dim % nd)], run_check=False)
                         for piece in pieces)
    return torch.split(x, split_size, dim)


torch.fx.wrap("split")
_registered = False


def register_cpu_attention() -> None:
    """DTensor's sharding rules for the CPU kernel of ``scaled_dot_product_attention``
    (torch has them for the CUDA kernels only): query, key, value and output cut along heads
    (dim 1), a mask whole (it broadcasts over heads), or everything whole. Registered once, when
    a stage is first cut (adds rules for two ops DTensor had none for)."""
    global _registered
    if _registered:
        return
    try:
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:  # torch < 2.5: attention on CPU stays a DTensor error, named when it runs
        return
    dt = _dtensor()
    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is None or backward is None:
        return
    heads, whole = dt.Shard(1), dt.Replicate()

    def mask(attn_mask: Any, cut: Any) -> Any:
        if attn_mask is None:
            return None
        return cut if cut is whole or attn_mask.shape[1] != 1 else whole

    @register_sharding(forward.default)
    def _forward(query: Any, key: Any, value: Any, dropout_p: float = 0.0, is_causal: bool = False,
                 attn_mask: Any = None, scale: Any = None) -> list:
        return [([cut, cut], [cut, cut, cut, None, None, mask(attn_mask, cut), None]) for cut in (heads, whole)]

    @register_sharding(backward.default)
    def _backward(grad_out: Any, query: Any, key: Any, value: Any, out: Any, logsumexp: Any, dropout_p: float,
                  is_causal: bool, attn_mask: Any = None, scale: Any = None) -> list:
        return [([cut, cut, cut], [cut] * 6 + [None, None, mask(attn_mask, cut), None]) for cut in (heads, whole)]

    _registered = True
_SPLITS = {torch.split, torch.Tensor.split, torch.ops.aten.split.Tensor}


def _shard_parameters(module: fx.GraphModule, dims: dict[str, int | None], canonical: dict[str, str],
                      mesh: Any, made: dict[int, torch.nn.Parameter], strided: dict[str, int]) -> int:
    """Each parameter named in ``dims`` (by canonical name) becomes a DTensor cut along its dim
    (None: replicated, for a whole bias a module inside a block adds), at every path it is
    reachable by (``made``: the ones already made from each original, shared by a rank's
    stages so that a weight two of them read stays one parameter). Returns how many."""
    dt = _dtensor()
    size = mesh.size()
    for name, p in list(module.named_parameters(remove_duplicate=False)):
        key = canonical.get(name, name)
        if key not in dims or _is_dtensor(p):
            continue
        dim = dims[key]
        if id(p) not in made:
            if dim is None:
                whole = dt.DTensor.from_local(p.detach(), mesh, [dt.Replicate()], run_check=False)
                made[id(p)] = torch.nn.Parameter(whole, requires_grad=p.requires_grad)
            elif p.shape[dim] % size:
                raise ConfigError(f"parameter {name!r} of shape {tuple(p.shape)} cannot be cut {size} ways along "
                                  f"dim {dim}; re-plan with a tensor_parallel_size that divides {p.shape[dim]}")
            else:
                local = dt.distribute_tensor(p.detach(), mesh, [_placement(dim, strided.get(key, 1))],
                                             src_data_rank=None)
                made[id(p)] = torch.nn.Parameter(local, requires_grad=p.requires_grad)
        path, _, field = name.rpartition(".")
        setattr(module.get_submodule(path), field, made[id(p)])
    return len(made)


def shard_stage_tensors(module: fx.GraphModule, blocks: Sequence[ShardedBlock], mesh: Any,
                        canonical: dict[str, str] | None = None,
                        made: dict[int, torch.nn.Parameter] | None = None, *, fsdp_next: bool = False,
                        sequence: Sequence[tuple[str, int]] = ()) -> int:
    """Cut ``module``'s share of ``blocks`` over ``mesh`` (the stage's tensor-parallel group),
    in place: parameters become DTensor shards, the graph converts at the blocks' borders.
    ``made``: pass one dict to every stage of a rank (a tied weight two of them hold stays one
    parameter). ``fsdp_next``: FSDP2 will shard the stage next (2-D). ``sequence``: the plan's
    sequence-parallel region (:func:`replica.partition.sequence_parallel.sequence_region`):
    those exits reduce-scatter along their dim and those ops between blocks run on the sequence
    shards. Returns how many of the stage's nodes compute on shards."""
    # the ops (a value received from another stage keeps its maker's name: it enters whole)
    names = {n.name for n in module.graph.nodes if n.op in ("call_module", "call_function", "call_method")}
    inside = {n for b in blocks for n in b.nodes} & names
    if not inside:
        return 0
    canonical = canonical or {}
    register_cpu_attention()
    seq = {n: d for n, d in sequence if n in names}
    region = set(seq) - inside  # the token-wise ops between blocks: on sequence shards
    dims: dict[str, int | None] = {p: k for b in blocks if set(b.nodes) & inside for p, k in b.parameters}
    for n in module.graph.nodes:  # a called module's other parameters (a row-parallel bias, a norm's): replicated
        if n.op == "call_module" and (n.name in inside or n.name in region):
            for field, _ in module.get_submodule(str(n.target)).named_parameters(recurse=n.name in region):
                name = f"{n.target}.{field}"
                dims.setdefault(canonical.get(name, name), None)
    strided = {p: k for b in blocks if set(b.nodes) & inside for p, k in b.strided}
    if fsdp_next:  # FSDP2 mis-describes a 1-D tensor it shards again along the dim TP holds part by part
        # (a fused q/k/v bias): keep such a bias whole on each rank of the group (exact; its
        # gradient all-reduced over the group, a few bytes)
        for name in [n for n in strided if _vector(module, n, canonical)]:
            dims[name] = None
            del strided[name]
    _shard_parameters(module, dims, canonical, mesh, {} if made is None else made, strided)
    drop_dtype_asserts(module)  # export's dtype checks have no sharding rule (they compute nothing)
    module.add_module(_IN, ToReplicated(mesh))
    module.add_module(_IN_CAST, ToReplicated(mesh, cast=True))
    module.add_module(_OUT, ToPlain(mesh))
    graph = module.graph
    nodes = [n for n in graph.nodes]
    sharded: set[fx.Node] = {n for n in nodes if n.name in region}  # values held as sequence shards
    # 1. leaving a block: a sequence-parallel exit reduce-scattered (the region reads the shard,
    # anything else its gathered copy); any other exit made whole
    for n in nodes:
        if n.name not in inside:
            continue
        if n.op == "call_method" and n.target == "split" or n.op == "call_function" and n.target in _SPLITS:
            n.op, n.target = "call_function", split  # a fused projection's parts, each rank its share
        outside = [u for u in n.users if u.name not in inside]
        if not outside:
            continue
        if n.name in seq:
            scatter = f"_replica_sp_{seq[n.name]}"
            if not hasattr(module, scatter):
                module.add_module(scatter, ToSequence(mesh, seq[n.name]))
            with graph.inserting_after(n):
                shard = graph.call_module(scatter, (n,))
            sharded.add(shard)
            for u in outside:
                u.replace_input_with(n, shard)
            continue
        with graph.inserting_after(n):
            plain = graph.call_module(_OUT, (n,))
        for u in outside:
            u.replace_input_with(n, plain)
    # 2. a sequence shard read outside the region and the blocks (a stage output, a loss): gathered
    for n in list(sharded):
        others = [u for u in n.users if u.name not in inside and u not in sharded and not _reads_metadata(u)]
        if others:
            with graph.inserting_after(n):
                plain = graph.call_module(_OUT, (n,))
            for u in others:
                u.replace_input_with(n, plain)
    # 3. entering a block or the region: a replicated DTensor (a shard gathered for a block)
    wrapped: dict[tuple[fx.Node, str], fx.Node] = {}
    for n in nodes:
        if n.name not in inside and n.name not in region:
            continue
        target = _IN_CAST if n.name in inside and _linear(module, n) else _IN

        def entering(a: fx.Node) -> fx.Node:
            if a.name in inside and n.name in inside or a in sharded and n.name in region \
                    or a.op == "get_attr" and _is_dtensor(_attr(module, str(a.target))):
                return a
            if (a, target) not in wrapped:
                with graph.inserting_after(a):
                    wrapped[a, target] = graph.call_module(target, (a,))
            return wrapped[a, target]
        n.args = fx.map_arg(n.args, entering)
        n.kwargs = fx.map_arg(n.kwargs, entering)
    graph.lint()
    module.recompile()
    return len(inside) + len(region)


def _reads_metadata(node: fx.Node) -> bool:
    """Whether ``node`` only reads a tensor's shape, dtype or device (a DTensor answers with
    the whole tensor's)."""
    if node.op == "call_method":
        return node.target in ("size", "dim")
    if node.op == "call_function":
        if node.target is getattr:
            return len(node.args) > 1 and node.args[1] in ("shape", "dtype", "device", "ndim", "requires_grad")
        return "sym_size" in str(node.target)
    return False


def _linear(module: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` is a linear layer (a ``Linear`` module, GPT-2's ``Conv1D``, ``F.linear``,
    ``addmm``): autocast casts what it reads."""
    if node.op == "call_module":
        return type(module.get_submodule(str(node.target))).__name__ in ("Linear", "Conv1D")
    name = str(getattr(node.target, "__name__", node.target))
    return name.split(".")[0].lstrip("_") in ("linear", "addmm")


def _vector(module: torch.nn.Module, name: str, canonical: dict[str, str]) -> bool:
    """Whether the parameter ``name`` (canonical) of ``module`` is 1-D."""
    for path, p in module.named_parameters(remove_duplicate=False):
        if canonical.get(path, path) == name:
            return p.dim() == 1
    return False


def _attr(module: torch.nn.Module, target: str) -> Any:
    path, _, field = target.rpartition(".")
    return getattr(module.get_submodule(path), field)


def match_grad_placements(params: Iterable[torch.nn.Parameter]) -> None:
    """Make each DTensor parameter's gradient placed as the parameter is (a partial sum made
    whole), so the optimizer and the data-parallel reduction read what they expect."""
    for p in params:
        g = p.grad
        if g is not None and _is_dtensor(p) and _is_dtensor(g) and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)
