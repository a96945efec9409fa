"""Across processes, stages with data-dependent shapes inside, or ops without a usable meta kernel:
a torchtitan-style MoE (a ``nonzero`` loop, fp32 ``grouped_mm``) traced on one batch trains on
others, routed differently, with the plain model's gradients at every layout; a tensor whose length
depends on the data crosses a cut with its shape; a data-dependent Python value at a cut is the
same clear error on every rank, at once. A module kept whole (``leaf_modules=``) whose forward
loops on the data trains exactly; one whose output's length follows the data fails clearly at the cut.

One spawned job per world size runs every case (see tests/distributed/test_distributed.py).
"""

from __future__ import annotations

import copy
import pickle
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import replica
from replica.launch import run_local
from tests import moe
from tests.conftest import COMPUTE_BOUND
from tests.models import lm_loss
from tests.test_shapes import CountAtCut, ExpertsHit, HitMoE, KeptIfAny, KeptRows, LeafRowsAtCut, RaggedCut

pytestmark = pytest.mark.distributed

RUN_TIMEOUT_S = 120  # run_local: gloo set-up and every collective outside the pipeline
STEP_TIMEOUT_S = 30  # auto_parallel: every wait on another rank
STARVED = 3  # the expert of the first MoE layer that never gets a token
MOE = ["moe_loop"] + (["moe_grouped_mm"] if moe.HAS_GROUPED_MM else [])


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _case(name: str) -> tuple[torch.nn.Module, Any]:
    """The model (seeded alike on every rank) and a function of (batch size, seed) -> inputs, target."""
    torch.manual_seed(0)
    if name.startswith("moe"):
        model = moe.moe_transformer(1, experts=name.removeprefix("moe_")).model
        moe.starve(model, STARVED)
        ids = lambda n, g: torch.randint(0, 32, (n, 8), generator=g)  # noqa: E731
        return model, lambda n, seed: (ids(n, torch.Generator().manual_seed(seed)),
                                       ids(n, torch.Generator().manual_seed(seed + 100)))
    model = {"ragged": RaggedCut, "count": CountAtCut, "hit": HitMoE, "leaf_rows": LeafRowsAtCut}[name]()
    return model, lambda n, seed: (torch.randn(n, 16, generator=torch.Generator().manual_seed(seed)),
                                   torch.randn(n, 4 if name == "ragged" else 16,
                                               generator=torch.Generator().manual_seed(seed + 100)))


def _loss_fn(name: str) -> Any:
    return lm_loss if name.startswith("moe") else _mse


LEAVES = {"hit": [ExpertsHit], "leaf_rows": [KeptIfAny]}  # modules no tracer follows, kept whole


def _dynamic_cut(pm: replica.PipelineModel, x: torch.Tensor) -> list[str]:
    """The values crossing a cut whose size this micro-batch's data decides (the oracle's view)."""
    metas = pm.runtime.oracle(pm._microbatches(pm._pack(pm.replica_slice(x), {}))[0])
    return sorted(name for name, m in metas.items() if getattr(m, "dynamic", False) and name != "output")


def case_job(rank: int, world: int, layouts: list[tuple[str, int, str]], edges: bool) -> bytes:
    """Per layout (case, num_stages, schedule): trace on one batch, then train on two others (one
    of another size) and compare every gradient this rank holds, and the loss, with the plain
    model's on the same batch; then pipelined inference against the plain output. With
    ``edges``, then :func:`_edges` (2 ranks)."""
    reports = []
    for name, num_stages, schedule in layouts:
        model, batch = _case(name)
        plain = copy.deepcopy(model)
        traced_x, _ = batch(8, 1)
        pm = replica.auto_parallel(model, (traced_x,), num_stages=num_stages, num_microbatches=2,
                                   schedule=schedule, loss_fn=_loss_fn(name), device=COMPUTE_BOUND,
                                   timeout_s=STEP_TIMEOUT_S, leaf_modules=LEAVES.get(name, ()))
        report: dict[str, Any] = {"layout": (name, num_stages, schedule), "replicas": pm.data_parallel_size,
                                  "stages_here": [s.stage_index for s in pm.stages], "steps": []}
        if name.startswith("moe"):
            report["routing"] = [moe.routing(plain, traced_x)]
        for size, seed in ((8, 2), (12, 3)):
            x, y = batch(size, seed)
            ref = copy.deepcopy(plain)
            want = _loss_fn(name)(ref(x), y)
            want.backward()
            loss = pm.train_step(x, y)
            grads = dict(ref.named_parameters())
            checked = []
            for pname, p in pm.named_parameters():
                torch.testing.assert_close(p.grad, grads[pname].grad, msg=lambda m: f"{name} {pname}: {m}")
                checked.append(pname)
            torch.testing.assert_close(loss, want.detach(), msg=lambda m: f"{name} loss: {m}")
            pm.zero_grad()
            report["steps"].append({"size": size, "checked": checked, "dynamic_cut": _dynamic_cut(pm, x)})
            if name.startswith("moe"):
                report["routing"].append(moe.routing(plain, x))
        with torch.no_grad():
            torch.testing.assert_close(pm(x), plain(x), msg=lambda m: f"{name} forward: {m}")
        reports.append(report)
    return pickle.dumps({"layouts": reports, "edges": _edges() if edges else None})


