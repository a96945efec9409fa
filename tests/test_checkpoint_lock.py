"""The checkpoint directory's writer lock: one job writes there; another job is refused before it reads or
writes anything; a dead process's lock is taken over; the same job (a restart, a second trainer) takes it back."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replica.checkpoint import lock
from replica.checkpoint import store as ckpt
from replica.checkpoint.store import CheckpointError
from tests.train_cases import run


def _lock_of(directory: Path, pid: int, job: str, host: str | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    record = {"job": job, "host": host or socket.gethostname(), "pid": pid, "since": time.time()}
    (directory / lock.LOCK).write_text(json.dumps(record))


def _dead_pid() -> int:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


@pytest.fixture
def other_job():
    """A live process of another job."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_the_job_id_follows_the_launcher(monkeypatch) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert lock.job_id().startswith("process ")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert lock.job_id() == "slurm job 77"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert lock.job_id() == "torchrun at node0:29500"  # a static rendezvous: one job per master address
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert lock.job_id() == "torchrun abc"


def test_acquire_is_taken_again_by_the_same_job_and_released(tmp_path: Path) -> None:
    path = lock.acquire(tmp_path / "c")
    first = lock.holder(tmp_path / "c")
    assert path.name == lock.LOCK and first["job"] == lock.job_id()
    lock.acquire(tmp_path / "c")  # ours already: unchanged
    assert lock.holder(tmp_path / "c") == first
    lock.release(tmp_path / "c")
    assert lock.holder(tmp_path / "c") is None


def test_a_live_other_job_is_refused_by_name_and_nothing_saved_is_touched(tmp_path: Path, other_job: int) -> None:
    run(tmp_path, stop_at=2)  # step-00000002 saved
    half = tmp_path / ".tmp-step-00000004"  # the other job's save in progress
    half.mkdir()
    _lock_of(tmp_path, other_job, "torchrun other-run")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(CheckpointError) as info:
        run(tmp_path)
    message = str(info.value)
    assert "torchrun other-run" in message and f"pid {other_job}" in message and socket.gethostname() in message
    assert "checkpoint_dir" in message and "delete" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == before and half.is_dir()
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-00000002"]


def test_another_hosts_lock_is_refused_and_a_dead_processs_is_taken_over(tmp_path: Path) -> None:
    _lock_of(tmp_path / "a", 1, "torchrun elsewhere", host="some-other-host")
    with pytest.raises(CheckpointError, match="some-other-host"):
        lock.acquire(tmp_path / "a")
    _lock_of(tmp_path, _dead_pid(), "torchrun crashed-run")
    trainer = run(tmp_path, epochs=1)  # the stale lock of a dead process: taken over, and trains
    assert trainer.step == 3 and [p.name for p in ckpt.checkpoints(tmp_path)][-1] == "step-00000003"
    assert lock.holder(tmp_path) is None  # released when train_dataset finished


def test_a_run_that_failed_lets_go_so_another_job_of_this_host_resumes(tmp_path: Path) -> None:
    run(tmp_path, stop_at=2)  # died mid-training (an exception): the lock goes with train_dataset
    assert lock.holder(tmp_path) is None
    _lock_of(tmp_path, _dead_pid(), lock.job_id())  # and a lock of this job's own is always taken back
    assert run(tmp_path).resumed_from.name == "step-00000002"
