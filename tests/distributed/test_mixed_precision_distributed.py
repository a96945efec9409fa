"""Mixed precision across processes: under bf16 autocast (``mixed_precision="bf16"`` or the
caller's own ``torch.autocast``) and with bf16 weights, every schedule on gloo ranks, with
and without data parallelism, leaves the gradients of the plain model run micro-batch by
micro-batch under the same autocast (what crosses a cut has the dtype the stage makes)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import replica
from replica.runtime import microbatch
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.distributed.test_distributed import STEP_TIMEOUT_S, _portable, _run

pytestmark = pytest.mark.distributed

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
BF16 = dict(rtol=2e-3, atol=1e-5)  # the same bf16 ops in another order of fp32 accumulation


def _case(batch: int = 8, dtype: torch.dtype = torch.float32) -> models.ModelCase:
    torch.manual_seed(0)
    case = models.tiny_gpt(batch, num_layers=4, size_ops=True)
    return case._replace(model=case.model.to(dtype))


def microbatch_reference(model: torch.nn.Module, inputs: tuple, target: torch.Tensor, loss_fn,
                         plan: replica.Plan, autocast: torch.dtype | None, **kwargs) -> torch.nn.Module:
    """A copy of ``model`` after the backward of every micro-batch of every replica's slice
    (cut as ``plan`` cuts them, graded or not), each under ``autocast`` and weighed by its
    share of the batch: the pipeline's arithmetic, op for op."""
    ref = copy.deepcopy(model)
    for p, q in zip(model.parameters(), ref.parameters()):  # deepcopy drops a gradient dtype
        if getattr(p, "grad_dtype", None) not in (None, p.dtype):
            q.grad_dtype = p.grad_dtype
    n = target.shape[0]
    for part in microbatch.split([*inputs, target], plan.data_parallel_size):
        for *x, y in microbatch.split(part, plan.num_microbatches, shares=plan.microbatch_shares):
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = loss_fn(ref(*x, **kwargs), y) * (y.shape[0] / n)
            loss.backward()
    return ref


def _compare(pm: replica.PipelineModel, ref: torch.nn.Module, **tolerance: float) -> list[str]:
    want = dict(ref.named_parameters())
    names = []
    for name, p in pm.named_parameters():
        assert p.grad is not None and p.grad.dtype == want[name].grad.dtype, (name, p.grad, want[name].grad.dtype)
        torch.testing.assert_close(p.grad, want[name].grad, msg=lambda m: f"{name}: {m}", **tolerance)
        names.append(name)
    return names


def bf16_job(rank: int, world: int, schedules: tuple[str, ...], num_stages: int) -> bytes:
    """Every schedule under mixed_precision="bf16", then the caller's own autocast, then bf16
    weights; each against the micro-batch reference (tight) and the whole batch (bf16)."""
    report: dict[str, object] = {}
    auto = functools.partial(replica.auto_parallel, device=COMPUTE_BOUND, timeout_s=STEP_TIMEOUT_S,
                             num_microbatches=4)
    for schedule in schedules:
        stages = num_stages * (2 if schedule in ("interleaved", "zb-v") and num_stages == world else 1)
        for how in ("mixed_precision", "autocast", "bf16_weights"):
            dtype = torch.bfloat16 if how == "bf16_weights" else torch.float32
            model, inputs, target, loss_fn = _case(16, dtype)
            plain = copy.deepcopy(model)  # a rank frees the weights of the stages it does not hold
            pm = auto(model, inputs, num_stages=stages, schedule=schedule, loss_fn=loss_fn,
                      mixed_precision="bf16" if how == "mixed_precision" else None)
            ref = microbatch_reference(plain, inputs, target, loss_fn, pm.plan,
                                       autocast=None if how == "bf16_weights" else torch.bfloat16)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "autocast"):
                loss = pm.train_step(inputs, target)
            names = _compare(pm, ref, **(BF16 if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)))
            report[(schedule, how)] = (float(loss), len(names), pm.data_parallel_size, pm.plan.num_stages)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "autocast"):
                out = pm(inputs[0])  # inference sees the same dtypes
            report[(schedule, how, "out")] = str(out.dtype)
    return _portable(report)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return _run(bf16_job, 2, SCHEDULES, 2)


def test_bf16_on_two_ranks_every_schedule(two_ranks) -> None:
    for schedule in SCHEDULES:
        for how in ("mixed_precision", "autocast", "bf16_weights"):
            losses = {r[(schedule, how)][0] for r in two_ranks}
            assert len(losses) == 1, (schedule, how, losses)
            assert sum(r[(schedule, how)][1] for r in two_ranks) >= 4 * 4  # every rank checked its part
        assert two_ranks[0][(schedule, "bf16_weights", "out")] == "torch.bfloat16"


def test_bf16_with_data_parallel_replicas_on_four_ranks() -> None:
    reports = _run(bf16_job, 4, ("1f1b", "zb-h1"), 2)
    assert {r[("1f1b", "mixed_precision")][2] for r in reports} == {2}


def disagreeing_autocast_job(rank: int, world: int) -> bytes:
    """Rank 0 wraps its step in bf16 autocast, rank 1 does not: both fail with an error that
    names the autocast, instead of a gloo abort on a message of the wrong size."""
    model, inputs, target, loss_fn = _case(8)
    pm = replica.auto_parallel(model, inputs, num_stages=2, num_microbatches=2, loss_fn=loss_fn, device=COMPUTE_BOUND,
                               timeout_s=5)
    pm.train_step(inputs, target)  # agreed: no autocast anywhere
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=rank == 0):
            pm.train_step(inputs, target)
    except replica.PipelineError as exc:
        return _portable(str(exc))
    return _portable(None)


def test_ranks_under_different_autocast_fail_with_a_clear_error() -> None:
    messages = _run(disagreeing_autocast_job, 2)
    assert "rank 1's autocast" in messages[0], messages  # the rank that changed alone waited for its peer
    assert messages[1] is not None, messages  # the other timed out on its first message

