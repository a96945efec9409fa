"""Expert parallelism: each rank of an expert group holds num_experts / ep experts; tokens travel by all-to-all.

The plan's expert blocks (:mod:`replica.partition.experts`) run, in each stage graph, as one call
of an :class:`ExpertParallel` module at the experts' own path (``model.layers.0.mlp.experts``),
whose parameters are this rank's rows of the stacked weights: DTensor ``Shard(0)`` over the
expert group, under their original names, so ``full_tensor()``, ``state_dict`` and checkpoints
see whole tensors. The expert groups are carved out of the data-parallel replicas of a stage
(torchtitan borrows them from its data-parallel dims too): replicas ``g·ep .. g·ep + ep - 1``
form group ``g``; each trains its own slice of the batch. A call, dropless (no capacity):

1. **dispatch**: the token slots sorted by expert; each expert's slot count goes to every rank
   of the group (an all-to-all of counts), then each token row to its expert's rank
   (``all_to_all_single`` with those splits; differentiable: its backward is the reverse one);
2. **experts**: the user's own experts module runs on the rows it received, each row one slot
   with weight 1 and its local expert's index (its ``num_experts`` the local count);
3. **combine**: the rows go back by the reverse all-to-all and each token sums its slots'
   outputs weighed by the router's weights (an ``index_add``, as the plain block does).

Every rank of a group runs the same ops in the same order, so the collectives pair up; a rank
whose experts got no token still takes part (its gradients flow as zeros). The experts'
gradients hold every group member's tokens: :func:`sync_expert_grads` sums them over the
replicas holding the same experts and divides by the replicas, as the data-parallel average does
for the other weights (which :func:`expert_parameters` keeps out of it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from replica.errors import ConfigError
from replica.parallel.mesh import ParallelMesh
from replica.partition.experts import ExpertBlock
from replica.partition.split import StageModule

__all__ = ["ExpertGroups", "ExpertParallel", "expert_groups", "place_experts", "expert_parameters",
           "sync_expert_grads"]


@dataclass
class ExpertGroups:
    """This rank's expert group (``size`` replicas of its stages) and the replicas holding its experts."""

    size: int
    rank: int  # this rank's place in its expert group
    group: Any  # the expert group: every all-to-all
    mesh: Any  # the same ranks as a 1-D DeviceMesh ("ep"): the experts' DTensor shards live on it
    replicas: Any  # the replicas holding the same experts (None where there is one): their gradients summed
    data_parallel_size: int


