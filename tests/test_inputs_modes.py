"""Keyword and nested inputs, shapes that vary, train()/eval() and seeded dropout, both tracers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import replica
from replica.partition.trace import trace
from tests.conftest import COMPUTE_BOUND

TRACERS = ["fx", "export"]


class Masked(nn.Module):
    """Token ids, an optional keyword mask and a flag; dropout as a module and as a function."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.drop = nn.Dropout(p)
        self.p = p
        self.head = nn.Linear(16, 32)

    def forward(self, ids, mask=None, scale: float = 1.0, extra=None):
        h = self.drop(self.embed(ids))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
            h = F.dropout(h, self.p, self.training)
        if mask is not None:
            h = h * mask.unsqueeze(-1)
        return self.head(h) * scale


def token_loss(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def batch(n: int = 8, t: int = 6):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (n, t), generator=g)
    mask = torch.ones(n, t)
    mask[:, -2:] = 0
    return ids, mask, torch.randint(0, 32, (n, t), generator=g)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_keyword_inputs_give_exact_gradients(tracer, schedule):
    torch.manual_seed(0)
    model = Masked()
    ref = copy.deepcopy(model)
    ids, mask, target = batch()
    kwargs = {"mask": mask, "scale": 2.0}
    token_loss(ref(ids, **kwargs), target).backward()
    pm = replica.auto_parallel(model, (ids,), example_kwargs=kwargs, num_stages=3, num_microbatches=4,
                               schedule=schedule, loss_fn=token_loss, device=COMPUTE_BOUND, tracer=tracer)
    assert pm.input_spec.keywords == ("mask",) and pm.input_spec.constants == {"scale": 2.0}
    pm.train_step(ids, target, mask=mask)
    expected = grads(ref)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, expected[name], msg=lambda m: f"{name}: {m}")
    # the same keywords as a dict, like model(**batch); and the forward
    model.zero_grad()
    pm.train_step({"ids": ids, "mask": mask}, target)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, expected[name], msg=lambda m: f"{name}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(pm(ids, mask=mask), ref(ids, **kwargs))


def test_keywords_in_any_order_follow_the_signature():
    """fx makes placeholders in signature order; the graph's inputs follow example_kwargs."""
    torch.manual_seed(0)
    model = Masked()
    ids, mask, _ = batch()
    extra = torch.zeros(8, 6)
    traced = trace(model, (ids,), example_kwargs={"extra": extra, "mask": mask}, tracer="fx")
    names = [n.target for n in traced.module.graph.nodes if n.op == "placeholder"][:3]
    assert names == ["ids", "extra", "mask"]
    torch.testing.assert_close(traced.module(ids, extra, mask), model(ids, mask=mask, extra=extra))


@pytest.mark.parametrize("tracer", TRACERS)
def test_keyword_mismatches_name_the_keyword(tracer):
    model = Masked()
    ids, mask, target = batch()
    pm = replica.auto_parallel(model, (ids,), example_kwargs={"mask": mask, "scale": 2.0}, num_stages=2,
                               num_microbatches=2, loss_fn=token_loss, device=COMPUTE_BOUND, tracer=tracer)
    with pytest.raises(replica.ConfigError, match=r"lack \['mask'\]"):
        pm.train_step(ids, target)
    with pytest.raises(replica.ConfigError, match=r"add \['bogus'\]"):
        pm.train_step(ids, target, mask=mask, bogus=mask)
    with pytest.raises(replica.ConfigError, match=r"scale=3.0 but .* traced with scale=2.0"):
        pm.train_step(ids, target, mask=mask, scale=3.0)
    pm.train_step(ids, target, mask=mask, scale=2.0)  # the traced value is accepted


def test_bad_example_kwargs_are_config_errors():
    ids, mask, _ = batch()
    with pytest.raises(replica.ConfigError, match="no such parameter"):
        trace(Masked(), (ids,), example_kwargs={"musk": mask})
    with pytest.raises(replica.ConfigError, match="already give by position"):
        trace(Masked(), (ids, mask), example_kwargs={"mask": mask})
    with pytest.raises(replica.ConfigError, match=r"example_kwargs\['mask'\] is a list"):
        trace(Masked(), (ids,), example_kwargs={"mask": [mask, 3]})


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, pair, features):
        h = torch.relu(self.a(pair[0])) + torch.relu(self.b(pair[1]))
        return self.c(h * features["gate"])


