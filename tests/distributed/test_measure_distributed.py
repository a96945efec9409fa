"""``measure_step`` on gloo ranks: train_step's gradients, and one measured timeline that
every pipeline rank agrees on, each action on the rank that ran it."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import replica
from replica.launch import run_local
from replica.schedules.schedule import BACKWARD, FORWARD, WEIGHT, placement
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.distributed.test_distributed import hung_rank_job
from tests.grads import assert_same_grads

pytestmark = pytest.mark.distributed


def measure_job(rank: int, world: int) -> bytes:
    reports = []
    for schedule, stages in (("1f1b", 2), ("zb-v", 4)):
        torch.manual_seed(0)  # every rank builds the same model
        model, inputs, target, loss_fn = models.tiny_gpt(8, num_layers=4, size_ops=True)
        ref = copy.deepcopy(model)
        ref_loss = loss_fn(ref(*inputs), target)
        ref_loss.backward()
        pm = replica.auto_parallel(model, inputs, num_stages=stages, num_microbatches=4, schedule=schedule,
                                   loss_fn=loss_fn, device=COMPUTE_BOUND, timeout_s=30)
        loss, timeline = pm.measure_step(inputs, target)
        torch.testing.assert_close(loss, ref_loss.detach())
        assert_same_grads(pm, ref, subset=True, context=f"{schedule} ")
        events = [(e.rank, str(e.action), e.start_s, e.end_s) for e in timeline.events]
        reports.append({"schedule": schedule, "events": events, "step_s": timeline.step_time_s,
                        "ranks": timeline.num_ranks, "place": placement(pm.schedule),
                        "early": sorted(pm.runtime.executor.early)})  # this rank's stages that send input gradients first
    return pickle.dumps(reports)


def data_parallel_job(rank: int, world: int) -> bytes:
    """Pipeline 2 x data 2, every rank given the whole batch: each replica measures its own
    pipeline on its half."""
    torch.manual_seed(0)
    model, inputs, target, loss_fn = models.tiny_gpt(16, size_ops=True)
    ref = copy.deepcopy(model)
    loss_fn(ref(*inputs), target).backward()
    pm = replica.auto_parallel(model, inputs, num_stages=2, num_microbatches=2,
                               loss_fn=loss_fn, device=COMPUTE_BOUND, timeout_s=30)
    _, timeline = pm.measure_step(inputs, target)
    assert_same_grads(pm, ref, subset=True)  # the whole batch's gradient, as train_step gives
    return pickle.dumps({"replica": pm.data_parallel_rank, "ranks": timeline.num_ranks,
                         "events": [(e.rank, str(e.action), e.start_s, e.end_s) for e in timeline.events]})


def test_measured_timeline_on_two_ranks():
    by_rank = [pickle.loads(r) for r in run_local(measure_job, 2, timeout_s=90)]
    for mine, theirs in zip(*by_rank):  # the same timeline on every pipeline rank
        assert (mine["events"], mine["step_s"]) == (theirs["events"], theirs["step_s"]), mine["schedule"]
    for report, last in zip(*by_rank):
        schedule, events, place = report["schedule"], report["events"], report["place"]
        assert report["ranks"] == 2
        stages = len(place)
        kinds: dict[str, list[str]] = {}
        for rank, action, start, end in events:
            stage, kind = int(action[0]), action[1]
            assert rank == place[stage], (schedule, action, rank)  # on the rank that holds its stage
            assert 0 <= start <= end <= report["step_s"], (schedule, action)
            kinds.setdefault(kind, []).append(action)
        everything = {f"{k}{kind}{i}" for k in range(stages) for i in range(4) for kind in (FORWARD, BACKWARD)}
        assert sorted(kinds[FORWARD] + kinds[BACKWARD]) == sorted(everything), schedule  # each once
        if schedule == "zb-v":  # every weight gradient is its own W
            assert len(kinds[WEIGHT]) == stages * 4
        else:  # 1F1B: the last stage sends its input gradients first, its weight gradients read as W
            assert last["early"] == [1]  # rank 1's runtime, which holds the last stage
            assert sorted(kinds[WEIGHT]) == [f"1W{i}" for i in range(4)]
        for rank in range(2):  # one rank runs one action at a time
            mine = sorted((s, e) for r, _, s, e in events if r == rank)
            assert all(a[1] <= b[0] + 1e-9 for a, b in zip(mine, mine[1:])), (schedule, rank)


def test_each_replica_measures_its_own_pipeline():
    reports = [pickle.loads(r) for r in run_local(data_parallel_job, 4, timeout_s=90)]
    by_replica: dict[int, list[dict]] = {}
    for report in reports:
        by_replica.setdefault(report["replica"], []).append(report)
    assert sorted(by_replica) == [0, 1]
    for pair in by_replica.values():  # both pipeline ranks of a replica hold its timeline
        assert len(pair) == 2 and pair[0]["events"] == pair[1]["events"] and pair[0]["ranks"] == 2
        assert sorted(a for _, a, _, _ in pair[0]["events"] if a[1] != WEIGHT) == \
            sorted(f"{k}{kind}{i}" for k in range(2) for kind in (FORWARD, BACKWARD) for i in range(2))


def test_measure_step_names_a_peer_that_never_joins():
    timeout_s = 3
    report = run_local(hung_rank_job, 2, timeout_s, "measure_step", timeout_s=45)[0]
    assert report["is_pipeline_error"], report
    assert "barrier before a measured step" in report["message"], report["message"]
    assert f"{timeout_s} s" in report["message"], report["message"]
    assert report["elapsed_s"] < timeout_s + 5, report
