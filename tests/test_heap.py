"""CPU ranks keep freed memory for the next micro-batch, when asked (replica/runtime/heap.py)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch

import replica
from replica.errors import ConfigError
from replica.launch import run_local
from replica.runtime import heap

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# A fresh interpreter: allocate four blocks of 16 MiB and free them, ten times; count the
# page faults of the last nine rounds. With glibc's own thresholds the 64 MiB free at the
# heap's top is over its trim threshold (twice the largest block it mapped), handed back
# and faulted in again next round: 16,384 pages a round.
FAULTS = textwrap.dedent("""
    import resource, sys
    import torch
    from replica.runtime.heap import keep_freed_memory
    applied = keep_freed_memory() if sys.argv[1] == "keep" else False
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


def _faults(keep: bool) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", FAULTS, "keep" if keep else "system"], capture_output=True,
                         text=True, env=env, timeout=120, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not GLIBC, reason="the settings are glibc's")
def test_freed_memory_is_reused_without_page_faults():
    applied, kept = _faults(keep=True)
    assert applied
    assert kept < 16384, f"{kept} page faults re-allocating 4 x 16 MiB freed, nine times"
    # glibc's own thresholds fault every round, unless (about one fresh run in six) some other
    # allocation landed above the freed blocks and kept the heap's top from being trimmed
    seen = []
    for _ in range(5):
        applied, system = _faults(keep=False)
        assert not applied
        seen.append(system)
        if system > 9 * 15000:
            break
    else:
        pytest.fail(f"only {seen} page faults with glibc's own thresholds in five runs: the test measures nothing")


@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "1000000"}, {"MALLOC_MMAP_THRESHOLD_": "65536"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1000000"},
                                 {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}])
def test_left_alone_when_the_user_tuned_malloc_or_glibc_is_not_the_allocator(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert heap._apply() is False


def test_replica_malloc_is_no_switch_any_more(monkeypatch):
    """The explicit call is the switch: the old environment variable neither stops nor fails it."""
    calls = _counting(monkeypatch)
    monkeypatch.setenv("REPLICA_MALLOC", "never")
    heap.keep_freed_memory()
    assert calls == [1]


def _counting(monkeypatch) -> list[int]:
    """Record each real application of the settings (``heap._apply``), starting from a process
    where none happened yet; nothing is applied to this process."""
    calls: list[int] = []
    monkeypatch.setattr(heap, "_applied", None)
    monkeypatch.setattr(heap, "_apply", lambda: calls.append(1) or True)
    return calls


def test_the_explicit_call_applies_once_and_is_exported(monkeypatch):
    calls = _counting(monkeypatch)
    assert replica.keep_freed_memory is heap.keep_freed_memory and "keep_freed_memory" in replica.__all__
    assert replica.keep_freed_memory() is True and replica.keep_freed_memory() is True
    assert calls == [1]  # once per process; the second call returns the first one's answer


def test_building_a_cpu_pipeline_leaves_malloc_alone(monkeypatch):
    calls = _counting(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pm = replica.auto_parallel(model, (x,), num_stages=2, num_microbatches=2, loss_fn=torch.nn.functional.mse_loss)
    pm.train_step(x, y)
    assert calls == [] and heap._applied is None


def test_the_trainer_applies_it_only_when_asked(monkeypatch):
    calls = _counting(monkeypatch)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    replica.get_trainer(model=model, loss=torch.nn.MSELoss(), optimizer=optimizer)
    assert calls == []
    replica.get_trainer(model=model, loss=torch.nn.MSELoss(), optimizer=optimizer, keep_freed_memory=True)
    assert calls == [1]
    with pytest.raises(ConfigError, match="keep_freed_memory must be True or False, got 'yes'"):
        replica.get_trainer(model=model, loss=torch.nn.MSELoss(), optimizer=optimizer, keep_freed_memory="yes")


def _rank_settings(rank: int, world_size: int) -> bool | None:
    return heap._applied


@pytest.mark.distributed
def test_the_launcher_applies_it_in_each_rank_only_when_asked():
    expected = GLIBC and not any(k.startswith("MALLOC_") for k in os.environ) and \
        "malloc" not in os.environ.get("GLIBC_TUNABLES", "")
    assert run_local(_rank_settings, 2, keep_freed_memory=True) == [expected, expected]
    assert run_local(_rank_settings, 1) == [None]
    with pytest.raises(ConfigError, match=r"run_local\(keep_freed_memory=...\) must be True or False, got 1"):
        run_local(_rank_settings, 1, keep_freed_memory=1)
