"""A model only torch.export can trace, pipelined over 2 gloo ranks: exact gradients, dict outputs."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import replica
from replica.launch import run_local
from tests.conftest import COMPUTE_BOUND
from tests.grads import assert_same_grads
from tests.test_export import ShapeBranch, batch, dict_loss

pytestmark = pytest.mark.distributed


def job(rank: int, world: int) -> bytes:
    torch.manual_seed(0)
    model = ShapeBranch()
    ref = copy.deepcopy(model)
    ids, target = batch()
    ref_loss = dict_loss(ref(ids), target)
    ref_loss.backward()
    pm = replica.auto_parallel(model, (ids,), num_stages=2, num_microbatches=4, loss_fn=dict_loss,
                               device=COMPUTE_BOUND, timeout_s=30)
    loss = pm.train_step(ids, target)
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_same_grads(pm, ref, subset=True)
    with torch.no_grad():
        out = pm(ids)
    torch.testing.assert_close(out["logits"], ref(ids)["logits"].detach())
    return pickle.dumps(sorted(n for n, _ in pm.named_parameters()))


def test_exported_model_on_two_ranks():
    held = [pickle.loads(r) for r in run_local(job, 2, timeout_s=60)]
    assert held[0] != held[1] and "embed.weight" in held[0] and "embed.weight" in held[1]
