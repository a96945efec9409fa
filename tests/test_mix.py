"""Per-stage recompute modes chosen by the tuner (replica/planner/mix.py): a mix where it is cheaper and fits."""

from __future__ import annotations

import copy

import pytest
import torch

import replica
from replica.planner.costs import rank_memory, stage_costs_from_plan
from replica.planner.mix import stage_modes
from replica.schedules.schedule import plan_schedule
from tests import models
from tests.grads import assert_same_grads

DEVICE = "a100-80gb"


def test_stage_modes_run_from_none_to_every_block():
    assert stage_modes(0) == [False, True]  # a stage without blocks: whole or nothing
    assert stage_modes(1) == [False, "selective", True]
    assert stage_modes(3) == [False, 1, 2, "selective", True]
    assert stage_modes(12) == [False, 3, 6, 9, "selective", True]  # a few k, spread


def _peaks(plan: replica.Plan) -> list[float]:
    schedule = plan_schedule(plan)
    return rank_memory(stage_costs_from_plan(plan, schedule), schedule)


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    return models.tiny_gpt(16, num_layers=8)


def _plan(case, **kw) -> replica.Plan:
    """4 pipeline ranks of 1F1B, 8 micro-batches (the tuner's search: the stage count left open)."""
    model, inputs, _, _ = case
    return replica.plan(model, inputs, world_size=4, data_parallel_size=1, tensor_parallel_size=1, schedule="1f1b",
                        num_microbatches=8, device=DEVICE, **kw)


def test_the_tuner_checkpoints_the_first_stages_and_not_the_last_where_that_fits(case):
    """Under 1F1B stage 0 holds 4 micro-batches and the last one: with a budget that every block
    checkpointed fits and nothing checkpointed does not, the tuner keeps the last stages whole."""
    none, every = (_plan(case, recompute=mode) for mode in (False, True))
    budget = (max(_peaks(none)) + max(_peaks(every))) / 2
    assert max(_peaks(every)) < budget < max(_peaks(none)) and _peaks(none)[-1] < budget
    plan = _plan(case, memory_budget=budget)
    modes = [s.recompute for s in plan.stages]
    assert modes[0] is not False and modes[-1] is False, modes
    assert max(_peaks(plan)) <= budget
    for mode in (True, "selective"):  # faster than every uniform mode that fits
        uniform = _plan(case, recompute=mode, memory_budget=budget)
        assert plan.predicted_step_time_s < uniform.predicted_step_time_s, (mode, modes)
    loaded = replica.Plan.from_json(plan.to_json())
    assert [s.recompute for s in loaded.stages] == modes
    assert "activation checkpointing per stage" in plan.summary()


def test_a_mixed_plan_gives_the_plain_gradients(case):
    model, inputs, target, loss_fn = case
    none, every = (_plan(case, recompute=mode) for mode in (False, True))
    plan = _plan(case, memory_budget=(max(_peaks(none)) + max(_peaks(every))) / 2)
    assert len({repr(s.recompute) for s in plan.stages}) > 1
    model = copy.deepcopy(model)
    ref = copy.deepcopy(model)
    loss_fn(ref(*inputs), target).backward()
    pm = replica.auto_parallel(model, inputs, loss_fn=loss_fn, plan=plan)
    pm.train_step(inputs, target)
    assert_same_grads(pm, ref)


def test_the_pick_keeps_its_own_cuts_where_the_final_cut_within_the_budget_fails(case, monkeypatch):
    """The solver bounds each stage's memory more strictly than the walk per rank that found the pick
    within the budget: where its cut fails, the pick's own cuts are priced again, not an error."""
    from replica.planner.pricing import Pricing

    want = _plan(case)
    solve = Pricing.partition_for

    def stricter(self, layout, m, *, within_budget=True, like=None, **kw):
        if within_budget and like is None:
            raise replica.PartitionError("the solver's bound (as a tight budget would)")
        return solve(self, layout, m, within_budget=within_budget, like=like, **kw)

    monkeypatch.setattr(Pricing, "partition_for", stricter)
    got = _plan(case)
    assert got.layout == want.layout and got.num_microbatches == want.num_microbatches
    assert [s.node_names for s in got.stages] == [s.node_names for s in want.stages]