def _edges() -> dict[str, Any]:
    """A data-dependent Python value at a cut: how the first step fails on this rank, how fast;
    then pipelined inference of a model whose output's length and Python number follow the data."""
    model, batch = _case("count")
    x, y = batch(8, 1)
    pm = replica.auto_parallel(model, (x,), num_stages=2, num_microbatches=2, loss_fn=_mse, device=COMPUTE_BOUND,
                               timeout_s=STEP_TIMEOUT_S)
    report: dict[str, Any] = {"cut": [b.name for s in pm.plan.stages for b in s.outputs if b.shape is None]}
    start = time.monotonic()
    try:
        pm.train_step(x, y)
        report.update(type=None, message="train_step succeeded")
    except Exception as exc:
        report.update(type=type(exc).__name__, message=str(exc), elapsed_s=time.monotonic() - start)
    torch.manual_seed(0)
    model = KeptRows()
    plain = copy.deepcopy(model)
    pm = replica.auto_parallel(model, (x,), num_stages=2, num_microbatches=1, device=COMPUTE_BOUND,
                               timeout_s=STEP_TIMEOUT_S)
    with torch.no_grad():
        report["kept"] = []
        for size, seed in ((8, 2), (12, 3)):
            x = batch(size, seed)[0]
            got, want = pm(x), plain(x)
            torch.testing.assert_close(got[0], want[0])
            assert got[1] == want[1] == len(want[0]), (got[1], want[1])
            report["kept"].append((size, want[1]))
    # last (a rank that raises ends the job): a module kept whole whose output's length follows the data
    # is run on zeros by the oracle; at the cut its sender finds another length and raises
    model, batch = _case("leaf_rows")
    x, y = batch(8, 1)
    pm = replica.auto_parallel(model, (x,), num_stages=2, num_microbatches=1, loss_fn=_mse, device=COMPUTE_BOUND,
                               timeout_s=STEP_TIMEOUT_S, leaf_modules=LEAVES["leaf_rows"])
    report["leaf_cut"] = [b.name for b in pm.plan.stages[0].outputs]
    start = time.monotonic()
    try:
        pm.train_step(x, y)
        report.update(leaf_type=None, leaf_message="train_step succeeded")
    except Exception as exc:
        report.update(leaf_type=type(exc).__name__, leaf_message=str(exc), leaf_elapsed_s=time.monotonic() - start)
    return report


def _run(fn: Any, world: int, *args: Any) -> list[Any]:
    return [pickle.loads(r) for r in run_local(fn, world, *args, timeout_s=RUN_TIMEOUT_S)]


def _every_parameter_checked(name: str, reports: list[dict]) -> None:
    """Over the ranks, every parameter of the plain model was compared, at every step."""
    model, _ = _case(name)
    for step in range(2):
        checked = set().union(*(r["steps"][step]["checked"] for r in reports))
        assert checked == {n for n, _ in model.named_parameters()}, (name, step)


def _check_moe_routing(report: dict) -> None:
    """Traced on one routing, trained on others; the starved expert got no token each time."""
    first = [layer[0] for layer in report["routing"]]  # per batch: the first MoE layer's counts
    assert all(counts[STARVED] == 0 for counts in first), first
    assert len({tuple(map(tuple, r)) for r in report["routing"]}) == len(report["routing"]), report["routing"]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    layouts = [("moe_loop", 2, "1f1b"), ("moe_loop", 1, "1f1b"), ("moe_loop", 4, "interleaved")]
    layouts += [(name, 2, "1f1b") for name in MOE[1:]] + [("ragged", 2, "1f1b"), ("hit", 2, "1f1b")]
    return _run(case_job, 2, layouts, True)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return _run(case_job, 4, [(name, 2, "1f1b") for name in MOE] + [("ragged", 2, "1f1b")], False)