@pytest.mark.parametrize("tracer", TRACERS)
def test_nested_inputs(tracer):
    torch.manual_seed(0)
    model = Nested()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    pair = (torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g))
    features = {"gate": torch.rand(8, 8, generator=g)}
    target = torch.randint(0, 3, (8,), generator=g)
    F.cross_entropy(ref(pair, features), target).backward()
    pm = replica.auto_parallel(model, (pair, features), num_stages=2, num_microbatches=4,
                               loss_fn=F.cross_entropy, device=COMPUTE_BOUND, tracer=tracer)
    pm.train_step((pair, features), target)
    expected = grads(ref)
    for name, grad in grads(model).items():
        torch.testing.assert_close(grad, expected[name], msg=lambda m: f"{name}: {m}")


def test_export_keeps_sequence_dynamic_and_names_fixed_dims():
    class FixedLength(nn.Module):  # reshapes with a literal length: export must fix dim 1
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(6, 6)

        def forward(self, x):
            if x.shape[1] == 6:  # fx cannot trace a branch on a shape
                x = x * 2
            return self.l(x.reshape(-1, 6)).reshape(x.shape[0], 6)

    ids, mask, target = batch()
    pm = replica.auto_parallel(Masked(), (ids,), example_kwargs={"mask": mask}, num_stages=2, num_microbatches=2,
                               loss_fn=token_loss, device=COMPUTE_BOUND, tracer="export")
    assert pm.input_spec.fixed_dims == ({}, {})
    with torch.no_grad():  # a shorter sequence and a smaller batch, without re-tracing
        out = pm(ids[:4, :3], mask=mask[:4, :3])
    assert out.shape == (4, 3, 32)

    x = torch.randn(8, 6)
    pm = replica.auto_parallel(FixedLength(), (x,), num_stages=2, num_microbatches=2,
                               loss_fn=F.mse_loss, device=COMPUTE_BOUND)
    assert pm.input_spec.fixed_dims == ({1: 6},)
    with pytest.raises(replica.ConfigError, match=r"size 4 in dimension 1.*fixed that dimension at 6"):
        pm(torch.randn(8, 4))


# --------------------------------------------------------------------------- modes and dropout


@pytest.mark.parametrize("tracer", TRACERS)
def test_eval_turns_dropout_off(tracer):
    torch.manual_seed(0)
    model = Masked(p=0.3)
    ids, mask, target = batch()
    pm = replica.auto_parallel(model, (ids,), num_stages=2, num_microbatches=2, loss_fn=token_loss,
                               device=COMPUTE_BOUND, tracer=tracer)
    assert any(s.uses_rng for s in pm.stages)
    pm.eval()
    assert not model.training
    with torch.no_grad():
        torch.testing.assert_close(pm(ids), model(ids))
    pm.train()
    with torch.no_grad():
        assert not torch.allclose(pm(ids), model.eval()(ids))


@pytest.mark.parametrize("tracer", TRACERS)
def test_dropout_is_reproducible_under_any_schedule(tracer):
    torch.manual_seed(0)
    model = Masked(p=0.3)
    ids, _, target = batch()
    results = []
    for schedule, recompute in [("gpipe", False), ("1f1b", False), ("1f1b", True), ("zb-h1", False)]:
        model.zero_grad()
        pm = replica.auto_parallel(model, (ids,), num_stages=2, num_microbatches=4, schedule=schedule,
                                   recompute=recompute, loss_fn=token_loss, device=COMPUTE_BOUND, tracer=tracer)
        torch.manual_seed(123)
        loss = pm.train_step(ids, target)
        results.append((loss, grads(model)))
    for loss, g in results[1:]:
        torch.testing.assert_close(loss, results[0][0])
        for name, grad in g.items():
            torch.testing.assert_close(grad, results[0][1][name], msg=lambda m: f"{name}: {m}")
    torch.manual_seed(124)
    assert pm.train_step(ids, target) != results[-1][0]


def test_model_without_random_ops_leaves_the_generator_alone():
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x, target = torch.randn(4, 4), torch.tensor([0, 1, 0, 1])
    pm = replica.auto_parallel(plain, (x,), num_stages=2, num_microbatches=2, loss_fn=F.cross_entropy,
                               device=COMPUTE_BOUND)
    assert not any(s.uses_rng for s in pm.stages)
    before = torch.random.get_rng_state()
    pm.train_step(x, target)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_frozen_batch_norm_mode_is_a_loud_error():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).eval()
    x = torch.randn(8, 4)
    pm = replica.auto_parallel(model, (x,), num_stages=2, num_microbatches=2, loss_fn=F.cross_entropy,
                               device=COMPUTE_BOUND, tracer="export")
    with torch.no_grad():
        torch.testing.assert_close(pm(x), model(x))
    pm.train()
    with pytest.raises(replica.PipelineError, match=r"traced in eval mode.*model.eval\(\)"):
        pm(x)
