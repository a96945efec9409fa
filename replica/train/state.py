"""One rank's share of the training state as DCP state dicts: what it writes, and a checkpoint loaded back into it.

A rank holds some stages' weights (DTensor shards where sharded or cut for tensor
parallelism), its optimizer's state for them and its RNG states. Everything is keyed by
ORIGINAL parameter name — weights as the plain model's state_dict, optimizer state as
``optimizer.state.<name>.<key>`` — and handed to torch.distributed.checkpoint as held: each
rank writes its own shards, nothing is gathered, and a load reshards to whatever the
loading ranks hold, so a checkpoint resumes in any layout.

These state dicts are built here, not by torch's ``get_state_dict`` / ``set_state_dict``: a rank's
share can be several stage modules under one optimizer, a tied weight is written by one stage
only, and a fused q/k/v weight's share goes to DCP box by box (:mod:`replica.checkpoint.pieces`).
As with ``get_state_dict(..., full_state_dict=False)``, DCP receives tensors and DTensors as held,
nothing gathered; the keys are the plain model's names.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from replica.api import PipelineModel
from replica.checkpoint import legacy
from replica.checkpoint import store as ckpt
from replica.checkpoint.optimizer import load_optimizer, optimizer_room, optimizer_tensors
from replica.checkpoint.pieces import as_pieces, needs_pieces
from replica.checkpoint.tensors import misfits
from replica.errors import ReplicaError
from replica.parallel.fsdp import shard_like
from replica.train.optim import load_state_by_name
from replica.train.rng import rng_state, set_rng_state

__all__ = ["save_pipeline", "load_into_pipeline", "OTHER_MODEL"]

OTHER_MODEL = ("config.checkpoint_dir holds checkpoints of another model (or another size or config of it): point "
               "config.checkpoint_dir at a new directory for this model, or build the model that wrote them.")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _held(pipeline: PipelineModel, plain_keys: Collection[str]) -> dict[str, torch.Tensor]:
    """The state_dict entries this rank holds that the plain model has (no stage-only buffers), as
    held: a sharded or tensor-parallel weight is this rank's DTensor shard. No copy, no gather."""
    return {k: v.detach() for k, v in pipeline.held_state().items() if k in plain_keys}


def _tied_owners(pipeline: PipelineModel, keys: Collection[str]) -> dict[str, int]:
    """For each tied weight's names held here, the lowest pipeline rank holding it (collective): only
    its ranks write it, as the copies on other stages may be cut differently (a vocabulary-parallel
    embedding, a whole head) and DCP wants one chunking per name."""
    tied = {n for first, aliases in pipeline.plan.tied_parameters.items() for n in (first, *aliases)}
    mine = {k: pipeline.pipeline_rank for k in keys if k in tied}
    if not _distributed() or not tied:
        return mine
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    owners: dict[str, int] = {}
    for held in everyone:
        for k, r in held.items():
            owners[k] = min(r, owners.get(k, r))
    return owners


def _tied_name(key: str) -> str:
    return key[len(ckpt.OPTIMIZER_PREFIX):].rpartition(".")[0] if key.startswith(ckpt.OPTIMIZER_PREFIX) else key


def save_pipeline(checkpoint_dir: str | Path, step: int, pipeline: PipelineModel,
                  optimizer: torch.optim.Optimizer | None, names: Mapping[int, str], plain_keys: Collection[str],
                  meta: dict[str, Any], *, keep: int, asynchronous: bool = False) -> ckpt.PendingSave:
    """Write this rank's share of checkpoint ``step`` (collective): its weights and optimizer state
    as held, its RNG states; see :func:`replica.checkpoint.store.save`."""
    tensors = _held(pipeline, plain_keys)
    optimizer_state, extras = optimizer_tensors(optimizer, names)
    tensors.update(optimizer_state)
    owners = _tied_owners(pipeline, {_tied_name(k) for k in tensors})
    tensors = {k: v for k, v in tensors.items() if owners.get(_tied_name(k), pipeline.pipeline_rank)
               == pipeline.pipeline_rank}
    tensors = {k: as_pieces(v) if needs_pieces(v) else v for k, v in tensors.items()}
    return ckpt.save(checkpoint_dir, step, tensors, rng_state(), meta, keep=keep,
                     tied=pipeline.plan.tied_parameters, trainer=extras, asynchronous=asynchronous)


