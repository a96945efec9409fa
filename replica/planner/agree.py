"""Set-up across ranks: rank 0's plan reaches every rank, and every rank checks it traced the same graph."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from replica import errors
from replica.errors import ConfigError, ReplicaError
from replica.partition.graph import fingerprint
from replica.partition.plan import Plan
from replica.partition.trace import Traced

__all__ = ["distributed", "use_the_model_device", "agree_on_plan"]


def distributed() -> bool:
    """Whether this process is one of several in a started process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def use_the_model_device(model: torch.nn.Module) -> None:
    """Under NCCL, make the model's GPU this process's current one, so the set-up's object
    collectives (the plan, the graph's fingerprint) run there and not all on GPU 0; a model
    NCCL cannot carry is refused before any collective can hang on it."""
    if dist.get_backend() != "nccl":
        return
    device = next(model.parameters()).device
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):  # a meta model: each rank's own stages
        return  # are materialized on its current GPU (torch.cuda.current_device()) after planning
    if device.type != "cuda":
        raise ConfigError(
            f"the process group runs NCCL, which carries only CUDA tensors, but the model is on {device}. Move it "
            "to this rank's GPU first (model.to(torch.device('cuda', int(os.environ['LOCAL_RANK'])))), or start "
            "the group with init_process_group('gloo') to train on CPUs."
        )
    if device.index is not None:
        torch.cuda.set_device(device)


def agree_on_plan(plan: Plan | None, traced: Traced, seed: int | None = None, *,
                  failed: ReplicaError | None = None) -> tuple[Plan, int | None]:
    """Rank 0's plan and ``seed`` (the seed a meta model's weights are initialized from), on every
    rank; every rank's traced graph must be the one the plan was made for. ``failed``: rank 0's
    planning error, raised on every rank (the same class and message), so none waits for a
    plan that never comes."""
    error = None if failed is None else (type(failed).__name__, str(failed))
    payload = [plan.to_json() if plan is not None else None, seed, error]
    dist.broadcast_object_list(payload, src=0)
    if payload[2] is not None:
        if failed is not None:
            raise failed
        kind, message = payload[2]
        raise getattr(errors, kind, ReplicaError)(f"{message} (rank 0 planned for every rank)")
    agreed = Plan.from_json(payload[0])
    seed = payload[1]
    mine = fingerprint(traced.graph)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    odd = [r for r, f in enumerate(everyone) if f != agreed.graph_fingerprint]
    if odd:
        raise ConfigError(
            f"ranks {odd} traced a different model (graph fingerprints {[everyone[r] for r in odd]}) than rank 0 "
            f"({agreed.graph_fingerprint}). Every rank must build the same model with the same example input "
            "shapes, leaf modules and seed-independent structure."
        )
    return agreed, seed