def expert_groups(mesh: ParallelMesh, expert_parallel_size: int, device_type: str) -> ExpertGroups:
    """Every rank makes every group, in one order (``new_group`` is collective)."""
    from torch.distributed.device_mesh import DeviceMesh

    layout, e = mesh.layout, expert_parallel_size
    d = layout.data_parallel_size
    mine: dict[str, Any] = {}
    for pp in range(layout.pipeline_ranks):
        for tp in range(layout.tensor_parallel_size):
            for g in range(d // e):
                members = [layout.global_rank(pp, g * e + i, tp) for i in range(e)]
                group = mesh.tied_group(members)
                if group is not None:
                    mine["group"], mine["members"] = group, members
            if d // e > 1:
                for i in range(e):
                    group = mesh.tied_group([layout.global_rank(pp, g * e + i, tp) for g in range(d // e)])
                    if group is not None:
                        mine["replicas"] = group
    members = mine["members"]
    ep_mesh = DeviceMesh.from_group(mine["group"], device_type, mesh=members, mesh_dim_names=("ep",))
    return ExpertGroups(size=e, rank=members.index(mesh.rank), group=mine["group"], mesh=ep_mesh,
                        replicas=mine.get("replicas"), data_parallel_size=d)


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """``x``'s rows, ``in_splits`` of them to each rank of ``group``; ``out_splits`` from each back."""
    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    return all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)


class ExpertParallel(nn.Module):
    """A layer's experts module holding this rank's ``num_experts / ep`` of them, called as the
    original was (``(tokens, index, weights) -> out``) with the dispatch and combine around it."""

    def __init__(self, original: nn.Module, num_experts: int, groups: ExpertGroups) -> None:
        from torch.distributed.tensor import DTensor, Shard

        super().__init__()
        self.num_experts = num_experts
        self.groups = groups
        self.local_experts = num_experts // groups.size
        object.__setattr__(self, "_original", original)  # not a submodule: its own weights are not ours
        for name, p in original.named_parameters(recurse=False):
            rows = p.detach()[groups.rank * self.local_experts:(groups.rank + 1) * self.local_experts].clone()
            shard = DTensor.from_local(rows, groups.mesh, [Shard(0)], run_check=False)
            self.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))

    def _experts(self, tokens: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """The original module's forward on ``tokens``, row ``i`` by local expert ``expert[i]``
        only, weight 1: on a shallow copy that sees this rank's rows as its stacked weights."""
        local = copy.copy(self._original)
        local._parameters = {name: p.to_local() for name, p in self._parameters.items()}
        if hasattr(local, "num_experts"):
            local.num_experts = self.local_experts
        ones = torch.ones(tokens.shape[0], 1, dtype=tokens.dtype, device=tokens.device)
        return type(self._original).forward(local, tokens, expert.unsqueeze(1), ones)

    def forward(self, tokens: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        g, k, L = self.groups, index.shape[-1], self.local_experts
        flat = index.reshape(-1)  # (N * k,): slot n * k + j is token n's j-th expert
        order = torch.argsort(flat, stable=True)  # slots sorted by expert, so by the rank holding it
        counts = torch.bincount(flat, minlength=self.num_experts)  # (E,) slots per expert
        received = torch.empty_like(counts)  # (ep * L,): from each rank, its slots for each of my experts
        work = dist.all_to_all_single(received, counts, group=g.group, async_op=True)
        work.wait()
        send = counts.view(g.size, L).sum(1).tolist()
        recv = received.view(g.size, L).sum(1).tolist()
        rows = _all_to_all(tokens[order // k], recv, send, g.group)  # (M, dim): by source rank, then by expert
        expert = torch.repeat_interleave(torch.arange(L, device=index.device).repeat(g.size), received)
        if rows.shape[0]:
            out = self._experts(rows, expert)
        else:  # no token for my experts: nothing to run, but the reverse all-to-all's backward must run here
            # too, so the (empty) output depends on what needs a gradient (the experts' zero gradients)
            out = rows * 0 + sum(p.to_local().sum() for p in self.parameters()) * 0
        back = _all_to_all(out, send, recv, g.group)  # (N * k, dim), in ``order``
        weighted = back * weights.reshape(-1)[order].unsqueeze(-1).to(back.dtype)
        return torch.zeros_like(tokens).index_add(0, order // k, weighted.to(tokens.dtype))


def _collapse(gm: fx.GraphModule, block: ExpertBlock) -> None:
    """Replace ``block``'s ops in ``gm`` by one call of the module at ``block.path``."""
    nodes = {n.name: n for n in gm.graph.nodes}
    exit_node = nodes[block.exit]
    with gm.graph.inserting_before(exit_node):
        call = gm.graph.call_module(block.path, (nodes[block.tokens], nodes[block.index], nodes[block.weights]))
    call.meta = dict(exit_node.meta)
    exit_node.replace_all_uses_with(call)
    for name in reversed(block.nodes):
        n = nodes.get(name)
        if n is not None and not n.users:
            gm.graph.erase_node(n)
    for n in list(gm.graph.nodes):  # the stacked weights' reads: the module holds them now
        if n.op == "get_attr" and str(n.target).startswith(block.path + "."):
            if n.users:  # an op outside the call still needs the whole experts: no shard can serve it
                raise ConfigError(
                    f"expert parallelism cannot place {block.path}: {sorted(u.name for u in n.users)[:3]} still read "
                    f"its weight {n.target} outside the experts' call; use expert_parallel_size=1")
            gm.graph.erase_node(n)


def place_experts(stages: Iterable[StageModule], blocks: Sequence[ExpertBlock], model: nn.Module,
                  groups: ExpertGroups) -> None:
    """In place: each of ``blocks`` held by one of ``stages`` runs as an :class:`ExpertParallel`
    of ``model``'s experts module at its path, on this rank's share of the experts."""
    for stage in stages:
        gm = stage.module
        names = {n.name for n in gm.graph.nodes}
        mine = [b for b in blocks if b.exit in names]
        for b in mine:
            assert all(n in names for n in b.nodes), f"expert block {b.path} is cut between stages"
            _collapse(gm, b)
            parent, _, leaf = b.path.rpartition(".")
            setattr(gm.get_submodule(parent) if parent else gm, leaf,
                    ExpertParallel(model.get_submodule(b.path), b.num_experts, groups))
        if mine:
            gm.graph.lint()
            gm.recompile()


def expert_parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The experts' shards among ``modules``' parameters (each once)."""
    found: dict[int, nn.Parameter] = {}
    for module in modules:
        for m in module.modules():
            if isinstance(m, ExpertParallel):
                for p in m.parameters(recurse=False):
                    found.setdefault(id(p), p)
    return list(found.values())


def sync_expert_grads(params: Sequence[nn.Parameter], groups: ExpertGroups,
                      wait: Callable[[Any, str, str], None]) -> None:
    """Each expert shard's gradient: summed over the replicas holding it (every token of its
    expert group is in it already), divided by the data-parallel replicas (their average)."""
    from replica.parallel.fsdp import local_tensor

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = local_tensor(p.grad)
        if groups.replicas is not None:
            wait(dist.all_reduce(grad, group=groups.replicas, async_op=True),
                 "the all-reduce of the experts' gradients", "the replicas holding the same experts")
        grad /= groups.data_parallel_size
