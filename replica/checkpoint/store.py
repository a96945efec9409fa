"""Checkpoints: atomic ``step-XXXXXXXX/`` directories of per-rank shards, checksummed, keyed by parameter name.

Layout of one checkpoint (``P`` pipeline ranks wrote it, one shard each)::

    step-00000120/
        manifest.json                 step, trainer state, tied weights' names, sha256 and size of every file
        model-00000-of-0000P.pt       a plain state_dict slice: ORIGINAL keys (loads into the model)
        optim-00000-of-0000P.pt       optimizer state and param groups keyed by parameter name
        rng-00000-of-0000P.pt         torch / python / numpy RNG states of the rank that wrote it

Writing is collective under ``torch.distributed``: every writing rank puts its files in
``.tmp-step-XXXXXXXX/`` and fsyncs them; rank 0 then writes the manifest and renames the
directory into place, so a checkpoint is either complete or absent. Reading takes every
shard and keeps the names a rank asks for: a checkpoint written by 4 pipeline ranks
loads on 2, or into the plain model (:func:`load_into_plain_model`). Every file is read
with ``torch.load(..., weights_only=True)``. :func:`export_safetensors` writes a checkpoint's
weights as a Hugging Face directory's ``model.safetensors`` (or its shards and index).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from replica.errors import ReplicaError

__all__ = [
    "CheckpointError", "Shard", "save", "step_dir", "checkpoints", "verify", "latest", "latest_across_ranks", "resolve",
    "read_manifest", "load_model_state", "load_optimizer_states", "load_rng", "load_into_plain_model",
]

FORMAT = 1
MANIFEST = "manifest.json"
_STEP = re.compile(r"^step-(\d{8,})$")


class CheckpointError(ReplicaError):
    """A checkpoint could not be written or read (disk full, missing shard, wrong model)."""


@dataclass
class Shard:
    """What one pipeline rank writes: its slice of the weights, optimizer state and RNG states."""

    index: int
    count: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: dict[str, Any]


def _name(kind: str, index: int, count: int) -> str:
    return f"{kind}-{index:05d}-of-{count:05d}.pt"


def step_dir(checkpoint_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(checkpoint_dir) / f"step-{step:08d}"


# --------------------------------------------------------------------------- writing


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms that cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write(path: Path, obj: Any) -> dict[str, Any]:
    """``torch.save`` + fsync; the checksum is taken from what reached the file."""
    with open(path, "wb") as f:
        if isinstance(obj, bytes):
            f.write(obj)
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": _sha256(path), "bytes": path.stat().st_size}


def _write_shard(tmp: Path, shard: Shard) -> dict[str, dict[str, Any]]:
    files = {}
    for kind, obj in (("model", shard.model), ("optim", shard.optimizer), ("rng", shard.rng)):
        name = _name(kind, shard.index, shard.count)
        files[name] = _write(tmp / name, obj)
    return files


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _from_rank0(value: Any) -> Any:
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value: Any) -> list[Any]:
    if not _distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def save(checkpoint_dir: str | os.PathLike[str], step: int, shard: Shard | None, meta: dict[str, Any], *,
         keep: int, tied: Mapping[str, Sequence[str]] | None = None) -> Path:
    """Write checkpoint ``step`` (collective: every rank calls; ranks without a shard pass ``None``).

    Returns the directory; raises :class:`CheckpointError` on every rank if any rank failed.
    Keeps the newest ``keep`` checkpoints. ``tied``: each tied weight's first name -> its other
    names (``plan.tied_parameters``), recorded so that an export stores the weight once.
    """
    root = Path(checkpoint_dir)
    final, tmp = step_dir(root, step), root / f".tmp-step-{step:08d}"
    is_root = not _distributed() or dist.get_rank() == 0
    problem = None
    if is_root:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as exc:
            problem = f"cannot create {tmp}: {exc}"
    problem = _from_rank0(problem)
    if problem:
        raise CheckpointError(problem)
    files, mine = {}, None
    if shard is not None:
        try:
            files = _write_shard(tmp, shard)
        except Exception as exc:  # reported to every rank below, never left for them to wait on
            mine = f"shard {shard.index} of {shard.count} could not be written to {tmp}: {type(exc).__name__}: {exc}"
    reports = _gather((shard.count if shard is not None else None, files, mine))
    if is_root:
        try:
            problem = _publish(root, final, tmp, step, reports, meta, keep, tied or {})
        except Exception as exc:  # every rank waits for this answer: give one
            problem = f"cannot publish checkpoint {final}: {type(exc).__name__}: {exc}"
    problem = _from_rank0(problem)
    if problem:
        raise CheckpointError(problem)
    return final


def _publish(root: Path, final: Path, tmp: Path, step: int, reports: list[Any], meta: dict[str, Any],
             keep: int, tied: Mapping[str, Sequence[str]]) -> str | None:
    """Rank 0: check every shard arrived, write the manifest, rename into place, prune."""
    errors = [e for _, _, e in reports if e]
    if errors:
        return "; ".join(errors)
    counts = {c for c, _, _ in reports if c is not None}
    files: dict[str, Any] = {}
    for _, f, _ in reports:
        files.update(f)
    if len(counts) != 1:
        return f"ranks disagree on the number of shards: {sorted(counts)}"
    count = counts.pop()
    expected = {_name(k, i, count) for k in ("model", "optim", "rng") for i in range(count)}
    if set(files) != expected:
        return f"checkpoint step {step} is missing shard files {sorted(expected - set(files))}"
    manifest = {"format": FORMAT, "step": step, "num_shards": count, "time": time.time(),
                "torch_version": torch.__version__, "trainer": meta, "files": files,
                "tied_parameters": {name: list(aliases) for name, aliases in tied.items()}}
    try:
        _write(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        _fsync_dir(tmp)
        if final.exists():  # a leftover of an earlier attempt at this step: replace it
            trash = root / f".trash-{final.name}-{os.getpid()}"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
    except OSError as exc:
        return f"cannot publish checkpoint {final}: {exc}"
    _prune(root, keep)
    return None


def _prune(root: Path, keep: int) -> None:
    for old in checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step-*"):  # written by a run that died mid-save
        shutil.rmtree(stale, ignore_errors=True)


# --------------------------------------------------------------------------- reading


def checkpoints(checkpoint_dir: str | os.PathLike[str]) -> list[Path]:
    """Every ``step-XXXXXXXX`` directory, oldest first (complete or not)."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
    return [p for _, p in sorted(found)]


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(Path(path) / MANIFEST) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {MANIFEST}: the checkpoint is incomplete") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{Path(path) / MANIFEST} is unreadable: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "files" not in manifest:
        raise CheckpointError(f"{Path(path) / MANIFEST} is not a format-{FORMAT} Replica manifest")
    return manifest


