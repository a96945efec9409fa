"""Fault tolerance under torchrun: a rank dies mid-save, torchrun restarts the job, the trainer
resumes from the newest complete checkpoint, and the final weights equal an uninterrupted run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.cifar10.model import CifarCNN
from replica.checkpoint.tensors import load_into_plain_model
from tests.distributed import elastic_job
from tests.train_cases import ACROSS_LAYOUTS, assert_same_weights, weights

pytestmark = pytest.mark.distributed

JOB = Path(elastic_job.__file__)
REPO = JOB.parents[2]
TIMEOUT_S = 240


def test_a_killed_rank_is_restarted_and_resumes_to_the_same_weights(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", "--monitor-interval", "0.5", str(JOB), str(tmp_path)]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    log = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, log
    # torchrun names the first failure it polls: rank 1's exit, or rank 0 losing rank 1 when
    # both are over by the time it looks (it looks at rank 0 first)
    assert "exitcode: 17" in log or "from rank 1" in log, \
        "rank 1 should have killed itself on the first attempt:\n" + log

    # the first attempt never finished; the restart (attempt 1) resumed from step 3 on both ranks, the
    # checkpoint of step 6 being half written when rank 1 died
    assert not list(tmp_path.glob("attempt0-*.json")), log
    for rank in (0, 1):
        report = json.loads((tmp_path / f"attempt1-rank{rank}.json").read_text())
        assert report["resumed_from"] == f"step-{elastic_job.LAST_GOOD:08d}", report
        assert report["step"] == 7 * elastic_job.EPOCHS

    # the uninterrupted reference: the same job in this process, both stages here
    reference = elastic_job.train(tmp_path / "reference", num_stages=2)
    assert reference.resumed_from is None and reference.step == 7 * elastic_job.EPOCHS
    resumed = load_into_plain_model(tmp_path / "checkpoints", CifarCNN(channels=(4, 8), hidden=16, image_size=16))
    # the plan (where the cut falls, how many micro-batches) may differ from the reference's: fp32 round-off
    assert_same_weights(weights(resumed), weights(reference.model), **ACROSS_LAYOUTS)
