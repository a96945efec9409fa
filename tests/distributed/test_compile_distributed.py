"""Compiled stages on gloo ranks: across a pipeline's ranks (1F1B, input gradients sent early; ZB-H1),
under FSDP2 (its root unit outside the compiled graph), with tensor-parallel blocks (DTensor traced,
static shapes: one graph per micro-batch size; ZB-H1, sequence parallel, graded micro-batches) and with
expert parallelism (each expert-parallel layer eager between compiled graphs, on routings the trace
never saw). Every gradient (gathered whole) is the plain model's, and a second step compiles
nothing. One spawn of two ranks, backend aot_eager; FSDP2 x TP compiled is in
test_mesh_distributed (4 ranks)."""

from __future__ import annotations

import copy

import pytest
import torch

import replica
from replica.parallel.compile import compile_backend, compiled_stage, recompiles
from tests import models, moe_zoo
from tests.conftest import COMPUTE_BOUND
from tests.distributed.test_distributed import STEP_TIMEOUT_S, _portable, _run
from tests.grads import assert_same_grads, whole
from tests.test_moe_routing import TOL, _batch, _loss

pytestmark = pytest.mark.distributed

RUNS = (
    dict(num_stages=2),
    dict(num_stages=2, schedule="zb-h1"),
    dict(num_stages=1, data_parallel_size=2, sharded_data_parallel="zero3"),
    dict(num_stages=1, tensor_parallel_size=2, schedule="zb-h1"),  # DTensor linears eager for their W actions
    # graded micro-batches of the 8 samples: two sizes, so two graphs of the static tensor-parallel stage
    dict(num_stages=1, tensor_parallel_size=2, sequence_parallel=True, num_microbatches=3, recompute=True),
)


def compile_job(rank: int, world: int) -> bytes:
    torch.set_num_threads(1)
    reports = []
    for layout in RUNS:
        torch.manual_seed(0)  # the same model and batch on every rank
        # one block (two stages: the block's and the head's): dynamo's tracing is most of this test's time,
        # 26 s against 35 s with two blocks on 2 cores; several blocks a stage compile in tests/test_compile.py
        model, inputs, target, loss_fn = models.tiny_gpt(8, num_layers=1)
        ref = copy.deepcopy(model)
        loss_fn(ref(*inputs), target).backward()
        with compile_backend("aot_eager"):
            pm = replica.auto_parallel(model, inputs, loss_fn=loss_fn, device=COMPUTE_BOUND, timeout_s=STEP_TIMEOUT_S,
                                       compile=True, **{"schedule": "1f1b", "num_microbatches": 2, **layout})
        before = recompiles()
        pm.train_step(inputs, target)
        assert_same_grads(pm, ref, subset=True, context=f"{layout}: ", rtol=1e-4, atol=1e-6)
        warm = recompiles()
        pm.zero_grad()
        pm.train_step(inputs, target)
        compiled = all(compiled_stage(s.module) is not None for s in pm.stages)
        reports.append((pm.plan.layout.describe(), compiled, warm - before, recompiles() - warm, pm.plan.compile_line))
    reports.append(_experts())
    return _portable(reports)


def _experts() -> tuple:
    """ep=2 (one stage, two replicas) compiled: the router and everything around the experts in
    graphs, the all-to-all dispatch eager; three steps, the routing another each time."""
    plain, vocab = moe_zoo.build("plain")
    traced_x, _ = _batch(vocab, 8, 1)
    with compile_backend("aot_eager"):
        pm = replica.auto_parallel(copy.deepcopy(plain), (traced_x,), num_stages=1, num_microbatches=2,
                                   expert_parallel_size=2, loss_fn=_loss, device=COMPUTE_BOUND,
                                   timeout_s=STEP_TIMEOUT_S, schedule="1f1b", compile=True)
    x, y = _batch(vocab, 12, 2)  # another size, another routing
    counts = []
    for mode in ("natural", "starve", "hog"):
        if mode != "natural":
            moe_zoo.force(plain, "plain", mode)
            pm.load_state_dict(plain.state_dict())
        before = recompiles()
        ref = copy.deepcopy(plain)
        _loss(ref(x), y).backward()
        pm.train_step(x, y)
        grads = dict(ref.named_parameters())
        for name, p in pm.named_parameters():
            torch.testing.assert_close(whole(p.grad), grads[name].grad, **TOL,
                                       msg=lambda m, name=name: f"{mode} {name}: {m}")
        pm.zero_grad()
        counts.append(recompiles() - before)
    return (pm.plan.layout.describe(), all(compiled_stage(s.module) is not None for s in pm.stages), counts,
            pm.plan.compile_line)


def test_compiled_stages_across_ranks_with_fsdp_tensor_and_expert_parallel() -> None:
    for reports in _run(compile_job, 2):
        for (layout, compiled, warm_up, after, line), asked in zip(reports, RUNS):
            assert compiled and after == 0 and warm_up >= 1, (layout, compiled, warm_up, after)
            if asked.get("tensor_parallel_size", 1) > 1:  # static shapes: one graph per micro-batch size
                assert "stages [0] compile each micro-batch size once" in line, line
                # each graph (the stage's pieces, each checkpointed block's region) once per size
                assert warm_up % (2 if asked.get("num_microbatches") == 3 else 1) == 0, (layout, warm_up)
        layout, compiled, counts, line = reports[-1]
        assert "experts over 2 replicas" in layout and compiled, layout
        assert counts[0] >= 1 and counts[1:] == [0, 0], counts  # new routings compile nothing
        assert "run each expert-parallel layer eagerly between compiled graphs" in line, line
