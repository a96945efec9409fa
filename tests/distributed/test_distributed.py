"""Transparency across processes: a pipeline over gloo ranks leaves the plain model's loss,
outputs and gradients, and a dead, silent or mismatched rank fails fast with a clear error.

Each test spawns its ranks once with ``replica.launch.run_local`` and runs several checks in
that one job: starting a process costs seconds on a loaded machine, a train step milliseconds.
Jobs compare tensors inside the ranks and send the parent plain ``pickle`` bytes, so a result
never depends on a rank that has already exited (see ``_portable``).
"""

from __future__ import annotations

import copy
import os
import pickle
import time
from typing import Any, Callable

import pytest
import torch

import replica
from replica.launch import run_local
from replica.stage import weightgrad
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.grads import assert_same_grads

pytestmark = pytest.mark.distributed

RUN_TIMEOUT_S = 45  # run_local: gloo set-up and every collective outside the pipeline
STEP_TIMEOUT_S = 30  # auto_parallel: every wait on another rank
TIED = "transformer.wte.weight"

CASES: dict[str, Callable[[int], models.ModelCase]] = {
    "tiny_gpt": lambda batch: models.tiny_gpt(batch, size_ops=True),
    "unet": models.unet,
    "two_input_branchy": models.two_input_branchy,
}


# --------------------------------------------------------------------------- in the ranks


def _portable(value: Any) -> bytes:
    """Plain pickle bytes: tensors by value, not shared through the (soon dead) rank's memory."""
    return pickle.dumps(value)


def _reference(model: torch.nn.Module, inputs: tuple, target: torch.Tensor, loss_fn) -> tuple:
    """A copy of the plain model after one backward of the whole batch, and its loss."""
    ref = copy.deepcopy(model)
    loss = loss_fn(ref(*inputs), target)
    loss.backward()
    return ref, loss.detach()


def _tied_grad(pm: replica.PipelineModel) -> torch.Tensor | None:
    p = dict(pm.named_parameters()).get(TIED)
    return None if p is None else p.grad.detach().clone()


def _forward_error(pm: replica.PipelineModel, ref: torch.nn.Module, inputs: tuple) -> str | None:
    """How ``pm(*inputs)`` differs from the plain model's output on this rank, or None."""
    try:
        with torch.no_grad():
            torch.testing.assert_close(pm(*inputs), ref(*inputs))
    except Exception as exc:
        return f"rank {torch.distributed.get_rank()}: {type(exc).__name__}: {exc}"
    return None


def transparency_job(rank: int, world: int, case: str, batch: int, num_stages: int,
                     num_microbatches: int, schedules: tuple[str, ...], early: bool = True,
                     recompute: bool | str | None = None) -> bytes:
    """One step per schedule, each on a fresh copy of the model: loss and gradients must be
    the plain model's on every rank; the pipelined forward's outcome is reported."""
    reports = []
    for schedule in schedules:
        torch.manual_seed(0)
        model, inputs, target, loss_fn = CASES[case](batch)
        ref, ref_loss = _reference(model, inputs, target, loss_fn)  # before auto_parallel frees weights
        pm = replica.auto_parallel(model, inputs, num_stages=num_stages, num_microbatches=num_microbatches,
                                   schedule=schedule, loss_fn=loss_fn, device=COMPUTE_BOUND,
                                   timeout_s=STEP_TIMEOUT_S, recompute=recompute)
        assert pm.plan.num_stages == num_stages and pm.plan.num_microbatches == num_microbatches
        if not early:  # what a plan within a tight memory budget does: weight gradients before sending
            pm.runtime.executor.early = set()
        loss = pm.train_step(inputs, target)
        torch.testing.assert_close(loss, ref_loss, msg=lambda m: f"{schedule} loss: {m}")
        names = assert_same_grads(pm, ref, subset=True)
        reports.append({
            "pointwise": {k: sorted(kinds) for k, kinds in pm.runtime.executor.rebuilt.items()},
            "rebuilds": pm.plan.rebuilds,
            "schedule": schedule,
            "loss": loss.item(),
            "names": names,
            "stages": sorted(s.stage_index for s in pm.stages),
            "early": pm.plan.early_input_grads,
            "deferring": sorted(s.stage_index for s in pm.stages  # linears rewritten to defer weight gradients
                                if any(n.target in (weightgrad.linear, weightgrad.addmm) for n in s.module.graph.nodes)),
            "tied_grad": _tied_grad(pm),
            "state_dict": {k: v.detach().clone() for k, v in pm.state_dict().items()},
            "forward_error": _forward_error(pm, ref, inputs),  # last: it may fail on one rank only
        })
    return _portable(reports)


