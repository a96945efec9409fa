"""The Trainer under torchrun as a new user meets it: 4 gloo ranks and no process group started by hand, one
line of layout on rank 0, a rank killed (kill -9) mid-save, torchrun restarting the job, the trainer resuming
from the newest complete checkpoint to an uninterrupted run's weights, and the survivors' errors one line each."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from examples.cifar10.model import CifarCNN
from replica.checkpoint import lock
from replica.checkpoint.tensors import load_into_plain_model
from tests.distributed import elastic_job
from tests.train_cases import ACROSS_LAYOUTS, assert_same_weights, weights

pytestmark = pytest.mark.distributed

JOB = Path(elastic_job.__file__)
REPO = JOB.parents[2]
TIMEOUT_S = 240


def test_a_killed_rank_is_restarted_and_resumes_to_the_same_weights(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               "--max-restarts", "1", "--monitor-interval", "0.5", str(JOB), str(tmp_path)]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    full = done.stdout + done.stderr
    log = full[-6000:]
    # a failure's every error line first (each rank's), then the end of the log: its end alone is torchrun's report
    said = "\n".join(line for line in full.splitlines() if any(w in line for w in ("rror", "terminate", "imed out")))
    assert done.returncode == 0, said[-8000:] + "\n...\n" + log
    # torchrun names the first failure it polls: rank 1's SIGKILL, or a survivor losing rank 1
    assert "exitcode: -9" in full or "Signal 9" in full or "local_rank: 1" in full, \
        "rank 1 should have been killed on the first attempt:\n" + log
    # rank 0 alone says what it chose, once per attempt: 4 processes, not four worlds of one
    starts = [line for line in full.splitlines() if line.startswith("replica: 4 processes: ")]
    assert len(starts) == 2 and starts[0].endswith("weights: the model's own"), full[-12000:]
    assert any(line.startswith("step 2 (epoch 1/2): loss ") for line in full.splitlines()), log
    # the survivors of the kill: a line each, not a traceback each (rank 0's is whole)
    tracebacks = {line.split("]")[0] for line in full.splitlines() if "Traceback (most recent" in line}
    assert tracebacks <= {"[rank0"}, full[-12000:]
    # a survivor names what it lost: rank 0 in its traceback, another rank in one line, if it says it before
    # torchrun's SIGTERM reaches it (a race torchrun decides: on CI ranks 2 and 3 were ended first)
    assert any((line.startswith("replica: rank ") or line.startswith("[rank0]: replica."))
               and ("PipelineError" in line or "CheckpointError" in line) for line in full.splitlines()), log

    # the first attempt never finished; the restart (attempt 1) resumed from step 3 on both ranks, the
    # checkpoint of step 6 being half written when rank 1 died
    assert not list(tmp_path.glob("attempt0-*.json")), log
    for rank in range(4):
        report = json.loads((tmp_path / f"attempt1-rank{rank}.json").read_text())
        assert report["resumed_from"] == f"step-{elastic_job.LAST_GOOD:08d}", report
        assert report["step"] == 7 * elastic_job.EPOCHS

    assert lock.holder(tmp_path / "checkpoints") is None  # the restarted job took its own lock back, then let go

    # the uninterrupted reference: the same job in this process, both stages here
    reference = elastic_job.train(tmp_path / "reference", num_stages=2)
    assert reference.resumed_from is None and reference.step == 7 * elastic_job.EPOCHS
    resumed = load_into_plain_model(tmp_path / "checkpoints", CifarCNN(channels=(4, 8), hidden=16, image_size=16))
    # the plan (where the cut falls, how many micro-batches) may differ from the reference's: fp32 round-off
    assert_same_weights(weights(resumed), weights(reference.model), **ACROSS_LAYOUTS)


def test_an_error_every_rank_raises_is_read_once(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               "--monitor-interval", "0.5", str(JOB), str(tmp_path), "--data-parallel-size", "3"]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    full = done.stdout + done.stderr
    assert done.returncode != 0, full[-6000:]
    whole = [line for line in full.splitlines() if "ConfigError: data_parallel_size=3 does not divide" in line]
    assert len([line for line in whole if line.startswith("[rank0]")]) == 1, full[-12000:]  # rank 0: in full
    tracebacks = {line.split("]")[0] for line in full.splitlines()
                  if line.startswith("[rank") and "Traceback (most recent" in line}  # torchrun's own aside
    assert tracebacks == {"[rank0"}, full[-12000:]
    # the others: a line each, written whole (one write, so two ranks' lines never splice); torchrun may
    # SIGTERM a rank still on its way to the error once rank 0 has failed: such a rank printed nothing
    short = re.findall(r"^replica: rank (\d+): ConfigError: data_parallel_size=3 does not divide world_size=4: .*"
                       r"a multiple of 3$", full, flags=re.MULTILINE)
    assert len(short) == len(set(short)), full[-12000:]
    killed = set(re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*: -15", full))
    assert set(short) | killed == {"1", "2", "3"} and not set(short) & killed, full[-12000:]
    assert short, full[-12000:]
    assert "SIGABRT" not in full and "terminate called" not in full, full[-6000:]  # they exit, not abort
