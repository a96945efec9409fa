"""Under a launcher (``WORLD_SIZE > 1``) with no process group: ``auto_parallel`` and the Trainer start one,
``plan`` lays out that world, and an environment that cannot start one is a ``ConfigError`` naming the call."""

from __future__ import annotations

import pytest
import torch

import replica
from replica.process_group import default_backend, ensure_process_group, launched_world_size
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.train_cases import DATA, make_trainer


@pytest.fixture
def torchrun_env(monkeypatch):
    """WORLD_SIZE=4 as torchrun sets it, without the rendezvous address: no group can start."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")


def test_one_process_stays_one() -> None:
    assert launched_world_size() == 1 and ensure_process_group("x") == 1
    assert default_backend("cpu") == "gloo" and default_backend(torch.device("cuda", 0)) == "nccl"


def test_under_a_launcher_auto_parallel_and_the_trainer_never_run_as_world_one(torchrun_env) -> None:
    mlp = models.mlp(8)
    with pytest.raises(replica.ConfigError, match=r"replica.auto_parallel runs in a world of 4 .*MASTER_ADDR"):
        replica.auto_parallel(mlp.model, mlp.example_inputs, num_stages=2, loss_fn=mlp.loss_fn)
    with pytest.raises(replica.ConfigError, match=r"replica.get_trainer runs in a world of 4 .*torchrun"):
        make_trainer()


def test_plan_lays_out_the_launchers_world(torchrun_env) -> None:
    model, inputs, _, _ = models.tiny_gpt(8)
    plan = replica.plan(model, inputs, num_stages=2, schedule="1f1b", device=COMPUTE_BOUND)
    assert plan.layout.world_size == 4, plan.layout.describe()
    with pytest.raises(replica.ConfigError, match=r"data_parallel_size=3 does not divide world_size=4.*\[1, 2, 4\]"):
        replica.plan(model, inputs, data_parallel_size=3, device=COMPUTE_BOUND)  # the cause, not a batch of 32


@pytest.mark.parametrize("asked, says", [
    (dict(data_parallel_size=2), "data_parallel_size=2 needs a world of processes"),
    (dict(sharded_data_parallel=True), "sharded_data_parallel=True shards"),
])
def test_replicas_asked_of_one_process_are_refused_with_torchrun_named(asked: dict, says: str) -> None:
    with pytest.raises(replica.ConfigError, match=says) as info:
        make_trainer(batch_size=32, **asked).train_dataset(*DATA, epochs=1)
    assert "torchrun --nproc_per_node" in str(info.value), str(info.value)


def test_off_rank_0_a_replica_error_ends_the_process_in_one_line(monkeypatch, capsys) -> None:
    import sys

    from replica.process_group import one_line_errors_off_rank_0

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: seen.append(args[0]))
    monkeypatch.setenv("RANK", "2")
    one_line_errors_off_rank_0()
    error = replica.ConfigError("data_parallel_size=3 does not divide world_size=4\nthe rest of the message")
    sys.excepthook(type(error), error, None)
    assert capsys.readouterr().err == \
        "replica: rank 2: ConfigError: data_parallel_size=3 does not divide world_size=4 …\n"
    sys.excepthook(KeyError, KeyError("x"), None)  # anything else: as Python prints it
    assert seen == [KeyError]
    monkeypatch.setenv("RANK", "0")
    hook = sys.excepthook
    one_line_errors_off_rank_0()  # rank 0 prints every error whole; once made, the hook is not stacked
    assert sys.excepthook is hook