def data_parallel_job(rank: int, world: int, num_stages: int, num_microbatches: int,
                      schedule: str = "1f1b") -> bytes:
    """Every rank is given the same batch of 16, as the plain model would be; each replica
    trains its half, and the gradients are the whole batch's."""
    torch.manual_seed(0)
    model, inputs, target, loss_fn = models.tiny_gpt(16, size_ops=True)
    ref, ref_loss = _reference(model, inputs, target, loss_fn)
    pm = replica.auto_parallel(model, inputs, num_stages=num_stages, num_microbatches=num_microbatches,
                               schedule=schedule, loss_fn=loss_fn, device=COMPUTE_BOUND, timeout_s=STEP_TIMEOUT_S)
    loss = pm.train_step(inputs, target)
    torch.testing.assert_close(loss, ref_loss)
    names = assert_same_grads(pm, ref, subset=True)
    return _portable({
        "pipeline_rank": pm.pipeline_rank,
        "data_parallel_rank": pm.data_parallel_rank,
        "data_parallel_size": pm.data_parallel_size,
        "loss": loss.item(),
        "names": names,
        "tied_grad": _tied_grad(pm),
        "forward_error": _forward_error(pm, ref, inputs),  # the whole batch's output on every rank
    })


def dead_rank_job(rank: int, world: int, timeout_s: float) -> dict[str, Any] | None:
    """Rank 1 dies between two steps; rank 0 reports how its second step failed."""
    torch.manual_seed(0)
    model, inputs, target, loss_fn = models.tiny_gpt(8, size_ops=True)
    pm = replica.auto_parallel(model, inputs, num_stages=2, num_microbatches=2, loss_fn=loss_fn,
                               device=COMPUTE_BOUND, timeout_s=timeout_s)
    pm.train_step(inputs, target)
    if rank == 1:
        os._exit(1)  # no report, no goodbye to the process group
    return _failed_step(pm, inputs, target)


def hung_rank_job(rank: int, world: int, timeout_s: float, call: str = "train_step") -> dict[str, Any] | None:
    """Rank 1 sleeps through the step (then leaves cleanly); rank 0 reports how its ``call``
    (``train_step`` or ``measure_step``) failed."""
    torch.manual_seed(0)
    model, inputs, target, loss_fn = models.tiny_gpt(8, size_ops=True)
    pm = replica.auto_parallel(model, inputs, num_stages=2, num_microbatches=2, loss_fn=loss_fn,
                               device=COMPUTE_BOUND, timeout_s=timeout_s)
    if rank == 1:
        time.sleep(timeout_s + 3)
        return None
    return _failed_step(pm, inputs, target, call)


def _failed_step(pm: replica.PipelineModel, inputs: tuple, target: torch.Tensor,
                 call: str = "train_step") -> dict[str, Any]:
    start = time.monotonic()
    try:
        getattr(pm, call)(inputs, target)
    except Exception as exc:  # the type is part of the report: it must be PipelineError
        return {"type": type(exc).__name__, "is_pipeline_error": isinstance(exc, replica.PipelineError),
                "message": str(exc), "elapsed_s": time.monotonic() - start}
    return {"type": None, "message": f"{call} succeeded", "elapsed_s": time.monotonic() - start}


