"""Sharded data parallelism inside a stage: torch's FSDP2 (``fully_shard``) over the stage's
data-parallel group, applied by the original module names.

A stage is an ``fx.GraphModule`` whose graph calls the model's leaf modules (``Linear``,
``LayerNorm``, ``Embedding``) directly: the blocks that hold them (``transformer.h.3``) are
empty containers there whose ``forward`` never runs, so FSDP's hooks cannot sit on them.
Each block's called leaves are sharded together instead, one FSDP unit per block
(``fully_shard([leaf, leaf, ...])``: the first leaf to run gathers the whole block, as a
block-level unit would); everything else — parameters read by ``get_attr`` (a tied head,
a rewritten norm), leaves outside any block, or shared between blocks — belongs to the
stage's root unit, gathered when the stage starts.

Micro-batches (a stage's ``grad_sync``, :class:`replica.partition.plan.StagePlan`): under
"step" every backward but a stage's last accumulates unsharded gradients
(``set_requires_gradient_sync(False)``) and keeps the weights gathered
(``set_reshard_after_backward(False)``), so a step reduce-scatters each gradient once, not
once per micro-batch; under "microbatch" every backward reduce-scatters its gradients and
frees the gathered weights (FSDP2's default), so gradients accumulate sharded (LLM Foundry's
trade: m reduce-scatters a step for 1/d of the unsharded gradients). Under a split backward
(zero-bubble's W actions) a B whose weight gradients a later W computes reduces nothing; after
that W (the step's last, or each under "microbatch") :func:`reduce_now` runs FSDP2's end of
backward by hand: every unit's accumulated unsharded gradients reduce-scattered, weights freed.
``reshard_after_forward``: True frees the gathered weights after each forward (ZeRO-3:
gathered again for backward); False keeps them to the backward (ZeRO-2's memory for weights,
one all-gather fewer per micro-batch).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx

from replica.errors import ConfigError
from replica.partition.export import drop_dtype_asserts
from replica.partition.mutation import is_view, mutates_first_argument
from replica.stage.checkpoint import checkpointed_modules

__all__ = ["block_groups", "shard_stage", "set_last_backward", "reduce_now", "reshard", "local_tensor", "full_tensor",
           "shard_like", "drop_dtype_asserts"]

_BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")  # the first "<container>.<index>" of a module path


def block_groups(module: fx.GraphModule) -> dict[str, list[str]]:
    """Block path -> the paths of the leaf modules with parameters its graph calls under it
    (those a unit of their own can hook); leaves read by ``get_attr`` or called outside a
    block, and blocks sharing a parameter with another, are left to the root unit."""
    called: list[str] = []
    read: set[str] = set()
    for n in _nodes(module):
        if n.op == "call_module":
            called.append(str(n.target))
        elif n.op == "get_attr":
            read.add(str(n.target).rpartition(".")[0])
    groups: dict[str, list[str]] = defaultdict(list)
    written = _written_outputs(module)
    for path in dict.fromkeys(called):
        sub = module.get_submodule(path)
        m = _BLOCK.match(path)
        if m is None or path in read or not any(True for _ in sub.parameters(recurse=False)):
            continue
        groups[m[1]].append(path)
    # FSDP's backward gather hangs on a unit's output; an in-place write into it (or a view of
    # it) would drop that hook and leave the block's weights sharded in backward
    shared = {m[1] for path in written if (m := _BLOCK.match(path)) is not None}
    # a parameter in two units (a weight shared by two blocks) must stay in the root's
    owner: dict[int, str] = {}
    for block, paths in groups.items():
        for path in paths:
            for p in module.get_submodule(path).parameters():
                if owner.setdefault(id(p), block) != block:
                    shared |= {block, owner[id(p)]}
    gets = {id(p) for path in read if path for p in _parameters_at(module, path)}
    for block, paths in groups.items():
        if any(id(p) in gets for path in paths for p in module.get_submodule(path).parameters()):
            shared.add(block)
    return {b: paths for b, paths in groups.items() if b not in shared}


def _nodes(module: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``module``'s graph and of its checkpointed blocks' regions (whose calls of the
    stage's modules run inside ``torch.utils.checkpoint``, FSDP2's hooks with them)."""
    return [*module.graph.nodes, *(n for region in checkpointed_modules(module) for n in region.graph.nodes)]


def _written_outputs(module: fx.GraphModule) -> set[str]:
    """The called modules whose output (or a view of it) an in-place op writes into."""
    written: set[str] = set()
    for n in _nodes(module):
        if n.op != "call_module":
            continue
        frontier, seen = [n], set()
        while frontier:
            v = frontier.pop()
            for user in v.users:
                if user in seen or user.args[:1] != (v,):
                    continue
                seen.add(user)
                if mutates_first_argument(user, module):
                    written.add(str(n.target))
                elif is_view(user):
                    frontier.append(user)
    return written


