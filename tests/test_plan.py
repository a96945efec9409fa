"""Tests of the partition plan (``replica.partition.plan``): JSON, summary, boundaries, predictions."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import pytest
import torch

import replica
from replica.layout import Layout
from replica.partition.graph import fingerprint
from replica.partition.plan import BoundaryTensor, MemoryBreakdown
from replica.partition.trace import trace
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.grads import assert_same_grads


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return models.tiny_gpt(8)


@pytest.fixture(scope="module")
def graph(gpt):
    return trace(gpt.model, gpt.example_inputs).graph


@pytest.fixture(scope="module")
def plan(gpt):
    return replica.plan(gpt.model, gpt.example_inputs, num_stages=3, device=COMPUTE_BOUND)


# --------------------------------------------------------------------------- JSON


def test_json_round_trip(plan):
    assert replica.Plan.from_json(plan.to_json()) == plan


def test_json_round_trip_compact(plan):
    assert replica.Plan.from_json(plan.to_json(indent=None)) == plan


def test_json_round_trip_keeps_tuples(plan):
    loaded = replica.Plan.from_json(plan.to_json())
    assert isinstance(loaded.stages, tuple) and isinstance(loaded.stages[1].inputs[0].destination_stages, tuple)
    assert isinstance(loaded.stages[1].inputs[0].shape, tuple)
    assert loaded.tied_parameters == {"transformer.wte.weight": ("lm_head.weight",)}


def test_json_has_a_format(plan):
    data = json.loads(plan.to_json())
    assert data["format"] == 2
    assert data["layout"] == {"schedule": "1f1b", "num_stages": 3, "pipeline_ranks": 3, "data_parallel_size": 1,
                              "tensor_parallel_size": 1, "sharding": "none", "shard_group_size": None,
                              "sequence_parallel": False, "expert_parallel_size": 1}


def test_a_plan_of_format_1_loads_with_its_layout(plan):
    """Format 1 kept the layout's figures at the top, with pipeline_ranks 0 for one stage per rank."""
    data = json.loads(plan.to_json())
    layout = data.pop("layout")
    data.update(format=1, num_stages=layout["num_stages"], schedule=layout["schedule"], data_parallel_size=1,
                pipeline_ranks=0)
    assert replica.Plan.from_json(json.dumps(data)) == plan


@pytest.mark.parametrize("schedule, stages", [("1f1b", 3), ("zb-v", 4), ("interleaved", 4)])
def test_the_plan_carries_its_action_lists(gpt, schedule, stages):
    """Worked out once by the planner: the pipeline runs them, the report and the simulator
    read them, and a plan from JSON carries the same ones."""
    from replica.schedules.schedule import format_grid, plan_schedule

    p = replica.plan(gpt.model, gpt.example_inputs, num_stages=stages, schedule=schedule, device=COMPUTE_BOUND)
    assert len(p.actions) == p.pipeline_ranks
    derived = plan_schedule(dataclasses.replace(p, actions=()))
    assert [[str(a) for a in rank] for rank in derived] == [list(rank) for rank in p.actions]
    again = replica.Plan.from_json(p.to_json())
    assert again.actions == p.actions
    pm = replica.auto_parallel(gpt.model, gpt.example_inputs, plan=again, loss_fn=gpt.loss_fn)
    assert format_grid(pm.schedule, stages) == format_grid(derived, stages)


def test_actions_that_are_not_a_schedule_of_the_plan_are_refused(plan):
    from replica.schedules.schedule import execution_order, plan_schedule

    short = dataclasses.replace(plan, actions=tuple(rank[:-1] for rank in plan.actions))
    with pytest.raises(replica.ScheduleError, match="the plan's actions are not a schedule of its 3 stages"):
        plan_schedule(short)
    one_rank = (tuple(str(a) for a in execution_order(plan_schedule(plan), plan.num_stages)),)  # valid, serial
    with pytest.raises(replica.ScheduleError, match="actions are for 1 ranks but its layout has 3 pipeline ranks"):
        plan_schedule(dataclasses.replace(plan, actions=one_rank))


