"""Planning in the precision a run computes in (#29 item 5): under bf16 / fp16 autocast the
planner prices matmuls at the half-precision rate, every tensor in the dtype autocast gives
it, and memory as torch holds it (fp32 weights, gradients and Adam state, a half-precision
copy of the weights per micro-batch in flight)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import replica
from replica.errors import ConfigError, TraceError
from replica.partition.autocast import autocast_graph
from replica.partition.cost import PRESETS, CostModel
from replica.partition.partitioner import MemoryModel, in_flight_microbatches, partition, saves_activation
from replica.partition.plan import Plan
from replica.partition.profile import profile
from replica.partition.trace import trace
from replica.planner import PlanRequest, make_plan
from replica.viz.report import render_html
from tests import models
from tests.test_trace import ReadsAValue

# FLOPs alone decide time (no bytes, launches or transfers), at a 4x half-precision rate
FLOPS_ONLY = replica.DeviceSpec(name="gpu-flops-only", flops=1e9, half_flops=4e9, memory_bandwidth=1e30,
                                memory_bytes=1e15, link_bandwidth=1e30, link_latency_s=0.0, op_overhead_s=0.0)


def planned(model: nn.Module, inputs: tuple, precision: str, **request) -> Plan:
    """The plan ``make_plan`` makes for ``model``: analytic, even micro-batches, nothing rebuilt."""
    asked = dict(device=FLOPS_ONLY, cost="analytic", graded_microbatches=False, recompute=False) | request
    return make_plan(trace(model, inputs), model, PlanRequest(mixed_precision=precision, **asked))


def numel(model: nn.Module, names) -> int:
    """Elements of the parameters among ``names``."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return sum(params[n].numel() for n in names if n in params)


def buffer_bytes(model: nn.Module, names) -> int:
    buffers = dict(model.named_buffers())
    return sum(buffers[n].nbytes for n in names if n in buffers)


# CUDA autocast on the tiny GPT, by hand: matmuls and what follows them in bf16; embeddings,
# LayerNorms, residual adds (fp32 stream + bf16) and softmax (CUDA's fp32 list) in fp32
FP32_IN_A_GPT = {"embedding", "add", "layernorm", "softmax"}


CASTING = ("linear", "matmul")  # a tiny GPT's ops that autocast runs in bf16, casting their inputs


def numel_of(node) -> int:
    return sum(t.numel for t in node.outputs)


