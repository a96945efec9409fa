"""Checkpoints through torch.distributed.checkpoint on 4 gloo ranks, moved between layouts: written in
2 pipeline x 2 zero3 replicas, resumed in 2 tensor-parallel x 2 replicas (saving in the background),
then in 2 zero3 replicas x 2 tensor-parallel ranks, then in one process, then into the plain model and
its AdamW; the step after each resume equals the uninterrupted run's. Every
rank writes its own shards, torch.distributed.checkpoint alone reads them into the plain model, and
another model's checkpoint is refused by name on every rank.

One ``run_local`` job does every distributed layout in sequence; the one-process resumes run here.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import replica
from replica.checkpoint import store as ckpt
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.distributed.test_distributed import STEP_TIMEOUT_S, _portable, _run
from tests.train_cases import ACROSS_LAYOUTS, assert_same_weights, weights

pytestmark = pytest.mark.distributed

PP2_ZERO3 = dict(num_stages=2, data_parallel_size=2, tensor_parallel_size=1, sharded_data_parallel="zero3")
TP2_DP2 = dict(num_stages=1, data_parallel_size=2, tensor_parallel_size=2, sharded_data_parallel=False)
ZERO3_TP2 = dict(num_stages=1, data_parallel_size=2, tensor_parallel_size=2, sharded_data_parallel="zero3")
LR, WEIGHT_DECAY = 1e-2, 0.1


def _case(num_layers: int = 2) -> models.ModelCase:
    """The same tiny GPT (tied head) and batch of 8 in every process: one step per epoch."""
    torch.manual_seed(0)
    return models.tiny_gpt(8, num_layers=num_layers)


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def _trainer(directory: Path, layout: dict, num_layers: int = 2) -> replica.train.Trainer:
    from replica.defaults import default_config
    from replica.train.trainer import get_trainer

    case = _case(num_layers)
    config = default_config(batch_size=8, num_microbatches=2, schedule="1f1b", shuffle=False,
                            checkpoint_dir=str(directory), progress=False, timeout_s=STEP_TIMEOUT_S,
                            device=COMPUTE_BOUND, **layout)
    return get_trainer(config, case.model, case.loss_fn, _optimizer)


def _copy_newest(source: Path, target: Path) -> None:
    """Rank 0 starts ``target`` with ``source``'s newest checkpoint; every rank waits for it."""
    if dist.get_rank() == 0:
        newest = ckpt.checkpoints(source)[-1]
        shutil.copytree(newest, target / newest.name)
    dist.barrier()


def layouts_job(rank: int, world: int, root: str) -> bytes:
    torch.set_num_threads(1)
    root_path = Path(root)
    case = _case()
    report: dict = {}
    # 2 steps in 2 pipeline ranks x 2 zero3 replicas: every rank writes its own shards
    first = _trainer(root_path / "a", PP2_ZERO3)
    first.train_dataset(case.example_inputs[0], case.target, epochs=2)
    step = root_path / "a" / "step-00000002"
    report["a"] = (first.pipeline.plan.layout.describe(), first.step, (step / f"__{rank}_0.distcp").stat().st_size)
    # resumed in 2 tensor-parallel ranks x 2 replicas: one step more, saved in the background
    _copy_newest(root_path / "a", root_path / "b")
    second = _trainer(root_path / "b", {**TP2_DP2, "checkpoint_async": True})
    second.train_dataset(case.example_inputs[0], case.target, epochs=3)
    report["b"] = (second.pipeline.plan.layout.describe(), second.step, second.resumed_from.name)
    # resumed in 2 zero3 replicas x 2 tensor-parallel ranks (FSDP2 over the fused q/k/v pieces): one step more,
    # saved in the background
    _copy_newest(root_path / "b", root_path / "b2")
    third = _trainer(root_path / "b2", {**ZERO3_TP2, "checkpoint_async": True})
    third.train_dataset(case.example_inputs[0], case.target, epochs=4)
    report["b2"] = (third.pipeline.plan.layout.describe(), third.step, third.resumed_from.name)
    # another model (3 blocks, not 2) on that checkpoint: refused on every rank, by name
    try:
        _trainer(root_path / "b", PP2_ZERO3, num_layers=3).train_dataset(case.example_inputs[0], case.target, epochs=4)
        report["other"] = None
    except replica.CheckpointError as exc:
        report["other"] = str(exc)
    return _portable(report)


