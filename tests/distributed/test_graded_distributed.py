"""Graded (uneven) micro-batches across gloo ranks: the tied GPT keeps the plain model's gradients."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch

import replica
from replica.launch import run_local
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.grads import assert_same_grads

pytestmark = pytest.mark.distributed


def job(rank: int, world: int) -> bytes:
    checked = []
    for schedule, stages, shares in [("1f1b", 2, (1, 3, 4, 4, 3, 1)), ("zb-v", 4, (3, 4, 4, 2, 2, 1))]:
        torch.manual_seed(0)  # every rank builds the same model
        model, inputs, target, loss_fn = models.tiny_gpt(16, num_layers=4, size_ops=True)
        ref = copy.deepcopy(model)
        ref_loss = loss_fn(ref(*inputs), target)
        ref_loss.backward()
        plan = replica.plan(model, inputs, world_size=world, num_stages=stages, num_microbatches=6,
                            schedule=schedule, device=COMPUTE_BOUND)
        plan = dataclasses.replace(plan, microbatch_shares=tuple(s / 16 for s in shares))
        pm = replica.auto_parallel(model, inputs, loss_fn=loss_fn, plan=plan, timeout_s=30)
        torch.testing.assert_close(pm.train_step(inputs, target), ref_loss.detach())
        assert_same_grads(pm, ref, subset=True, context=f"{schedule} ")
        with torch.no_grad():
            torch.testing.assert_close(pm(*inputs), ref(*inputs))
        checked.append((schedule, sorted(n for n, _ in pm.named_parameters())))
    return pickle.dumps(checked)


def test_graded_microbatches_on_two_ranks():
    held = [pickle.loads(r) for r in run_local(job, 2, timeout_s=90)]
    for (schedule, names0), (_, names1) in zip(*held):
        assert names0 != names1, schedule
        # looped: the tied embedding/head on both ranks; V: the first and last stage share rank 0
        assert "transformer.wte.weight" in names0
        assert ("transformer.wte.weight" in names1) == (schedule == "1f1b"), schedule
