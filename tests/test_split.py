"""Tests of splitting a traced model into stage modules (``replica.partition.split``)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import replica
import replica.partition.partitioner as partitioner
from replica.partition.cost import CostModel
from replica.partition.graph import fingerprint
from replica.partition.split import split
from replica.partition.trace import trace
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.grads import assert_same_grads


def plan_with_bounds(graph, bounds, monkeypatch, *, num_microbatches=2, schedule="1f1b"):
    """The plan that cuts ``graph`` at node positions ``bounds`` (the solver bypassed)."""
    return partitioner.partition(graph, CostModel(COMPUTE_BOUND), num_stages=len(bounds) - 1,
                                 num_microbatches=num_microbatches, schedule=schedule, bounds=bounds)


def cut_before(graph, *names):
    """Bounds putting a cut right before each named node."""
    return (0, *(graph.index(n) for n in names), len(graph))


def chain(stages, inputs):
    """Run the stage modules one after another, as the local runtime's forward does."""
    values, out = {}, None
    for s in stages:
        args = inputs if s.is_first else tuple(values[n] for n in s.input_names)
        out = s.module(*args)
        if not s.is_last:
            assert isinstance(out, tuple) and len(out) == len(s.output_names)
            values.update(zip(s.output_names, out))
    return out


def grads_match(model, inputs, target, loss_fn, monkeypatch, bounds_of, num_microbatches=2):
    """Train one step pipelined at forced cuts and compare every gradient with the plain model."""
    ref = copy.deepcopy(model)
    loss_fn(ref(*inputs), target).backward()
    traced = trace(model, inputs)
    plan = plan_with_bounds(traced.graph, bounds_of(traced.graph), monkeypatch, num_microbatches=num_microbatches)
    pm = replica.auto_parallel(model, inputs, plan=plan, loss_fn=loss_fn)
    pm.train_step(inputs, target)
    assert_same_grads(model, ref)
    with torch.no_grad():
        torch.testing.assert_close(pm(*inputs), ref(*inputs))
    return pm


# --------------------------------------------------------------------------- parameters


@pytest.fixture
def gpt_stages():
    model, inputs, _, _ = models.tiny_gpt(4)
    traced = trace(model, inputs)
    plan = replica.plan(model, inputs, num_stages=3, device=COMPUTE_BOUND)
    return model, inputs, plan, split(traced, plan)


def test_stage_parameters_keep_original_names_and_objects(gpt_stages):
    model, _, _, stages = gpt_stages
    for s in stages:
        for name, p in s.module.named_parameters(remove_duplicate=False):
            assert p is model.get_parameter(name), name


def test_stages_hold_every_parameter(gpt_stages):
    model, _, _, stages = gpt_stages
    held = {id(p) for s in stages for p in s.module.parameters()}
    assert held == {id(p) for p in model.parameters()}


def test_tied_weight_is_one_parameter_in_two_stages(gpt_stages):
    model, _, _, stages = gpt_stages
    first = dict(stages[0].module.named_parameters())["transformer.wte.weight"]
    last = dict(stages[-1].module.named_parameters())["lm_head.weight"]
    assert first is last is model.lm_head.weight


def test_stage_parameters_match_the_plan(gpt_stages):
    model, _, plan, stages = gpt_stages
    canonical = {id(p): n for n, p in model.named_parameters()}
    for s, sp in zip(stages, plan.stages):
        names = {canonical[id(p)] for p in s.module.parameters()}
        assert names == {n for n in sp.parameter_names if n in canonical.values()}


def test_buffers_keep_original_names_and_objects():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.register_buffer("scale", torch.full((4,), 3.0))

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)) * self.scale)

    model = Scaled()
    traced = trace(model, (torch.randn(2, 4),))
    plan = replica.plan(model, (torch.randn(2, 4),), num_stages=2, device=COMPUTE_BOUND)
    buffers = {n: b for s in split(traced, plan) for n, b in s.module.named_buffers()}
    assert buffers["scale"] is model.scale


