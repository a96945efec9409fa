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
    assert Layout(schedule="1f1b", num_stages=1, pipeline_ranks=1, data_parallel_size=2, sharding="zero3",
                  expert_parallel_size=2).expert_parallel_size == 2  # FSDP2 shards the rest


def test_imbalance_is_the_busiest_ranks_slots_over_the_mean() -> None:
    from replica.planner.experts import imbalance

    assert imbalance([4, 4, 4, 4], 2) == 1.0 and imbalance([8, 0, 0, 0], 2) == 2.0
    assert imbalance([8, 0, 0, 0], 1) == 1.0 and imbalance([6, 2, 0, 0], 4) == 3.0


def test_the_all_to_all_is_priced_from_the_slots_each_rank_sends() -> None:
    """Per MoE layer, micro-batch and rank: S = tokens x top_k / replicas / micro-batches slots,
    S (ep - 1) / ep rows of 16 fp32 features sent, 4 times (dispatch and combine, forward and
    backward); the busiest stage holds both layers here (one stage)."""
    from replica.partition.trace import trace
    from replica.planner.experts import expert_costs, find_expert_blocks, routing_counts

    model, ids = _plain()
    plan = _plan(model, ids, 2, num_stages=1, expert_parallel_size=2)
    traced = trace(model, (ids,))
    blocks = find_expert_blocks(traced.graph)
    counts = routing_counts(traced, blocks)
    assert sorted(counts) == [b.path for b in blocks] and all(sum(c) == 12 * 8 * 2 for c in counts.values())
    costs = expert_costs(traced.graph, plan, blocks, 2, COMPUTE_BOUND, counts)
    slots = 12 * 8 * 2 / 2 / 2
    assert costs.alltoall_bytes == pytest.approx(2 * 4 * slots / 2 * 16 * 4 * 2)
    assert costs.alltoall_s > 0 and costs.saved_bytes > 0 and costs.imbalance >= 1.0
    assert plan.expert_parallel_bytes == int(costs.alltoall_bytes)
    assert "expert parallel: 2 MoE layers of 4 experts spread over 2 replicas (2 experts each)" in plan.summary()


def test_left_to_the_planner_expert_parallelism_is_chosen_where_it_pays() -> None:
    """On fast links the all-to-all only costs: whole experts. On a slow network the experts'
    gradient all-reduce, which expert parallelism leaves out (ep = replicas), costs more than
    the all-to-all: spread. Either way each rank holds less at ep=2."""
    import dataclasses

    model, ids = _plain()
    whole = _plan(model, ids, 2, num_stages=1, expert_parallel_size=1)
    spread = _plan(model, ids, 2, num_stages=1, expert_parallel_size=2)
    peak = lambda p: max(s.predicted_memory_bytes for s in p.stages)  # noqa: E731
    assert peak(spread) < peak(whole)
    assert spread.predicted_step_time_s > whole.predicted_step_time_s
    assert _plan(model, ids, 2, num_stages=1).layout.expert_parallel_size == 1
    slow = dataclasses.replace(COMPUTE_BOUND, link_bandwidth=1e4, network_bandwidth=1e4)
    chosen = replica.plan(model, (ids,), world_size=2, num_stages=1, schedule="1f1b", num_microbatches=2, device=slow,
                          sharded_data_parallel=False)
    assert chosen.layout.expert_parallel_size == 2, chosen.summary()


def test_experts_that_fit_only_spread_are_placed_when_the_size_is_given() -> None:
    """The partition weighs each rank's share of the experts against the budget: a budget the
    whole experts exceed plans at expert_parallel_size=2, and fails without it."""
    from replica.errors import PartitionError

    model, ids = _plain()
    whole = _plan(model, ids, 2, num_stages=1, expert_parallel_size=1)
    spread = _plan(model, ids, 2, num_stages=1, expert_parallel_size=2)
    peak = lambda p: max(s.predicted_memory_bytes for s in p.stages)  # noqa: E731
    budget = (peak(spread) + peak(whole)) / 2
    assert _plan(model, ids, 2, num_stages=1, expert_parallel_size=2, memory_budget=budget).layout \
        .expert_parallel_size == 2
    with pytest.raises(PartitionError):
        _plan(model, ids, 2, num_stages=1, expert_parallel_size=1, memory_budget=budget)


def test_compiled_plans_run_expert_parallel_layers_eagerly_and_price_them_so() -> None:
    """The stage compiles; each expert-parallel layer runs eagerly between its graphs (its
    all-to-all's sizes are the routing's), so its pointwise ops are priced unfused."""
    from replica.parallel.compile import runs_eagerly
    from replica.partition.partitioner import MemoryModel
    from replica.partition.trace import trace
    from replica.planner.pricing import Pricing

    model, ids = _plain()
    plan = _plan(model, ids, 2, num_stages=1, expert_parallel_size=2, compile=True)
    assert plan.expert_parallel_stages == (0,) and runs_eagerly(plan, 0) == ""
    assert "stages [0] run each expert-parallel layer eagerly between compiled graphs" in plan.compile_line
    whole = _plan(model, ids, 2, num_stages=1, expert_parallel_size=1, compile=True)
    assert whole.expert_parallel_stages == () and "expert-parallel" not in whole.compile_line
    pricing = Pricing(trace(model, (ids,)), model, device=COMPUTE_BOUND, cost="analytic", memory_budget=None,
                      memory_model=MemoryModel(), num_microbatches=None, num_stages_hint=1, compile=True)
    inside = {n for b in pricing.experts for n in b.nodes}
    fused = pricing.cost_model(pricing.spec, 1.0).fused
    assert fused & inside  # the experts' own pointwise chain, fused where they run in the graph
    assert not pricing.cost_model(pricing.spec, 1.0, expert_parallel_size=2).fused & inside
    assert pricing.cost_model(pricing.spec, 1.0, expert_parallel_size=2).fused == fused - inside


