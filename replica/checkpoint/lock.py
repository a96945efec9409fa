"""One writer per checkpoint directory: a lock file naming the job that writes there, refused to any other job.

``checkpoint_dir/.writer.lock`` holds the writing job's id, and the host and pid of the
process (rank 0) that took it. A job is one run: torchrun's rendezvous id
(``TORCHELASTIC_RUN_ID``; a static rendezvous, whose id is ``"none"``, by its master
address), else Slurm's ``SLURM_JOB_ID``, else the process itself. The same job takes the
lock back (a restarted attempt, a second trainer in one process); a lock whose process is
gone from this host is stale and taken over; anything else is a ``CheckpointError`` naming
the other writer and the fix, raised before the directory is read or written.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from replica.checkpoint.store import CheckpointError

__all__ = ["LOCK", "job_id", "acquire", "release", "holder"]

LOCK = ".writer.lock"


def job_id() -> str:
    """What makes one job's processes (and its restarted attempts) one writer."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run and run != "none":
        return f"torchrun {run}"
    if run == "none":  # a static rendezvous: one job per master address
        return f"torchrun at {os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm job {os.environ['SLURM_JOB_ID']}"
    return f"process {os.getpid()} on {socket.gethostname()}"


def _me() -> dict[str, Any]:
    return {"job": job_id(), "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}


def holder(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The lock's record (job, host, pid, since), or None when the directory has none."""
    try:
        record = json.loads((Path(checkpoint_dir) / LOCK).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # half-written by a process that died: nobody's
        return {}
    return record if isinstance(record, dict) else {}


def _alive(record: dict[str, Any]) -> bool:
    """Whether the lock's process may still run: certainly gone only when it was on this host."""
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return bool(record)  # another host's process cannot be checked from here; a garbled lock is nobody's
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _describe(record: dict[str, Any]) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("since", 0)))
    return f"{record.get('job')} (pid {record.get('pid')} on host {record.get('host')}, since {since})"


def _write(path: Path, record: dict[str, Any], *, replace: bool) -> None:
    tmp = path.with_name(f"{LOCK}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    try:
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # atomic, and fails when another process created it first
    finally:
        tmp.unlink(missing_ok=True)


def acquire(checkpoint_dir: str | os.PathLike[str]) -> Path:
    """Take ``checkpoint_dir``'s writer lock for this job (made if missing); returns the lock's path.

    Raises :class:`CheckpointError` naming the other writer when another live job holds it."""
    root = Path(checkpoint_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create checkpoint directory {root}: {exc}") from None
    path, me = root / LOCK, _me()
    for _ in range(3):  # lost races re-read who won
        record = holder(root)
        if record and all(record.get(k) == me[k] for k in ("job", "host", "pid")):
            return path  # ours already
        try:
            if record is None:
                _write(path, me, replace=False)
            elif record.get("job") == me["job"] or not _alive(record):
                _write(path, me, replace=True)  # our own job's again, or a dead process's: taken over
            else:
                raise CheckpointError(
                    f"checkpoint directory {root} is being written by another job: {_describe(record)}, while this "
                    f"is {me['job']} (pid {me['pid']} on host {me['host']}). Two jobs publishing into one directory "
                    "would overwrite and delete each other's checkpoints. Give this run its own "
                    "config.checkpoint_dir, or stop the other job; if it is gone (a crash on another host), delete "
                    f"{path} to take the directory over. Nothing in {root} was touched."
                )
        except FileExistsError:
            continue
        except OSError as exc:
            raise CheckpointError(f"cannot write the checkpoint writer lock {path}: {exc}") from None
        if holder(root) == me:
            return path
    raise CheckpointError(f"another process keeps taking checkpoint directory {root}'s writer lock ({path}); "
                          f"it now names {_describe(holder(root) or {})}. Give this run its own checkpoint_dir")


def release(checkpoint_dir: str | os.PathLike[str]) -> None:
    """Drop ``checkpoint_dir``'s writer lock if this job holds it (another's stays)."""
    record = holder(checkpoint_dir)
    if record and record.get("job") == job_id():
        (Path(checkpoint_dir) / LOCK).unlink(missing_ok=True)
