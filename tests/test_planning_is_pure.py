"""Planning never changes the user's model: parameters, buffers, random generators, modes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import replica
from replica.partition.profile import profile
from replica.partition.trace import trace
from tests import models
from tests.conftest import COMPUTE_BOUND


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.drop1 = nn.Linear(12, 32), nn.Dropout(0.3)
        self.l2, self.l3 = nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 12) -> (B, 4)
        h = self.drop1(torch.relu(self.l1(x)))
        h = F.dropout(torch.tanh(self.l2(h)), 0.2, self.training)
        return self.l3(h)


def resnet() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return models.TinyResNet(num_blocks=2, cumulative=False), (torch.randn(32, 3, 8, 8),)  # 4 a micro-batch: BatchNorm1d


def dropout_mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return DropoutMLP(), (torch.randn(8, 12),)


def snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "rng": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "modes": {name: m.training for name, m in model.named_modules()},
    }


def assert_untouched(model: nn.Module, before: dict[str, Any]) -> None:
    after = snapshot(model)
    assert after["state"].keys() == before["state"].keys()
    changed = [k for k in before["state"] if not torch.equal(before["state"][k], after["state"][k])]
    assert not changed, f"planning changed {changed}"
    assert torch.equal(before["rng"], after["rng"]), "planning drew from torch's CPU generator"
    assert all(torch.equal(a, b) for a, b in zip(before["cuda"], after["cuda"])), "planning drew from CUDA's"
    assert after["modes"] == before["modes"]


FACTORIES = [resnet, dropout_mlp]
PLANS: dict[str, dict[str, Any]] = {
    "fx": dict(tracer="fx", cost="profile"),
    "export": dict(tracer="export", cost="profile"),
    "profile": dict(cost="profile"),
    "analytic": dict(cost="analytic", device=COMPUTE_BOUND),
}


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize("how", sorted(PLANS))
def test_plan_leaves_the_model_alone(factory: Any, how: str) -> None:
    model, inputs = factory()
    before = snapshot(model)
    replica.plan(model, inputs, num_stages=2, num_microbatches=2, **PLANS[how])
    assert_untouched(model, before)


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize("how", sorted(PLANS))
def test_auto_parallel_leaves_the_model_alone(factory: Any, how: str) -> None:
    model, inputs = factory()
    before = snapshot(model)
    replica.auto_parallel(model, inputs, num_stages=2, num_microbatches=2, **PLANS[how])
    assert_untouched(model, before)


@pytest.mark.parametrize("factory", FACTORIES)
def test_tuned_auto_parallel_leaves_the_model_alone(factory: Any) -> None:
    model, inputs = factory()
    before = snapshot(model)
    replica.auto_parallel(model, inputs, num_stages=2, schedule="auto")  # profiles, then tunes
    assert_untouched(model, before)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_trace_and_profile_alone_leave_the_model_alone(tracer: str) -> None:
    model, (x,) = resnet()
    before = snapshot(model)
    traced = trace(model, (x,), tracer=tracer)
    assert_untouched(model, before)
    profile(traced.module, (x[:4],), cache=False)
    assert_untouched(model, before)


def test_modes_of_a_partly_frozen_model_are_kept() -> None:
    model, inputs = resnet()
    model.blocks[0].eval()  # a frozen block inside a training model
    before = snapshot(model)
    replica.auto_parallel(model, inputs, num_stages=2, num_microbatches=2, cost="profile")
    assert_untouched(model, before)
    assert not model.blocks[0].training and model.blocks[1].training


def test_a_model_in_eval_mode_stays_in_eval_mode() -> None:
    model, inputs = dropout_mlp()
    model.eval()
    before = snapshot(model)
    replica.auto_parallel(model, inputs, num_stages=2, num_microbatches=2, cost="profile")
    assert_untouched(model, before)


class WritesItsWeight(nn.Module):
    """A forward that writes a (frozen) weight in place: a decay kept in the parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 6), nn.Linear(6, 2)
        self.gain = nn.Parameter(torch.ones(6), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gain.mul_(0.5)
        return self.l2(torch.relu(self.l1(x)) * g)


def test_profiling_a_forward_that_writes_a_weight_leaves_the_weight_alone() -> None:
    model, x = WritesItsWeight(), torch.randn(8, 6)
    before = snapshot(model)
    replica.plan(model, (x,), num_stages=2, cost="profile", tracer="fx")
    assert_untouched(model, before)
