"""Tests of tracing a model into Replica's graph (``replica.partition.trace``)."""

from __future__ import annotations

import inspect
import resource

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import replica
from replica.partition.graph import INPUT, OP, OUTPUT
from replica.partition.trace import normalize_inputs, trace
from tests import models


def line_of(fn, text: str) -> str:
    """``file:line`` of the first line of ``fn``'s source containing ``text``."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(fn)}:{start + offset}"


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, x):
        return torch.relu(self.lin(x)) * 2


class Small(nn.Module):
    """ids (B, 6) -> (B, 6, 5): embedding, a sub-module, a buffer, a linear and a matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.inner = Inner()
        self.head = nn.Linear(16, 10, bias=False)
        self.register_buffer("scale", torch.full((16,), 0.5))
        self.register_buffer("proj", torch.randn(10, 5))

    def forward(self, ids):
        h = self.inner(self.emb(ids)) * self.scale  # (B, 6, 16)
        return self.head(h) @ self.proj  # (B, 6, 5)


def small_graph():
    return trace(Small(), (torch.randint(0, 10, (4, 6)),)).graph


# --------------------------------------------------------------------------- structure


def test_inputs_first_output_last():
    kinds = [n.kind for n in small_graph()]
    assert kinds[0] == INPUT and kinds[-1] == OUTPUT and set(kinds[1:-1]) == {OP}


def test_topological_order():
    g = small_graph()
    for i, n in enumerate(g):
        assert all(g.index(a) < i for a in n.inputs), n.name


def test_users_mirror_inputs():
    g = small_graph()
    assert all(n.name in g[a].users for n in g for a in n.inputs)


def test_targets():
    assert [n.target for n in small_graph()][1:-1] == ["embedding", "linear", "relu", "mul", "mul", "linear", "matmul"]


def test_shapes_and_dtypes():
    g = small_graph()
    assert g.input_nodes[0].outputs == (replica.partition.graph.TensorInfo((4, 6), "int64"),)
    assert g["inner_lin"].outputs[0].shape == (4, 6, 16)
    assert g["inner_lin"].outputs[0].dtype == "float32"
    assert g.output_node.outputs[0].shape == (4, 6, 5)


def test_python_values_have_no_tensor_outputs():
    model, inputs, _, _ = models.tiny_gpt(2, size_ops=True)
    g = trace(model, inputs).graph
    sizes = [n for n in g if n.target == "size"]
    assert sizes and all(n.outputs == () and not n.is_tensor for n in sizes)


def test_module_path_of_ops_inside_sub_modules():
    g = small_graph()
    assert g["inner_lin"].module_path == "inner.lin"
    assert g["relu"].module_path == "inner"  # a function called inside Inner.forward
    assert g["mul"].module_path == "inner"
    assert g["mul_1"].module_path == ""  # top-level op
    assert g["head"].module_path == "head"


def test_module_path_in_module_list():
    model, inputs, _, _ = models.tiny_gpt(2)
    paths = {n.module_path for n in trace(model, inputs).graph}
    assert {"transformer.h.0.attn", "transformer.h.1.mlp.c_fc", "lm_head"} <= paths


# --------------------------------------------------------------------------- FLOPs


def test_flops_of_linear():
    assert small_graph()["inner_lin"].flops == 2 * (4 * 6) * 16 * 8  # 2·M·N·K


def test_flops_of_matmul():
    assert small_graph()["matmul"].flops == 2 * (4 * 6) * 5 * 10


def test_flops_of_batched_matmul():
    class BMM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(7, 3))

        def forward(self, a, b):
            return (a @ b) @ self.w  # (2, 5, 4) @ (2, 4, 7) @ (7, 3)

    g = trace(BMM(), (torch.randn(2, 5, 4), torch.randn(2, 4, 7))).graph
    assert [n.flops for n in g.op_nodes] == [2 * 2 * 5 * 7 * 4, 2 * (2 * 5) * 3 * 7]


def test_flops_of_conv():
    g = trace(nn.Conv2d(3, 8, 3, padding=1), (torch.randn(2, 3, 10, 10),)).graph
    assert g.op_nodes[0].flops == 2 * (2 * 10 * 10) * 8 * (3 * 3 * 3)


def test_elementwise_ops_have_no_flops_but_move_bytes():
    g = small_graph()
    assert g["relu"].flops == 0
    assert g["relu"].bytes_accessed == 2 * 4 * 6 * 16 * 4  # read and write fp32


def test_total_flops():
    g = small_graph()
    assert g.total_flops == sum(n.flops for n in g) > 0


# --------------------------------------------------------------------------- parameters


