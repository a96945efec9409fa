"""The GPT example under multi-node torchrun: two agents on 127.0.0.1 play two nodes, and the
losses they print are the one-process run's (the pipeline's gradients are the plain model's)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from replica.launch import free_port

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "gpt" / "train.py"
TIMEOUT_S = 240
TINY = ["--steps", "3", "--log-every", "1", "--max-bytes", "200000", "--n-layer", "2", "--n-embd", "32",
        "--n-head", "2", "--block-size", "32", "--num-microbatches", "4", "--sample-tokens", "20", "--threads", "1"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _figures(log: str) -> tuple[list[float], float, str]:
    """The training losses, the validation loss and the sample a run printed."""
    losses = [float(v) for v in re.findall(r"^step +\d+ \| loss ([\d.]+)", log, re.M)]
    val = re.search(r"^val loss ([\d.]+)", log, re.M)
    sample = re.search(r"^-{60}\n(.*?)\n-{60}$", log, re.M | re.S)
    assert losses and val and sample, "the run printed no losses, validation loss or sample:\n" + log[-4000:]
    return losses, float(val.group(1)), sample.group(1)


def _one_process(*args: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), *TINY, *args], env=ENV, cwd=REPO, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def _two_nodes(procs_per_node: int, *args: str) -> str:
    """Rank 0's output of the script run by two torchrun agents, node ranks 0 and 1."""
    port = free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", str(procs_per_node), "--master-addr", "127.0.0.1", "--master-port", str(port),
         str(SCRIPT), *TINY, *args],
        env=ENV, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # the agent and its workers: one process group, killed together
    ) for node in (0, 1)]
    logs = []
    try:
        for agent in agents:
            logs.append(agent.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    for agent, log in zip(agents, logs):
        assert agent.returncode == 0, log[-4000:]
    return logs[0]


@pytest.mark.parametrize("procs_per_node, torchrun_args, reference_args", [
    # one stage per node: the one-process run with 2 stages
    (1, ["--batch-size", "8", "--num-stages", "2"], ["--batch-size", "8", "--num-stages", "2"]),
    # 2 stages x 2 data-parallel replicas over 4 ranks on 2 nodes, the same 16 windows a step on every rank
    # (each replica trains 8 of them): one process training the 16
    (2, ["--batch-size", "16", "--num-stages", "2"], ["--batch-size", "16", "--num-stages", "2"]),
], ids=["pipeline-across-nodes", "pipeline-x-data-across-nodes"])
def test_multi_node_torchrun_trains_the_gpt_example_as_one_process_does(
        procs_per_node: int, torchrun_args: list[str], reference_args: list[str]) -> None:
    log = _two_nodes(procs_per_node, *torchrun_args)
    assert f"GPT: 2 stages × {procs_per_node} replica" in log, log[-4000:]  # 2 x procs ranks, 2 stages
    losses, val, sample = _figures(log)
    reference_losses, reference_val, reference_sample = _figures(_one_process(*reference_args))
    assert losses == pytest.approx(reference_losses, abs=2e-4)  # printed to 4 places: fp32 round-off at most
    assert val == pytest.approx(reference_val, abs=2e-4)
    assert sample.startswith("def ") and len(sample) > len("def ")  # the gathered weights sample, on rank 0