def config_error_job(rank: int, world: int, num_layers_per_rank: tuple[int, ...], num_stages: int) -> dict:
    """``auto_parallel`` on every rank, each with its own model depth; the error each rank sees."""
    # Every rank has finished joining before any can fail and leave: gloo's set-up is not a
    # barrier, and a rank leaving early breaks a peer still connecting.
    torch.distributed.barrier()
    torch.manual_seed(0)
    model, inputs, _, loss_fn = models.tiny_gpt(8, num_layers=num_layers_per_rank[rank], size_ops=True)
    try:
        replica.auto_parallel(model, inputs, num_stages=num_stages, loss_fn=loss_fn, device=COMPUTE_BOUND,
                              timeout_s=STEP_TIMEOUT_S)
    except Exception as exc:
        return {"type": type(exc).__name__, "is_config_error": isinstance(exc, replica.ConfigError),
                "message": str(exc)}
    return {"type": None, "message": "auto_parallel succeeded"}


def nccl_on_cpu_job(rank: int, world: int) -> dict:
    """``auto_parallel`` of a CPU model in a group that says it runs NCCL (gloo underneath)."""
    torch.distributed.barrier()
    torch.distributed.get_backend = lambda group=None: "nccl"  # this process only: it exits after
    model, inputs, _, loss_fn = models.tiny_gpt(8, num_layers=2, size_ops=True)
    try:
        replica.auto_parallel(model, inputs, num_stages=2, loss_fn=loss_fn, device=COMPUTE_BOUND,
                              timeout_s=STEP_TIMEOUT_S)
    except Exception as exc:
        return {"is_config_error": isinstance(exc, replica.ConfigError), "message": str(exc)}
    return {"is_config_error": False, "message": "auto_parallel succeeded"}


# --------------------------------------------------------------------------- in the parent


def _run(fn: Callable[..., Any], world: int, *args: Any, **kwargs: Any) -> list[Any]:
    results = run_local(fn, world, *args, timeout_s=RUN_TIMEOUT_S, **kwargs)
    return [pickle.loads(r) if isinstance(r, bytes) else r for r in results]


def _plain_names(case: str) -> set[str]:
    return {name for name, _ in CASES[case](2).model.named_parameters()}


def _assert_pipeline_cut(case: str, reports_by_rank: list[dict]) -> None:
    """Every rank holds part of the model, together all of it; the loss is one number everywhere."""
    held = [set(r["names"]) for r in reports_by_rank]
    everything = _plain_names(case)
    assert set().union(*held) == everything
    assert all(h and h != everything for h in held), [sorted(h) for h in held]
    assert len({r["loss"] for r in reports_by_rank}) == 1, [r["loss"] for r in reports_by_rank]


# One spawned job per configuration, shared by the tests that read it.


@pytest.fixture(scope="module")
def gpt() -> list[list[dict]]:
    """Tiny GPT (tied embedding and head), 2 stages on 2 ranks, gpipe then 1f1b."""
    return _run(transparency_job, 2, "tiny_gpt", 8, 2, 4, ("gpipe", "1f1b"))


@pytest.fixture(scope="module")
def gpt_pointwise() -> list[list[dict]]:
    """Tiny GPT, 2 stages on 2 ranks, 1f1b then zb-h1, GELU outputs rebuilt in backward."""
    return _run(transparency_job, 2, "tiny_gpt", 8, 2, 4, ("1f1b", "zb-h1"), True, "pointwise")


@pytest.fixture(scope="module")
def unet() -> list[list[dict]]:
    """U-Net, skips across the whole net, 3 stages on 3 ranks, gpipe then 1f1b."""
    return _run(transparency_job, 3, "unet", 8, 3, 4, ("gpipe", "1f1b"))


@pytest.fixture(scope="module")
def branchy() -> list[list[dict]]:
    """Two inputs, a layer used twice far apart; a batch of 7 in 3 uneven micro-batches."""
    return _run(transparency_job, 2, "two_input_branchy", 7, 2, 3, ("gpipe", "1f1b"))


@pytest.fixture(scope="module")
def unet_late() -> list[list[dict]]:
    """The U-Net again with each backward's weight gradients computed before its input
    gradient is sent."""
    return _run(transparency_job, 3, "unet", 8, 3, 4, ("1f1b",), False)


@pytest.fixture(scope="module")
def interleaved() -> list[list[dict]]:
    """Tiny GPT, 4 stages on 2 ranks (two each), interleaved 1F1B."""
    return _run(transparency_job, 2, "tiny_gpt", 8, 4, 4, ("interleaved",))