def gpt_bytes(node) -> int:
    """A tiny GPT node's output bytes under bf16 CUDA autocast, from its fp32 shapes."""
    size = 4 if node.target in FP32_IN_A_GPT else 2
    return sum(t.numel * (size if t.is_floating else t.nbytes // t.numel) for t in node.outputs)


# --------------------------------------------------------------------------- the request


@pytest.mark.parametrize("given, name", [(None, "fp32"), ("fp32", "fp32"), ("bfloat16", "bf16"),
                                         (torch.bfloat16, "bf16"), ("half", "fp16"), (torch.float16, "fp16")])
def test_a_request_names_its_precision(given, name):
    assert PlanRequest(mixed_precision=given).precision == name


@pytest.mark.parametrize("given", [True, "int8", torch.float64])
def test_a_request_refuses_what_is_no_precision(given):
    with pytest.raises(ConfigError, match="precision"):
        PlanRequest(mixed_precision=given)


# --------------------------------------------------------------------------- dtypes under autocast


@pytest.fixture
def gpt():
    return models.tiny_gpt()


@pytest.fixture
def gpt_traced(gpt):
    return trace(gpt.model, gpt.example_inputs)


def test_a_gpu_autocast_graph_has_autocasts_dtypes(gpt, gpt_traced):
    g = autocast_graph(gpt_traced, gpt.model, "cuda", "bf16")
    dtypes = {n.name: n.outputs[0].dtype for n in g.op_nodes if n.outputs}
    assert dtypes["transformer_h_0_attn_c_attn"] == dtypes["transformer_h_0_mlp_gelu"] == "bfloat16"
    assert dtypes["matmul"] == dtypes["masked_fill"] == dtypes["matmul_1"] == dtypes["lm_head"] == "bfloat16"
    assert dtypes["softmax"] == "float32"  # CUDA autocast's fp32 list
    assert dtypes["transformer_h_0_ln_1"] == dtypes["add_1"] == dtypes["transformer_wte"] == "float32"
    for n in g.op_nodes:
        assert gpt_bytes(gpt_traced.graph[n.name]) == n.output_bytes, n.name
        assert n.compute_dtype == ("bfloat16" if n.flops else "")
        assert n.flops == gpt_traced.graph[n.name].flops  # the same work, in another dtype
    assert g["transformer_h_0_mlp_c_fc"].weight_casts == (("transformer.h.0.mlp.c_fc.bias", "bfloat16"),
                                                          ("transformer.h.0.mlp.c_fc.weight", "bfloat16"))
    assert g["lm_head"].weight_casts == (("transformer.wte.weight", "bfloat16"),)  # tied: by its canonical name
    assert not g["transformer_h_0_ln_1"].weight_casts and not g["transformer_wte"].weight_casts


def test_a_cpu_autocast_graph_follows_the_cpus_autocast(gpt, gpt_traced):
    g = autocast_graph(gpt_traced, gpt.model, "cpu", "bf16")
    assert g["softmax"].outputs[0].dtype == "bfloat16"  # the CPU's autocast keeps it in its input's dtype
    assert g["transformer_h_0_ln_1"].outputs[0].dtype == "float32"


def test_fp16_autocast_graph(gpt, gpt_traced):
    g = autocast_graph(gpt_traced, gpt.model, "cuda", "fp16")
    assert g["transformer_h_0_attn_c_attn"].outputs[0].dtype == g["lm_head"].compute_dtype == "float16"


def test_an_fp32_graph_is_the_traced_one(gpt, gpt_traced):
    assert autocast_graph(gpt_traced, gpt.model, "cuda", "fp32") is gpt_traced.graph


def test_the_traced_graph_is_left_alone(gpt, gpt_traced):
    before = [(n.outputs, n.bytes_accessed, tuple(n.users)) for n in gpt_traced.graph.nodes]
    autocast_graph(gpt_traced, gpt.model, "cuda", "bf16")
    assert [(n.outputs, n.bytes_accessed, tuple(n.users)) for n in gpt_traced.graph.nodes] == before


def test_an_ops_bytes_under_autocast(gpt, gpt_traced):
    """c_fc: reads its fp32 input, writes and reads again its bf16 cast; reads its fp32
    weight and bias, writes and reads their bf16 copies; writes its bf16 output."""
    node = autocast_graph(gpt_traced, gpt.model, "cuda", "bf16")["transformer_h_0_mlp_c_fc"]
    x, weight, bias = 8 * 16 * 32, 128 * 32, 128
    moved = 4 * x + 2 * 2 * x + 4 * (weight + bias) + 2 * 2 * (weight + bias) + 2 * 8 * 16 * 128
    assert node.bytes_accessed == moved
    a100 = PRESETS["a100-80gb"]
    want = node.flops / a100.half_flops + moved / a100.memory_bandwidth + a100.op_overhead_s
    assert CostModel(a100).forward_time(node) == pytest.approx(want)


def test_a_meta_model_is_retyped_without_weights():
    with torch.device("meta"):
        case = models.tiny_gpt()
    tokens = torch.empty(8, 16, dtype=torch.long, device="meta")
    g = autocast_graph(trace(case.model, (tokens,)), case.model, "cuda", "bf16")
    assert g["lm_head"].outputs[0].dtype == "bfloat16" and g["softmax"].outputs[0].dtype == "float32"


def test_an_exported_graph_is_retyped(gpt):
    traced = trace(gpt.model, gpt.example_inputs, tracer="export")
    g = autocast_graph(traced, gpt.model, "cuda", "bf16")
    casts = {p for n in g.nodes for p, _ in n.weight_casts}
    assert "transformer.h.1.mlp.c_proj.weight" in casts and "transformer.wte.weight" in casts


def test_a_graph_fake_tensors_cannot_run_runs_for_real_on_its_own_device():
    model = ReadsAValue()
    traced = trace(model, (torch.randn(5, 4),))
    g = autocast_graph(traced, model, "cpu", "bf16", real=True)
    assert g["lin"].outputs[0].dtype == "bfloat16" and g["lin"].weight_casts
    with pytest.raises(TraceError, match="bf16 autocast"):  # a GPU's autocast it cannot run here
        autocast_graph(traced, model, "cuda", "bf16", real=True)


class MixedAttention(nn.Module):
    """Attention whose query and key stay fp32 (a rotary embedding's cos / sin do that) while
    its value comes out of a linear in bf16: autocast casts all three before attention
    checks that their dtypes agree."""

    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Linear(8, 8)

    def forward(self, x):
        q = x * 2.0
        return F.scaled_dot_product_attention(q, q, self.v(x))


@pytest.mark.parametrize("leaf", [False, True], ids=["traced", "leaf"])
def test_composite_ops_are_cast_before_they_check_dtypes(leaf):
    model = nn.Sequential(MixedAttention())
    traced = trace(model, (torch.randn(2, 3, 4, 8),), leaf_modules=[MixedAttention] if leaf else ())
    g = autocast_graph(traced, model, "cuda", "bf16")
    assert g.output_node.outputs[0].dtype == "bfloat16"
    assert {c for n in g.nodes for c in n.weight_casts} == {("0.v.bias", "bfloat16"), ("0.v.weight", "bfloat16")}


def test_planning_in_bf16_leaves_the_model_as_it_was():
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 4)).train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 8)
    rng = torch.get_rng_state()
    planned(model, (x,), "bf16", num_stages=2)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert torch.equal(rng, torch.get_rng_state()) and model.training


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares with CUDA autocast on a GPU")
@pytest.mark.parametrize("case", [models.tiny_gpt, models.unet, models.two_input_branchy, models.mlp,
                                  lambda: models.ModelCase(nn.Sequential(MixedAttention()), (torch.randn(2, 3, 4, 8),),
                                                           None, None)])
