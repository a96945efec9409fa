"""Format 1 checkpoints (before DCP: one ``torch.save`` shard per pipeline rank), read only."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Collection, Iterator

import torch

from replica.checkpoint.store import CheckpointError, read_manifest

__all__ = ["is_legacy", "load_model_state", "load_optimizer_states", "load_rng"]


def is_legacy(path: str | os.PathLike[str]) -> bool:
    """Whether checkpoint ``path`` is format 1 (``model-0000i-of-0000n.pt`` shards)."""
    return int(read_manifest(path)["format"]) == 1


def _name(kind: str, index: int, count: int) -> str:
    return f"{kind}-{index:05d}-of-{count:05d}.pt"


def _load(file: Path) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: the checkpoint is incomplete") from None
    except Exception as exc:  # unpickling errors, truncated zip files
        raise CheckpointError(f"{file} cannot be read ({type(exc).__name__}: {exc})") from None


def _shards(path: Path, kind: str) -> Iterator[Any]:
    count = int(read_manifest(path)["num_shards"])
    for i in range(count):
        yield _load(path / _name(kind, i, count))


def load_model_state(path: str | os.PathLike[str], names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """Weights by original name from every shard (only ``names`` if given)."""
    out: dict[str, torch.Tensor] = {}
    for state in _shards(Path(path), "model"):
        for key, value in state.items():
            if names is None or key in names:
                out.setdefault(key, value)
    return out


def load_optimizer_states(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return list(_shards(Path(path), "optim"))


def load_rng(path: str | os.PathLike[str], shard_index: int) -> dict[str, Any]:
    """The RNG states shard ``shard_index`` wrote (the last shard's when there are fewer)."""
    path = Path(path)
    count = int(read_manifest(path)["num_shards"])
    state: dict[str, Any] = _load(path / _name("rng", min(shard_index, count - 1), count))
    return state
