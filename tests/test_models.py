"""The test models themselves: they run, trace, share what they claim, and split cleanly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.models import ALL_FACTORIES, ModelCase, random_dag, tiny_gpt, two_input_branchy

NAMES = sorted(ALL_FACTORIES)


def make(name: str) -> ModelCase:
    torch.manual_seed(0)
    return ALL_FACTORIES[name]()


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_reaches_every_parameter(name: str) -> None:
    model, inputs, target, loss_fn = make(name)
    loss = loss_fn(model(*inputs), target)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for param_name, p in model.named_parameters():
        assert p.dtype == torch.float32
        assert p.grad is not None, param_name
        assert torch.isfinite(p.grad).all(), param_name


@pytest.mark.parametrize("name", NAMES)
def test_fx_trace_matches_eager(name: str) -> None:
    model, inputs, _, _ = make(name)
    traced = torch.fx.symbolic_trace(model)
    assert torch.equal(traced(*inputs), model(*inputs))


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_under_manual_seed(name: str) -> None:
    a, b = make(name), make(name)
    for x, y in zip(a.example_inputs, b.example_inputs):
        assert torch.equal(x, y)
    assert torch.equal(a.target, b.target)
    for (n1, p1), (n2, p2) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("num_microbatches", [2, 4])
def test_microbatch_mean_loss_gives_whole_batch_gradients(name: str, num_microbatches: int) -> None:
    """What a pipeline computes (mean of equal micro-batch losses) equals the plain step:
    no op mixes samples across the batch."""
    model, inputs, target, loss_fn = make(name)
    split_model = copy.deepcopy(model)
    loss_fn(model(*inputs), target).backward()

    split_inputs = [x.chunk(num_microbatches) for x in inputs]
    for i, t in enumerate(target.chunk(num_microbatches)):
        out = split_model(*(xs[i] for xs in split_inputs))
        (loss_fn(out, t) / num_microbatches).backward()

    for (n, p), q in zip(model.named_parameters(), split_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("batch_size", [4, 6])
def test_batch_size_argument(batch_size: int) -> None:
    for factory in (tiny_gpt, two_input_branchy):
        model, inputs, target, loss_fn = factory(batch_size)
        assert all(x.shape[0] == batch_size for x in inputs) and target.shape[0] == batch_size
        assert model(*inputs).shape[0] == batch_size
    assert random_dag(1, 5, batch_size=batch_size).target.shape[0] == batch_size


@pytest.mark.parametrize("size_ops", [False, True])
def test_tiny_gpt_ties_lm_head_to_token_embedding(size_ops: bool) -> None:
    model = tiny_gpt(size_ops=size_ops).model
    assert model.lm_head.weight is model.transformer.wte.weight
    all_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert "lm_head.weight" in all_names and "transformer.wte.weight" in all_names
    assert len(all_names) == len(list(model.parameters())) + 1


def test_tiny_gpt_size_ops_flow_integers_through_the_graph() -> None:
    plain = torch.fx.symbolic_trace(tiny_gpt().model)
    sized = torch.fx.symbolic_trace(tiny_gpt(size_ops=True).model)
    assert not any(n.target == "size" for n in plain.graph.nodes)
    assert any(n.target == "size" for n in sized.graph.nodes)


def test_two_input_branchy_calls_shared_linear_twice() -> None:
    model = two_input_branchy().model
    traced = torch.fx.symbolic_trace(model)
    calls = [n for n in traced.graph.nodes if n.op == "call_module" and n.target == "shared"]
    assert len(calls) == 2
    order = list(traced.graph.nodes)
    assert order.index(calls[1]) - order.index(calls[0]) >= 8  # far apart
    assert sum(1 for n, _ in model.named_parameters() if n.startswith("shared.")) == 2
    assert [n.op for n in traced.graph.nodes if n.op == "placeholder"] == ["placeholder"] * 2


def test_unet_has_inplace_relu_groupnorm_and_long_skips() -> None:
    model = make("unet").model
    modules = list(model.modules())
    assert any(isinstance(m, torch.nn.ReLU) and m.inplace for m in modules)
    assert any(isinstance(m, torch.nn.GroupNorm) for m in modules)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in modules)
    order = list(torch.fx.symbolic_trace(model).graph.nodes)
    cats = [n for n in order if n.target is torch.cat]
    assert len(cats) == 3
    # every skip spans many ops: the concatenated encoder feature was made long before
    for cat in cats:
        first = min(order.index(a) for a in cat.args[0])
        assert order.index(cat) - first >= 5


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_nodes=st.integers(1, 24))
def test_random_dag_traces_runs_and_is_a_function_of_its_seed(seed: int, num_nodes: int) -> None:
    model, inputs, target, loss_fn = random_dag(seed, num_nodes)
    again = random_dag(seed, num_nodes)
    assert model.nodes == again.model.nodes
    for p, q in zip(model.parameters(), again.model.parameters()):
        assert torch.equal(p, q)
    traced = torch.fx.symbolic_trace(model)
    out = model(*inputs)
    assert torch.equal(traced(*inputs), out)
    loss_fn(out, target).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_random_dag_shares_linears_for_some_seeds() -> None:
    shared = [random_dag(seed, 16).model.num_shared_uses for seed in range(20)]
    assert any(shared)
    model = next(random_dag(s, 16).model for s in range(20) if shared[s])
    targets = [n.target for n in torch.fx.symbolic_trace(model).graph.nodes if n.op == "call_module"]
    assert len(targets) > len(set(targets))


def test_random_dag_leaves_global_generator_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    random_dag(5, 10)
    assert torch.equal(torch.rand(3), expected)
