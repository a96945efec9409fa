"""Layouts composed on one device mesh, on gloo ranks: FSDP2 × tensor parallelism (2-D), pipeline ×
FSDP2 × tensor parallelism (3-D) and HSDP (shard groups that replicate each other). Every gradient
(gathered with ``full_tensor()``) is the plain model's on the whole batch (FSDP2 x TP also compiled),
each rank holds its share of the weights, and the Trainer trains, checkpoints and resumes in each layout."""

from __future__ import annotations

import pytest
import torch

import replica
from replica.layout import Layout
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.distributed.test_distributed import STEP_TIMEOUT_S, _portable, _run
from tests.distributed.test_tensor_parallel_distributed import _check

pytestmark = pytest.mark.distributed

FSDP_TP = dict(tensor_parallel_size=2, num_stages=1, data_parallel_size=2, num_microbatches=2, schedule="1f1b")


def mesh_job(rank: int, world: int, runs: tuple[tuple[str, str | None, dict], ...]) -> bytes:
    torch.set_num_threads(1)
    return _portable([_check(name, precision, layout) for name, precision, layout in runs])


def _held_share(report: dict) -> float:
    return report["local"] / report["whole"]


def test_fsdp_by_tensor_parallel_and_hsdp_on_four_ranks() -> None:
    runs = (("example", None, {**FSDP_TP, "sharded_data_parallel": "zero3", "compile": True}),  # fused q/k/v, SDPA
            ("gpt2", None, {**FSDP_TP, "sharded_data_parallel": "zero3"}),  # Conv1D, fused c_attn
            ("llama", None, {**FSDP_TP, "sharded_data_parallel": "zero2"}),  # GQA, torch.export
            ("llama", "bf16", {**FSDP_TP, "sharded_data_parallel": "zero3"}),
            ("gpt", None, dict(num_stages=1, data_parallel_size=4, num_microbatches=2, schedule="1f1b",
                               sharded_data_parallel="zero3", shard_group_size=2)))  # HSDP 2 x 2
    reports = _run(mesh_job, 4, runs)
    for run in zip(*reports):
        assert len({r["loss"] for r in run}) == 1, run  # every rank computed the same loss
    by = {(r["case"], r["layout"]): r for r in reports[0]}
    for (case, layout), r in by.items():
        if "tensor" in layout:  # FSDP x TP: the cut weights a quarter, the rest a half
            assert "2 data (zero" in layout and "x 2 tensor" in layout, layout
            assert 0.25 <= _held_share(r) < 0.5, (case, layout, r["local"], r["whole"])
        else:  # HSDP: sharded over a group of 2, replicated across the 2 groups
            assert "HSDP 2 x 2" in layout, layout
            assert 0.5 <= _held_share(r) < 0.6, (case, layout, r["local"], r["whole"])


def test_pipeline_by_fsdp_by_tensor_parallel_on_eight_ranks() -> None:
    three_d = dict(tensor_parallel_size=2, num_stages=2, data_parallel_size=2, num_microbatches=2, schedule="1f1b",
                   sharded_data_parallel="zero3")
    reports = _run(mesh_job, 8, (("gpt", None, three_d),))  # a tied embedding and head on two stages
    for r in (run[0] for run in reports):
        assert "2 pipeline x 2 data (zero3 sharded) x 2 tensor" in r["layout"], r
        assert r["local"] < r["whole"] / 2, r


def mesh_trainer_job(rank: int, world: int, directory: str, layouts: tuple[dict, ...]) -> bytes:
    """The Trainer in each layout in turn, on one checkpoint directory: the first trains an epoch and
    checkpoints whole tensors; each next one resumes from it, trains an epoch more, checkpoints."""
    from replica.defaults import default_config
    from replica.train.trainer import get_trainer

    torch.set_num_threads(1)
    _, inputs, target, loss_fn = models.tiny_gpt(16, num_layers=4)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return models.tiny_gpt(8, num_layers=4).model

    seen = []
    for epochs, layout in enumerate(layouts, start=1):
        config = default_config(batch_size=8, num_microbatches=2, schedule="1f1b", checkpoint_dir=directory,
                                progress=False, timeout_s=STEP_TIMEOUT_S, device=COMPUTE_BOUND, **layout)
        trainer = get_trainer(config, build(), loss_fn, lambda params: torch.optim.Adam(params, lr=1e-2))
        trainer.train_dataset(inputs[0], target, epochs=epochs)
        seen.append((trainer.pipeline.plan.layout.describe(), trainer.step,
                     None if trainer.resumed_from is None else trainer.resumed_from.name))
    return _portable(seen)


def test_the_trainer_trains_checkpoints_and_resumes_in_each_layout(tmp_path) -> None:
    layouts = (dict(num_stages=1, data_parallel_size=2, tensor_parallel_size=2, sharded_data_parallel="zero3"),
               dict(num_stages=1, data_parallel_size=4, sharded_data_parallel="zero3", shard_group_size=2),
               dict(num_stages=2, data_parallel_size=2, tensor_parallel_size=1, sharded_data_parallel="zero2"))
    reports = _run(mesh_trainer_job, 4, str(tmp_path / "ckpt"), layouts)
    first, second, third = reports[0]
    assert "x 2 tensor" in first[0] and first[1] == 2 and first[2] is None, first
    assert "HSDP 2 x 2" in second[0] and second[1] == 4 and second[2] is not None, second
    assert "2 pipeline" in third[0] and third[1] == 6 and third[2] is not None, third
    plain = models.tiny_gpt(8, num_layers=4).model
    replica.load_into_plain_model(tmp_path / "ckpt", plain)  # whole tensors under the original names


@pytest.mark.parametrize("asked, says", [
    (dict(world_size=4, data_parallel_size=3), "data_parallel_size=3 does not divide world_size=4"),
    (dict(world_size=8, data_parallel_size=2, tensor_parallel_size=8), "does not divide world_size=8"),
    (dict(world_size=8, data_parallel_size=4, shard_group_size=3), "shard_group_size=3 does not divide"),
    (dict(world_size=4, sharded_data_parallel=False, shard_group_size=2), "sharded_data_parallel=False"),
])
def test_degrees_that_do_not_multiply_are_named(asked: dict, says: str) -> None:
    model, inputs, _, _ = models.tiny_gpt(8)
    with pytest.raises(replica.ConfigError) as info:
        replica.plan(model, inputs, device=COMPUTE_BOUND, **asked)
    assert says in str(info.value), str(info.value)


def test_a_layout_names_its_hsdp_groups() -> None:
    layout = Layout(schedule="1f1b", num_stages=2, pipeline_ranks=2, data_parallel_size=4, tensor_parallel_size=2,
                    sharding="zero3", shard_group_size=2)
    assert layout.mesh_shape == (2, 2, 2, 2) and layout.world_size == 16
    with pytest.raises(replica.ConfigError, match=r"shard_group_size=3 does not divide the 4 .*\[1, 2, 4\]"):
        Layout(schedule="1f1b", num_stages=1, pipeline_ranks=1, data_parallel_size=4, sharding="zero3",
               shard_group_size=3)
    with pytest.raises(replica.ConfigError, match="does not shard"):
        Layout(schedule="1f1b", num_stages=1, pipeline_ranks=1, data_parallel_size=4, shard_group_size=2)
