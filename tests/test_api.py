"""Tests of the front door (``replica.api``): the public surface and every user error."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import replica
from replica.layout import TUNED_SCHEDULES
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.grads import assert_same_grads


@pytest.fixture
def mlp():
    return models.mlp(8)


@pytest.fixture
def pm(mlp):
    return replica.auto_parallel(mlp.model, mlp.example_inputs, num_stages=2, num_microbatches=4,
                                 loss_fn=mlp.loss_fn, device=COMPUTE_BOUND)


def error(exc_type, fn, *args, **kwargs) -> str:
    """The message of the ``exc_type`` that ``fn`` raises, checked to be a ReplicaError and a ValueError."""
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, replica.ReplicaError) and isinstance(info.value, ValueError)
    return str(info.value)


# --------------------------------------------------------------------------- public surface


@pytest.mark.parametrize("name", ["auto_parallel", "plan", "Plan", "PipelineModel", "DeviceSpec", "ReplicaError",
                                  "ConfigError", "TraceError", "PartitionError", "ScheduleError", "PipelineError"])
def test_public_names(name):
    assert hasattr(replica, name) and name in replica.__all__


@pytest.mark.parametrize("name", ["ConfigError", "TraceError", "PartitionError", "ScheduleError", "PipelineError"])
def test_errors_are_replica_errors_and_value_errors(name):
    cls = getattr(replica, name)
    assert issubclass(cls, replica.ReplicaError) and issubclass(cls, ValueError)


def test_version():
    assert isinstance(replica.__version__, str)


def test_plan_on_a_meta_model():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)])
    p = replica.plan(model, torch.empty(16, 4096, device="meta"), num_stages=4, device="a100-80gb")
    assert isinstance(p, replica.Plan) and p.num_stages == 4
    assert sum(s.memory.gradients for s in p.stages) == 8 * (4096 * 4096 + 4096) * 4
    assert all(p.device.type == "meta" for p in model.parameters())


def test_plan_on_a_meta_gpt():
    with torch.device("meta"):
        model = models.TinyGPT(num_layers=4)
    p = replica.plan(model, (torch.empty(4, 16, dtype=torch.long, device="meta"),), world_size=4, num_stages=4,
                     device="h100-80gb")
    assert p.num_stages == 4 and p.device == "h100-80gb"


def test_meta_example_inputs_then_real_training(mlp):
    model, inputs, target, loss_fn = mlp
    ref = copy.deepcopy(model)
    loss_fn(ref(*inputs), target).backward()
    pm = replica.auto_parallel(model, (inputs[0].to("meta"),), num_stages=3, num_microbatches=4, loss_fn=loss_fn,
                               device=COMPUTE_BOUND)
    pm.train_step(inputs, target)
    assert_same_grads(model, ref)


def test_pipeline_model_surface(pm, mlp):
    assert isinstance(pm, replica.PipelineModel) and isinstance(pm.plan, replica.Plan)
    assert (pm.pipeline_rank, pm.data_parallel_rank, pm.data_parallel_size) == (0, 0, 1)
    assert [n for n, _ in pm.named_parameters()] == [n for n, _ in mlp.model.named_parameters()]
    assert pm.state_dict().keys() == mlp.model.state_dict().keys()
    assert "num_stages=2" in repr(pm)


def test_train_step_returns_the_loss(pm, mlp):
    model, inputs, target, loss_fn = mlp
    want = loss_fn(model(*inputs), target)
    torch.testing.assert_close(pm.train_step(inputs, target), want.detach())


def test_train_step_accepts_a_tensor_or_a_tuple(pm, mlp):
    _, inputs, target, _ = mlp
    torch.testing.assert_close(pm.train_step(inputs[0], target), pm.train_step(inputs, target))


def test_zero_grad(pm, mlp):
    pm.train_step(mlp.example_inputs, mlp.target)
    pm.zero_grad()
    assert all(p.grad is None for p in mlp.model.parameters())


def test_auto_schedule(mlp):
    pm = replica.auto_parallel(mlp.model, mlp.example_inputs, num_stages=2, schedule="auto", device=COMPUTE_BOUND)
    assert pm.plan.schedule in TUNED_SCHEDULES and pm.plan.num_stages == 2


def test_schedule_name_case_insensitive(mlp):
    pm = replica.auto_parallel(mlp.model, mlp.example_inputs, num_stages=2, schedule="GPipe", device=COMPUTE_BOUND)
    assert pm.plan.schedule == "gpipe"


# --------------------------------------------------------------------------- errors: the model


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return x


def test_untraceable_model():
    model = nn.Sequential(nn.Linear(4, 4), Gate())
    msg = error(replica.TraceError, replica.auto_parallel, model, torch.randn(2, 4))
    assert "'1' (Gate)" in msg and "test_api.py" in msg and "leaf_modules=[Gate]" in msg


def test_untraceable_model_works_as_leaf():
    model = nn.Sequential(nn.Linear(4, 4), Gate())
    pm = replica.auto_parallel(model, torch.randn(2, 4), num_stages=2, leaf_modules=[Gate], device=COMPUTE_BOUND)
    assert pm.plan.num_stages == 2


def test_untraceable_model_at_plan():
    error(replica.TraceError, replica.plan, nn.Sequential(Gate()), torch.randn(2, 4))


def test_not_a_module():
    msg = error(replica.ConfigError, replica.auto_parallel, lambda x: x, torch.randn(2, 4))
    assert "torch.nn.Module" in msg and "function" in msg


def test_model_without_parameters():
    msg = error(replica.ConfigError, replica.auto_parallel, nn.ReLU(), torch.randn(2, 4))
    assert "ReLU has no parameters" in msg


def test_too_many_stages_names_both_counts(mlp):
    msg = error(replica.PartitionError, replica.auto_parallel, mlp.model, mlp.example_inputs, num_stages=10,
                device=COMPUTE_BOUND)
    assert "num_stages=10" in msg and "9 ops" in msg and "num_stages <= 9" in msg


def test_too_many_stages_at_plan(mlp):
    msg = error(replica.PartitionError, replica.plan, mlp.model, mlp.example_inputs, world_size=100,
                device=COMPUTE_BOUND)
    assert "100 devices" in msg and "9 ops" in msg and "batch of 8" in msg


def test_plan_for_a_world_leaves_data_parallel_replicas(mlp):
    p = replica.plan(mlp.model, mlp.example_inputs, world_size=4, num_stages=2, device=COMPUTE_BOUND)
    assert (p.num_stages, p.data_parallel_size) == (2, 2)


@pytest.mark.parametrize("kwargs", [
    dict(num_stages=2, num_microbatches=4),
    dict(num_stages=3, schedule="gpipe"),
    dict(num_stages=4, schedule="auto"),  # without a world both tune, over 4 pipeline ranks
    dict(num_stages=4, schedule="zb-v", recompute=True),
    dict(num_stages=2, recompute="pointwise", options=replica.PlannerOptions(min_gain=0.5)),
])
def test_plan_and_auto_parallel_make_the_same_plan(kwargs):
    """One decision tree: the same arguments mean the same plan, with or without a pipeline."""
    model, inputs, _, loss_fn = models.tiny_gpt(16, num_layers=4)
    planned = replica.plan(model, inputs, device=COMPUTE_BOUND, **kwargs)
    pm = replica.auto_parallel(model, inputs, device=COMPUTE_BOUND, loss_fn=loss_fn, **kwargs)
    assert pm.plan == planned
    if kwargs.get("schedule") == "auto":
        assert planned.alternatives, "schedule='auto' without world_size tunes, as auto_parallel does"


def test_planner_options_are_used_and_checked(mlp):
    even = replica.plan(mlp.model, mlp.example_inputs, num_stages=2, num_microbatches=4, device=COMPUTE_BOUND,
                        options=replica.PlannerOptions(min_gain=1.0))  # grading can never gain all of the step
    assert even.microbatch_shares == ()
    msg = error(replica.ConfigError, replica.PlannerOptions, tie=-0.1)
    assert "PlannerOptions.tie must be a number >= 0, got -0.1" in msg
    msg = error(replica.ConfigError, replica.plan, mlp.model, mlp.example_inputs, options={"tie": 0.1})
    assert "options must be a replica.PlannerOptions, got dict" in msg


def test_auto_parallel_refuses_what_it_cannot_run(mlp):
    msg = error(replica.ConfigError, replica.auto_parallel, mlp.model, mlp.example_inputs, mixed_precision=True)
    assert "mixed_precision=True does not say which half precision" in msg
    msg = error(replica.ConfigError, replica.plan, mlp.model, mlp.example_inputs, data_parallel_size=2)
    assert "data_parallel_size=2 needs a world of processes: give world_size=" in msg
    msg = error(replica.ConfigError, replica.auto_parallel, mlp.model, mlp.example_inputs, tensor_parallel_size=2)
    assert "tensor_parallel_size=2 needs a world of processes" in msg


def test_plan_num_stages_must_divide_world_size(mlp):
    msg = error(replica.ConfigError, replica.plan, mlp.model, mlp.example_inputs, world_size=6, num_stages=4,
                schedule="1f1b", device=COMPUTE_BOUND)
    assert "num_stages=4" in msg and "6" in msg
    # the schedule left to the tuner: no schedule lays 4 stages out on 6 ranks either
    msg = error(replica.ConfigError, replica.plan, mlp.model, mlp.example_inputs, world_size=6, num_stages=4,
                device=COMPUTE_BOUND)
    assert "num_stages=4 fits no layout of 6 devices" in msg and "[1, 2, 3, 6]" in msg


def test_as_many_stages_as_ops(mlp):
    p = replica.plan(mlp.model, mlp.example_inputs, num_stages=9, num_microbatches=1, device=COMPUTE_BOUND)
    assert p.num_stages == 9


# --------------------------------------------------------------------------- errors: counts and names


@pytest.mark.parametrize("value", [0, -2, 2.0, "2", True, [2]])
def test_bad_num_stages(mlp, value):
    msg = error(replica.ConfigError, replica.auto_parallel, mlp.model, mlp.example_inputs, num_stages=value)
    assert "num_stages must be a positive int" in msg and repr(value) in msg


@pytest.mark.parametrize("name", ["num_stages", "num_microbatches", "world_size"])
def test_bad_counts_at_plan(mlp, name):
    msg = error(replica.ConfigError, replica.plan, mlp.model, mlp.example_inputs, **{name: 0})
    assert f"{name} must be a positive int or None, got 0" in msg


def test_bad_num_microbatches(mlp):
    error(replica.ConfigError, replica.auto_parallel, mlp.model, mlp.example_inputs, num_microbatches=0)


@pytest.mark.parametrize("schedule", ["zigzag", "", "1F1Bx"])
def test_unknown_schedule(mlp, schedule):
    msg = error(replica.ConfigError, replica.auto_parallel, mlp.model, mlp.example_inputs, schedule=schedule)
    assert f"unknown schedule {schedule!r}" in msg and "'1f1b'" in msg and "'gpipe'" in msg


def test_schedule_not_a_string(mlp):
    error(replica.ConfigError, replica.auto_parallel, mlp.model, mlp.example_inputs, schedule=1)


def test_unknown_device(mlp):
    msg = error(replica.ConfigError, replica.plan, mlp.model, mlp.example_inputs, device="tpu")
    assert "a100-80gb" in msg


def test_loss_fn_not_callable(mlp):
    error(replica.ConfigError, replica.auto_parallel, mlp.model, mlp.example_inputs, loss_fn="mse")


def test_bad_loss_reduction(mlp):
    msg = error(replica.ConfigError, replica.auto_parallel, mlp.model, mlp.example_inputs, loss_reduction="max")
    assert "'mean' or 'sum'" in msg


# --------------------------------------------------------------------------- errors: batches and inputs


def test_too_many_microbatches_at_auto_parallel(mlp):
    msg = error(replica.ConfigError, replica.auto_parallel, mlp.model, mlp.example_inputs, num_stages=2,
                num_microbatches=9, device=COMPUTE_BOUND)
    assert "num_microbatches=9" in msg and "batch of 8" in msg and "num_microbatches <= 8" in msg


def test_too_many_microbatches_at_train_step(pm, mlp):
    _, inputs, target, _ = mlp
    msg = error(replica.ConfigError, pm.train_step, inputs[0][:3], target[:3])
    assert "num_microbatches=4" in msg and "batch of 3" in msg and "<= 3" in msg


def test_too_many_microbatches_at_forward(pm, mlp):
    msg = error(replica.ConfigError, pm, mlp.example_inputs[0][:2])
    assert "num_microbatches=4" in msg and "batch of 2" in msg


def test_wrong_arity_at_auto_parallel(mlp):
    x = mlp.example_inputs[0]
    msg = error(replica.ConfigError, replica.auto_parallel, mlp.model, (x, x))
    assert "forward(input) takes 1" in msg and "has 2" in msg


def test_wrong_arity_at_train_step(pm, mlp):
    _, inputs, target, _ = mlp
    msg = error(replica.ConfigError, pm.train_step, (inputs[0], inputs[0]), target)
    assert "traced with 1 positional input(s) but the inputs have 2" in msg and "example_inputs" in msg


def test_wrong_arity_at_forward(pm, mlp):
    x = mlp.example_inputs[0]
    error(replica.ConfigError, pm, x, x)


def test_non_tensor_example_input(mlp):
    msg = error(replica.ConfigError, replica.auto_parallel, mlp.model, ([1.0] * 20,))
    assert "example_inputs[0] is a list" in msg


def test_target_batch_differs_from_input_batch(pm, mlp):
    _, inputs, target, _ = mlp
    msg = error(replica.ConfigError, pm.train_step, inputs, target[:5])
    assert "batch of 8" in msg and "target has 5" in msg


def test_target_without_batch(pm, mlp):
    error(replica.ConfigError, pm.train_step, mlp.example_inputs, torch.tensor(1))


def test_inputs_disagree_on_batch():
    model, inputs, target, loss_fn = models.two_input_branchy(8)
    pm = replica.auto_parallel(model, inputs, num_stages=2, num_microbatches=2, loss_fn=loss_fn,
                               device=COMPUTE_BOUND)
    msg = error(replica.ConfigError, pm.train_step, (inputs[0], inputs[1][:6]), target)
    assert "[6, 8]" in msg


# --------------------------------------------------------------------------- errors: loss


def test_train_step_without_loss_fn(mlp):
    pm = replica.auto_parallel(mlp.model, mlp.example_inputs, num_stages=2, device=COMPUTE_BOUND)
    msg = error(replica.PipelineError, pm.train_step, mlp.example_inputs, mlp.target)
    assert "loss_fn=" in msg and "auto_parallel" in msg


def test_loss_fn_returning_a_non_scalar(mlp):
    pm = replica.auto_parallel(mlp.model, mlp.example_inputs, num_stages=2, num_microbatches=2,
                               loss_fn=lambda out, target: out.pow(2), device=COMPUTE_BOUND)
    msg = error(replica.PipelineError, pm.train_step, mlp.example_inputs, mlp.target)
    assert "scalar" in msg and re.search(r"of shape \([45], 10\)", msg)


def test_loss_fn_returning_a_number(mlp):
    pm = replica.auto_parallel(mlp.model, mlp.example_inputs, num_stages=2, num_microbatches=2,
                               loss_fn=lambda out, target: 1.0, device=COMPUTE_BOUND)
    msg = error(replica.PipelineError, pm.train_step, mlp.example_inputs, mlp.target)
    assert "scalar" in msg and "float" in msg


def test_sum_reduction(mlp):
    model, inputs, target, _ = mlp
    pm = replica.auto_parallel(model, inputs, num_stages=2, num_microbatches=4, device=COMPUTE_BOUND,
                               loss_fn=lambda out, t: F.cross_entropy(out, t, reduction="sum"), loss_reduction="sum")
    want = F.cross_entropy(model(*inputs), target, reduction="sum")
    torch.testing.assert_close(pm.train_step(inputs, target), want.detach())


def test_a_model_whose_remote_weights_were_freed_is_refused(mlp):
    pm = replica.auto_parallel(mlp.model, mlp.example_inputs, num_stages=2, num_microbatches=2,
                               loss_fn=mlp.loss_fn, device=COMPUTE_BOUND)
    pm.stages = pm.stages[:1]  # as on rank 0 of two: the other stage's weights live elsewhere
    pm._release_remote_weights()
    msg = error(replica.ConfigError, replica.auto_parallel, mlp.model, mlp.example_inputs, num_stages=2)
    assert "already went through a distributed auto_parallel" in msg and "Build (or load) the model again" in msg


def test_a_plan_with_replicas_needs_its_world(mlp):
    """In one process a data-parallel plan would train one replica's slice only: refused."""
    p = replica.plan(mlp.model, mlp.example_inputs, world_size=4, num_stages=2, device=COMPUTE_BOUND)
    assert p.data_parallel_size == 2
    msg = error(replica.ConfigError, replica.auto_parallel, mlp.model, mlp.example_inputs, plan=p,
                loss_fn=mlp.loss_fn)
    assert "2 data-parallel replicas" in msg and "process group of 4" in msg