def test_the_emulated_policy_is_cuda_autocasts(case, monkeypatch):
    c = case()
    model = c.model.cuda()
    traced = trace(model, tuple(x.cuda() for x in c.example_inputs))
    real = autocast_graph(traced, model, "cuda", "bf16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # what a machine without a GPU runs
    emulated = autocast_graph(traced, model, "cuda", "bf16")
    for a, b in zip(real.nodes, emulated.nodes):
        assert (a.outputs, a.compute_dtype, a.weight_casts) == (b.outputs, b.compute_dtype, b.weight_casts), a.name


# --------------------------------------------------------------------------- time


def test_matmul_time_drops_by_the_half_precision_rate(gpt):
    fp32 = planned(gpt.model, gpt.example_inputs, "fp32", num_stages=2, num_microbatches=2)
    bf16 = planned(gpt.model, gpt.example_inputs, "bf16", num_stages=2, num_microbatches=2)
    ratio = FLOPS_ONLY.half_flops / FLOPS_ONLY.flops
    for a, b in zip(fp32.stages, bf16.stages):
        assert a.node_names == b.node_names  # the same cuts: every stage 4x faster
        assert b.forward_time_s == pytest.approx(a.forward_time_s / ratio)
        assert b.backward_time_s == pytest.approx(a.backward_time_s / ratio)
    assert bf16.predicted_step_time_s == pytest.approx(fp32.predicted_step_time_s / ratio)


@pytest.fixture
def tf32():
    """Matmuls in fp32 may use TF32 (torch.set_float32_matmul_precision("high")) for the test."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    yield
    torch.set_float32_matmul_precision(before)


def test_on_an_a100_matmuls_run_about_twice_as_fast_as_tf32(tf32):
    """Against TF32, matmuls drop towards the 2x of the A100's bf16 rate (their bytes, casts
    included, do not shrink as much); LayerNorms, embeddings and residual adds stay fp32 and
    memory-bound."""
    with torch.device("meta"):
        model = models.TinyGPT(vocab_size=256, block_size=256, n_embd=1024, n_head=8, num_layers=2)
    tokens = torch.empty(16, 256, dtype=torch.long, device="meta")
    traced = trace(model, (tokens,))
    retyped = autocast_graph(traced, model, "cuda", "bf16")
    a100 = CostModel(PRESETS["a100-80gb"])
    for name in ("transformer_h_0_attn_c_attn", "transformer_h_0_mlp_c_fc", "transformer_h_1_mlp_c_proj"):
        assert 1.6 < a100.forward_time(traced.graph[name]) / a100.forward_time(retyped[name]) <= 2.0
    assert a100.forward_time(traced.graph["transformer_h_0_ln_1"]) == a100.forward_time(retyped["transformer_h_0_ln_1"])
    fp32, bf16 = (planned(model, (tokens,), p, device="a100-80gb", num_stages=2, num_microbatches=4)
                  for p in ("fp32", "bf16"))
    compute = [sum(s.forward_time_s + s.backward_time_s for s in plan.stages) for plan in (fp32, bf16)]
    assert 1.3 < compute[0] / compute[1] < 2.0  # the fp32 ops and every launch at their fp32 times


def test_fp32_matmuls_without_tf32_run_at_the_full_fp32_rate():
    """torch's default keeps fp32 matmuls whole (no TF32): a GPU preset prices them at its
    fp32 rate, an order of magnitude under bf16 (benchmarks/gpu_check.py measured it on an H200)."""
    assert torch.get_float32_matmul_precision() == "highest"
    for name in ("a100-80gb", "h100-80gb"):
        spec = PRESETS[name]
        assert spec.peak("float32") == spec.fp32_flops and spec.half_flops / spec.peak("float32") > 10
        assert spec.peak("bfloat16") == spec.half_flops
    cpu = replica.DeviceSpec(name="cpu", flops=1e11, half_flops=2.5e10, memory_bandwidth=1e10,
                             memory_bytes=2**30, link_bandwidth=1e9, link_latency_s=1e-5)
    assert cpu.peak("float32") == 1e11  # no fp32_flops: the one fp32 rate


# --------------------------------------------------------------------------- bytes crossing a cut


def test_boundary_bytes_halve_for_matmul_outputs(gpt, gpt_traced):
    nodes = gpt_traced.graph.nodes
    cut = [n.name for n in nodes].index("transformer_h_0_mlp_c_fc") + 1  # the GELU in the next stage
    plans = {precision: partition(autocast_graph(gpt_traced, gpt.model, "cuda", precision), CostModel(FLOPS_ONLY),
                                  num_stages=2, num_microbatches=1, schedule="1f1b", bounds=[0, cut, len(nodes)])
             for precision in ("fp32", "bf16")}
    sent = {p: {b.name: b for b in plan.stages[0].outputs} for p, plan in plans.items()}
    fc, residual = "transformer_h_0_mlp_c_fc", "add_1"
    assert sent["bf16"][fc].dtype == "bfloat16" and sent["fp32"][fc].dtype == "float32"
    assert sent["bf16"][fc].nbytes == sent["fp32"][fc].nbytes // 2 == 2 * 8 * 16 * 128
    assert sent["bf16"][residual].nbytes == sent["fp32"][residual].nbytes == 4 * 8 * 16 * 32  # fp32 stream
    sends = {p: plan.stages[0].communication_time_s for p, plan in plans.items()}
    assert sends["bf16"] == pytest.approx(sends["fp32"] - 2 * 2 * 8 * 16 * 128 / FLOPS_ONLY.link_bandwidth)


# --------------------------------------------------------------------------- memory


def test_one_stage_holds_fp32_state_and_one_bf16_copy():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(8, 16)
    weights = 16 * 32 + 32 + 32 * 8 + 8
    mem = planned(model, (x,), "bf16").stages[0].memory
    assert (mem.parameters, mem.gradients, mem.optimizer) == (4 * weights, 4 * weights, 8 * weights)
    # saved: two linear outputs and the ReLU's, bf16; one micro-batch in flight, with its weight copies
    assert mem.activations == 2 * (8 * 32 + 8 * 32 + 8 * 8) + 2 * weights
    plain = planned(model, (x,), "fp32").stages[0].memory
    assert plain.activations == 4 * (8 * 32 + 8 * 32 + 8 * 8)
    assert (plain.parameters, plain.gradients, plain.optimizer) == (mem.parameters, mem.gradients, mem.optimizer)


@pytest.mark.parametrize("schedule, recompute", [("1f1b", False), ("gpipe", False), ("1f1b", True)])
def test_each_stage_holds_what_the_memory_model_says(gpt, gpt_traced, schedule, recompute):
    m, stages = 4, 3
    plan = planned(gpt.model, gpt.example_inputs, "bf16", num_stages=stages, num_microbatches=m, schedule=schedule,
                   recompute=recompute)
    graph = gpt_traced.graph
    linears = {n.name: n.parameters for n in graph.op_nodes if n.target == "linear"}
    for st in plan.stages:
        params, buffers = numel(gpt.model, st.parameter_names), buffer_bytes(gpt.model, st.parameter_names)
        assert (st.memory.parameters, st.memory.gradients, st.memory.optimizer) == (4 * params + buffers,
                                                                                     4 * params, 8 * params)
        here = set(st.node_names)

        def kept(n) -> int:  # an fp32 value only matmuls read: each reader's bf16 copy (one if it leaves)
            if gpt_bytes(n) == 2 * numel_of(n) or not n.users or any(graph[u].target not in CASTING for u in n.users):
                return gpt_bytes(n)
            return min(gpt_bytes(n), 2 * numel_of(n) * (sum(u in here for u in n.users)
                                                        + any(u not in here for u in n.users)))

        saved = sum(kept(graph[n]) for n in st.node_names if saves_activation(graph[n]))
        copies = 2 * numel(gpt.model, {p for n in st.node_names for p in linears.get(n, ())})
        received = sum(gpt_bytes(graph[b.name]) for b in st.inputs)
        assert received == sum(b.nbytes for b in st.inputs)
        # each micro-batch in flight keeps its activations and its own copies of the weights, and
        # its received inputs (the next micro-batch's too: received ahead); checkpointing every
        # block, only the blocks' inputs, and one micro-batch's largest block while it is rebuilt
        held = in_flight_microbatches(schedule, st.stage_index, stages, m)
        assert st.in_flight == held
        if recompute:
            assert st.activation_bytes < saved + m * copies and st.recompute_bytes > 0
        else:
            assert st.activation_bytes == saved + m * copies and st.recompute_bytes == 0
        assert st.memory.activations == int((st.activation_bytes * held + st.recompute_bytes
                                             + received * min(held + 1, m)) / m), st.stage_index


def test_bf16_weights_are_two_bytes_with_torchs_adam():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).to(torch.bfloat16)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    weights = 16 * 32 + 32 + 32 * 8 + 8
    for precision in ("fp32", "bf16"):  # autocast has nothing to cast: no copies either way
        st = planned(model, (x,), precision).stages[0]
        assert (st.memory.parameters, st.memory.gradients, st.memory.optimizer) == (2 * weights, 2 * weights,
                                                                                     4 * weights)
        assert st.memory.activations == 2 * (8 * 32 + 8 * 32 + 8 * 8)
        assert st.forward_time_s == pytest.approx(2 * 8 * (16 * 32 + 32 * 8) / FLOPS_ONLY.half_flops)


def test_optimizer_state_is_the_size_of_its_weights():
    assert MemoryModel(optimizer="adam").optimizer_bytes(1000) == 2000
    assert MemoryModel(optimizer="sgd-momentum").optimizer_bytes(1000) == 1000
    assert MemoryModel(optimizer="sgd").optimizer_bytes(1000) == 0


def test_a_meta_model_plans_in_bf16_on_a_preset():
    with torch.device("meta"):
        case = models.tiny_gpt()
    tokens = torch.empty(8, 16, dtype=torch.long, device="meta")
    traced = trace(case.model, (tokens,))
    p = make_plan(traced, case.model, PlanRequest(mixed_precision="bf16", device="a100-80gb", num_stages=2))
    assert p.precision == "bf16" and p.device == "a100-80gb"
    assert {b.dtype for s in p.stages for b in s.outputs} <= {"bfloat16", "float32"}


def test_an_exported_moe_on_meta_plans_in_bf16_for_a_gpu():
    """Qwen3-MoE (HF, grouped_mm experts) on meta: torch.export writes dtype checks into the graph
    (a q_norm asserts its fp32 input, which autocast makes bf16) and the experts count tokens with
    an int32 histc, which only a GPU (or meta) kernel takes: planned for an H100 on meta, in bf16."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=16, use_cache=False, tie_word_embeddings=False, mlp_only_layers=[])
    config._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config)
    tokens = torch.empty(4, 16, dtype=torch.long, device="meta")
    p = replica.plan(model, (tokens,), num_stages=2, device="h100-80gb", cost="analytic", mixed_precision="bf16")
    assert p.precision == "bf16" and p.num_stages == 2


