"""Transparency: a pipelined step leaves the plain model's loss, output and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

import replica
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.grads import assert_same_grads

CASES = {
    "tiny_gpt": lambda: models.tiny_gpt(8, num_layers=2, size_ops=True),
    "unet": lambda: models.unet(8),
    "two_input_branchy": lambda: models.two_input_branchy(8),
    "mlp": lambda: models.mlp(8),
}


def reference(model, inputs, target, loss_fn):
    """The plain model's loss and gradients on the whole batch."""
    ref = copy.deepcopy(model)
    loss = loss_fn(ref(*inputs), target)
    loss.backward()
    return ref, loss.detach()


@pytest.mark.parametrize("num_microbatches", [1, 3, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_transparency(case, num_stages, schedule, num_microbatches):
    model, inputs, target, loss_fn = CASES[case]()
    ref, ref_loss = reference(model, inputs, target, loss_fn)
    pm = replica.auto_parallel(model, inputs, num_stages=num_stages, num_microbatches=num_microbatches,
                               schedule=schedule, loss_fn=loss_fn, device=COMPUTE_BOUND)
    assert pm.plan.num_stages == num_stages
    loss = pm.train_step(inputs, target)
    torch.testing.assert_close(loss, ref_loss)
    assert_same_grads(pm, ref)
    with torch.no_grad():
        torch.testing.assert_close(pm(*inputs), ref(*inputs))


def test_forward_backpropagates_like_the_model():
    model, inputs, target, loss_fn = models.unet(6)
    ref, _ = reference(model, inputs, target, loss_fn)
    pm = replica.auto_parallel(model, inputs, num_stages=3, num_microbatches=2, device=COMPUTE_BOUND)
    loss_fn(pm(*inputs), target).backward()
    assert_same_grads(pm, ref)


def test_gradients_accumulate_over_steps_like_backward():
    model, inputs, target, loss_fn = models.tiny_gpt(4)
    ref = copy.deepcopy(model)
    for _ in range(2):
        loss_fn(ref(*inputs), target).backward()
    pm = replica.auto_parallel(model, inputs, num_stages=2, num_microbatches=2, loss_fn=loss_fn,
                               device=COMPUTE_BOUND)
    pm.train_step(inputs, target)
    pm.train_step(inputs, target)
    assert_same_grads(pm, ref)


def test_sum_reduction_is_exact():
    model, inputs, target, _ = models.mlp(7)

    def summed(out, t):
        return torch.nn.functional.cross_entropy(out, t, reduction="sum")

    ref, ref_loss = reference(model, inputs, target, summed)
    pm = replica.auto_parallel(model, inputs, num_stages=3, num_microbatches=3, loss_fn=summed,
                               loss_reduction="sum", device=COMPUTE_BOUND)
    torch.testing.assert_close(pm.train_step(inputs, target), ref_loss)
    assert_same_grads(pm, ref)


def test_training_batch_other_than_traced_batch():
    model, inputs, target, loss_fn = models.two_input_branchy(8)
    pm = replica.auto_parallel(model, inputs, num_stages=3, num_microbatches=4, loss_fn=loss_fn,
                               device=COMPUTE_BOUND)
    small = tuple(x[:5] for x in inputs)
    ref, ref_loss = reference(model, small, target[:5], loss_fn)
    torch.testing.assert_close(pm.train_step(small, target[:5]), ref_loss)
    assert_same_grads(pm, ref)


def test_tied_weight_is_one_parameter_held_by_two_stages():
    model, inputs, target, loss_fn = models.tiny_gpt(8)
    pm = replica.auto_parallel(model, inputs, num_stages=4, num_microbatches=2, loss_fn=loss_fn,
                               device=COMPUTE_BOUND)
    holders = [s.stage_index for s in pm.plan.stages if "transformer.wte.weight" in s.parameter_names]
    assert holders == [0, 3]
    assert pm.plan.tied_parameters == {"transformer.wte.weight": ("lm_head.weight",)}
    names = [n for n, _ in pm.named_parameters()]
    assert names.count("transformer.wte.weight") == 1 and "lm_head.weight" not in names


def test_state_dict_loads_into_plain_model():
    model, inputs, target, loss_fn = models.tiny_gpt(4)
    pm = replica.auto_parallel(model, inputs, num_stages=2, loss_fn=loss_fn, device=COMPUTE_BOUND)
    plain = models.tiny_gpt(4).model
    plain.load_state_dict(pm.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(plain(*inputs), model(*inputs))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_recompute_is_transparent(schedule):
    model, inputs, target, loss_fn = models.tiny_gpt(8, size_ops=True)
    ref, ref_loss = reference(model, inputs, target, loss_fn)
    pm = replica.auto_parallel(model, inputs, num_stages=3, num_microbatches=4, schedule=schedule,
                               loss_fn=loss_fn, device=COMPUTE_BOUND, recompute=True)
    assert pm.plan.recompute
    torch.testing.assert_close(pm.train_step(inputs, target), ref_loss)
    assert_same_grads(pm, ref)


def test_recompute_plans_hold_fewer_activations():
    model, inputs, _, _ = models.tiny_gpt(8)
    kept = replica.plan(model, inputs, num_stages=3, num_microbatches=8, device=COMPUTE_BOUND)
    again = replica.plan(model, inputs, num_stages=3, num_microbatches=8, device=COMPUTE_BOUND, recompute=True)
    assert again.stages[0].memory.activations < kept.stages[0].memory.activations
    assert again.stages[0].backward_time_s > kept.stages[0].backward_time_s


@pytest.mark.parametrize("schedule,num_stages,num_microbatches", [
    ("zb-h1", 3, 3), ("zb-v", 4, 4), ("zb-interleaved", 4, 3), ("interleaved", 4, 4), ("zb-v", 2, 1),
])
@pytest.mark.parametrize("case", sorted(CASES))
def test_transparency_of_the_other_schedules(case, schedule, num_stages, num_microbatches):
    model, inputs, target, loss_fn = CASES[case]()
    ref, ref_loss = reference(model, inputs, target, loss_fn)
    pm = replica.auto_parallel(model, inputs, num_stages=num_stages, num_microbatches=num_microbatches,
                               schedule=schedule, loss_fn=loss_fn, device=COMPUTE_BOUND)
    torch.testing.assert_close(pm.train_step(inputs, target), ref_loss)
    assert_same_grads(pm, ref)
    # a .grad that records a graph keeps every micro-batch's activations alive until it is reset
    recording = [name for name, p in pm.named_parameters() if p.grad is not None and p.grad.grad_fn is not None]
    assert not recording, f"{schedule}: gradients with a grad_fn: {recording}"


@pytest.mark.parametrize("schedule,num_stages", [("1f1b", 3), ("zb-h1", 2), ("interleaved", 4)])
def test_measure_step_is_a_train_step_with_its_timeline(schedule, num_stages, tmp_path):
    model, inputs, target, loss_fn = models.tiny_gpt(8, num_layers=4, size_ops=True)
    ref, ref_loss = reference(model, inputs, target, loss_fn)
    pm = replica.auto_parallel(model, inputs, num_stages=num_stages, num_microbatches=4, schedule=schedule,
                               loss_fn=loss_fn, device=COMPUTE_BOUND)
    loss, timeline = pm.measure_step(inputs, target)
    torch.testing.assert_close(loss, ref_loss)
    assert_same_grads(pm, ref)
    fused = pm.runtime.executor.fused  # a W right after its B runs inside it
    ran = [a for actions in pm.schedule for a in actions
           if a.kind != "W" or (a.stage_index, a.microbatch_index) not in fused]
    assert sorted(str(e.action) for e in timeline.events) == sorted(str(a) for a in ran)
    place = {a.stage_index: r for r, actions in enumerate(pm.schedule) for a in actions}
    assert all(e.rank == place[e.action.stage_index] for e in timeline.events)
    assert timeline.num_ranks == len(pm.schedule)
    spans = sorted((e.start_s, e.end_s) for e in timeline.events)  # one process: one action at a time
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert 0 <= spans[0][0] and spans[-1][1] <= timeline.step_time_s
    report = replica.visualize(pm, tmp_path / "plan.html", measured=timeline, device=COMPUTE_BOUND)  # beside the plan
    assert "Measured" in report.read_text()


def test_measure_step_needs_a_loss():
    model, inputs, target, _ = models.tiny_gpt(8)
    pm = replica.auto_parallel(model, inputs, num_stages=2, device=COMPUTE_BOUND)
    with pytest.raises(replica.PipelineError, match="measure_step needs a loss"):
        pm.measure_step(inputs, target)