def _agree(problem: str | None) -> None:
    """Raise on every rank if any rank found a problem, before anyone enters DCP's collectives."""
    problems = [problem]
    if _distributed():
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    found = [(r, p) for r, p in enumerate(problems) if p]
    if found:
        raise ckpt.CheckpointError(problem or f"rank {found[0][0]}: {found[0][1]}")


def load_into_pipeline(path: str | Path, pipeline: PipelineModel, optimizer: torch.optim.Optimizer | None,
                       names: Mapping[int, str], plain_keys: Collection[str]) -> dict[str, Any]:
    """Copy checkpoint ``path``'s weights, optimizer state and RNG states into this rank's share
    (collective: DCP reads each rank the chunks it holds); returns the trainer state the
    manifest recorded. Another model's checkpoint: a :class:`CheckpointError` on every rank
    naming the first missing or mis-shaped names, before any tensor is read."""
    manifest = ckpt.read_manifest(path)
    if legacy.is_legacy(path):
        return _load_legacy(path, pipeline, optimizer, names, plain_keys)
    problem = None
    try:
        metadata = ckpt.read_index(path)
        specs = {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    except ckpt.CheckpointError as exc:
        specs, problem = {}, str(exc)
    held = _held(pipeline, plain_keys)
    problem = problem or misfits(path, {k: (tuple(m.size), m.properties.dtype) for k, m in specs.items()},
                                 {k: tuple(v.shape) for k, v in held.items()})
    state = dict(held)
    by_index: dict[int, dict[str, torch.Tensor]] = {}
    if optimizer is not None and problem is None:
        room, by_index = optimizer_room(specs, optimizer, names)
        state.update(room)
    _agree(problem)
    state = {k: as_pieces(v) if needs_pieces(v) else v for k, v in state.items()}  # filled in place
    try:
        with ckpt.single_process_quietly():
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=not _distributed())
    except (Exception, CheckpointException) as exc:  # DCP raises on every rank when any rank failed
        raise ckpt.CheckpointError(f"checkpoint {path} cannot be read ({ckpt.dcp_failure(exc)})") from None
    if optimizer is not None:
        load_optimizer(path, optimizer, names, by_index)
    rank = dist.get_rank() if _distributed() else 0
    set_rng_state(_load(Path(path) / ckpt.rank_file(min(rank, int(manifest["world_size"]) - 1))))
    meta: dict[str, Any] = manifest["trainer"]
    return meta


def _load(file: Path) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # missing, unpickling errors, truncated files
        raise ckpt.CheckpointError(f"{file} cannot be read ({type(exc).__name__}: {exc})") from None


def _load_legacy(path: str | Path, pipeline: PipelineModel, optimizer: torch.optim.Optimizer | None,
                 names: Mapping[int, str], plain_keys: Collection[str]) -> dict[str, Any]:
    """A format-1 checkpoint (whole tensors per pipeline rank), read only: each rank takes its names."""
    meta: dict[str, Any] = ckpt.read_manifest(path)["trainer"]
    held = {k: v for k, v in pipeline.held_state().items() if k in plain_keys}
    saved = legacy.load_model_state(path, names=held.keys())
    problem = misfits(path, {k: (tuple(v.shape), v.dtype) for k, v in saved.items()},
                      {k: tuple(v.shape) for k, v in held.items()})
    if problem:
        raise ckpt.CheckpointError(problem)
    with torch.no_grad():
        for key, tensor in held.items():
            tensor.copy_(shard_like(saved[key], tensor))  # a sharded replica keeps its part
    try:
        load_state_by_name(optimizer, legacy.load_optimizer_states(path), names)
    except (KeyError, RuntimeError, TypeError, ValueError) as exc:
        if isinstance(exc, ReplicaError):
            raise
        raise ckpt.CheckpointError(
            f"the optimizer state in {path} does not fit {type(optimizer).__name__} "
            f"({type(exc).__name__}: {exc}); resume with the optimizer (class and param groups) that wrote it"
        ) from None
    set_rng_state(legacy.load_rng(path, pipeline.pipeline_rank))
    return meta