def test_a_plan_whose_layout_does_not_hold_is_refused(plan):
    data = json.loads(plan.to_json())
    data["layout"]["pipeline_ranks"] = 2  # three one-per-rank stages on two ranks
    with pytest.raises(replica.ConfigError, match="3 stages need 3 pipeline ranks, got 2"):
        replica.Plan.from_json(json.dumps(data))


def test_json_round_trip_of_python_value_boundary():
    model, inputs, _, _ = models.tiny_gpt(4, size_ops=True)
    p = replica.plan(model, inputs, num_stages=4, device=COMPUTE_BOUND)
    assert replica.Plan.from_json(p.to_json()) == p


@pytest.mark.parametrize("text", ["", "nope", "{", "{'format': 1}"])
def test_invalid_json(text):
    with pytest.raises(replica.ConfigError, match="not a Replica plan: invalid JSON"):
        replica.Plan.from_json(text)


@pytest.mark.parametrize("text", ["{}", '{"format": 3}', '{"format": "1"}'])
def test_wrong_format(text):
    with pytest.raises(replica.ConfigError, match="replica.plan"):
        replica.Plan.from_json(text)


@pytest.mark.parametrize("text", ["[]", "null"])
def test_json_that_is_not_an_object(text):
    with pytest.raises(replica.ConfigError):
        replica.Plan.from_json(text)


def test_truncated_plan(plan):
    data = json.loads(plan.to_json())
    del data["stages"]
    with pytest.raises(replica.ConfigError):
        replica.Plan.from_json(json.dumps(data))


def test_stage_count_must_match():
    with pytest.raises(replica.ConfigError, match="plan has 0 stages but num_stages=2"):
        replica.Plan(model_name="m", layout=Layout.for_stages("1f1b", 2), num_microbatches=1, device="cpu",
                     stages=(), predicted_step_time_s=0.0)


# --------------------------------------------------------------------------- summary


def test_summary_has_a_row_per_stage(plan):
    text = plan.summary()
    for s in plan.stages:
        assert re.search(rf"^\S\s+{s.stage_index}\s+\S", text, re.M), text


def test_summary_ops_column_counts_ops(plan, graph):
    # the same count PartitionError calls "ops": inputs and the output are not ops
    text = plan.summary()
    for s in plan.stages:
        num_ops = sum(1 for n in s.node_names if graph[n].kind == "op")
        assert re.search(rf"^\S\s+{s.stage_index}\s+\S\s+{num_ops}\s", text, re.M), text


def test_summary_balance_line(plan):
    text = plan.summary()
    assert f"balance {plan.balance:.2f} (1.00 = perfect)" in text
    assert f"bubble {plan.bubble_fraction:.0%}" in text


def test_summary_title(plan):
    title = " ".join(plan.summary().split("┏")[0].split())
    assert title.startswith("TinyGPT: 3 stages × 1 replica, 8 micro-batches, 1f1b, rebuilding GELU outputs on stages")
    assert title.endswith(", on compute-bound-test")


def test_summary_title_without_rebuilds(gpt):
    plain = replica.plan(gpt.model, gpt.example_inputs, num_stages=3, device=COMPUTE_BOUND, recompute=False)
    assert plain.rebuilds == ()
    assert "TinyGPT: 3 stages × 1 replica, 8 micro-batches, 1f1b, on compute-bound-test" in plain.summary()


def test_summary_names_tied_weights_across_stages(plan):
    holders = [s.stage_index for s in plan.stages if "transformer.wte.weight" in s.parameter_names]
    assert holders == [0, 2]
    assert "tied: transformer.wte.weight = lm_head.weight held by stages [0, 2]" in plan.summary()


def test_str_is_summary(plan):
    assert str(plan) == plan.summary()


# --------------------------------------------------------------------------- derived figures


def test_balance_at_least_one(plan):
    assert plan.balance >= 1.0


