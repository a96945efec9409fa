"""Expert parallelism in the plan (replica/planner/experts.py, the layout's expert_parallel_size):
the expert blocks and the size on the plan and in its JSON; every number that cannot work is a
ConfigError naming the numbers and the fix, before any rank starts."""

from __future__ import annotations

import pytest
import torch

import replica
from replica.errors import ConfigError
from replica.layout import Layout
from tests import models, moe_zoo
from tests.conftest import COMPUTE_BOUND


def _plain() -> tuple[torch.nn.Module, torch.Tensor]:
    model, vocab = moe_zoo.build("plain")
    return model, torch.randint(0, vocab, (12, 8))


def _plan(model: torch.nn.Module, ids: torch.Tensor, world: int, **kw) -> replica.Plan:
    return replica.plan(model, (ids,), world_size=world, schedule="1f1b", num_microbatches=2, device=COMPUTE_BOUND,
                        **kw)


def test_the_plan_carries_the_experts_and_their_size_through_json() -> None:
    model, ids = _plain()
    plan = _plan(model, ids, 2, num_stages=1, expert_parallel_size=2)
    assert plan.layout.expert_parallel_size == 2 and "experts over 2 replicas" in plan.layout.describe()
    assert [b.path for b in plan.experts] == ["layers.0.moe.experts", "layers.1.moe.experts"]
    again = replica.Plan.from_json(plan.to_json())
    assert again.experts == plan.experts and again.layout == plan.layout
    assert not plan.layout.sharded  # sharded replicas do not run with expert parallelism yet
    assert _plan(model, ids, 2, num_stages=1).layout.expert_parallel_size == 1


def test_num_experts_not_divisible_by_the_expert_parallel_size_names_both_and_the_fix() -> None:
    model, ids = _plain()
    with pytest.raises(ConfigError, match=r"expert_parallel_size=3 does not divide the 4 experts of "
                                          r"layers.0.moe.experts.*Use expert_parallel_size in \[1, 2, 4\]"):
        _plan(model, ids, 6, num_stages=1, expert_parallel_size=3)


@pytest.mark.parametrize("world,kw,match", [
    (2, dict(num_stages=2), r"expert_parallel_size=2 does not divide the plan's 1 data-parallel replicas"),
    (None, dict(num_stages=2), r"needs a world of processes"),
    (4, dict(data_parallel_size=2, expert_parallel_size=4), r"does not divide data_parallel_size=2"),
])
def test_an_expert_group_the_replicas_cannot_form_is_a_config_error(world, kw, match) -> None:
    model, ids = _plain()
    kw = {"expert_parallel_size": 2, **kw}
    with pytest.raises(ConfigError, match=match):
        if world is None:
            replica.plan(model, (ids,), device=COMPUTE_BOUND, **kw)
        else:
            _plan(model, ids, world, **kw)


def test_a_dense_model_has_no_experts_to_spread() -> None:
    case = models.tiny_gpt(4)
    with pytest.raises(ConfigError, match="has no expert block"):
        _plan(case.model, case.example_inputs[0], 2, num_stages=1, expert_parallel_size=2)


def test_the_layout_checks_expert_parallel_size() -> None:
    with pytest.raises(ConfigError, match=r"expert_parallel_size=2 does not divide the 3 data-parallel replicas"):
        Layout(schedule="1f1b", num_stages=1, pipeline_ranks=1, data_parallel_size=3, expert_parallel_size=2)
    with pytest.raises(ConfigError, match="sharded data parallelism"):
        Layout(schedule="1f1b", num_stages=1, pipeline_ranks=1, data_parallel_size=2, sharding="zero3",
               expert_parallel_size=2)
