"""Compiled stages on gloo ranks: across a pipeline's ranks (1F1B, input gradients sent early; ZB-H1) and
under FSDP2 (its root unit outside the compiled graph); stages with tensor-parallel blocks stay
eager. Every gradient (gathered whole) is the plain model's, and a second step compiles nothing.
One spawn of two ranks, backend aot_eager."""

from __future__ import annotations

import copy

import pytest
import torch

import replica
from replica.parallel.compile import compile_backend, compiled_stage, recompiles
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.distributed.test_distributed import STEP_TIMEOUT_S, _portable, _run
from tests.grads import assert_same_grads

pytestmark = pytest.mark.distributed

RUNS = (
    dict(num_stages=2),
    dict(num_stages=2, schedule="zb-h1"),
    dict(num_stages=1, data_parallel_size=2, sharded_data_parallel="zero3"),
    dict(num_stages=1, tensor_parallel_size=2),
)


def compile_job(rank: int, world: int) -> bytes:
    torch.set_num_threads(1)
    reports = []
    for layout in RUNS:
        torch.manual_seed(0)  # the same model and batch on every rank
        model, inputs, target, loss_fn = models.tiny_gpt(8, num_layers=2)
        ref = copy.deepcopy(model)
        loss_fn(ref(*inputs), target).backward()
        with compile_backend("aot_eager"):
            pm = replica.auto_parallel(model, inputs, loss_fn=loss_fn, device=COMPUTE_BOUND, timeout_s=STEP_TIMEOUT_S,
                                       num_microbatches=2, compile=True, **{"schedule": "1f1b", **layout})
        before = recompiles()
        pm.train_step(inputs, target)
        assert_same_grads(pm, ref, subset=True, context=f"{layout}: ", rtol=1e-4, atol=1e-6)
        warm = recompiles()
        pm.zero_grad()
        pm.train_step(inputs, target)
        compiled = all(compiled_stage(s.module) is not None for s in pm.stages)
        reports.append((pm.plan.layout.describe(), compiled, warm - before, recompiles() - warm))
    return _portable(reports)


def test_compiled_stages_across_ranks_with_fsdp_and_tensor_parallel() -> None:
    for reports in _run(compile_job, 2):
        for (layout, compiled, warm_up, after), asked in zip(reports, RUNS):
            tensor_parallel = asked.get("tensor_parallel_size", 1) > 1  # those stages stay eager (parallel/compile.py)
            assert compiled != tensor_parallel and after == 0, (layout, compiled, warm_up, after)
            assert warm_up >= 1 or tensor_parallel, (layout, warm_up)