def test_parameters_recorded_on_their_ops():
    g = small_graph()
    assert g["inner_lin"].parameters == ("inner.lin.weight", "inner.lin.bias")
    assert g["emb"].parameters == ("emb.weight",)
    assert g["relu"].parameters == ()


def test_every_parameter_listed_once():
    model = Small()
    g = trace(model, (torch.randint(0, 10, (4, 6)),)).graph
    assert {n for n, p in g.parameters.items() if not p.is_buffer} == {n for n, _ in model.named_parameters()}
    assert g.parameter_bytes == sum(p.nbytes for p in model.parameters())


def test_buffers_marked():
    g = small_graph()
    assert g.parameters["scale"].is_buffer and g.parameters["proj"].is_buffer
    assert not g.parameters["head.weight"].is_buffer
    assert g["mul_1"].buffers == ("scale",) and g["mul_1"].parameters == ()
    assert g["matmul"].buffers == ("proj",)


def test_tied_parameters_are_one_with_aliases():
    model, inputs, _, _ = models.tiny_gpt(2)
    g = trace(model, inputs).graph
    tied = g.parameters["transformer.wte.weight"]
    assert tied.aliases == ("lm_head.weight",)
    assert "lm_head.weight" not in g.parameters
    assert g.canonical("lm_head.weight") == "transformer.wte.weight"
    assert g["lm_head"].parameters == ("transformer.wte.weight",)
    assert g["transformer_wte"].parameters == ("transformer.wte.weight",)


def test_canonical_of_unknown_name():
    with pytest.raises(KeyError):
        small_graph().canonical("nope.weight")


def test_module_called_twice_shares_parameters():
    model, inputs, _, _ = models.two_input_branchy(4)
    g = trace(model, inputs).graph
    users = [n.name for n in g if "shared.weight" in n.parameters]
    assert len(users) == 2 and "shared.weight" in g.parameters


# --------------------------------------------------------------------------- leaf modules


class Gate(nn.Module):
    """Untraceable: Python control flow on a tensor value."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return x


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Sequential(Gate(), nn.Tanh())])

    def forward(self, x):
        return self.blocks[0](self.pre(x))


def test_leaf_module_by_class_keeps_it_whole():
    g = trace(Gated(), (torch.randn(2, 4),), leaf_modules=[Gate]).graph
    node = g["blocks_0_0"]
    assert node.target == "gate" and node.module_path == "blocks.0.0"
    assert node.parameters == ("blocks.0.0.lin.weight", "blocks.0.0.lin.bias")
    assert node.flops == 2 * 2 * 4 * 4


def test_leaf_module_by_qualified_name_keeps_it_whole():
    g = trace(Gated(), (torch.randn(2, 4),), leaf_modules=["blocks.0.0"]).graph
    assert [n.target for n in g.op_nodes] == ["linear", "gate", "tanh"]


def test_leaf_module_by_name_leaves_other_instances_traced():
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = Inner(), Inner()

        def forward(self, x):
            return self.second(self.first(x)[..., :8])

    g = trace(Two(), (torch.randn(2, 8),), leaf_modules=["first"]).graph
    assert g["first"].target == "inner" and g["first"].parameters == ("first.lin.weight", "first.lin.bias")
    assert "second_lin" in [n.name for n in g]


def test_leaf_module_instance_is_not_silently_ignored():
    model = Gated()
    try:
        g = trace(model, (torch.randn(2, 4),), leaf_modules=[model.blocks[0][0]]).graph
    except replica.ConfigError:
        return  # refusing an instance, with a message, is fine too
    assert g["blocks_0_0"].target == "gate"


def test_leaf_module_name_that_names_no_module():
    with pytest.raises(replica.ConfigError, match="blocks.9"):
        trace(Gated(), (torch.randn(2, 4),), leaf_modules=["blocks.9"])


def test_leaf_modules_none_keeps_nothing_whole_and_a_bare_class_is_named():
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert [n.name for n in trace(mlp, (torch.randn(2, 4),), leaf_modules=None).graph] == \
        [n.name for n in trace(mlp, (torch.randn(2, 4),)).graph]
    with pytest.raises(replica.ConfigError, match=r"leaf_modules must be a list.*leaf_modules=\[Gate\]"):
        trace(Gated(), (torch.randn(2, 4),), leaf_modules=Gate)


def test_leaf_module_output_shape_recorded():
    g = trace(Gated(), (torch.randn(3, 4),), leaf_modules=[Gate]).graph
    assert g["blocks_0_0"].outputs[0].shape == (3, 4)


# --------------------------------------------------------------------------- meta and fake


def test_meta_model_20k_linear_allocates_nothing():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(20_000, 20_000), nn.ReLU(), nn.Linear(20_000, 10))  # 1.6 GB of fp32
    g = trace(model, (torch.empty(4, 20_000, device="meta"),)).graph
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grew_mib < 400, f"tracing a meta model grew the peak RSS by {grew_mib:.0f} MiB"
    assert g["_0"].flops == 2 * 4 * 20_000 * 20_000
    assert g.output_node.outputs[0].shape == (4, 10)
    assert g.parameters["0.weight"].shape == (20_000, 20_000)
    assert all(p.device.type == "meta" for p in model.parameters())


def test_meta_model_takes_real_inputs_as_shapes():
    with torch.device("meta"):
        model = nn.Linear(6, 3)
    g = trace(model, (torch.randn(5, 6),)).graph
    assert g.output_node.outputs[0].shape == (5, 3)


def test_real_params_with_meta_inputs_use_fake_tensors():
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    before_weights = [p.detach().clone() for p in model.parameters()]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    g = trace(model, (torch.empty(2**20, 64, device="meta"),)).graph  # 1 GiB of activations if real
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grew_mib < 400, f"tracing with meta inputs grew the peak RSS by {grew_mib:.0f} MiB"
    assert g["_0"].outputs[0].shape == (2**20, 256)
    assert g["_0"].flops == 2 * 2**20 * 256 * 64
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before_weights, model.parameters()))


def test_real_model_and_inputs_allocate_no_activations():
    """Shapes come from fake tensors even when everything is real: a full-batch forward would
    leave its activations' holes in the allocator for the rest of the run."""
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    x = torch.randn(2**18, 64)  # 64 MiB of input, 256 MiB per activation if run for real
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    g = trace(model, (x,)).graph
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grew_mib < 150, f"tracing real inputs grew the peak RSS by {grew_mib:.0f} MiB"
    assert g["_0"].outputs[0].shape == (2**18, 256)
    assert g["_0"].flops == 2 * 2**18 * 256 * 64