def test_bottleneck_is_the_slowest_stage(plan):
    assert plan.bottleneck_s == max(s.predicted_time_s for s in plan.stages)


def test_predicted_step_time(plan):
    # simulated: near the bubble formula's (the cuts also wait on transfers), never far above it;
    # below it by at most what sending each input gradient before the weight gradients saves
    # on the way back (a share of each B in the drain)
    p, m = plan.num_stages, plan.num_microbatches
    formula = plan.bottleneck_s * (m + p - 1) / m
    assert formula * 0.9 <= plan.predicted_step_time_s <= formula * 1.25


def test_bubble_fraction(plan):
    # simulated: the 1F1B formula for these nearly even stages, plus the waits on transfers
    assert plan.bubble_fraction == pytest.approx(2 / (8 + 2), abs=0.05)


def test_stage_time_is_the_sum_of_its_parts(plan, gpt):
    plain = replica.plan(gpt.model, gpt.example_inputs, num_stages=3, device=COMPUTE_BOUND, recompute=False)
    for s, p in zip(plan.stages, plain.stages):
        assert s.predicted_time_s == pytest.approx(s.forward_time_s + s.backward_time_s + s.communication_time_s)
        assert p.backward_time_s == pytest.approx(2 * p.forward_time_s)  # no rebuild: twice the forward
        assert s.backward_time_s >= p.backward_time_s  # and a rebuild on top
        assert s.communication_time_s >= 0


def test_default_microbatches(plan):
    assert plan.num_microbatches == 8  # largest divisor of the batch (8) up to 4 × num_stages


def test_one_stage_plan(gpt):
    p = replica.plan(gpt.model, gpt.example_inputs, device=COMPUTE_BOUND)
    assert p.num_stages == 1 and p.num_microbatches == 1 and p.balance == 1.0
    assert p.stages[0].inputs == () and p.stages[0].outputs == ()


def test_one_stage_plan_communicates_nothing():
    model, inputs, _, _ = models.mlp(8)
    assert replica.plan(model, inputs, device=COMPUTE_BOUND).stages[0].communication_time_s == 0.0


def test_world_size_is_filled_by_the_tuner(gpt):
    p = replica.plan(gpt.model, gpt.example_inputs, world_size=2, device=COMPUTE_BOUND)
    assert p.layout.world_size == 2


def test_world_size_with_data_parallel_size_given_sets_num_stages(gpt):
    p = replica.plan(gpt.model, gpt.example_inputs, world_size=2, num_stages=2, num_microbatches=4,
                     device=COMPUTE_BOUND)
    assert (p.num_stages, p.data_parallel_size) == (2, 1)


# --------------------------------------------------------------------------- stages


def test_stages_cover_every_node_once_in_order(plan, graph):
    assert [n for s in plan.stages for n in s.node_names] == [n.name for n in graph]


def test_stage_indices(plan):
    assert [s.stage_index for s in plan.stages] == [0, 1, 2]


def test_every_stage_has_an_op(plan, graph):
    for s in plan.stages:
        assert any(graph[n].kind == "op" for n in s.node_names)


def test_stage_of(plan, graph):
    assert plan.stage_of(graph.nodes[0].name) == 0
    assert plan.stage_of("output") == 2
    with pytest.raises(KeyError):
        plan.stage_of("nope")


def test_parameters_by_original_name(plan, graph):
    held = {p for s in plan.stages for p in s.parameter_names}
    assert {n for n, p in graph.parameters.items() if not p.is_buffer} <= held <= set(graph.parameters)
    for s in plan.stages:
        used = {p for n in s.node_names for p in graph[n].parameters + graph[n].buffers}
        assert used <= set(s.parameter_names)  # and the tensors no op reads, on their module's stage


def test_module_paths(plan):
    assert plan.stages[0].module_paths[0] == "transformer.wte"
    assert plan.stages[-1].module_paths[-1] == "lm_head"


def test_fingerprint(plan, graph):
    assert plan.graph_fingerprint == fingerprint(graph) and len(plan.graph_fingerprint) == 16


