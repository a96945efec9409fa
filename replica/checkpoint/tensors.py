"""A checkpoint's weights read in one process, tensor by tensor: their names and shapes, one tensor, the plain model.

A DCP checkpoint (format 2) holds each tensor as the chunks its writers held; reading one
here asks torch.distributed.checkpoint for that name alone (``no_dist``: no collective, also
inside a distributed run), so memory holds about one tensor, never the model. Format 1
checkpoints are read memory-mapped (:mod:`replica.checkpoint.legacy`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from replica.checkpoint import legacy
from replica.checkpoint.optimizer import load_optimizer, optimizer_room
from replica.checkpoint.store import (
    OPTIMIZER_PREFIX,
    CheckpointError,
    dcp_failure,
    read_index,
    resolve,
    single_process_quietly,
)

__all__ = ["StoredWeights", "stored_weights", "misfits", "load_into_plain_model"]

Spec = tuple[tuple[int, ...], torch.dtype]
_LISTED = 5


class StoredWeights:
    """The model tensors of one checkpoint: ``specs`` (name -> (shape, dtype)) and :meth:`read`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._legacy: dict[str, torch.Tensor] | None = None
        self.legacy = legacy.is_legacy(path)
        if self.legacy:
            self._legacy = legacy.load_model_state(path)  # memory-mapped: read when copied
            self.specs = {k: (tuple(v.shape), v.dtype) for k, v in self._legacy.items()}
            return
        metadata = read_index(path)
        self.specs = {k: (tuple(m.size), m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
                      if isinstance(m, TensorStorageMetadata) and not k.startswith(OPTIMIZER_PREFIX)}

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` whole, on the CPU (a memory-mapped view for format 1)."""
        if self._legacy is not None:
            return self._legacy[name]
        shape, dtype = self.specs[name]
        tensor = torch.empty(shape, dtype=dtype)
        self.load({name: tensor})
        return tensor

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill ``tensors`` (names of this checkpoint -> tensors of their shapes) in place."""
        if self._legacy is not None:
            with torch.no_grad():
                for name, t in tensors.items():
                    t.copy_(self._legacy[name])
            return
        try:
            with single_process_quietly():
                dcp.load(tensors, storage_reader=dcp.FileSystemReader(self.path), no_dist=True)
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(f"checkpoint {self.path} cannot be read ({dcp_failure(exc)})") from None


def stored_weights(path: str | os.PathLike[str]) -> StoredWeights:
    """The weights of checkpoint ``path`` (a step directory, or the newest good one of a checkpoint_dir)."""
    return StoredWeights(resolve(path))


def misfits(path: str | os.PathLike[str], stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
            wanted: Mapping[str, tuple[int, ...]], *, unexpected: bool = False,
            fix: str = "resume from a checkpoint of this model and config, or point config.checkpoint_dir at a "
                       "new directory") -> str | None:
    """What keeps ``stored`` from loading into tensors of ``wanted`` shapes (by name): the first missing,
    mis-shaped (and with ``unexpected``, unknown) names, as a sentence; None when it fits."""
    missing = [n for n in wanted if n not in stored]
    wrong = [f"{n} {tuple(stored[n][0])} where the model has {tuple(s)}" for n, s in wanted.items()
             if n in stored and tuple(stored[n][0]) != tuple(s)]
    extra = [n for n in stored if n not in wanted] if unexpected else []
    if not (missing or wrong or extra):
        return None
    parts = []
    for count, what, names in ((len(missing), "missing", missing), (len(wrong), "mis-shaped", wrong),
                               (len(extra), "not the model's", extra)):
        if count:
            parts.append(f"{count} {what} (first: {', '.join(names[:_LISTED])})")
    return (f"checkpoint {path} was written for another model: of the model's {len(wanted)} tensors, "
            + "; ".join(parts) + f". Fix: {fix}")


def load_into_plain_model(path: str | os.PathLike[str], model: torch.nn.Module, *, strict: bool = True,
                          optimizer: torch.optim.Optimizer | None = None) -> torch.nn.Module:
    """Load a checkpoint (a ``step-XXXXXXXX`` directory, or the newest good one in a
    ``checkpoint_dir``) into the plain, unsplit model, whatever layout wrote it: each tensor
    read into the model's own, one at a time. ``strict``: every key of the model's state_dict
    stored, and nothing else. ``optimizer`` (built on ``model.parameters()``, of the class that
    wrote the checkpoint): its state and hyper-parameters too, by parameter name, so plain torch
    continues the run."""
    stored = stored_weights(path)
    state = model.state_dict()
    wanted = {k: tuple(v.shape) for k, v in state.items() if strict or k in stored.specs}
    problem = misfits(stored.path, stored.specs, wanted, unexpected=strict,
                      fix=f"load a checkpoint of this {type(model).__name__} (same config), or pass strict=False")
    if problem:
        raise CheckpointError(problem)
    tensors = {k: v for k, v in state.items() if k in wanted}
    if optimizer is None:
        stored.load(tensors)
        return model
    if stored.legacy:
        raise CheckpointError(f"checkpoint {stored.path} is format 1 (before DCP): its optimizer state loads "
                              "through the Trainer only; load the weights alone (no optimizer=)")
    names = {id(p): n for n, p in model.named_parameters()}
    metadata = read_index(stored.path)
    room, by_index = optimizer_room(metadata.state_dict_metadata, optimizer, names)
    stored.load({**tensors, **room})
    load_optimizer(stored.path, optimizer, names, by_index)
    return model
