"""The partitioner: memory budgets, heterogeneous devices, hand-imposed cuts, large graphs."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import replica
from replica.partition.cost import CostModel
from replica.partition.partitioner import MemoryModel, partition
from replica.partition.trace import trace
from tests import models
from tests.conftest import COMPUTE_BOUND


@pytest.fixture(scope="module")
def gpt_graph():
    torch.manual_seed(0)
    model, inputs, _, _ = models.tiny_gpt(8, num_layers=4)
    return trace(model, inputs).graph


def plan(graph, **kwargs):
    options = dict(num_stages=2, num_microbatches=4, schedule="1f1b")
    options.update(kwargs)
    return partition(graph, options.pop("cost", CostModel(COMPUTE_BOUND)), **options)


def test_every_stage_fits_its_budget(gpt_graph):
    loose = plan(gpt_graph, num_stages=3)
    budget = max(s.predicted_memory_bytes for s in loose.stages) * 0.9
    tight = plan(gpt_graph, num_stages=3, memory_budget=budget)
    assert all(s.predicted_memory_bytes <= budget for s in tight.stages)


def test_an_infeasible_budget_names_the_need_and_the_stage_count(gpt_graph):
    least = plan(gpt_graph, num_stages=4)
    budget = min(s.predicted_memory_bytes for s in least.stages) * 0.8
    with pytest.raises(replica.PartitionError) as err:
        plan(gpt_graph, num_stages=2, memory_budget=budget)
    message = str(err.value)
    assert "does not fit in 2 stages of" in message and "iB on its fullest stage" in message
    assert re.search(r"smallest num_stages that fits is \d+|no stage count", message)


def test_optimizer_state_counts(gpt_graph):
    adam = plan(gpt_graph, memory_model=MemoryModel(optimizer="adam"))
    sgd = plan(gpt_graph, memory_model=MemoryModel(optimizer="sgd"))
    assert all(a.memory.optimizer == 2 * a.memory.gradients for a in adam.stages)
    assert all(s.memory.optimizer == 0 for s in sgd.stages)


def test_a_slower_device_gets_less_work(gpt_graph):
    slow = dataclasses.replace(COMPUTE_BOUND, name="slow", flops=COMPUTE_BOUND.flops / 3,
                               memory_bandwidth=COMPUTE_BOUND.memory_bandwidth / 3)
    even = plan(gpt_graph)
    mixed = plan(gpt_graph, cost=[CostModel(COMPUTE_BOUND), CostModel(slow)])
    assert mixed.stages[1].num_ops < even.stages[1].num_ops
    assert [s.device for s in mixed.stages] == ["compute-bound-test", "slow"]


def test_hand_bounds_are_kept(gpt_graph):
    cut = len(gpt_graph) // 2
    p = plan(gpt_graph, bounds=[0, cut, len(gpt_graph)])
    assert len(p.stages[0].node_names) == cut


def test_bad_bounds_are_an_error(gpt_graph):
    with pytest.raises(replica.ConfigError, match="bounds must rise"):
        plan(gpt_graph, bounds=[0, 0, len(gpt_graph)])


def test_a_96_layer_gpt_cuts_into_64_stages():
    # its time (under a second) is benchmarks/partition_time.py's figure, not a test's
    from examples.gpt.model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(block_size=128, vocab_size=512, n_layer=96, n_head=4, n_embd=64))
    graph = trace(model, (torch.empty(8, 128, dtype=torch.long, device="meta"),)).graph
    assert len(graph) > 2000
    p = partition(graph, CostModel(replica.partition.cost.device_spec("a100-80gb")), num_stages=64,
                  num_microbatches=8, schedule="1f1b")
    assert p.num_stages == 64 and not p.exact and p.lower_bound_s > 0
    assert "lower bound" in p.summary()


def test_bad_budgets_are_errors(gpt_graph):
    with pytest.raises(replica.ConfigError, match="memory_budget must be > 0"):
        plan(gpt_graph, memory_budget=0)
    with pytest.raises(replica.ConfigError, match="memory_budget has 3 entries for num_stages=2"):
        plan(gpt_graph, memory_budget=[1e9, 1e9, 1e9])
    with pytest.raises(replica.ConfigError, match="3 device cost models for num_stages=2"):
        plan(gpt_graph, cost=[CostModel(COMPUTE_BOUND)] * 3)


def test_plans_know_their_pipeline_ranks():
    model, inputs, _, _ = models.tiny_gpt(8)
    assert replica.plan(model, inputs, num_stages=4, schedule="zb-v", device=COMPUTE_BOUND).stages_per_rank == 2
    assert replica.plan(model, inputs, num_stages=2, device=COMPUTE_BOUND).stages_per_rank == 1
