"""One batch meaning for every layout: every rank is given the batch the plain model takes,
each data-parallel replica trains its slice, and the gradients are the whole batch's, whatever
the planner chose; ``batch="per_rank"`` feeds each replica its own batch instead."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import replica
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.distributed.test_distributed import STEP_TIMEOUT_S, _portable, _reference, _run
from tests.grads import assert_same_grads

pytestmark = pytest.mark.distributed


def _sum_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")


def _case(batch: int):
    torch.manual_seed(0)
    return models.tiny_gpt(batch, size_ops=True)


def _forward_agrees(pm: replica.PipelineModel, ref: torch.nn.Module, inputs: tuple) -> bool:
    with torch.no_grad():
        torch.testing.assert_close(pm(*inputs), ref(*inputs))
    return True


def batch_meaning_job(rank: int, world: int) -> bytes:
    """Two ranks, 1 stage x 2 replicas (the layout fixed by num_stages=1): uneven slices, a summed
    loss, a per-rank feed; and schedule="auto", whichever layout it picks."""
    report: dict[str, object] = {}
    auto = functools.partial(replica.auto_parallel, device=COMPUTE_BOUND, timeout_s=STEP_TIMEOUT_S)

    # 15 samples over 2 replicas: 8 and 7, each weighed by its share of the batch
    model, inputs, target, loss_fn = _case(16)
    pm = auto(model, inputs, num_stages=1, num_microbatches=2, loss_fn=loss_fn)
    odd = tuple(x[:15] for x in inputs), target[:15]
    ref, ref_loss = _reference(model, *odd, loss_fn)
    torch.testing.assert_close(pm.train_step(*odd), ref_loss)
    assert_same_grads(pm, ref, subset=True)
    report["uneven"] = (pm.data_parallel_size, pm.replica_slice(odd[0])[0].shape[0])
    report["uneven_forward"] = _forward_agrees(pm, ref, odd[0])

    # a loss summed over the batch: the sum over both replicas' samples
    model, inputs, target, _ = _case(16)
    ref, ref_loss = _reference(model, inputs, target, _sum_loss)
    pm = auto(model, inputs, num_stages=1, num_microbatches=2, loss_fn=_sum_loss, loss_reduction="sum")
    torch.testing.assert_close(pm.train_step(inputs, target), ref_loss)
    assert_same_grads(pm, ref, subset=True)

    # a loader that shards per rank: each replica is fed its own half, planned on it
    model, inputs, target, loss_fn = _case(16)
    ref, ref_loss = _reference(model, inputs, target, loss_fn)
    half = tuple(x[8 * rank:8 * rank + 8] for x in inputs), target[8 * rank:8 * rank + 8]
    pm = auto(model, half[0], num_stages=1, data_parallel_size=2, num_microbatches=2, loss_fn=loss_fn,
              batch="per_rank")
    assert torch.equal(pm.replica_slice(inputs[0]), half[0][0])  # the helper shards alike
    torch.testing.assert_close(pm.train_step(*half), ref_loss)
    assert_same_grads(pm, ref, subset=True)
    with torch.no_grad():
        report["per_rank_forward_rows"] = pm(*half[0]).shape[0]  # its replica's outputs only
    try:
        pm(*half[0])  # with autograd on: it could not backpropagate, so it says so
    except replica.PipelineError as exc:
        report["grad_forward"] = str(exc)

    # the tuner's layout, whichever it is: the same batch on every rank, the plain model's gradients
    model, inputs, target, loss_fn = _case(16)
    ref, ref_loss = _reference(model, inputs, target, loss_fn)
    pm = auto(model, inputs, schedule="auto", loss_fn=loss_fn)
    torch.testing.assert_close(pm.train_step(inputs, target), ref_loss)
    assert_same_grads(pm, ref, subset=True)
    report["auto"] = pm.plan.layout.describe()
    report["auto_forward"] = _forward_agrees(pm, ref, inputs)
    return _portable(report)


@pytest.fixture(scope="module")
def batch_meaning() -> list[dict]:
    return _run(batch_meaning_job, 2)


def test_uneven_replica_slices_give_the_whole_batch_gradients(batch_meaning):
    # each rank compared its gradients with the plain model's on the 15 samples inside the job
    assert [r["uneven"] for r in batch_meaning] == [(2, 8), (2, 7)]
    assert all(r["uneven_forward"] for r in batch_meaning)


def test_per_rank_batches_and_auto_layouts(batch_meaning):
    assert [r["per_rank_forward_rows"] for r in batch_meaning] == [8, 8]
    assert all("is inference" in r["grad_forward"] and "torch.no_grad()" in r["grad_forward"] for r in batch_meaning)
    assert len({r["auto"] for r in batch_meaning}) == 1 and all(r["auto_forward"] for r in batch_meaning)


def test_per_rank_batches_need_the_replicas_fixed():
    model, inputs, _, _ = _case(16)
    with pytest.raises(replica.ConfigError, match=r"batch='per_rank'.*data_parallel_size="):
        replica.plan(model, inputs, world_size=4, batch="per_rank", device=COMPUTE_BOUND)
    with pytest.raises(replica.ConfigError, match=r"batch='lots'; use 'global'"):
        replica.plan(model, inputs, world_size=4, batch="lots", device=COMPUTE_BOUND)