@pytest.fixture(scope="module")
def data_parallel() -> list[dict]:
    """Tiny GPT, 2 stages × 2 replicas on 4 ranks, each replica with its own batch."""
    return _run(data_parallel_job, 4, 2, 2)


@pytest.fixture(scope="module")
def pure_data_parallel() -> list[dict]:
    """Tiny GPT, 1 stage × 2 replicas: every gradient is reduced by the bucket hooks."""
    return _run(data_parallel_job, 2, 1, 2)


def test_tiny_gpt_tied_weight_gpipe_and_1f1b(gpt):
    for k, schedule in enumerate(("gpipe", "1f1b")):
        reports = [r[k] for r in gpt]
        assert [r["schedule"] for r in reports] == [schedule, schedule]
        assert [r["stages"] for r in reports] == [[0], [1]]
        _assert_pipeline_cut("tiny_gpt", reports)
        # only stage 1 sends an input gradient back: only its linears defer their weight
        # gradients (for early sending); stage 0 runs autograd's own
        assert [r["deferring"] for r in reports] == ([[], [1]] if reports[0]["early"] else [[], []]), schedule
        # the embedding lives on rank 0, the head on rank 1: both hold the tied weight and
        # both get the full gradient (embedding's + head's), not just their own part
        grads = [r["tied_grad"] for r in reports]
        assert all(g is not None for g in grads), f"{schedule}: {TIED} held: {[g is not None for g in grads]}"
        torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_pointwise_recompute_keeps_gradients(gpt_pointwise):
    # every rank compared loss and gradients with the plain model's inside the job
    rank0, rank1 = gpt_pointwise
    every = ["activation", "norm"]
    # asked for: every kind, under 1F1B on rank 0 (it holds two micro-batches) and rank 1 (it
    # sends input gradients first); ZB-H1 splits backward itself, so rank 1 rebuilds only what
    # the planner found as good as free
    assert [r["pointwise"] for r in rank0] == [{0: every}, {0: every}]
    # ZB-H1's W actions need every stage's weight gradients deferred; 1F1B's only where an
    # input gradient goes back to another rank
    assert [r["deferring"] for r in rank0] == [[], [0]] and [r["deferring"] for r in rank1] == [[1], [1]]
    assert rank1[0]["pointwise"] == {1: every}
    assert rank1[1]["pointwise"] == ({1: sorted(kind for _, kind in rank1[1]["rebuilds"] if _ == 1)}
                                     if any(k == 1 for k, _ in rank1[1]["rebuilds"]) else {})


def test_rebuilds_the_planner_found_keep_gradients(gpt):
    # unasked: on a compute-bound device a GELU or a norm costs next to nothing, so the stage
    # that waits for the other rebuilds both kinds; each rank compared its gradients with the
    # plain model's
    for rank, reports in enumerate(gpt):
        for r in reports:
            stages = {k for k, _ in r["rebuilds"]}
            assert len(stages) == 1 and {kind for _, kind in r["rebuilds"]} == {"activation", "norm"}, r["schedule"]
            waiting = stages.pop()
            assert r["pointwise"] == ({rank: ["activation", "norm"]} if rank == waiting else {}), r["schedule"]


def test_state_dict_per_rank_and_union_loads_into_plain_model(gpt):
    dicts = [r[-1]["state_dict"] for r in gpt]
    torch.manual_seed(0)
    model, inputs, _, _ = models.tiny_gpt(8, size_ops=True)
    plain = model.state_dict()
    for rank, sd in enumerate(dicts):
        assert set(sd) < set(plain), f"rank {rank}: extra keys {sorted(set(sd) - set(plain))}, or holds all"
        assert {TIED, "lm_head.weight"} <= set(sd), f"rank {rank} lacks the tied weight"
        for key, value in sd.items():
            torch.testing.assert_close(value, plain[key], msg=lambda m: f"rank {rank} {key}: {m}")
    params = {name for name, _ in model.named_parameters()}
    held = [set(sd) & params for sd in dicts]
    assert held[0] - {TIED} and held[1] - {TIED} and held[0] & held[1] == {TIED}, held
    torch.manual_seed(1)  # other weights, so only the loaded ones can give the same outputs
    other = models.tiny_gpt(8, size_ops=True).model
    other.load_state_dict({**dicts[0], **dicts[1]})
    with torch.no_grad():
        torch.testing.assert_close(other(*inputs), model(*inputs))


