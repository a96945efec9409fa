"""Checkpoints: atomic ``step-XXXXXXXX/`` directories written by every rank through torch.distributed.checkpoint.

Layout of one checkpoint (``W`` ranks wrote it)::

    step-00000120/
        manifest.json        format, step, world size, trainer state, tied weights, sha256 and size of every file
        .metadata            torch.distributed.checkpoint's index: every tensor's global shape, dtype and chunks
        __R_0.distcp         rank R's own shards (a DCP file): weights under their ORIGINAL names, optimizer
                             state under ``optimizer.state.<name>.<key>``; nothing is gathered
        rank-R.pt            rank R's RNG states (``torch.load(weights_only=True)``)
        trainer.pt           the optimizer's param groups and non-tensor state, by parameter name

Writing is collective under ``torch.distributed``: every rank writes its files into
``.tmp-step-XXXXXXXX/`` (DCP: each rank what it holds, a replicated tensor once) and checksums
them; rank 0 then writes the manifest and renames the directory into place, so a checkpoint is
either complete or absent. With ``asynchronous=True`` the tensors are copied and written in the
background (DCP's ``async_save``); :meth:`PendingSave.finish` waits and publishes. A checkpoint
loads into any layout (DCP reshards), into the plain model, or with ``torch.distributed.checkpoint``
alone: ``dcp.load(model.state_dict(), checkpoint_id=step_dir)``. Format 1 (``model-*-of-*.pt``
per pipeline rank, before DCP) still loads, read only (:mod:`replica.checkpoint.legacy`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
import shutil
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from replica.checkpoint.pieces import snapshot
from replica.errors import ReplicaError

__all__ = [
    "CheckpointError", "PendingSave", "save", "step_dir", "checkpoints", "verify", "latest", "latest_across_ranks",
    "resolve", "read_manifest", "rank_file", "single_process_quietly", "dcp_failure", "read_index", "OPTIMIZER_PREFIX",
    "TRAINER_FILE",
]

FORMAT = 2
FORMATS = (1, 2)  # 1: torch.save shards per pipeline rank, read only
MANIFEST = "manifest.json"
TRAINER_FILE = "trainer.pt"
OPTIMIZER_PREFIX = "optimizer.state."
_STEP = re.compile(r"^step-(\d{8,})$")


class CheckpointError(ReplicaError):
    """A checkpoint could not be written or read (disk full, missing shard, wrong model)."""


def step_dir(checkpoint_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(checkpoint_dir) / f"step-{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


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


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


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


@contextlib.contextmanager
def single_process_quietly() -> Iterator[None]:
    """DCP in one process warns on every call that it assumes one process: it is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _own_files(tmp: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Checksums of the files this rank wrote: its DCP files, its RNG file, rank 0 the index too."""
    names = [p.name for p in tmp.iterdir() if p.name.startswith(f"__{rank}_") and p.name.endswith(".distcp")]
    names.append(rank_file(rank))
    if rank == 0:
        names += [".metadata", TRAINER_FILE]
    return {name: {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size} for name in names}


_ASYNC_GROUP: list[Any] = []  # a gloo group of its own for background writes, made once (collective)


def _async_group() -> Any:
    """Background writes coordinate on a process group of their own (gloo), so they never
    interleave with the training step's collectives (as torchtitan does)."""
    if not _distributed():
        return None
    if not _ASYNC_GROUP:
        _ASYNC_GROUP.append(dist.new_group(backend="gloo"))
    return _ASYNC_GROUP[0]


class _Copied:
    """DCP's stager for tensors :func:`save` copied already: hands them on as they are."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class PendingSave:
    """A checkpoint being written: :meth:`finish` (collective) waits for every rank's files and
    publishes the step directory. Returned by :func:`save`; a synchronous save comes finished."""

    root: Path
    step: int
    meta: dict[str, Any]
    keep: int
    tied: Mapping[str, Sequence[str]]
    future: Future[Any] | None = None
    problem: str | None = None
    path: Path | None = field(default=None)

    def finish(self) -> Path:
        """Wait for the write, checksum, publish (rank 0 renames), prune; raises
        :class:`CheckpointError` on every rank if any rank failed."""
        if self.path is not None:
            return self.path
        final, tmp = step_dir(self.root, self.step), self.root / f".tmp-step-{self.step:08d}"
        mine, files = self.problem, {}
        if self.future is not None and mine is None:
            try:
                self.future.result()
            except (Exception, CheckpointException) as exc:  # reported to every rank below
                mine = _failure(tmp, exc)
        self.future = None
        if mine is None:
            try:
                files = _own_files(tmp, _rank())
            except OSError as exc:
                mine = f"cannot read back what rank {_rank()} wrote to {tmp}: {exc}"
        reports = _gather((files, mine))
        problem = None
        if _rank() == 0:
            try:
                problem = _publish(self.root, final, tmp, self.step, reports, self.meta, self.keep, self.tied)
            except Exception as exc:  # every rank waits for this answer: give one
                problem = f"cannot publish checkpoint {final}: {type(exc).__name__}: {exc}"
        problem = _from_rank0(problem)
        if problem:
            raise CheckpointError(problem)
        self.path = final
        return final


def dcp_failure(exc: BaseException) -> str:
    """What went wrong in a DCP call, in one line: a ``CheckpointException`` (a BaseException
    carrying each failed rank's exception) names those ranks and the first one's error."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (inner, _) = next(iter(sorted(exc.failures.items())))
        ranks = sorted(exc.failures)
        return f"{type(inner).__name__}: {inner} (on rank{'s' if len(ranks) > 1 else ''} {ranks})"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _failure(tmp: Path, exc: BaseException) -> str:
    return f"rank {_rank()} could not write its shards to {tmp}: {dcp_failure(exc)}"


def save(checkpoint_dir: str | os.PathLike[str], step: int, tensors: dict[str, torch.Tensor], rng: dict[str, Any],
         meta: dict[str, Any], *, keep: int, tied: Mapping[str, Sequence[str]] | None = None,
         trainer: dict[str, Any] | None = None, asynchronous: bool = False) -> PendingSave:
    """Write checkpoint ``step`` (collective: every rank calls with the tensors it holds).

    ``tensors``: flat names -> tensors (DTensors as held: each rank writes its own shards; a
    tensor two ranks hold alike is written once); ``rng``: this rank's RNG states; ``trainer``:
    this rank's small extras (param groups by name; ``weights_only`` types), gathered into one
    ``trainer.pt`` list (rank order) by rank 0; ``meta``: the trainer state
    for the manifest. ``tied``: each tied weight's first name -> its other names, recorded so an
    export stores the weight once. Keeps the newest ``keep`` checkpoints. Returns a
    :class:`PendingSave`: finished unless ``asynchronous`` (then call ``finish()``, collective, later).
    Raises :class:`CheckpointError` on every rank if any rank failed; the previous checkpoints stay.
    """
    root = Path(checkpoint_dir)
    tmp = root / f".tmp-step-{step:08d}"
    rank = _rank()
    problem = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as exc:
            problem = (f"cannot write checkpoint step {step} into {root}: {exc}; make the directory writable "
                       "(or point config.checkpoint_dir elsewhere): the previous checkpoints are untouched")
    problem = _from_rank0(problem)
    if problem:
        raise CheckpointError(problem)
    pending = PendingSave(root, step, meta, keep, tied or {})
    try:
        _write(tmp / rank_file(rank), rng)
    except Exception as exc:
        pending.problem = _failure(tmp, exc)
    reports = _gather((pending.problem, trainer or {}))  # every rank enters DCP's collectives, or none does
    if rank == 0 and not any(p for p, _ in reports):
        try:
            _write(tmp / TRAINER_FILE, [t for _, t in reports])
        except Exception as exc:
            pending.problem = _failure(tmp, exc)
    problems = [p for p in _gather(pending.problem) if p]  # rank 0's trainer.pt too
    if problems:
        pending.problem = pending.problem or problems[0]
        pending.finish()  # raises on every rank
    writer = dcp.FileSystemWriter(tmp, sync_files=True, overwrite=True)
    try:
        if asynchronous:  # copied to the CPU here, as DCP sees them (its own stager would lose pieces' boxes)
            copies = {k: snapshot(v) for k, v in tensors.items()}
            pending.future = dcp.async_save(copies, storage_writer=writer, process_group=_async_group(),
                                             async_stager=_Copied(), no_dist=not _distributed())
        else:
            with single_process_quietly():
                dcp.save(tensors, storage_writer=writer, no_dist=not _distributed())
    except (Exception, CheckpointException) as exc:  # DCP raises on every rank when any rank failed
        pending.problem = _failure(tmp, exc)
    if not asynchronous:
        pending.finish()
    return pending


def _publish(root: Path, final: Path, tmp: Path, step: int, reports: list[Any], meta: dict[str, Any],
             keep: int, tied: Mapping[str, Sequence[str]]) -> str | None:
    """Rank 0: check every rank's files arrived, write the manifest, rename into place, prune."""
    errors = [e for _, e in reports if e]
    if errors:
        return "; ".join(errors)
    files: dict[str, Any] = {}
    for f, _ in reports:
        files.update(f)
    manifest = {"format": FORMAT, "step": step, "world_size": len(reports), "time": time.time(),
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
    if not isinstance(manifest, dict) or manifest.get("format") not in FORMATS or "files" not in manifest:
        raise CheckpointError(f"{Path(path) / MANIFEST} is not a Replica manifest of format {FORMATS}")
    return manifest


class _IndexUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: only what a DCP index holds may be built from it (its own
    dataclasses and enums, ``torch.Size``, dtypes, layouts, paths), never a call chosen by the file."""

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        if (module.startswith("torch.distributed.checkpoint.") and isinstance(found, type)) \
                or (module == "torch" and (found is torch.Size or isinstance(found, torch.dtype))) \
                or (module, name) in (("torch.serialization", "_get_layout"), ("collections", "OrderedDict")) \
                or (module == "pathlib" and name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath")):
            return found
        raise pickle.UnpicklingError(f"{module}.{name} is not something a DCP index holds")


def read_index(path: str | os.PathLike[str]) -> Any:
    """Checkpoint ``path``'s DCP index (``.metadata``: every tensor's global shape, dtype and
    chunks), unpickled with only the types such an index holds: a forged one is refused before
    torch.distributed.checkpoint (which unpickles it freely) reads it."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            return _IndexUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: the checkpoint is incomplete; use an older step directory") from None
    except Exception as exc:  # unpickling errors, truncated files, refused globals
        raise CheckpointError(f"{file} cannot be read ({type(exc).__name__}: {exc}); it is not an index "
                              "torch.distributed.checkpoint wrote: use another step directory") from None


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