def _parameters_at(module: torch.nn.Module, path: str) -> list[torch.Tensor]:
    try:
        return list(module.get_submodule(path).parameters(recurse=False))
    except AttributeError:
        return []


def shard_stage(module: fx.GraphModule, mesh: Any, *, reshard_after_forward: bool = True,
                gather_dtype: torch.dtype | None = None, ignored: "set[torch.nn.Parameter] | None" = None) -> int:
    """Shard ``module``'s parameters over ``mesh`` (the stage's data-parallel group): one FSDP
    unit per block, then the root. ``gather_dtype`` (the run's autocast dtype under mixed
    precision): weights are gathered and computed in it, gradients reduced in fp32 (FSDP's
    ``MixedPrecisionPolicy``), as the planner prices it: half the bytes of each gather, and no
    autocast copy of the weights. ``ignored``: parameters FSDP leaves as they are (expert-parallel
    shards, whose gradients :mod:`replica.parallel.experts` reduces). Returns how many units."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        raise ConfigError(f"sharded data parallelism runs on torch's FSDP2 (torch.distributed.fsdp.fully_shard), "
                          f"which torch {torch.__version__} lacks: upgrade torch (2.6 or later), or plan with "
                          "sharded_data_parallel=False") from None

    if gather_dtype is not None:
        drop_dtype_asserts(module)
    groups = block_groups(module)
    policy = MixedPrecisionPolicy() if gather_dtype is None else \
        MixedPrecisionPolicy(param_dtype=gather_dtype, reduce_dtype=torch.float32)
    extra = {"shard_placement_fn": _shard_placement} if _takes_placement_fn(fully_shard) else {}
    if ignored:
        extra["ignored_params"] = set(ignored)
    for paths in groups.values():
        fully_shard([module.get_submodule(p) for p in paths], mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=policy, **extra)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy, **extra)
    return len(groups) + 1


def _takes_placement_fn(fully_shard: Any) -> bool:
    import inspect

    try:
        return "shard_placement_fn" in inspect.signature(fully_shard).parameters
    except (TypeError, ValueError):
        return False


def _shard_placement(param: torch.nn.Parameter) -> Any:
    """FSDP2's dim for a parameter: dim 0 (its default), except for a tensor-parallel weight
    held part by part along dim 0 (a fused q/k/v projection's ``_StridedShard``), which FSDP
    cannot shard along that dim again exactly: dim 1 (2-D FSDP x TP)."""
    from torch.distributed.tensor import Shard

    for placement in getattr(param, "placements", ()):
        if getattr(placement, "split_factor", 1) > 1 and param.dim() > 1:
            return Shard(1) if placement.dim == 0 else Shard(0)
    return None


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter's or gradient's local shard; any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def full_tensor(t: Any) -> Any:
    """A sharded (DTensor) tensor gathered whole — a collective over its replicas: every one of
    them must call it, in the same order — or anything else as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` (the whole tensor, the same on every replica) cut as the sharded ``like`` is:
    each replica keeps its own part, without communicating; ``full`` itself if ``like`` is not
    sharded."""
    mesh = getattr(like, "device_mesh", None)
    if mesh is None:
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(device=local_tensor(like).device, dtype=like.dtype), mesh, like.placements,
                             src_data_rank=None)


def reshard(module: torch.nn.Module) -> None:
    """Free every FSDP unit's gathered weights under ``module`` (a stage): its parameters are
    the local shards again (zero2 keeps them gathered after a forward without a backward)."""
    for unit in module.modules():
        free = getattr(unit, "reshard", None)
        if callable(free) and hasattr(unit, "set_requires_gradient_sync"):  # an FSDPModule
            free()


def set_last_backward(module: torch.nn.Module, last: bool, every_microbatch: bool = False) -> None:
    """Before a stage's backward of one micro-batch: reduce-scatter the gradients and free the
    gathered weights only after its last one in the step, or (``every_microbatch``) after each."""
    now = last or every_microbatch
    module.set_requires_gradient_sync(now)  # type: ignore[operator]
    module.set_reshard_after_backward(now)  # type: ignore[operator]
    module.set_is_last_backward(now)  # type: ignore[operator]


def reduce_now(module: torch.nn.Module) -> None:
    """After a W action wrote weight gradients into a stage's unsharded parameters outside any
    autograd pass: reduce-scatter every unit's accumulated gradients and free the gathered weights
    now, as FSDP2's root does at the end of a backward (its post-backward callback, run by hand)."""
    set_last_backward(module, True)
    state = module._get_fsdp_state()  # type: ignore[operator]
    state._root_post_backward_final_callback()
