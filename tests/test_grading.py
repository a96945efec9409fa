"""Graded micro-batches: sizes from shares, the search, and exact gradients with uneven sizes."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import replica
from replica.partition.plan import Plan
from replica.runtime import microbatch
from replica.schedules import grading
from replica.schedules.grading import grade
from replica.schedules.schedule import make_schedule
from replica.schedules.simulate import StageCosts, simulate
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.grads import assert_same_grads

SCHEDULES = [("gpipe", 2), ("1f1b", 2), ("1f1b", 3), ("zb-h1", 2), ("interleaved", 4), ("zb-v", 4)]


def costs(num_stages: int, split: bool = False) -> list[StageCosts]:
    b = 0.08 * 2 / num_stages
    return [StageCosts(forward_s=0.04 * 2 / num_stages, backward_s=b * (0.6 if split else 1.0),
                       weight_s=b * 0.4 if split else 0.0, forward_fixed_s=0.002, backward_fixed_s=0.004,
                       activation_bytes=1000, static_bytes=10_000) for _ in range(num_stages)]


@pytest.mark.parametrize("n,m", [(32, 8), (30, 8), (8, 8), (9, 2)])
def test_even_sizes_differ_by_one_at_most(n, m):
    sizes = microbatch.sizes(n, m)
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_shares_become_sizes_that_add_up():
    assert microbatch.sizes(32, 8, (2, 4, 5, 5, 5, 5, 4, 2)) == [2, 4, 5, 5, 5, 5, 4, 2]
    sizes = microbatch.sizes(31, 8, (2, 4, 5, 5, 5, 5, 4, 2))  # a smaller batch: proportional
    assert sum(sizes) == 31 and min(sizes) >= 1
    assert microbatch.sizes(8, 8, (1, 9, 9, 9, 9, 9, 9, 1)) == [1] * 8  # every micro-batch keeps a sample
    with pytest.raises(replica.ConfigError, match="must be 8 positive numbers"):
        microbatch.sizes(32, 8, (1, 2))


def test_split_follows_shares():
    x = torch.arange(32).reshape(32, 1)
    parts = microbatch.split((x,), 8, shares=(2, 4, 5, 5, 5, 5, 4, 2))
    assert [p[0].shape[0] for p in parts] == [2, 4, 5, 5, 5, 5, 4, 2]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)


def test_simulate_with_unit_sizes_is_the_even_simulation():
    schedule = make_schedule("1f1b", 2, 8)
    c = costs(2)
    assert simulate(schedule, c, sizes=[1.0] * 8).step_time_s == pytest.approx(simulate(schedule, c).step_time_s)
    half = simulate(schedule, c, sizes=[0.5] * 8).step_time_s
    assert half < simulate(schedule, c).step_time_s / 2 + 16 * 0.006  # only the fixed parts do not shrink


@pytest.mark.parametrize("name,stages", SCHEDULES)
def test_graded_sizes_keep_the_batch_and_the_bounds(name, stages):
    schedule = make_schedule(name, stages, 8)
    sizes, step, even = grade(schedule, costs(stages, name.startswith("zb")), 32, 8)
    assert sum(sizes) == 32 and len(sizes) == 8
    assert min(sizes) >= grading.MIN_SHRINK * 4 and max(sizes) <= grading.MAX_GROWTH * 4
    assert step <= even
    if len(set(sizes)) > 1:
        assert step <= even * (1 - grading.MIN_GAIN)


def test_one_f_one_b_gains_from_smaller_ends():
    sizes, step, even = grade(make_schedule("1f1b", 2, 8), costs(2), 32, 8)
    assert sizes[0] < 4 and sizes[-1] < 4, sizes
    assert step < 0.98 * even


def test_gpipe_and_tight_memory_stay_even():
    sizes, step, even = grade(make_schedule("gpipe", 2, 8), costs(2), 32, 8)  # its bubble does not shrink
    assert sizes == (4,) * 8 and step == even
    sizes, _, _ = grade(make_schedule("1f1b", 2, 8), costs(2), 32, 8, memory_limit=10_000 + 2 * 1000)
    assert sizes == (4,) * 8  # growing any micro-batch would pass the memory limit


def test_plan_keeps_its_shares_through_json():
    model, inputs, _, _ = models.tiny_gpt(16, size_ops=True)
    plan = replica.plan(model, inputs, num_stages=2, num_microbatches=4, device=COMPUTE_BOUND)
    graded = dataclasses.replace(plan, microbatch_shares=(0.125, 0.375, 0.375, 0.125))
    assert Plan.from_json(graded.to_json()).microbatch_shares == graded.microbatch_shares
    assert Plan.from_json(plan.to_json()).microbatch_shares == plan.microbatch_shares


@pytest.mark.parametrize("name,stages", SCHEDULES)
def test_uneven_microbatches_give_exact_gradients(name, stages):
    model, inputs, target, loss_fn = models.tiny_gpt(16, num_layers=4, size_ops=True)
    ref = copy.deepcopy(model)
    ref_loss = loss_fn(ref(*inputs), target)
    ref_loss.backward()
    plan = replica.plan(model, inputs, num_stages=stages, num_microbatches=4, schedule=name, device=COMPUTE_BOUND)
    plan = dataclasses.replace(plan, microbatch_shares=(1, 6, 7, 2))
    pm = replica.auto_parallel(model, inputs, loss_fn=loss_fn, plan=plan)
    loss = pm.train_step(inputs, target)
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_same_grads(model, ref)
    with torch.no_grad():
        torch.testing.assert_close(pm(*inputs), ref(*inputs))


def test_planner_grades_one_f_one_b_and_can_be_told_not_to():
    model, inputs, _, loss_fn = models.tiny_gpt(32, num_layers=4, size_ops=True)
    graded = replica.plan(model, inputs, num_stages=2, num_microbatches=8, device=COMPUTE_BOUND)
    even = replica.plan(model, inputs, num_stages=2, num_microbatches=8, device=COMPUTE_BOUND,
                        graded_microbatches=False)
    assert even.microbatch_shares == ()
    assert len(graded.microbatch_shares) == 8 and sum(graded.microbatch_shares) == pytest.approx(1.0)
    assert graded.predicted_step_time_s < even.predicted_step_time_s
    assert "graded micro-batches" in graded.summary() and "graded" not in even.summary()