def test_unet_long_skips_on_three_ranks(unet):
    for k in range(2):
        reports = [r[k] for r in unet]
        assert [r["stages"] for r in reports] == [[0], [1], [2]]
        _assert_pipeline_cut("unet", reports)


def test_unet_with_late_input_gradients(unet_late):
    _assert_pipeline_cut("unet", [r[0] for r in unet_late])


def test_two_input_branchy_with_uneven_microbatches(branchy):
    for k in range(2):  # 7 samples in micro-batches of 3, 2, 2 (or so): the loss weighs them
        _assert_pipeline_cut("two_input_branchy", [r[k] for r in branchy])


def test_interleaved_two_stages_per_rank(interleaved):
    reports = [r[0] for r in interleaved]
    assert [r["stages"] for r in reports] == [[0, 2], [1, 3]]
    _assert_pipeline_cut("tiny_gpt", reports)
    torch.testing.assert_close(reports[0]["tied_grad"], reports[1]["tied_grad"], rtol=0, atol=0)


@pytest.fixture(scope="module")
def zero_bubble_v() -> list[list[dict]]:
    """Tiny GPT in a V: 4 stages on 2 ranks, rank 0 holds the tied embedding's and head's stages."""
    return _run(transparency_job, 2, "tiny_gpt", 8, 4, 4, ("zb-v",))


@pytest.fixture(scope="module")
def zero_bubble_interleaved() -> list[list[dict]]:
    """Tiny GPT, 4 stages looped over 2 ranks, split backward (zb-interleaved), 3 micro-batches."""
    return _run(transparency_job, 2, "tiny_gpt", 8, 4, 3, ("zb-interleaved",))


def test_zero_bubble_interleaved_two_stages_per_rank(zero_bubble_interleaved):
    reports = [r[0] for r in zero_bubble_interleaved]
    assert [r["stages"] for r in reports] == [[0, 2], [1, 3]]
    torch.testing.assert_close(reports[0]["tied_grad"], reports[1]["tied_grad"], rtol=0, atol=0)


@pytest.fixture(scope="module")
def zero_bubble_unet() -> list[list[dict]]:
    """U-Net's long skips under ZB-H1 on 3 ranks (split backward: B now, W later)."""
    return _run(transparency_job, 3, "unet", 8, 3, 4, ("zb-h1",))


def test_zero_bubble_v_tied_weight_on_one_rank(zero_bubble_v):
    reports = [r[0] for r in zero_bubble_v]
    assert [r["stages"] for r in reports] == [[0, 3], [1, 2]]
    assert reports[0]["tied_grad"] is not None  # both uses on rank 0: summed once, not twice
    assert reports[0]["loss"] == reports[1]["loss"]


def test_zero_bubble_h1_long_skips_on_three_ranks(zero_bubble_unet):
    reports = [r[0] for r in zero_bubble_unet]
    assert [r["stages"] for r in reports] == [[0], [1], [2]]
    _assert_pipeline_cut("unet", reports)


def test_pipeline_2_by_data_parallel_2(data_parallel):
    results = data_parallel
    assert [(r["pipeline_rank"], r["data_parallel_rank"]) for r in results] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [r["data_parallel_size"] for r in results] == [2, 2, 2, 2]
    for replica_reports in (results[:2], results[2:]):
        _assert_pipeline_cut("tiny_gpt", replica_reports)
    assert len({r["loss"] for r in results}) == 1
    assert [r["names"] for r in results[:2]] == [r["names"] for r in results[2:]]
    grads = [r["tied_grad"] for r in results]
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], rtol=0, atol=0)


@pytest.fixture(scope="module")
def data_parallel_zero_bubble() -> list[dict]:
    """2 stages × 2 replicas under ZB-H1: a stage's last action may be a deferred W."""
    return _run(data_parallel_job, 4, 2, 3, "zb-h1")


