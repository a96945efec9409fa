"""Activation checkpointing per block on gloo ranks: with FSDP2 (zero3: its hooks fire again in the
recomputation), with tensor parallelism (DTensor blocks under the selective policy) and across a
pipeline's ranks; every gradient (gathered whole) is the plain model's. One spawn of two ranks."""

from __future__ import annotations

import copy

import pytest
import torch

import replica
from replica.stage.checkpoint import checkpointed_modules
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.distributed.test_distributed import STEP_TIMEOUT_S, _portable, _run
from tests.grads import assert_same_grads

pytestmark = pytest.mark.distributed

RUNS = (
    dict(num_stages=1, data_parallel_size=2, sharded_data_parallel="zero3", recompute=True),
    dict(num_stages=1, data_parallel_size=2, sharded_data_parallel="zero2", recompute="selective"),
    dict(num_stages=1, tensor_parallel_size=2, recompute="selective"),
    dict(num_stages=1, tensor_parallel_size=2, recompute=True),
    dict(num_stages=2, recompute=1),
)


def checkpoint_job(rank: int, world: int) -> bytes:
    torch.set_num_threads(1)
    reports = []
    for layout in RUNS:
        torch.manual_seed(0)  # the same model and batch on every rank
        model, inputs, target, loss_fn = models.tiny_gpt(8, num_layers=2)
        ref = copy.deepcopy(model)
        loss_fn(ref(*inputs), target).backward()
        pm = replica.auto_parallel(model, inputs, loss_fn=loss_fn, device=COMPUTE_BOUND, timeout_s=STEP_TIMEOUT_S,
                                   num_microbatches=2, schedule="1f1b", **layout)
        pm.train_step(inputs, target)
        assert_same_grads(pm, ref, subset=True, context=f"{layout}: ")
        regions = sum(len(checkpointed_modules(s.module)) for s in pm.stages)
        reports.append((pm.plan.layout.describe(), [s.recompute for s in pm.plan.stages], regions))
    return _portable(reports)


def test_block_checkpointing_with_fsdp_tensor_parallel_and_a_pipeline() -> None:
    for reports in _run(checkpoint_job, 2):
        for (layout, modes, regions), asked in zip(reports, RUNS):
            assert regions >= 1 and all(m == asked["recompute"] for m in modes), (layout, modes, regions)
