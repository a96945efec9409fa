"""The Docker image builds and runs (docker/test.sh): skipped unless REPLICA_DOCKER_TEST=1, as it
takes minutes, needs root and downloads packages."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.docker
@pytest.mark.skipif(os.environ.get("REPLICA_DOCKER_TEST") != "1",
                    reason="builds a Docker image (minutes, as root): REPLICA_DOCKER_TEST=1 runs it")
def test_the_image_builds_runs_the_demo_and_torchrun() -> None:
    done = subprocess.run(["bash", str(REPO / "docker" / "test.sh")], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "OK: the image builds" in done.stdout
