"""A value cast at a cut under autocast (replica/partition/crossing.py) crosses processes in bf16, with the
gradients of the plain model run micro-batch by micro-batch under the same autocast."""

from __future__ import annotations

import copy

import pytest
import torch

import replica
from tests.conftest import COMPUTE_BOUND
from tests.distributed.test_distributed import STEP_TIMEOUT_S, _portable, _run
from tests.distributed.test_mixed_precision_distributed import microbatch_reference
from tests.test_crossing import _Blocks, _mse, casts

pytestmark = pytest.mark.distributed


def cast_job(rank: int, world: int) -> bytes:
    report = {}
    for schedule, stages in (("1f1b", 2), ("zb-v", 4)):
        torch.manual_seed(0)
        model, x, y = _Blocks(), torch.randn(8, 16, 32), torch.randn(8, 16, 8)
        plain = copy.deepcopy(model)
        pm = replica.auto_parallel(model, (x,), num_stages=stages, num_microbatches=4, schedule=schedule,
                                   loss_fn=_mse, mixed_precision="bf16", device=COMPUTE_BOUND, timeout_s=STEP_TIMEOUT_S)
        pm.train_step((x,), y)
        want = dict(microbatch_reference(plain, (x,), y, _mse, pm.plan, torch.bfloat16).named_parameters())
        for name, p in pm.named_parameters():
            torch.testing.assert_close(p.grad, want[name].grad, rtol=2e-3, atol=1e-6, msg=lambda m: f"{name}: {m}")
        report[schedule] = sum(casts(s.module) for s in pm.stages)  # this rank's stages' casts
    return _portable(report)


def test_cast_values_cross_processes_with_the_plain_gradients() -> None:
    reports = _run(cast_job, 2)
    assert sum(r["1f1b"] for r in reports) >= 1 and sum(r["zb-v"] for r in reports) >= 1, reports