def _reference(steps: int) -> list[dict[str, torch.Tensor]]:
    """The uninterrupted run, in plain torch: the weights after each step (index 0: the initial ones)."""
    case = _case()
    optimizer = _optimizer(case.model.parameters())
    out = [weights(case.model)]
    for _ in range(steps):
        optimizer.zero_grad()
        case.loss_fn(case.model(*case.example_inputs), case.target).backward()
        optimizer.step()
        out.append(weights(case.model))
    return out


def _stored(step: Path) -> dict[str, torch.Tensor]:
    plain = _case().model
    replica.load_into_plain_model(step, plain)
    return weights(plain)


def test_a_checkpoint_resumes_in_any_layout_and_continues_the_uninterrupted_run(tmp_path: Path) -> None:
    reports = _run(layouts_job, 4, str(tmp_path))
    reference = _reference(6)
    a, b, b2 = reports[0]["a"], reports[0]["b"], reports[0]["b2"]
    assert "2 pipeline x 2 data (zero3" in a[0] and a[1] == 2, a
    assert "2 data" in b[0] and "x 2 tensor" in b[0] and "zero" not in b[0] and b[1] == 3, b
    assert b[2] == "step-00000002"
    assert "2 data (zero3" in b2[0] and "x 2 tensor" in b2[0] and b2[1] == 4 and b2[2] == "step-00000003", b2
    assert_same_weights(_stored(tmp_path / "a" / "step-00000002"), reference[2], **ACROSS_LAYOUTS)
    assert_same_weights(_stored(tmp_path / "b" / "step-00000003"), reference[3], **ACROSS_LAYOUTS)
    assert_same_weights(_stored(tmp_path / "b2" / "step-00000004"), reference[4], **ACROSS_LAYOUTS)

    # every rank wrote its own shards, none most of them
    written = [r["a"][2] for r in reports]
    assert min(written) > 0 and max(written) <= 0.4 * sum(written), written

    # checksummed per rank, and exported tensor by tensor with the tied head once, as Hugging Face stores it
    step = tmp_path / "a" / "step-00000002"
    assert ckpt.verify(step) is None
    assert {f"__{r}_0.distcp" for r in range(4)} | {f"rank-{r:05d}.pt" for r in range(4)} <= set(
        ckpt.read_manifest(step)["files"])
    exported = load_file(str(replica.export_safetensors(step, tmp_path / "hf")))
    assert "lm_head.weight" not in exported and reference[2].keys() <= exported.keys()  # and the buffers
    assert_same_weights({k: exported[k] for k in reference[2]}, reference[2], **ACROSS_LAYOUTS)

    # torch.distributed.checkpoint alone: the plain model's state_dict, original names (the tied head too)
    plain = _case().model
    state = plain.state_dict()
    with ckpt.single_process_quietly():
        dcp.load(state, checkpoint_id=tmp_path / "a" / "step-00000002", no_dist=True)
    plain.load_state_dict(state)
    assert_same_weights(weights(plain), reference[2], **ACROSS_LAYOUTS)

    # another model's checkpoint: every rank names the first missing and mis-shaped names
    for r in reports:
        assert r["other"] is not None and "another model" in r["other"], r["other"]
        assert "missing (first: transformer.h.2." in r["other"], r["other"]
        assert "aliases=" not in r["other"] and "all_names=" not in r["other"]

    # one process (2 stages here): resumed from the FSDP x tensor-parallel run's step 4, one step more
    shutil.copytree(tmp_path / "b2" / "step-00000004", tmp_path / "c" / "step-00000004")
    here = _trainer(tmp_path / "c", dict(num_stages=2))
    here.train_dataset(_case().example_inputs[0], _case().target, epochs=5)
    assert here.resumed_from.name == "step-00000004" and here.step == 5
    assert_same_weights(weights(here.model), reference[5], **ACROSS_LAYOUTS)

    # the plain model and a plain AdamW: weights and moments by name; plain torch takes step 6
    case = _case()
    torch.manual_seed(1)
    model = models.tiny_gpt(8).model  # other weights: all must come from the checkpoint
    optimizer = _optimizer(model.parameters())
    replica.load_into_plain_model(tmp_path / "c", model, optimizer=optimizer)
    assert optimizer.param_groups[0]["weight_decay"] == WEIGHT_DECAY
    optimizer.zero_grad()
    case.loss_fn(model(*case.example_inputs), case.target).backward()
    optimizer.step()
    assert_same_weights(weights(model), reference[6], **ACROSS_LAYOUTS)