# --------------------------------------------------------------------------- boundaries


def test_stage_inputs_come_from_earlier_stages(plan):
    for s in plan.stages:
        for b in s.inputs:
            assert b.source_stage < s.stage_index
            assert s.stage_index in b.destination_stages
            assert b in plan.stages[b.source_stage].outputs
            assert b.name in plan.stages[b.source_stage].node_names


def test_stage_outputs_reach_their_destinations(plan):
    for s in plan.stages:
        for b in s.outputs:
            assert b.source_stage == s.stage_index
            assert all(d > s.stage_index and b in plan.stages[d].inputs for d in b.destination_stages)


def test_first_stage_receives_nothing_and_last_sends_nothing(plan):
    assert plan.stages[0].inputs == () and plan.stages[-1].outputs == ()


def test_boundaries_are_exactly_the_cut_edges(plan, graph):
    for s in plan.stages:
        received = {b.name for b in s.inputs}
        for name in s.node_names:
            for a in graph[name].inputs:
                assert a in s.node_names or a in received, (name, a)
        assert received == {a for n in s.node_names for a in graph[n].inputs if a not in s.node_names}


def test_boundary_shapes_and_bytes(plan, graph):
    for s in plan.stages:
        for b in s.outputs:
            info = graph[b.name].outputs[0]
            assert (b.shape, b.dtype, b.nbytes) == (info.shape, info.dtype, info.nbytes)


def test_long_skip_is_received_by_the_far_stage():
    model, inputs, _, _ = models.unet(4)
    p = replica.plan(model, inputs, num_stages=4, num_microbatches=2, device=COMPUTE_BOUND)
    assert any(max(b.destination_stages) > b.source_stage + 1 for s in p.stages for b in s.outputs)


# --------------------------------------------------------------------------- memory


def test_memory_total():
    m = MemoryBreakdown(parameters=1, gradients=2, optimizer=3, activations=4)
    assert m.total == 10


def test_memory_breakdown(plan, graph):
    for s in plan.stages:
        infos = [graph.parameters[p] for p in s.parameter_names]
        weights = sum(i.nbytes for i in infos if not i.is_buffer)
        assert s.memory.parameters == sum(i.nbytes for i in infos)
        assert s.memory.gradients == weights
        assert s.memory.optimizer == 2 * weights  # Adam's two moments
        assert s.memory.activations > 0
        assert s.predicted_memory_bytes == s.memory.total == (
            s.memory.parameters + s.memory.gradients + s.memory.optimizer + s.memory.activations
        )


def test_one_f_one_b_holds_fewer_activations_than_gpipe(gpt, plan):
    gp = replica.plan(gpt.model, gpt.example_inputs, num_stages=3, schedule="gpipe", device=COMPUTE_BOUND)
    assert [s.node_names for s in gp.stages] == [s.node_names for s in plan.stages]
    p, m = plan.num_stages, plan.num_microbatches
    for g, o in zip(gp.stages, plan.stages):
        # saved activations and received inputs for each micro-batch in flight (and the next's inputs)
        received = sum(b.nbytes for b in g.inputs)
        assert o.activation_bytes == g.activation_bytes and (g.in_flight, o.in_flight) == (m, min(m, p - g.stage_index))
        for st in (g, o):
            held = (st.activation_bytes * st.in_flight + received * min(st.in_flight + 1, m)) / m
            assert st.memory.activations == pytest.approx(held, abs=1)
        if o.in_flight < m:
            assert o.memory.activations < g.memory.activations


def test_tied_weight_counted_on_each_holder(plan, graph):
    nbytes = graph.parameters["transformer.wte.weight"].nbytes
    assert sum(s.memory.gradients for s in plan.stages) == graph.parameter_bytes + nbytes


# --------------------------------------------------------------------------- reuse