def test_data_parallel_under_zero_bubble(data_parallel_zero_bubble):
    results = data_parallel_zero_bubble  # each rank compared its gradients with the whole batch's
    assert len({r["loss"] for r in results}) == 1


def test_pure_data_parallel(pure_data_parallel):
    results = pure_data_parallel  # each replica compared its gradients with the whole batch's
    assert [(r["pipeline_rank"], r["data_parallel_rank"], r["data_parallel_size"]) for r in results] == \
        [(0, 0, 2), (0, 1, 2)]
    assert results[0]["loss"] == results[1]["loss"]


def bucket_job(rank: int, world: int) -> dict[str, Any]:
    """The reducer on its own: tiny buckets; some start during backward, all average right."""
    import torch.distributed as dist

    from replica.parallel.gradsync import ReplicaReducer

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    x = torch.randn(8, 16)
    ref = copy.deepcopy(model)
    ref(x).square().sum().backward()  # the average of rank 0's and rank 1's (= 3 x rank 0's) gradients
    reducer = ReplicaReducer({0: list(model.parameters())}, dist.group.WORLD, world,
                             lambda work, what, peer: work.wait(), bucket_bytes=1)
    reducer.arm(0)
    (model(x) * (1 + rank)).square().sum().backward()
    during = len(reducer.works)
    reducer.flush(0)
    after = len(reducer.works)
    reducer.finish()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad * 2.5)  # (1 + 4) / 2
    return {"during": during, "after": after}


def test_bucket_all_reduces_start_during_backward():
    for report in _run(bucket_job, 2):
        assert report["after"] == 8  # one bucket per parameter (bucket_bytes=1)
        assert report["during"] == 8  # autograd finished every one inside backward


@pytest.mark.parametrize("job", ["gpt", "unet", "unet_late", "branchy", "interleaved", "data_parallel"])
def test_pipelined_forward_returns_plain_output_on_every_rank(job, request):
    results = request.getfixturevalue(job)
    reports = results if job == "data_parallel" else [report for rank in results for report in rank]
    errors = [r["forward_error"] for r in reports if r["forward_error"] is not None]
    assert not errors, "\n".join(errors)


def test_dead_rank_fails_the_step_naming_it():
    timeout_s = 10
    start = time.monotonic()
    results = _run(dead_rank_job, 2, timeout_s, allow_dead=True)
    assert results[1] is None  # rank 1 died without a report, as planned
    report = results[0]
    assert report["is_pipeline_error"], report
    assert "rank 1" in report["message"], report["message"]
    assert report["elapsed_s"] < timeout_s + 5, report
    assert time.monotonic() - start < 55


def test_hung_rank_times_out_naming_it():
    timeout_s = 3
    results = _run(hung_rank_job, 2, timeout_s)
    report = results[0]
    assert report["is_pipeline_error"], report
    message = report["message"]
    assert "rank 1" in message and f"{timeout_s} s" in message, message
    assert "timed out" in message or "timeout" in message, message
    assert timeout_s - 0.5 <= report["elapsed_s"] < timeout_s + 5, report


def test_mismatched_models_fail_on_every_rank():
    results = _run(config_error_job, 2, (2, 3), 2)
    for rank, report in enumerate(results):
        assert report["is_config_error"], (rank, report)
        assert "fingerprint" in report["message"] and "[1]" in report["message"], (rank, report["message"])


def test_num_stages_must_divide_world_size():
    results = _run(config_error_job, 2, (2, 2), 3)
    for rank, report in enumerate(results):
        assert report["is_config_error"], (rank, report)
        message = report["message"]
        assert "num_stages=3" in message and "[1, 2]" in message, (rank, message)


def test_a_cpu_model_under_nccl_is_refused_before_any_collective():
    for rank, report in enumerate(_run(nccl_on_cpu_job, 2)):
        assert report["is_config_error"], (rank, report)
        message = report["message"]
        assert "NCCL" in message and "cpu" in message and "init_process_group('gloo')" in message, (rank, message)