def test_a_plan_priced_compiled_and_eager_reruns_the_autocast_once(monkeypatch) -> None:
    """compile=None on a GPU prices the chosen layout compiled and eager: two price sets of one
    trace, one autocast rerun (kept on the trace)."""
    import replica.partition.autocast as autocast

    runs = []
    real = autocast._autocast_graph
    monkeypatch.setattr(autocast, "_autocast_graph", lambda *a, **k: runs.append(1) or real(*a, **k))
    from examples.gpt.model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16))
    tokens = torch.empty(4, 16, dtype=torch.long, device="meta")
    p = replica.plan(model, (tokens,), num_stages=2, device="h100-80gb", cost="analytic", mixed_precision="bf16")
    assert p.precision == "bf16" and "compile=None on h100-80gb" in p.summary()
    assert runs == [1]


# --------------------------------------------------------------------------- the plan


@pytest.fixture
def bf16_plan(gpt):
    return planned(gpt.model, gpt.example_inputs, "bf16", num_stages=2)


def test_the_plan_keeps_its_precision_in_json(bf16_plan):
    assert bf16_plan.precision == "bf16"
    assert Plan.from_json(bf16_plan.to_json()) == bf16_plan
    older = json.loads(bf16_plan.to_json())
    del older["precision"]  # a plan saved before precisions were planned
    assert Plan.from_json(json.dumps(older)).precision == "fp32"


