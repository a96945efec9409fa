"""One rank's share of the training state: the shard it writes, and a checkpoint loaded back into it.

A rank holds some stages' weights, its optimizer's state for them and its RNG states.
Everything is keyed by ORIGINAL parameter name, so a checkpoint loads into any layout:
each rank takes the names it holds from every shard.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from replica.api import PipelineModel
from replica.checkpoint import store as ckpt
from replica.errors import ReplicaError
from replica.parallel.fsdp import shard_like
from replica.train.optim import load_state_by_name, state_by_name
from replica.train.rng import rng_state, set_rng_state

__all__ = ["shard_of", "load_into_pipeline", "OTHER_MODEL"]

OTHER_MODEL = ("config.checkpoint_dir holds checkpoints of another model (or another size or config of it): point "
               "config.checkpoint_dir at a new directory for this model, or build the model that wrote them.")


def _weights(pipeline: PipelineModel, plain_keys: Collection[str], *, whole: bool = True) -> dict[str, torch.Tensor]:
    """The state_dict entries this rank holds that the plain model has (no stage-only buffers):
    whole tensors (a sharded replica gathers them, with its stage's other replicas), or with
    ``whole=False`` the tensors held (shards), to load into."""
    held = pipeline.state_dict() if whole else pipeline.held_state()
    return {k: v for k, v in held.items() if k in plain_keys}


def shard_of(pipeline: PipelineModel, optimizer: torch.optim.Optimizer | None, names: Mapping[int, str],
             plain_keys: Collection[str], world_size: int) -> ckpt.Shard | None:
    """What this rank writes: one shard per pipeline rank, by data-parallel replica 0's first
    tensor-parallel rank only (sharded replicas, and the tensor-parallel ranks of replica 0,
    first gather their weights and optimizer state whole, together)."""
    if pipeline.plan.layout.sharded and pipeline.data_parallel_size > 1:
        model, optimizer_state = _weights(pipeline, plain_keys), state_by_name(optimizer, names)  # collectives
    elif pipeline.data_parallel_rank == 0:
        model, optimizer_state = _weights(pipeline, plain_keys), state_by_name(optimizer, names)
    if pipeline.data_parallel_rank != 0 or pipeline.tensor_parallel_rank != 0:
        return None
    count = world_size // (pipeline.data_parallel_size * pipeline.plan.layout.tensor_parallel_size)
    return ckpt.Shard(index=pipeline.pipeline_rank, count=count, model=model, optimizer=optimizer_state,
                      rng=rng_state())


def load_into_pipeline(path: str | Path, pipeline: PipelineModel, optimizer: torch.optim.Optimizer | None,
                       names: Mapping[int, str], plain_keys: Collection[str]) -> dict[str, Any]:
    """Copy checkpoint ``path``'s weights, optimizer state and RNG states into this rank's share;
    returns the trainer state the manifest recorded."""
    meta: dict[str, Any] = ckpt.read_manifest(path)["trainer"]
    held = _weights(pipeline, plain_keys, whole=False)
    saved = ckpt.load_model_state(path, names=held.keys())
    missing = sorted(set(held) - set(saved))
    if missing:
        raise ckpt.CheckpointError(
            f"checkpoint {path} lacks {len(missing)} of this rank's {len(held)} weights "
            f"(e.g. {missing[:3]}): it was written for a different model. {OTHER_MODEL}"
        )
    with torch.no_grad():
        for key, tensor in held.items():
            if tensor.shape != saved[key].shape:
                raise ckpt.CheckpointError(
                    f"checkpoint {path}: {key} has shape {tuple(saved[key].shape)}, the model's is "
                    f"{tuple(tensor.shape)}; it was written for a different model. {OTHER_MODEL}"
                )
            tensor.copy_(shard_like(saved[key], tensor))  # a sharded replica keeps its part
    try:
        load_state_by_name(optimizer, ckpt.load_optimizer_states(path), names)
    except (KeyError, RuntimeError, TypeError, ValueError) as exc:
        if isinstance(exc, ReplicaError):
            raise
        raise ckpt.CheckpointError(
            f"the optimizer state in {path} does not fit {type(optimizer).__name__} "
            f"({type(exc).__name__}: {exc}); resume with the optimizer (class and param groups) that wrote it"
        ) from None
    set_rng_state(ckpt.load_rng(path, pipeline.pipeline_rank))
    return meta
