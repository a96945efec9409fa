"""CPU ranks keep freed memory for the next micro-batch (replica/pipeline/heap.py)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from replica.errors import ConfigError
from replica.pipeline import heap

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# A fresh interpreter: allocate four blocks of 16 MiB and free them, ten times; count the
# page faults of the last nine rounds. With glibc's own thresholds the 64 MiB free at the
# heap's top is over its trim threshold (twice the largest block it mapped), handed back
# and faulted in again next round: 16,384 pages a round.
FAULTS = textwrap.dedent("""
    import resource, sys
    import torch
    from replica.pipeline.heap import keep_freed_memory
    applied = keep_freed_memory()
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    def round_():
        blocks = [torch.ones(4 << 20) for _ in range(4)]
        del blocks
    round_()
    before = faults()
    for _ in range(9):
        round_()
    print(applied, faults() - before)
""")


def _faults(env_extra: dict[str, str]) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if k != "REPLICA_MALLOC" and not k.startswith("MALLOC_")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, env=env, timeout=120,
                         check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not GLIBC, reason="the settings are glibc's")
def test_freed_memory_is_reused_without_page_faults():
    applied, kept = _faults({})
    assert applied
    assert kept < 16384, f"{kept} page faults re-allocating 4 x 16 MiB freed, nine times"
    # glibc's own thresholds fault every round, unless (about one fresh run in six) some other
    # allocation landed above the freed blocks and kept the heap's top from being trimmed
    seen = []
    for _ in range(5):
        applied, system = _faults({"REPLICA_MALLOC": "system"})
        assert not applied
        seen.append(system)
        if system > 9 * 15000:
            break
    else:
        pytest.fail(f"only {seen} page faults with glibc's own thresholds in five runs: the test measures nothing")


@pytest.mark.parametrize("env", [{"REPLICA_MALLOC": "system"}, {"MALLOC_TRIM_THRESHOLD_": "1000000"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1000000"},
                                 {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}])
def test_left_alone_when_asked_or_tuned_or_not_glibc(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert heap._apply() is False


def test_unknown_choice_is_refused(monkeypatch):
    monkeypatch.setenv("REPLICA_MALLOC", "never")
    with pytest.raises(ConfigError, match="REPLICA_MALLOC='never'.*'keep'.*'system'"):
        heap._apply()