def test_summary_and_report_name_the_precision(bf16_plan):
    line = "precision: bf16 autocast (weights, gradients and optimizer state in the weights' dtype)"
    assert line in bf16_plan.summary()
    assert line.replace("'", "&#x27;") in render_html(bf16_plan, device=FLOPS_ONLY)
    plain = dataclasses.replace(bf16_plan, precision="fp32")
    assert "precision: the weights' own dtype (no autocast)" in plain.summary()


# --------------------------------------------------------------------------- profiling


class Probe(nn.Module):
    """Notes the autocast dtype and the input dtype of every call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[object, torch.dtype]] = []

    def forward(self, x):
        on = torch.is_autocast_enabled("cpu")
        self.seen.append((torch.get_autocast_dtype("cpu") if on else None, x.dtype))
        return x * 2


def test_a_profile_times_ops_under_the_autocast(tmp_path, monkeypatch):
    monkeypatch.setenv("REPLICA_CACHE_DIR", str(tmp_path))
    model = nn.Sequential(nn.Linear(16, 32), Probe())
    traced = trace(model, (torch.randn(8, 16),), leaf_modules=[Probe])
    model[1].seen.clear()  # what tracing saw
    profile(traced.module, (torch.randn(8, 16),), precision="bf16")
    assert model[1].seen and set(model[1].seen) == {(torch.bfloat16, torch.bfloat16)}
    keys = json.loads(next(tmp_path.glob("profile-*.json")).read_text())
    assert all(key.endswith("|autocast bf16") for key in keys)
    model[1].seen.clear()
    profile(traced.module, (torch.randn(8, 16),))  # fp32: timed afresh, outside autocast
    assert set(model[1].seen) == {(None, torch.float32)}


def test_a_profiled_plan_in_bf16(monkeypatch, tmp_path):
    monkeypatch.setenv("REPLICA_CACHE_DIR", str(tmp_path))
    case = models.mlp()
    p = make_plan(trace(case.model, case.example_inputs), case.model,
                  PlanRequest(mixed_precision="bf16", num_stages=2, cost="profile"))
    assert p.precision == "bf16" and all(s.forward_time_s > 0 for s in p.stages)