def test_auto_parallel_reuses_a_loaded_plan(gpt, plan):
    model, inputs, target, loss_fn = gpt
    loaded = replica.Plan.from_json(plan.to_json())
    pm = replica.auto_parallel(copy.deepcopy(model), inputs, plan=loaded, loss_fn=loss_fn)
    assert pm.plan == plan and len(pm.stages) == 3
    assert [tuple(s.module.graph.nodes)[-1].op for s in pm.stages] == ["output"] * 3
    assert torch.isfinite(pm.train_step(inputs, target))


def test_reused_plan_gives_the_same_gradients(gpt, plan):
    model, inputs, target, loss_fn = gpt
    ref = copy.deepcopy(model)
    loss_fn(ref(*inputs), target).backward()
    pm = replica.auto_parallel(copy.deepcopy(model), inputs, plan=replica.Plan.from_json(plan.to_json()),
                               loss_fn=loss_fn)
    pm.train_step(inputs, target)
    assert_same_grads(pm, ref)


def test_loaded_plan_and_other_num_microbatches_disagree(gpt, plan):
    model, inputs, _, _ = gpt
    with pytest.raises(replica.ConfigError, match="num_microbatches=2.*8|8.*num_microbatches=2"):
        replica.auto_parallel(copy.deepcopy(model), inputs, plan=plan, num_microbatches=2)


def test_loaded_plan_and_other_num_stages_disagree(gpt, plan):
    model, inputs, _, _ = gpt
    with pytest.raises(replica.ReplicaError, match="3.*5|5.*3"):
        replica.auto_parallel(copy.deepcopy(model), inputs, plan=plan, num_stages=5)


def test_plan_for_another_model_mentions_the_fingerprint(plan):
    model, inputs, _, _ = models.mlp(8)
    with pytest.raises(replica.ConfigError, match=f"fingerprint {plan.graph_fingerprint}"):
        replica.auto_parallel(model, inputs, plan=plan)


def test_plan_for_other_input_shapes_mentions_the_fingerprint(gpt, plan):
    model, inputs, _, _ = gpt
    with pytest.raises(replica.ConfigError, match="fingerprint.*replica.plan"):
        replica.auto_parallel(copy.deepcopy(model), (inputs[0][:4],), plan=plan)


def test_boundary_tensor_is_frozen():
    b = BoundaryTensor("x", 0, (1,), (2, 3), "float32", 24)
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.name = "y"  # type: ignore[misc]


def test_interleaved_with_three_stages_per_rank_plans() -> None:
    """9 stages on 3 ranks (3 model chunks each): the plan's layout has the ranks the stages were
    balanced over, not the schedule's default of 2 stages a rank (which 9 does not divide)."""
    model, inputs, _, _ = models.tiny_gpt(8, num_layers=9)
    plan = replica.plan(model, inputs, world_size=3, num_stages=9, num_microbatches=3, schedule="interleaved",
                        device="a100-80gb")
    assert (plan.layout.pipeline_ranks, plan.layout.num_stages) == (3, 9)


def test_the_summary_never_says_zero_tflops_or_zero_bytes_for_a_number(plan):
    from replica.units import format_flop_rate

    assert format_flop_rate(3.14e10) == "31.4 GFLOP/s" and format_flop_rate(2.5e14) == "250 TFLOP/s"
    assert format_flop_rate(1.5e5) == "150 kFLOP/s" and format_flop_rate(0) == "0 FLOP/s"
    text = plan.summary()  # priced on a slow device: GFLOP/s, not "0.0 TFLOP/s"
    assert "0.0 TFLOP/s" not in text and re.search(r"predicted [\d.]+ [kMGTP]?FLOP/s per device", text), text
    size = BoundaryTensor(name="sym_size", source_stage=0, destination_stages=(1,), shape=None, dtype=None, nbytes=0)
    stages = list(plan.stages)
    stages[0] = dataclasses.replace(stages[0], outputs=(size, *stages[0].outputs))
    row = next(line for line in dataclasses.replace(plan, stages=tuple(stages)).summary().splitlines()
               if line.startswith("│     0 │"))
    assert "a number→1" in row and "0→1" not in row and "0 B→1" not in row, row