# --------------------------------------------------------------------------- wiring


def test_stage_flags_and_indices(gpt_stages):
    _, _, _, stages = gpt_stages
    assert [s.stage_index for s in stages] == [0, 1, 2]
    assert [s.is_first for s in stages] == [True, False, False]
    assert [s.is_last for s in stages] == [False, False, True]


def test_wiring_follows_the_plan(gpt_stages):
    _, _, plan, stages = gpt_stages
    for s, sp in zip(stages, plan.stages):
        assert s.input_names == tuple(b.name for b in sp.inputs)
        assert s.input_sources == tuple(b.source_stage for b in sp.inputs)
        assert s.output_names == tuple(b.name for b in sp.outputs)
        assert s.output_destinations == tuple(b.destination_stages for b in sp.outputs)


def test_chained_stages_equal_the_model(gpt_stages):
    model, inputs, _, stages = gpt_stages
    with torch.no_grad():
        torch.testing.assert_close(chain(stages, inputs), model(*inputs))


def test_python_values_cross_stages():
    model, inputs, _, _ = models.tiny_gpt(2, size_ops=True)
    traced = trace(model, inputs)
    plan = replica.plan(model, inputs, num_stages=4, device=COMPUTE_BOUND)
    with torch.no_grad():
        torch.testing.assert_close(chain(split(traced, plan), inputs), model(*inputs))


