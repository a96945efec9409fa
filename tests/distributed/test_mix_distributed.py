"""Stages of one plan checkpointing differently (the tuner's per-stage mixes, replica/planner/mix.py) across
gloo ranks: the plain model's gradients, with 1F1B and ZB-V."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import replica
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.distributed.test_distributed import STEP_TIMEOUT_S, _portable, _run
from tests.grads import assert_same_grads

pytestmark = pytest.mark.distributed


def mixed_job(rank: int, world: int) -> bytes:
    report = {}
    for schedule, modes in (("1f1b", (1, False)), ("zb-v", (True, "selective", 1, False))):
        torch.manual_seed(0)
        model, inputs, target, loss_fn = models.tiny_gpt(8, num_layers=len(modes) * 2)
        ref = copy.deepcopy(model)
        loss_fn(ref(*inputs), target).backward()
        plan = replica.plan(model, inputs, world_size=world, num_stages=len(modes), num_microbatches=4,
                            schedule=schedule, recompute=False, device=COMPUTE_BOUND)
        plan = dataclasses.replace(plan, recompute=True, stages=tuple(
            dataclasses.replace(s, recompute=mode) for s, mode in zip(plan.stages, modes)))
        pm = replica.auto_parallel(model, inputs, loss_fn=loss_fn, plan=plan, timeout_s=STEP_TIMEOUT_S)
        pm.train_step(inputs, target)
        report[schedule] = len(assert_same_grads(pm, ref, subset=True))
    return _portable(report)


def test_a_mixed_plan_gives_the_plain_gradients_across_ranks() -> None:
    reports = _run(mixed_job, 2)
    assert all(r["1f1b"] > 0 and r["zb-v"] > 0 for r in reports), reports