def _by_layout(reports_by_rank: list[dict]) -> list[list[dict]]:
    return [list(reports) for reports in zip(*(r["layouts"] for r in reports_by_rank))]


def test_moe_trains_exactly_across_two_ranks(two_ranks):
    """2 stages (one per rank), 1 stage x 2 replicas, 4 stages interleaved over 2 ranks: the
    nonzero loop; 2 stages: fp32 grouped_mm (where this torch has it)."""
    for reports in _by_layout(two_ranks):
        name, num_stages, _ = reports[0]["layout"]
        if not name.startswith("moe"):
            continue
        _every_parameter_checked(name, reports)
        _check_moe_routing(reports[0])
        assert reports[0]["replicas"] == (2 if num_stages == 1 else 1)
        assert sorted(s for r in reports for s in r["stages_here"]) == (list(range(num_stages)) if num_stages > 1
                                                                        else [0, 0])
        if num_stages == 4:  # the planner cuts inside the experts' loop: each expert's rows cross
            assert all(step["dynamic_cut"] for step in reports[0]["steps"]), reports[0]["steps"]


def test_moe_trains_exactly_on_two_stages_by_two_replicas(four_ranks):
    for reports in _by_layout(four_ranks):
        name = reports[0]["layout"][0]
        if name.startswith("moe"):
            assert [r["replicas"] for r in reports] == [2] * 4
            _every_parameter_checked(name, reports)
            _check_moe_routing(reports[0])


@pytest.mark.parametrize("world", [2, 4])
def test_a_tensor_whose_length_depends_on_the_data_crosses_a_cut_with_its_shape(world, two_ranks, four_ranks):
    """The cut carries the kept rows and their indices, sized by the data; gradients still exact."""
    reports = next(r for r in _by_layout(two_ranks if world == 2 else four_ranks) if r[0]["layout"][0] == "ragged")
    _every_parameter_checked("ragged", reports)
    for step in reports[0]["steps"]:
        assert len(step["dynamic_cut"]) == 2, step  # the indices and the rows


def test_data_dependent_python_values_fail_fast_at_a_cut_and_come_back_from_the_last_stage(two_ranks):
    """At a cut: the same clear error on every rank, at once. In the output (with a tensor sized
    by the data): pm(x) gives every rank the plain model's."""
    for r in (report["edges"] for report in two_ranks):
        assert r["cut"] == ["item"], r
        assert r["type"] == "PipelineError", r
        for part in ("'item'", "stage 0", "stage(s) [1]", "depends on the data", "move the cut"):
            assert part in r["message"], (part, r["message"])
        assert r["elapsed_s"] < STEP_TIMEOUT_S / 2, r  # raised by the oracle, not a timeout
        assert all(0 < kept < size for size, kept in r["kept"]), r["kept"]  # lengths the data decided


def test_a_module_kept_whole_that_loops_on_the_data_trains_exactly(two_ranks):
    """Hugging Face's older Mixtral loop (``for e in experts hit``), kept whole as the tracer's
    error advises: the oracle runs it on zeros; every gradient the plain model's."""
    reports = next(r for r in _by_layout(two_ranks) if r[0]["layout"][0] == "hit")
    _every_parameter_checked("hit", reports)


def test_a_module_kept_whole_whose_output_length_follows_the_data_fails_clearly_at_the_cut(two_ranks):
    """Its sender names the value, the stages and the fix; its receiver names the sender: no hang."""
    sender, receiver = (r["edges"] for r in two_ranks)
    (cut,) = sender["leaf_cut"]  # the module's rows, or a value made from them: sized by the data
    assert sender["leaf_type"] == receiver["leaf_type"] == "PipelineError", (sender, receiver)
    for part in (f"stage 0 made {cut!r}", "stage(s) [1]", "leaf_modules=", "move the cut"):
        assert part in sender["leaf_message"], (part, sender["leaf_message"])
    assert "from rank 0" in receiver["leaf_message"], receiver["leaf_message"]
    assert receiver["leaf_elapsed_s"] < STEP_TIMEOUT_S / 2, receiver  # the sender's exit, not a timeout