class ReadsAValue(nn.Module):
    """Reads a number out of a tensor: fake tensors cannot, so the graph runs for real."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.bn(self.lin(x)) * x.abs().max().item()


def test_a_graph_fake_tensors_cannot_run_runs_for_real():
    g = trace(ReadsAValue(), (torch.randn(5, 4),)).graph
    assert g.output_node.outputs[0].shape == (5, 3)
    assert g["lin"].flops == 2 * 5 * 3 * 4


@pytest.mark.parametrize("model", [nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)), ReadsAValue()],
                         ids=["fake", "real"])
def test_tracing_leaves_batch_norm_statistics_alone(model):
    bn = model[1] if isinstance(model, nn.Sequential) else model.bn
    model.train()
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    trace(model, (torch.randn(16, 4) * 5 + 3,))
    for k, v in bn.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_real_params_with_fake_inputs():
    with FakeTensorMode():
        x = torch.empty(7, 8)
    g = trace(Inner(), (x,)).graph
    assert g.output_node.outputs[0].shape == (7, 16)
    assert g["lin"].flops == 2 * 7 * 16 * 8


def test_meta_tiny_gpt_matches_real():
    model, inputs, _, _ = models.tiny_gpt(2)
    real = trace(model, inputs).graph
    meta = trace(model, (inputs[0].to("meta"),)).graph
    assert [(n.name, n.outputs, n.flops) for n in real] == [(n.name, n.outputs, n.flops) for n in meta]


# --------------------------------------------------------------------------- errors


def test_untraceable_sub_module_names_path_class_line_and_fix():
    with pytest.raises(replica.TraceError) as info:
        trace(Gated(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert "'blocks.0.0'" in msg and "(Gate)" in msg
    assert line_of(Gate.forward, "if x.sum() > 0") in msg
    assert "leaf_modules=[Gate]" in msg
    assert "control flow" in msg


class NanoGPT(nn.Module):
    """nanoGPT's forward prologue: ``assert t <= block_size`` on a traced size."""

    def __init__(self, block_size: int = 8) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(16, 4)
        self.wpe = nn.Embedding(block_size, 4)

    def forward(self, idx):
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        return self.wte(idx) + self.wpe(pos)


def test_nanogpt_assert_points_at_the_user_line():
    with pytest.raises(replica.TraceError) as info:
        trace(NanoGPT(), (torch.randint(0, 16, (2, 8)),), tracer="fx")
    msg = str(info.value)
    assert "NanoGPT" in msg
    assert line_of(NanoGPT.forward, "assert t <= self.block_size") in msg
    assert "leaf_modules" in msg and "assert" in msg


def test_nanogpt_assert_is_traced_by_export_when_fx_fails():
    assert trace(NanoGPT(), (torch.randint(0, 16, (2, 8)),)).tracer == "export"


def test_trace_error_is_a_value_error():
    with pytest.raises(ValueError):
        trace(Gated(), (torch.randn(2, 4),))