def verify(path: str | os.PathLike[str], *, share: tuple[int, int] = (0, 1)) -> str | None:
    """What is wrong with a checkpoint (missing manifest or file, wrong size or checksum), or None.

    ``share=(index, count)``: checksum only every ``count``-th file from the ``index``-th (sizes
    are checked for all), so that ``count`` ranks together read each byte once
    (:func:`latest_across_ranks`) instead of one rank reading the whole checkpoint."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
        files = sorted(manifest["files"].items())
        for name, info in files:
            file = path / name
            if not file.is_file():
                return f"{name} is missing"
            if file.stat().st_size != info["bytes"]:
                return f"{name} has {file.stat().st_size} bytes, the manifest says {info['bytes']}"
        index, count = share
        for name, info in files[index::count]:
            if _sha256(path / name) != info["sha256"]:
                return f"{name} fails its sha256 checksum"
    except CheckpointError as exc:
        return str(exc)
    except OSError as exc:  # unreadable: permissions, a file removed meanwhile
        return f"cannot read it: {exc}"
    return None


def _set_aside(path: Path, problem: str, quarantine: bool) -> None:
    """Warn that ``path`` is skipped; with ``quarantine`` rename it ``corrupt-step-XXXXXXXX`` (kept
    for inspection, so a resumed run can write that step again)."""
    note = ""
    if quarantine:
        target = path.with_name(f"corrupt-{path.name}")
        n = 1
        while target.exists():
            target, n = path.with_name(f"corrupt-{path.name}.{n}"), n + 1
        try:
            os.rename(path, target)
            note = f" (moved to {target.name})"
        except OSError:
            pass
    warnings.warn(f"checkpoint {path} is corrupt or incomplete: {problem}; skipping it{note} and "
                  "falling back to the previous checkpoint", RuntimeWarning, stacklevel=3)


def latest(checkpoint_dir: str | os.PathLike[str], *, quarantine: bool = False) -> Path | None:
    """The newest checkpoint that verifies. Each bad one newer than it is reported with
    ``warnings.warn`` (and with ``quarantine`` renamed to ``corrupt-step-XXXXXXXX``, kept for
    inspection, so a resumed run can write that step again)."""
    for path in reversed(checkpoints(checkpoint_dir)):
        problem = verify(path)
        if problem is None:
            return path
        _set_aside(path, problem, quarantine)
    return None


def latest_across_ranks(checkpoint_dir: str | os.PathLike[str], *, quarantine: bool = False) -> Path | None:
    """:func:`latest`, collective under ``torch.distributed`` (every rank calls, every rank gets the
    same answer): each rank checksums a 1/world share of each candidate's files, so no rank reads
    the whole checkpoint of a model larger than it holds. Rank 0 lists the candidates, warns and
    quarantines."""
    if not _distributed():
        return latest(checkpoint_dir, quarantine=quarantine)
    root, rank, world = Path(checkpoint_dir), dist.get_rank(), dist.get_world_size()
    names = _from_rank0([p.name for p in checkpoints(root)] if rank == 0 else None)
    for path in (root / name for name in reversed(names)):
        problems = [p for p in _gather(verify(path, share=(rank, world))) if p is not None]
        if not problems:
            return path
        if rank == 0:
            _set_aside(path, problems[0], quarantine)
    return None


def resolve(path: str | os.PathLike[str]) -> Path:
    """A checkpoint directory itself, or the newest good one inside a ``checkpoint_dir``."""
    path = Path(path)
    if (path / MANIFEST).exists() or _STEP.match(path.name):
        problem = verify(path)
        if problem:
            raise CheckpointError(f"checkpoint {path} is corrupt or incomplete: {problem}")
        return path
    found = latest(path)
    if found is None:
        raise CheckpointError(
            f"no complete checkpoint in {path} ({len(checkpoints(path))} step-XXXXXXXX directories found); "
            "pass a checkpoint_dir the trainer wrote, or one of its step-XXXXXXXX directories"
        )
    return found


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


def load_into_plain_model(path: str | os.PathLike[str], model: torch.nn.Module, *, strict: bool = True
                          ) -> torch.nn.Module:
    """Load a checkpoint (a ``step-XXXXXXXX`` directory, or the newest good one in a
    ``checkpoint_dir``) into the plain, unsplit model, whatever layout wrote it."""
    state = load_model_state(resolve(path))
    try:
        model.load_state_dict(state, strict=strict)
    except RuntimeError as exc:
        raise CheckpointError(
            f"checkpoint {path} does not fit {type(model).__name__}: {str(exc).splitlines()[0]} "
            f"(it holds {len(state)} tensors; the model's state_dict has {len(model.state_dict())})"
        ) from None
    return model
