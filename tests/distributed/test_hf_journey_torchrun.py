"""Issue #45's journey under the real launcher, as README tells it: a tiny Hugging Face Llama on
meta with weights from a save_pretrained directory, the Trainer in bf16 on 2 gloo ranks started by
torchrun (no process group by hand), a rank killed and the job restarted and resumed, ``replica
export`` naming its step, and ``from_pretrained`` of the export giving the checkpoint's logits
bit for bit. (tests/distributed/test_elastic.py: 4 ranks, a kill mid-save, the uninterrupted weights.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import hf_journey_job as job

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # ~60 CPU-s: two launcher attempts, each rank tracing a Llama

REPO = Path(job.__file__).parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
TIMEOUT_S = 300


def test_a_hugging_face_llama_from_save_pretrained_trains_resumes_and_exports(tmp_path: Path) -> None:
    import replica

    job.save_model(tmp_path)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", "--monitor-interval", "0.5", job.__file__, str(tmp_path)]
    done = subprocess.run(command, env=ENV, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-8000:]
    lines = log.splitlines()
    # rank 0 says once per attempt what it chose and where the weights came from
    starts = [line for line in lines if line.startswith("replica: 2 processes: 2 pipeline x 1 data")]
    assert len(starts) == 2 and "bf16" in starts[0], log[-6000:]
    assert starts[0].endswith(f"weights: {tmp_path / 'tiny-llama'} (each rank read its own stages)"), starts
    assert f"weights: checkpoint {tmp_path / 'checkpoints' / 'step-00000002'} (resumed" in starts[1], starts
    # steps 3 and 4 ran again from the checkpoint of step 2: step 3's loss is the first attempt's
    losses = re.findall(r"^step (\d) \(epoch 1/1\): loss ([\d.]+)", log, re.M)
    assert [s for s, _ in losses] == ["1", "2", "3", "3", "4"], losses
    assert losses[2][1] == losses[3][1], losses
    # (not anchored: torchrun's own lines may still meet a rank's on the shared pipe)
    ended = sorted(re.findall(r"rank \d ended at step 4, resumed from step-00000002", log))
    assert ended == [f"rank {r} ended at step 4, resumed from step-00000002" for r in range(2)], log[-4000:]

    exported = subprocess.run([sys.executable, "-m", "replica.cli", "export", str(tmp_path / "checkpoints"),
                               str(tmp_path / "exported")], env=ENV, cwd=REPO, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    assert exported.returncode == 0, exported.stderr[-4000:]
    assert exported.stdout.startswith("exported step 4 ("), exported.stdout

    config = transformers.AutoConfig.from_pretrained(tmp_path / "tiny-llama")
    config.save_pretrained(tmp_path / "exported")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "exported")
    plain = transformers.LlamaForCausalLM(config)
    replica.load_into_plain_model(tmp_path / "checkpoints", plain)
    start = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "tiny-llama")
    ids = job.batch()[0][:2]
    with torch.no_grad():
        got, want = loaded(ids).logits, plain(ids).logits
        assert torch.equal(got, want)
        assert not torch.equal(got, start(ids).logits)  # it trained