def test_trace_error_keeps_the_cause():
    with pytest.raises(replica.TraceError) as info:
        trace(Gated(), (torch.randn(2, 4),))
    assert info.value.__cause__ is not None


def test_run_failure_is_a_trace_error():
    with pytest.raises(replica.TraceError, match="shapes and dtypes"):
        trace(nn.Linear(4, 2), (torch.randn(3, 5),))


class TwoArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, a, b):
        return self.lin(a + b)


@pytest.mark.parametrize("num_inputs", [0, 1, 3])
def test_wrong_arity_names_expected_arguments(num_inputs):
    with pytest.raises(replica.ConfigError) as info:
        trace(TwoArgs(), tuple(torch.randn(2, 4) for _ in range(num_inputs)))
    msg = str(info.value)
    assert "TwoArgs.forward(a, b)" in msg and f"has {num_inputs}" in msg and "(a, b,)" in msg


def test_non_tensor_input_is_a_config_error():
    with pytest.raises(replica.ConfigError, match=r"example_inputs\[1\] is a int"):
        trace(TwoArgs(), (torch.randn(2, 4), 3))


def test_non_module_is_a_config_error():
    with pytest.raises(replica.ConfigError, match="torch.nn.Module"):
        trace(lambda x: x, (torch.randn(2),))


def test_list_and_single_tensor_inputs():
    x = torch.randn(2, 4)
    assert normalize_inputs(TwoArgs(), [x, x])[0] == (x, x)
    assert normalize_inputs(nn.Linear(4, 4), x)[0] == (x,)


# --------------------------------------------------------------------------- fixed defaults


class WithDefaults(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask=None, scale: float = 2.0):
        return self.lin(x) * scale


def test_defaults_not_given_are_fixed():
    model, x = WithDefaults(), torch.randn(3, 4)
    traced = trace(model, (x,))
    assert traced.concrete_args == {"mask": None, "scale": 2.0}
    torch.testing.assert_close(traced.module(x), model(x))


def test_given_inputs_are_not_fixed():
    model, x = WithDefaults(), torch.randn(3, 4)
    assert trace(model, (x, torch.ones(3, 4))).concrete_args == {"scale": 2.0}


def test_inputs_first_even_with_fixed_defaults():
    g = trace(WithDefaults(), (torch.randn(3, 4),)).graph
    kinds = [n.kind for n in g]
    first_op = kinds.index(OP)
    assert INPUT not in kinds[first_op:], [(n.name, n.kind) for n in g]


def test_varargs_accept_more_inputs():
    class Var(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, *rest):
            return self.lin(x)

    x = torch.randn(2, 4)
    assert normalize_inputs(Var(), (x, x, x))[0] == (x, x, x)


def test_functional_model_traced_through():
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return F.gelu(F.linear(x, self.w))

    g = trace(Functional(), (torch.randn(2, 4),)).graph
    assert [n.target for n in g.op_nodes] == ["linear", "gelu"]
    assert g.op_nodes[0].parameters == ("w",)


class _ValueBranch(nn.Module):
    """Reads a value out of a tensor: fake tensors cannot run it, so it is recorded on real values."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l1(x) * x.abs().sum().item()


def test_a_model_built_alike_is_recorded_once_and_alike(monkeypatch):
    from replica.partition import record as recording

    monkeypatch.setattr(recording, "_RECORDS", recording.Kept(16))
    runs = []
    real = recording._run_recorder
    monkeypatch.setattr(recording, "_run_recorder", lambda *a: runs.append(1) or real(*a))

    def nodes(traced):
        return [(n.name, n.outputs, n.flops, n.value_kind) for n in traced.graph.nodes]

    first = trace(*models.tiny_gpt(8)[:2])
    again = trace(*models.tiny_gpt(8)[:2])  # other weights, the same shapes: recorded once
    assert len(runs) == 1 and nodes(again) == nodes(first)
    smaller = trace(*models.tiny_gpt(4)[:2])
    assert len(runs) == 2 and nodes(smaller) != nodes(first)  # another batch: recorded again
    with torch.device("meta"):
        on_meta = models.tiny_gpt(8)[0]
    trace(on_meta, (torch.randint(0, 10, models.tiny_gpt(8)[1][0].shape, device="meta"),))
    assert len(runs) == 3  # meta weights: another device, recorded again
    assert 0 < len(recording._RECORDS) <= recording._RECORDS.size


def test_a_graph_run_on_real_values_is_recorded_every_time(monkeypatch):
    from replica.partition import record as recording

    monkeypatch.setattr(recording, "_RECORDS", recording.Kept(16))
    for _ in range(2):
        traced = trace(_ValueBranch(), (torch.randn(3, 4),))
    assert len(recording._RECORDS) == 0 and traced.graph.nodes