# --- expert parallelism inside the tuner's search (#41) ------------------------------------------------------------

def _tuned(model: torch.nn.Module, ids: torch.Tensor, device=COMPUTE_BOUND, **kw) -> replica.Plan:
    """The tuner's plan over 2 unsharded replicas of one stage (schedule, micro-batches, recompute
    and the expert-parallel size searched): what the experts cost alone decides."""
    return replica.plan(model, (ids,), world_size=2, data_parallel_size=2, sharded_data_parallel=False, device=device,
                        **kw)


def test_the_search_spreads_experts_that_fit_no_device_whole_and_refuses_them_whole() -> None:
    """A budget between what a rank holds at ep=2 and with every expert: the search picks ep=2
    (its layouts cut on each rank's share of the experts), and the same search held to whole
    experts finds nothing that fits."""
    from replica.errors import PartitionError

    model, ids = _plain()
    peak = lambda p: max(s.predicted_memory_bytes for s in p.stages)  # noqa: E731
    whole, spread = _tuned(model, ids, expert_parallel_size=1), _tuned(model, ids, expert_parallel_size=2)
    assert peak(spread) < peak(whole)
    budget = (peak(spread) + peak(whole)) / 2
    chosen = _tuned(model, ids, memory_budget=budget)
    assert chosen.layout.expert_parallel_size == 2 and peak(chosen) <= budget, chosen.summary()
    assert chosen.expert_parallel_bytes > 0 and "expert parallel: 2 MoE layers" in chosen.summary()
    with pytest.raises(PartitionError, match="no configuration of 2 devices fits"):
        _tuned(model, ids, memory_budget=budget, expert_parallel_size=1)


def test_the_search_keeps_whole_experts_where_the_all_to_all_costs_more_than_it_saves(monkeypatch) -> None:
    """Tiny experts on slow, high-latency links: each MoE layer's 5 all-to-alls a micro-batch
    cost more than the experts' small all-reduce saves, so the search keeps ep=1, having cut
    and priced ep=2 layouts too."""
    import dataclasses

    from replica.planner.pricing import Pricing

    cut = Pricing.partition_for
    sizes: set[int] = set()

    def spy(self, layout, *args, **kw):
        sizes.add(layout.expert_parallel_size)
        return cut(self, layout, *args, **kw)

    monkeypatch.setattr(Pricing, "partition_for", spy)
    model, ids = _plain()
    slow = dataclasses.replace(COMPUTE_BOUND, link_latency_s=1e-2, link_bandwidth=1e6)
    chosen = _tuned(model, ids, device=slow)
    assert chosen.layout.expert_parallel_size == 1 and sizes == {1, 2}, chosen.summary()
    spread = _tuned(model, ids, device=slow, expert_parallel_size=2)
    assert spread.expert_parallel_s > 0 and spread.predicted_step_time_s > chosen.predicted_step_time_s


def test_an_expert_parallel_size_given_is_kept_by_the_search() -> None:
    """expert_parallel_size=2 given: the tuner searches every other choice at ep=2, even where
    whole experts would be faster; over 4 devices it leaves only layouts of an even replica count."""
    model, ids = _plain()
    assert _tuned(model, ids).layout.expert_parallel_size == 1  # compute-bound: the routing's imbalance costs
    assert _tuned(model, ids, expert_parallel_size=2).layout.expert_parallel_size == 2
    four = replica.plan(model, (ids,), world_size=4, device=COMPUTE_BOUND, expert_parallel_size=2)
    assert four.layout.expert_parallel_size == 2 and four.layout.data_parallel_size % 2 == 0
    assert all("experts over 2 replicas" in name for name, _ in four.alternatives), four.alternatives


def test_a_dense_model_adds_no_expert_choice_to_the_search() -> None:
    """Without an expert block the search's expert-parallel choices are (1,): no new loop."""
    from replica.partition.partitioner import MemoryModel
    from replica.partition.trace import trace
    from replica.planner.pricing import Pricing

    case = models.tiny_gpt(4)
    traced = trace(case.model, case.example_inputs)
    pricing = Pricing(traced, case.model, device=COMPUTE_BOUND, cost="analytic", memory_budget=None,
                      memory_model=MemoryModel(), num_microbatches=None, num_stages_hint=1)
    assert pricing.experts == () and pricing.expert_choices(8) == (1,)
    model, ids = _plain()
    moe = Pricing(trace(model, (ids,)), model, device=COMPUTE_BOUND, cost="analytic", memory_budget=None,
                  memory_model=MemoryModel(), num_microbatches=None, num_stages_hint=1)
    assert moe.expert_choices(8) == (1, 2, 4) and moe.expert_choices(6, asked=4) == ()
