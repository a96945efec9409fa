"""Tensor parallelism in the planner: pricing a stage cut across tp ranks, the layouts it makes, the tuner's choice.

Fast, no processes: the blocks are made by hand where the pricing is checked (so the
formulas are checked whatever the pattern finder finds), found by
``replica.partition.tensor_parallel.find_blocks`` elsewhere.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import replica
from replica.layout import Layout
from replica.partition.cost import DeviceSpec, ring_collective_time
from replica.partition.partitioner import MemoryModel
from replica.partition.tensor_parallel import ShardedBlock
from replica.partition.trace import trace
from replica.planner.pricing import Pricing
from replica.planner.tensor_parallel import sharded_graph, tensor_parallel_choices
from replica.planner.tuner import lower_bound
from tests.models import tiny_gpt

# a GPU-like spec without a cache model, so that analytic times are linear in FLOPs and bytes
SPEC = DeviceSpec(name="gpu-ish", flops=1e12, half_flops=4e12, memory_bandwidth=1e11, memory_bytes=2**34,
                  link_bandwidth=1e10, link_latency_s=1e-6, op_overhead_s=1e-5, devices_per_node=4,
                  network_bandwidth=1e9)

MLP = ShardedBlock(
    kind="mlp",
    nodes=("transformer_h_0_mlp_c_fc", "transformer_h_0_mlp_gelu", "transformer_h_0_mlp_c_proj"),
    parameters=(("transformer.h.0.mlp.c_fc.weight", 0), ("transformer.h.0.mlp.c_fc.bias", 0),
                ("transformer.h.0.mlp.c_proj.weight", 1)),
    exits=("transformer_h_0_mlp_c_proj",), entries=("transformer_h_0_ln_2",), units=128)


def _pricing(blocks=(MLP,), batch_size: int = 8) -> tuple[Pricing, object]:
    case = tiny_gpt(batch_size)
    traced = trace(case.model, case.example_inputs)
    pricing = Pricing(traced, case.model, device=SPEC, cost="analytic", memory_budget=None,
                      memory_model=MemoryModel(), num_microbatches=None, num_stages_hint=1)
    pricing._blocks = list(blocks)  # by hand: the pricing, not the pattern finder, is under test
    return pricing, traced.graph


# --- pricing -----------------------------------------------------------------------------
def test_ops_of_a_block_do_a_tp_share_of_their_work_and_pay_their_whole_launch():
    pricing, graph = _pricing()
    whole, cut = pricing.cost_model(SPEC, 1.0, 1), pricing.cost_model(SPEC, 1.0, 2)
    overhead = SPEC.op_overhead_s
    for name in ("transformer_h_0_mlp_c_fc", "transformer_h_0_mlp_gelu"):
        n = graph[name]
        assert cut.forward_time(n, 2) - 2 * overhead == pytest.approx((whole.forward_time(n, 2) - 2 * overhead) / 2)
    fc = graph["transformer_h_0_mlp_c_fc"]
    entry = graph["transformer_h_0_ln_2"].output_bytes
    assert cut.backward_time(fc, 2) == pytest.approx(
        (whole.backward_time(fc, 2) - 4 * overhead) / 2 + 4 * overhead
        + ring_collective_time(SPEC, entry, 2, 2, passes=2, calls=2))  # the entry's gradient all-reduced
    proj = graph["transformer_h_0_mlp_c_proj"]
    exit_ = proj.output_bytes
    assert cut.forward_time(proj, 2) == pytest.approx(
        (whole.forward_time(proj, 2) - 2 * overhead) / 2 + 2 * overhead
        + ring_collective_time(SPEC, exit_, 2, 2, passes=2, calls=2))  # its output all-reduced
    assert cut.backward_time(proj, 2) == pytest.approx((whole.backward_time(proj, 2) - 4 * overhead) / 2
                                                      + 4 * overhead)
    outside = graph["transformer_h_0_ln_2"]  # replicated: its whole cost on every rank
    assert cut.forward_time(outside, 2) == whole.forward_time(outside, 2)
    assert cut.backward_time(outside, 2) == whole.backward_time(outside, 2)


def test_a_gathering_block_all_gathers_its_exit_in_one_pass():
    head = ShardedBlock(kind="head", nodes=("lm_head",), parameters=(("transformer.wte.weight", 0),),
                        exits=("lm_head",), entries=("transformer_ln_f",), units=64, gathers=True)
    pricing, graph = _pricing((head,))
    whole, cut = pricing.cost_model(SPEC, 0.5, 1), pricing.cost_model(SPEC, 0.5, 4)
    n = graph["lm_head"]
    assert cut.forward_time(n, 1) == pytest.approx(
        (whole.forward_time(n, 1) - SPEC.op_overhead_s) / 4 + SPEC.op_overhead_s
        + ring_collective_time(SPEC, 0.5 * n.output_bytes, 4, 4, passes=1))


def test_a_stage_holds_a_tp_share_of_its_blocks_parameters_and_of_the_activations_made_inside():
    pricing, graph = _pricing()
    mine = [p for p, _ in MLP.parameters]
    half = sum(graph.parameters[p].nbytes for p in mine) // 2
    layout = {t: Layout(schedule="1f1b", num_stages=1, pipeline_ranks=1, tensor_parallel_size=t) for t in (1, 2)}
    whole, cut = (pricing.partition_for(layout[t], 1) for t in (1, 2))
    w, c = whole.stages[0].memory, cut.stages[0].memory
    assert w.parameters - c.parameters == half and w.gradients - c.gradients == half
    assert w.optimizer - c.optimizer == 2 * half  # Adam's two moments
    inside = graph["transformer_h_0_mlp_c_fc"].output_bytes + graph["transformer_h_0_mlp_gelu"].output_bytes
    assert w.activations - c.activations == inside // 2  # the exit's output is whole after its all-reduce
    assert cut.tensor_parallel == (MLP,) and whole.tensor_parallel == ()
    # the replicas' gradient all-reduce moves a rank's shards
    names = cut.stages[0].parameter_names
    assert pricing.stage_weights(names, 1).nbytes - pricing.stage_weights(names, 2).nbytes == half
    # model FLOPs count the model once, whatever the layout
    assert cut.model_flops == whole.model_flops


def test_the_stage_names_its_tp_collectives_and_they_sit_in_its_forward_and_backward():
    pricing, graph = _pricing()
    m = 4
    plans = {t: pricing.partition_for(Layout(schedule="1f1b", num_stages=1, pipeline_ranks=1,
                                             tensor_parallel_size=t), m) for t in (1, 2)}
    st = plans[2].stages[0]
    exit_ = graph["transformer_h_0_mlp_c_proj"].output_bytes
    entry = graph["transformer_h_0_ln_2"].output_bytes
    expected = (ring_collective_time(SPEC, exit_, 2, 2, passes=2, calls=m)
                + ring_collective_time(SPEC, entry, 2, 2, passes=2, calls=m))
    assert st.tensor_parallel_s == pytest.approx(expected)
    assert st.tensor_parallel_bytes == exit_ + entry
    assert plans[1].stages[0].tensor_parallel_s == 0.0
    # recompute runs the forward, its all-reduce included, again in backward
    again = pricing.partition_for(Layout(schedule="1f1b", num_stages=1, pipeline_ranks=1, tensor_parallel_size=2),
                                  m, recompute=True).stages[0]
    assert again.tensor_parallel_s == pytest.approx(expected + ring_collective_time(SPEC, exit_, 2, 2, passes=2,
                                                                                    calls=m))


def test_the_pipeline_never_cuts_inside_a_block():
    case = tiny_gpt(16, num_layers=4)
    plan = replica.plan(case.model, case.example_inputs, world_size=16, tensor_parallel_size=2, num_stages=8,
                        num_microbatches=8, schedule="1f1b", device=SPEC, cost="analytic")
    assert plan.tensor_parallel
    for block in plan.tensor_parallel:
        assert len({plan.stage_of(n) for n in block.nodes}) == 1, block
    assert sum(len(plan.blocks_of(k)) for k in range(plan.num_stages)) == len(plan.tensor_parallel)


def test_the_sharded_graph_keeps_names_flops_and_exits_whole():
    pricing, graph = _pricing()
    g = sharded_graph(graph, [MLP], 2)
    assert [n.name for n in g] == [n.name for n in graph]
    assert g["transformer_h_0_mlp_c_fc"].flops == graph["transformer_h_0_mlp_c_fc"].flops
    assert g["transformer_h_0_mlp_c_proj"].outputs == graph["transformer_h_0_mlp_c_proj"].outputs
    assert g.parameters["transformer.h.0.mlp.c_proj.weight"].shape[1] * 2 == \
        graph.parameters["transformer.h.0.mlp.c_proj.weight"].shape[1]
    assert g.parameters["transformer.h.0.mlp.c_proj.bias"] == graph.parameters["transformer.h.0.mlp.c_proj.bias"]
    assert sharded_graph(graph, [MLP], 1) is graph


# --- plans through replica.plan ------------------------------------------------------------
@pytest.mark.parametrize("microbatches", [4, None])  # a fixed layout, and the tuner for the rest
def test_a_plan_with_a_fixed_tensor_parallel_size(microbatches):
    case = tiny_gpt()
    plan = replica.plan(case.model, case.example_inputs, world_size=4, tensor_parallel_size=2, num_stages=2,
                        schedule="1f1b", num_microbatches=microbatches)
    assert plan.layout.tensor_parallel_size == 2 and plan.layout.world_size == 4
    assert plan.data_parallel_size == 1 and plan.pipeline_ranks == 2
    kinds = [b.kind for b in plan.tensor_parallel]
    assert kinds.count("mlp") == 2, kinds  # tiny_gpt's two MLPs, found by the pattern finder
    assert all(b.fits(2) for b in plan.tensor_parallel)
    assert any(s.tensor_parallel_s > 0 for s in plan.stages)
    again = replica.Plan.from_json(plan.to_json())
    assert again == plan and again.tensor_parallel == plan.tensor_parallel
    text = plan.summary()
    assert "2 tensor-parallel ranks" in text and "tensor parallel: 2 ranks per stage" in text
    assert "mlps" in text


def test_a_plan_saved_before_tensor_parallelism_still_loads():
    case = tiny_gpt()
    plan = replica.plan(case.model, case.example_inputs, num_stages=2, num_microbatches=2)
    import json
    data = json.loads(plan.to_json())
    data.pop("tensor_parallel")
    for s in data["stages"]:
        s.pop("tensor_parallel_s"), s.pop("tensor_parallel_bytes")
    data["layout"].pop("tensor_parallel_size")
    old = replica.Plan.from_json(json.dumps(data))
    assert old.layout.tensor_parallel_size == 1 and old.tensor_parallel == () and old.stages == plan.stages


def test_a_report_shows_each_stages_sharded_modules_and_their_collectives(tmp_path):
    case = tiny_gpt()
    plan = replica.plan(case.model, case.example_inputs, world_size=4, tensor_parallel_size=2, num_stages=2,
                        schedule="1f1b", num_microbatches=2)
    graph = trace(case.model, case.example_inputs).graph
    for g in (None, graph):
        html = replica.visualize(plan, tmp_path / "plan.html", graph=g).read_text()
        assert "Tensor parallel: " in html and "transformer.h.0.mlp.c_fc" in html
        assert "all-reduce of <code>transformer_h_0_mlp_c_proj</code>" in html
        assert "all-reduce of <code>transformer_h_0_ln_2</code>'s gradient" in html


@pytest.mark.parametrize("tp, world, message", [
    (3, 4, r"tensor_parallel_size=3 does not divide world_size=4.*\[1, 2, 4\]"),
    (2, None, "needs a world of processes"),
])
def test_an_impossible_tensor_parallel_size_is_named_with_the_fix(tp, world, message):
    case = tiny_gpt()
    with pytest.raises(replica.ConfigError, match=message):
        replica.plan(case.model, case.example_inputs, world_size=world, tensor_parallel_size=tp)


def test_tensor_parallelism_with_sharded_replicas_plans_fsdp_by_tp():
    case = tiny_gpt()
    plan = replica.plan(case.model, case.example_inputs, world_size=4, tensor_parallel_size=2,
                        sharded_data_parallel=True)
    layout = plan.layout
    assert (layout.tensor_parallel_size, layout.data_parallel_size) == (2, 2)
    assert layout.sharded and layout.dp_shard == 2


def test_layouts_of_a_world_with_tensor_parallel_ranks():
    layout = Layout.for_world("1f1b", 1024, num_stages=16, data_parallel_size=8, tensor_parallel_size=8)
    assert (layout.pipeline_ranks, layout.data_parallel_size, layout.tensor_parallel_size) == (16, 8, 8)
    assert Layout.for_world("interleaved", 32, num_stages=4, tensor_parallel_size=4, data_parallel_size=4) \
        .pipeline_ranks == 2
    assert Layout.for_world("1f1b", 8).tensor_parallel_size == 1  # the default, as before
    with pytest.raises(replica.ConfigError, match=r"leaves 64 data-parallel replicas.*tensor_parallel_size=8"):
        Layout.for_world("1f1b", 1024, num_stages=16, data_parallel_size=8)
    with pytest.raises(replica.ConfigError, match=r"tensor_parallel_size=3 does not divide the world size 8"):
        Layout.for_world("1f1b", 8, tensor_parallel_size=3)
    assert tensor_parallel_choices(16, 8) == [1, 2, 4, 8]
    assert tensor_parallel_choices(12, 8) == [1, 2, 4]
    assert tensor_parallel_choices(4, 1) == [1]


def test_a_fixed_megatron_like_layout_of_a_meta_gpt_plans_quickly():
    from examples.gpt.model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(block_size=128, vocab_size=512, n_layer=8, n_head=8, n_embd=256))
    tokens = torch.empty(64, 128, dtype=torch.long, device="meta")
    for schedule, stages in (("1f1b", 4), ("interleaved", 8)):
        plan = replica.plan(model, (tokens,), world_size=64, device="a100-80gb", mixed_precision="bf16",
                            tensor_parallel_size=8, num_stages=stages, data_parallel_size=2, num_microbatches=8,
                            schedule=schedule, recompute=True)
        assert (plan.pipeline_ranks, plan.data_parallel_size, plan.layout.tensor_parallel_size) == (4, 2, 8)
        assert {b.kind for b in plan.tensor_parallel} >= {"mlp"}
        # utilisation counts every rank, the tensor-parallel ones included
        assert plan.model_flops / plan.predicted_step_time_s / 64 < plan.device_peak_flops


# --- the tuner ---------------------------------------------------------------------------
class MLPStack(nn.Module):
    """Wide MLP blocks (Megatron's column then row linear) with residuals: most of the work cuts."""

    def __init__(self, d: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.ups = nn.ModuleList(nn.Linear(d, 4 * d) for _ in range(layers))
        self.downs = nn.ModuleList(nn.Linear(4 * d, d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, up, down in zip(self.norms, self.ups, self.downs):
            x = x + down(torch.nn.functional.gelu(up(norm(x))))
        return x


def _mlp_stack() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return MLPStack(), (torch.randn(2, 64, 256),)


def _weights(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_the_tuner_cuts_tensors_where_a_replica_does_not_fit_and_the_links_are_fast():
    model, inputs = _mlp_stack()
    fast = dataclasses.replace(SPEC, link_bandwidth=1e13, link_latency_s=1e-7, devices_per_node=2,
                               memory_bytes=3 * _weights(model))  # Adam's state: a replica needs 4x its weights
    plan = replica.plan(model, inputs, world_size=2, schedule="auto", device=fast, cost="analytic",
                        sharded_data_parallel=False)
    assert plan.layout.tensor_parallel_size == 2, plan.layout.describe()
    assert (plan.pipeline_ranks, plan.data_parallel_size) == (1, 1)
    assert [b.kind for b in plan.tensor_parallel] == ["mlp"] * 4
    assert max(s.predicted_memory_bytes for s in plan.stages) <= fast.memory_bytes
    assert any("tensor" not in d for d, _ in plan.alternatives)  # a pipeline of two was priced too, slower


def test_the_tuner_keeps_whole_stages_on_a_cpu_and_where_collectives_cost_more_than_they_save():
    model, inputs = _mlp_stack()
    cpu = replica.plan(model, inputs, world_size=2, schedule="auto", device="cpu", cost="analytic")
    assert cpu.layout.tensor_parallel_size == 1 and cpu.tensor_parallel == ()  # one device per node
    slow = dataclasses.replace(SPEC, link_bandwidth=1e8, link_latency_s=1e-3, devices_per_node=2)
    plan = replica.plan(model, inputs, world_size=2, schedule="auto", device=slow, cost="analytic")
    assert plan.layout.tensor_parallel_size == 1, plan.layout.describe()


def test_the_tuner_prefers_fewer_tensor_parallel_ranks_on_a_tie():
    model, inputs = _mlp_stack()
    free = dataclasses.replace(SPEC, link_bandwidth=1e15, link_latency_s=0.0, op_overhead_s=0.0,
                               devices_per_node=2, network_bandwidth=1e15)
    plan = replica.plan(model, inputs, world_size=2, schedule="auto", device=free, cost="analytic",
                        options=replica.PlannerOptions(tie=10.0))  # everything ties
    assert plan.layout.tensor_parallel_size == 1


def test_the_lower_bound_never_exceeds_what_the_tuner_simulates(monkeypatch):
    from replica.planner import tuner

    seen = []  # (the cut's bound, the simulated step, the layout, micro-batches, recompute)
    evaluate = tuner._evaluate

    def checked(plan, layout, *args):
        found = evaluate(plan, layout, *args)
        if found is not None:
            seen.append((lower_bound(plan, layout), found.step_time_s, layout.describe(), plan.num_microbatches,
                         plan.recompute))
        return found

    work = Pricing.work
    early = {}

    def worked(self, layout, m, recompute):
        early[(layout.describe(), m, recompute)] = work(self, layout, m, recompute) / layout.pipeline_ranks
        return early[(layout.describe(), m, recompute)]

    monkeypatch.setattr(tuner, "_evaluate", checked)
    monkeypatch.setattr(Pricing, "work", worked)
    case = tiny_gpt(32, num_layers=4)
    replica.plan(case.model, case.example_inputs, world_size=8, schedule="auto", device="a100-80gb",
                 cost="analytic")
    assert len({d for _, _, d, _, _ in seen}) > 5
    assert all(bound <= step * (1 + 1e-9) for bound, step, *_ in seen), [s for s in seen if s[0] > s[1]]
    # the bound before the cut (a replica's work over its ranks) is never above the cut's
    assert all(early[(d, m, r)] <= bound * (1 + 1e-9) for bound, _, d, m, r in seen)


# --- which blocks are cut --------------------------------------------------------------------
def test_blocks_sharing_a_parameter_are_cut_together_or_not_at_all():
    from replica.planner.tensor_parallel import blocks_for

    embedding = ShardedBlock(kind="embedding", nodes=("wte",), parameters=(("wte.weight", 0),), exits=("wte",),
                             entries=(), units=64)
    head = ShardedBlock(kind="head", nodes=("head",), parameters=(("wte.weight", 0),), exits=("head",),
                        entries=("ln_f",), units=48, gathers=True)
    assert blocks_for([MLP, embedding, head], 2) == (MLP, embedding, head)
    assert blocks_for([MLP, embedding, head], 16) == (MLP, embedding, head)
    assert blocks_for([MLP, embedding, head], 32) == (MLP,)  # 48 is not a multiple of 32: the embedding stays whole too
    assert blocks_for([MLP, embedding, head], 2, pays=lambda group: MLP in group) == (MLP,)
    assert blocks_for([MLP], 1) == ()


class TinyHead(nn.Module):
    """A stack whose only block is a 4-logit head: cutting it saves nothing, holds nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.ModuleList(nn.Linear(128, 128) for _ in range(4))
        self.head = nn.Linear(128, 4)  # 0.8% of the weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.body:
            x = x + torch.relu(layer(x))
        return self.head(x)


def test_a_block_that_pays_neither_in_time_nor_in_memory_stays_whole():
    torch.manual_seed(0)
    model, inputs = TinyHead(), (torch.randn(8, 128),)
    slow = dataclasses.replace(SPEC, link_latency_s=1e-3)
    plan = replica.plan(model, inputs, world_size=2, tensor_parallel_size=2, num_stages=1, num_microbatches=1,
                        schedule="1f1b", device=slow, cost="analytic")
    assert plan.layout.tensor_parallel_size == 2 and plan.tensor_parallel == ()
    assert "no block of the graph can be cut 2 ways" in plan.summary()
    tuned = replica.plan(model, inputs, world_size=2, schedule="auto", device=slow, cost="analytic")
    assert tuned.layout.tensor_parallel_size == 1  # a size that cuts nothing is not even priced


def test_the_pruned_search_chooses_what_simulating_every_candidate_chooses(monkeypatch):
    from replica.planner import tuner

    case = tiny_gpt(32, num_layers=4)

    def tuned(budget):
        return replica.plan(case.model, case.example_inputs, world_size=8, schedule="auto", device="a100-80gb",
                            cost="analytic", memory_budget=budget)

    # one replica per rank, sharded replicas checkpointing every block, 8 pipeline ranks; 4 stages x 2
    # tensor ranks (budgets as the memory model prices per-block checkpointing and received inputs, #39,
    # and walks each rank's actions: at 3e5 a mix of modes per stage fits 8 pipeline ranks)
    budgets = (2e6, 1e6, 6e5, 2.5e5)
    pruned = [tuned(b) for b in budgets]
    assert pruned[-1].layout.tensor_parallel_size == 2
    monkeypatch.setattr(tuner, "lower_bound", lambda plan, layout: 0.0)
    monkeypatch.setattr(Pricing, "work", lambda self, layout, m, recompute: 0.0)  # the bound before the cut
    monkeypatch.setattr(tuner, "_zero_bubble_floor", lambda plan, layout: 0.0)
    monkeypatch.setattr(tuner, "_static_peak", lambda plan, layout: 0.0)
    for budget, p in zip(budgets, pruned):
        full = tuned(budget)
        assert p.layout == full.layout and p.num_microbatches == full.num_microbatches
        assert p.predicted_step_time_s == full.predicted_step_time_s
