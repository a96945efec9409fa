"""One rank's share of the training state as DCP state dicts: what it writes, and a checkpoint loaded back into it.

A rank holds some stages' weights (DTensor shards where sharded or cut for tensor
parallelism), its optimizer's state for them and its RNG states. Everything is keyed by
ORIGINAL parameter name — weights as the plain model's state_dict, optimizer state as
``optimizer.state.<name>.<key>`` — and handed to torch.distributed.checkpoint as held: each
rank writes its own shards, nothing is gathered, and a load reshards to whatever the
loading ranks hold, so a checkpoint resumes in any layout.
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
from replica.checkpoint.tensors import misfits
from replica.errors import ReplicaError
from replica.parallel.fsdp import shard_like
from replica.train.optim import load_state_by_name
from replica.train.rng import rng_state, set_rng_state

__all__ = ["save_pipeline", "load_into_pipeline"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _held(pipeline: PipelineModel, plain_keys: Collection[str]) -> dict[str, torch.Tensor]:
    """The state_dict entries this rank holds that the plain model has (no stage-only buffers), as
    held: a sharded or tensor-parallel weight is this rank's DTensor shard. No copy, no gather."""
    return {k: v.detach() for k, v in pipeline.held_state().items() if k in plain_keys}


def _optimizer_tensors(optimizer: torch.optim.Optimizer | None, names: Mapping[int, str]
                       ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Optimizer state tensors as ``optimizer.state.<name>.<key>`` (DTensors as held), and the rest
    (param groups' hyper-parameters, non-tensor state) by parameter name."""
    if optimizer is None:
        return {}, {"state": {}, "param_groups": []}
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{ckpt.OPTIMIZER_PREFIX}{names[id(p)]}.{key}"] = value.detach()
                else:
                    scalars.setdefault(names[id(p)], {})[key] = value
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
              for group in optimizer.param_groups]
    return tensors, {"state": scalars, "param_groups": groups}


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
    optimizer_tensors, extras = _optimizer_tensors(optimizer, names)
    tensors.update(optimizer_tensors)
    owners = _tied_owners(pipeline, {_tied_name(k) for k in tensors})
    tensors = {k: v for k, v in tensors.items() if owners.get(_tied_name(k), pipeline.pipeline_rank)
               == pipeline.pipeline_rank}
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


def _empty_like_saved(p: torch.Tensor, spec: TensorStorageMetadata) -> torch.Tensor:
    """Room for one saved optimizer-state tensor of parameter ``p``: cut as ``p`` is when it has its
    shape (Adam's moments), else whole (a step count)."""
    if tuple(spec.size) == tuple(p.shape):
        return torch.zeros_like(p.detach(), dtype=spec.properties.dtype)
    return torch.zeros(tuple(spec.size), dtype=spec.properties.dtype, device=p.device)


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
        metadata = dcp.FileSystemReader(path).read_metadata()
        specs = {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    except Exception as exc:
        specs, problem = {}, f"{path}/.metadata cannot be read ({type(exc).__name__}: {exc})"
    held = _held(pipeline, plain_keys)
    problem = problem or misfits(path, {k: (tuple(m.size), m.properties.dtype) for k, m in specs.items()},
                                 {k: tuple(v.shape) for k, v in held.items()})
    state = dict(held)
    index: dict[int, dict[str, torch.Tensor]] = {}
    if optimizer is not None and problem is None:
        saved: dict[str, list[str]] = {}
        for key in specs:
            if key.startswith(ckpt.OPTIMIZER_PREFIX):
                name, _, what = key[len(ckpt.OPTIMIZER_PREFIX):].rpartition(".")
                saved.setdefault(name, []).append(what)
        i = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = names[id(p)]
                index[i] = {}
                for what in saved.get(name, ()):
                    key = f"{ckpt.OPTIMIZER_PREFIX}{name}.{what}"
                    state[key] = index[i][what] = _empty_like_saved(p, specs[key])
                i += 1
    _agree(problem)
    try:
        with ckpt.single_process_quietly():
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=not _distributed())
    except (Exception, CheckpointException) as exc:  # DCP raises on every rank when any rank failed
        raise ckpt.CheckpointError(f"checkpoint {path} cannot be read ({ckpt.dcp_failure(exc)})") from None
    if optimizer is not None:
        _load_optimizer(path, optimizer, names, index)
    rank = dist.get_rank() if _distributed() else 0
    set_rng_state(_load(Path(path) / ckpt.rank_file(min(rank, int(manifest["world_size"]) - 1))))
    meta: dict[str, Any] = manifest["trainer"]
    return meta


def _load(file: Path) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # missing, unpickling errors, truncated files
        raise ckpt.CheckpointError(f"{file} cannot be read ({type(exc).__name__}: {exc})") from None


def _load_optimizer(path: str | Path, optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                    index: dict[int, dict[str, torch.Tensor]]) -> None:
    """Hand the optimizer its state: the tensors DCP filled, the non-tensor state and each group's
    hyper-parameters by parameter name (``trainer.pt``, one entry per rank that wrote)."""
    extras = _load(Path(path) / ckpt.TRAINER_FILE)
    scalars: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for extra in extras:
        for name, s in extra["state"].items():
            scalars.setdefault(name, s)
        for group in extra["param_groups"]:
            for name in group["params"]:
                hyper.setdefault(name, {k: v for k, v in group.items() if k != "params"})
    state: dict[int, dict[str, Any]] = {}
    groups = []
    i = 0
    for group in optimizer.param_groups:
        ids, saved_hyper = [], None
        for p in group["params"]:
            name = names[id(p)]
            if index.get(i) or name in scalars:
                state[i] = {**scalars.get(name, {}), **index.get(i, {})}
            saved_hyper = saved_hyper or hyper.get(name)
            ids.append(i)
            i += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, **(saved_hyper or {}), "params": ids})
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (KeyError, RuntimeError, TypeError, ValueError) as exc:
        raise ckpt.CheckpointError(
            f"the optimizer state in {path} does not fit {type(optimizer).__name__} ({type(exc).__name__}: {exc}); "
            "resume with the optimizer (class and param groups) that wrote it"
        ) from None


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
