"""Per-block activation checkpointing (full, selective, the first k blocks): the plain model's gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx

import replica
from replica.parallel.parallelize import checkpointed_blocks
from replica.partition.blocks import block_of, find_blocks, repeated_containers
from replica.stage.checkpoint import checkpoint_blocks, checkpointed_modules
from replica.stage.remat import rebuildable_norms
from replica.stage.weightgrad import WeightGrads, collecting, defer_linear_weight_grads
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.grads import assert_same_grads


def test_blocks_are_the_repeated_modules():
    paths = ["transformer.wte", "transformer.h.0.ln_1", "transformer.h.0.attn.c_attn", "transformer.h.1.mlp",
             "transformer.ln_f", "lm_head", "heads.0"]
    assert repeated_containers(paths) == {"transformer.h"}
    assert find_blocks(paths) == ("transformer.h.0", "transformer.h.1")
    assert block_of("transformer.h.12.mlp.experts.3.w1") == "transformer.h.12"
    assert block_of("heads.0", repeated_containers(paths)) is None


@pytest.mark.parametrize("selective", [False, True], ids=["full", "selective"])
@pytest.mark.parametrize("defer", [False, True], ids=["autograd", "split-backward"])
def test_a_checkpointed_graph_gives_the_plain_gradients(selective, defer):
    model, inputs, target, loss_fn = models.tiny_gpt(4, num_layers=3)
    ref = copy.deepcopy(model)
    loss_fn(ref(*inputs), target).backward()
    gm = fx.symbolic_trace(model)
    if defer:
        defer_linear_weight_grads(gm)
    rebuildable_norms(gm)
    keys = list(gm.state_dict())
    assert checkpoint_blocks(gm, ["transformer.h.0", "transformer.h.2"], selective=selective) == 2
    assert len(checkpointed_modules(gm)) == 2 and list(gm.state_dict()) == keys  # no new names
    sink = WeightGrads() if defer else None
    with collecting(sink):
        loss_fn(gm(*inputs), target).backward()
    if sink is not None:
        sink.apply()
    assert_same_grads(model, ref)


# --- through the pipeline: every mode x schedule, in one process ----------------------------
MODES = [True, "selective", 1, False]
SCHEDULES = [("1f1b", 2), ("interleaved", 4), ("zb-v", 4)]


@pytest.mark.parametrize("schedule,num_stages", SCHEDULES, ids=[s for s, _ in SCHEDULES])
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_every_mode_and_schedule_gives_the_plain_gradients(mode, schedule, num_stages):
    model, inputs, target, loss_fn = models.tiny_gpt(8, num_layers=num_stages, size_ops=True)
    ref = copy.deepcopy(model)
    ref_loss = loss_fn(ref(*inputs), target)
    ref_loss.backward()
    pm = replica.auto_parallel(model, inputs, num_stages=num_stages, num_microbatches=4, schedule=schedule,
                               loss_fn=loss_fn, device=COMPUTE_BOUND, recompute=mode)
    assert all(s.recompute == mode for s in pm.plan.stages)
    made = sum(len(checkpointed_modules(s.module)) for s in pm.stages)
    expected = sum(len(checkpointed_blocks(pm.plan, s.stage_index)) for s in pm.stages)
    assert made == expected and (made > 0) == (mode is not False)
    torch.testing.assert_close(pm.train_step(inputs, target), ref_loss.detach())
    assert_same_grads(pm, ref)


def test_each_stage_s_mode_is_in_the_plan_json_and_summary():
    model, inputs, _, _ = models.tiny_gpt(8, num_layers=4)
    plan = replica.plan(model, inputs, num_stages=2, num_microbatches=4, device=COMPUTE_BOUND, recompute=1)
    assert [s.recompute for s in plan.stages] == [1, 1] and all(len(s.blocks) >= 2 for s in plan.stages)
    back = replica.Plan.from_json(plan.to_json())
    assert [(s.recompute, s.blocks, s.recompute_bytes) for s in back.stages] == \
        [(s.recompute, s.blocks, s.recompute_bytes) for s in plan.stages]
    text = plan.summary()
    assert "checkpointing the first 1 blocks of each stage" in text
    assert f"1 of {len(plan.stages[1].blocks)} blocks" in text


def test_modes_order_the_predicted_activations():
    model, inputs, _, _ = models.tiny_gpt(8, num_layers=4)
    # GPipe: every micro-batch in flight, where checkpointing pays most (with two, as 1F1B's first
    # stage here, k=1 saves about what rebuilding a block costs at once)
    held = {repr(mode): replica.plan(model, inputs, num_stages=2, num_microbatches=8, device=COMPUTE_BOUND,
                                     schedule="gpipe", recompute=mode).stages[0]
            for mode in (False, 1, "selective", True)}
    act = {mode: s.memory.activations for mode, s in held.items()}  # keyed by repr: 1 == True
    assert act["False"] > act["1"] > act["True"] and act["False"] > act["'selective'"] > act["True"]
    # what checkpointing costs: the forward of what it rebuilds, again in backward
    assert held["False"].backward_time_s < held["'selective'"].backward_time_s < held["True"].backward_time_s


def test_k_beyond_a_stage_s_blocks_names_the_stage_its_blocks_and_the_fix():
    model, inputs, _, loss_fn = models.tiny_gpt(8, num_layers=4)
    plan = replica.plan(model, inputs, num_stages=2, num_microbatches=4, device=COMPUTE_BOUND, recompute=True)
    fewest = min(plan.stages, key=lambda s: len(s.blocks))
    k = len(fewest.blocks) + 1
    with pytest.raises(replica.ConfigError, match=rf"recompute={k} checkpoints the first {k} blocks of each stage, but "
                                                  rf"stage {fewest.stage_index} holds {k - 1}: "
                                                  rf"{', '.join(fewest.blocks)}\. Use recompute={k - 1}"):
        replica.auto_parallel(model, inputs, num_stages=2, num_microbatches=4, loss_fn=loss_fn, device=COMPUTE_BOUND,
                              recompute=k)


@pytest.mark.parametrize("mode", ["selective", 2])
def test_a_block_mode_for_a_model_without_blocks_is_a_config_error(mode):
    model, inputs, _, loss_fn = models.mlp(8, num_layers=3)  # Sequential-free linears: no indexed container
    with pytest.raises(replica.ConfigError, match=r"checkpoints blocks .* has none.* Use recompute=True"):
        replica.auto_parallel(model, inputs, num_stages=2, loss_fn=loss_fn, device=COMPUTE_BOUND, recompute=mode)


def test_true_on_a_model_without_blocks_checkpoints_each_stage_whole():
    model, inputs, target, loss_fn = models.mlp(8, num_layers=3)
    ref = copy.deepcopy(model)
    loss_fn(ref(*inputs), target).backward()
    pm = replica.auto_parallel(model, inputs, num_stages=2, num_microbatches=2, loss_fn=loss_fn, device=COMPUTE_BOUND,
                               recompute=True)
    assert all(s.blocks == () and s.recompute is True and s.recompute_note == "stage" for s in pm.plan.stages)
    assert pm.runtime.executor.recompute == {0: "full", 1: "full"}
    pm.train_step(inputs, target)
    assert_same_grads(pm, ref)


def test_stages_of_one_plan_may_checkpoint_differently():
    """The runtime reads each stage's own mode: a plan whose stages differ (as a hand-edited JSON)."""
    import dataclasses

    model, inputs, target, loss_fn = models.tiny_gpt(8, num_layers=4)
    ref = copy.deepcopy(model)
    loss_fn(ref(*inputs), target).backward()
    plan = replica.plan(model, inputs, num_stages=3, num_microbatches=4, device=COMPUTE_BOUND, recompute=False)
    mixed = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, recompute=mode) for s, mode in
                                                   zip(plan.stages, ("selective", 1, True))))
    mixed = replica.Plan.from_json(mixed.to_json())
    pm = replica.auto_parallel(model, inputs, loss_fn=loss_fn, plan=mixed)
    assert [len(checkpointed_modules(s.module)) for s in pm.stages] == \
        [len(mixed.stages[0].blocks), 1 if mixed.stages[1].blocks else 0, len(mixed.stages[2].blocks)]
    pm.train_step(inputs, target)
    assert_same_grads(pm, ref)