class Skip(nn.Module):
    """A projection read again at the very end: a skip over every block."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h0 = self.inp(x)
        h = h0
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h + h0)


def test_long_skip_goes_straight_to_the_far_stage(monkeypatch):
    model, x = Skip(), torch.randn(6, 4)
    traced = trace(model, (x,))
    plan = plan_with_bounds(traced.graph, cut_before(traced.graph, "blocks_1", "blocks_3"), monkeypatch)
    first, middle, last = split(traced, plan)
    assert "inp" in last.input_names and "inp" not in middle.input_names
    assert last.input_sources[last.input_names.index("inp")] == 0
    assert first.output_destinations[first.output_names.index("inp")] == (2,)
    with torch.no_grad():
        torch.testing.assert_close(chain([first, middle, last], (x,)), model(x))


def test_long_skip_gradients(monkeypatch):
    grads_match(Skip(), (torch.randn(6, 4),), torch.randn(6, 2), F.mse_loss, monkeypatch,
                lambda g: cut_before(g, "blocks_1", "blocks_3"))


# --------------------------------------------------------------------------- in-place at a cut


class InPlaceAtCut(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.relu, self.b = nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 2)

    def forward(self, x):
        h = self.a(x)
        if self.how == "module":
            h = self.relu(h)
        elif self.how == "functional":
            h = F.relu(h, inplace=True)
        elif self.how == "method":
            h = h.relu_()
        elif self.how == "view":
            h = h.view(-1, 2, 3).mul_(2.0).flatten(1)
        elif self.how == "contiguous":  # returns its input itself when already contiguous
            h = h.contiguous().mul_(2.0)
        elif self.how == "float":  # returns its input itself when already fp32
            h = h.float().add_(1.0)
        return self.b(h)


def first_after_a(graph):
    return cut_before(graph, graph.nodes[graph.index("a") + 1].name)


@pytest.mark.parametrize("how", ["module", "functional", "method"])
def test_in_place_op_on_a_received_input_is_cloned(how, monkeypatch):
    model, x = InPlaceAtCut(how), torch.randn(6, 4)
    traced = trace(model, (x,))
    stages = split(traced, plan_with_bounds(traced.graph, first_after_a(traced.graph), monkeypatch))
    assert [n.target for n in stages[1].module.graph.nodes if n.op == "call_function"][:1] == [torch.clone]


@pytest.mark.parametrize("how", ["module", "functional", "method"])
def test_in_place_op_at_a_cut_keeps_gradients(how, monkeypatch):
    grads_match(InPlaceAtCut(how), (torch.randn(6, 4),), torch.randn(6, 2), F.mse_loss, monkeypatch,
                first_after_a)


@pytest.mark.parametrize("how", ["view", "contiguous", "float"])
def test_in_place_op_through_an_alias_of_a_received_input(how, monkeypatch):
    grads_match(InPlaceAtCut(how), (torch.randn(6, 4),), torch.randn(6, 2), F.mse_loss, monkeypatch,
                first_after_a)


class MutatedThenReadLater(nn.Module):
    """``h`` is written in place by the ReLU, then read again at the end (eager sees the ReLU'd ``h``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c, self.b = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        r = F.relu(h, inplace=True)
        return self.b(torch.tanh(self.c(r))) + h  # h is r here


def test_in_place_write_is_seen_by_a_later_stage(monkeypatch):
    # a in stage 0, the in-place relu in stage 1, the read of h in stage 2
    grads_match(MutatedThenReadLater(), (torch.randn(6, 4),), torch.randn(6, 4), F.mse_loss, monkeypatch,
                lambda g: cut_before(g, "relu", "b"))


def test_unet_in_place_relu_at_every_cut(monkeypatch):
    model, inputs, target, loss_fn = models.unet(4)
    grads_match(model, inputs, target, loss_fn, monkeypatch, lambda g: cut_before(g, "enc1_2"))


def test_no_clone_without_in_place(gpt_stages):
    _, _, _, stages = gpt_stages
    assert all(n.target is not torch.clone for s in stages for n in s.module.graph.nodes)


# --------------------------------------------------------------------------- output structure


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return {"logits": self.b(h), "hidden": h}


class TupleOut(DictOut):
    def forward(self, x):
        out = super().forward(x)
        return out["logits"], (out["hidden"], x.shape[0])


def test_last_stage_returns_a_dict():
    model, x = DictOut(), torch.randn(6, 4)
    traced = trace(model, (x,))
    out = chain(split(traced, replica.plan(model, x, num_stages=2, device=COMPUTE_BOUND)), (x,))
    assert set(out) == {"logits", "hidden"}
    torch.testing.assert_close(out["logits"], model(x)["logits"])


def test_pipeline_returns_a_dict(monkeypatch):
    def loss_fn(out, target):
        return F.mse_loss(out["logits"], target) + out["hidden"].pow(2).mean()

    pm = grads_match(DictOut(), (torch.randn(6, 4),), torch.randn(6, 3), loss_fn, monkeypatch,
                     lambda g: cut_before(g, "b"), num_microbatches=3)
    assert set(pm(torch.randn(6, 4))) == {"logits", "hidden"}


def test_pipeline_returns_a_tuple():
    model, x = TupleOut(), torch.randn(6, 4)
    pm = replica.auto_parallel(model, x, num_stages=2, num_microbatches=2, device=COMPUTE_BOUND)
    logits, (hidden, n) = pm(x)
    torch.testing.assert_close(logits, model(x)[0])
    assert hidden.shape == (6, 4)


# --------------------------------------------------------------------------- wrong plan


def test_plan_for_another_graph_names_both_fingerprints(gpt_stages):
    _, _, plan, _ = gpt_stages
    model, inputs, _, _ = models.mlp(4)
    traced = trace(model, inputs)
    with pytest.raises(replica.ConfigError) as info:
        split(traced, plan)
    msg = str(info.value)
    assert plan.graph_fingerprint in msg and fingerprint(traced.graph) in msg
    assert "replica.plan(" in msg


def test_plan_without_fingerprint_missing_nodes(gpt_stages):
    _, _, plan, _ = gpt_stages
    model, inputs, _, _ = models.mlp(4)
    with pytest.raises(replica.ConfigError, match="places no stage for nodes"):
        split(trace(model, inputs), dataclasses.replace(plan, graph_fingerprint=""))


# --------------------------------------------------------------------------- parameters no op reads


class Masked(nn.Module):
    """Embeddings with a ``mask_token`` used only when a mask is passed (as in a ViT), a
    head with a ``temperature`` never used, and a top-level ``spare`` and buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.mask_token = nn.Parameter(torch.zeros(16))
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)
        self.head.temperature = nn.Parameter(torch.ones(()))
        self.spare = nn.Parameter(torch.ones(2))
        self.register_buffer("table", torch.arange(4.0))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:  # (B, 6) -> (B, 3)
        h = self.embed(x)
        if mask is not None:
            h = torch.where(mask[:, None], self.mask_token, h)
        return self.head(self.body(h))


def masked_pipeline(tracer: str = "fx", num_stages: int = 2):
    model, x, y = Masked(), torch.randn(8, 6), torch.randn(8, 3)
    pm = replica.auto_parallel(copy.deepcopy(model), (x,), num_stages=num_stages, num_microbatches=2,
                               device=COMPUTE_BOUND, tracer=tracer, loss_fn=F.mse_loss)
    return model, pm, x, y


def stage_holding(pm, name):
    return [s.stage_index for s in pm.plan.stages if name in s.parameter_names]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_unused_parameters_belong_to_a_stage(tracer):
    model, pm, _, _ = masked_pipeline(tracer)
    assert sorted(n for n, _ in pm.named_parameters()) == sorted(n for n, _ in model.named_parameters())
    assert pm.state_dict().keys() == model.state_dict().keys()
    last = pm.plan.num_stages - 1
    assert stage_holding(pm, "head.temperature") == stage_holding(pm, "head.weight") == [last]
    assert stage_holding(pm, "mask_token") == stage_holding(pm, "spare") == stage_holding(pm, "table") == [0]


def test_unused_parameter_has_no_grad_and_the_others_are_exact():
    model, pm, x, y = masked_pipeline()
    F.mse_loss(model(x), y).backward()
    optimizer = torch.optim.Adam(pm.parameters(), lr=0.1)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(pm.model.mask_token) in held and id(pm.model.head.temperature) in held
    pm.train_step((x,), y)
    want = dict(model.named_parameters())
    assert_same_grads(pm, want)
    assert pm.model.mask_token.grad is None and pm.model.head.temperature.grad is None
    optimizer.step()  # a parameter without a gradient is skipped, as in the plain model


def test_state_dict_with_unused_parameters_round_trips():
    model, pm, x, _ = masked_pipeline(num_stages=3)
    with torch.no_grad():
        pm.model.mask_token.fill_(3.0)
    plain = Masked()
    plain.load_state_dict(pm.state_dict())  # strict: every key, unused ones too
    torch.testing.assert_close(plain.mask_token, torch.full((16,), 3.0))
    again = replica.auto_parallel(Masked(), (x,), plan=pm.plan, loss_fn=F.mse_loss)
    again.load_state_dict(pm.state_dict())
    torch.testing.assert_close(dict(again.named_parameters())["mask_token"], torch.full((16,), 3.0))


def _unused_in_ranks(rank: int, world_size: int) -> tuple[list[str], list[str]]:
    torch.manual_seed(0)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    pm = replica.auto_parallel(Masked(), (x,), num_stages=2, num_microbatches=2, device=COMPUTE_BOUND,
                               loss_fn=F.mse_loss, timeout_s=30)
    pm.train_step((x,), y)
    return sorted(n for n, _ in pm.named_parameters()), sorted(pm.state_dict())


@pytest.mark.distributed
def test_unused_parameters_live_on_one_rank():
    from replica.launch import run_local

    ranks = run_local(_unused_in_ranks, 2, timeout_s=60)
    params = [set(names) for names, _ in ranks]
    assert not params[0] & params[1]
    assert params[0] | params[1] == {n for n, _ in Masked().named_parameters()}
    assert {"mask_token", "spare"} <= params[0] and "head.temperature" in params[1]
    assert set(ranks[0][1]) | set(ranks[1][1]) == set(Masked().state_dict())
