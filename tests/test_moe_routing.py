"""Mixtures of experts stay exact under any routing: traced on one batch, a pipelined MoE trains on
others, routed as the trace never saw (an expert without a token, one taking every token), with
the plain model's gradients. The plain stacked-weight MoE and tiny HF Mixtral, Qwen3-MoE,
DeepSeek-V3 (a dense first layer, a shared expert) and GPT-OSS; one process, 2 stages. Their
plans hold each MoE layer's expert block (replica/partition/experts.py), found on the exported graph."""

from __future__ import annotations

import copy

import pytest
import torch

import replica
from tests import grads, moe, moe_zoo
from tests.conftest import COMPUTE_BOUND
from tests.models import lm_loss

TOL = dict(rtol=1e-4, atol=1e-5)


def _loss(out, target):
    logits = out if isinstance(out, torch.Tensor) else out.logits
    loss = lm_loss(logits, target)
    aux = getattr(out, "aux_loss", None)
    return loss if aux is None else loss + 0.01 * aux


def _params(name: str):
    marks = pytest.mark.skip(reason=moe_zoo.missing(name)) if moe_zoo.missing(name) else ()
    return pytest.param(name, marks=marks)


def _batch(vocab: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, 8), generator=g), torch.randint(0, vocab, (n, 8), generator=g)


def _step(pm: replica.PipelineModel, plain: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, what: str) -> None:
    ref = copy.deepcopy(plain)
    want = _loss(ref(x), y)
    want.backward()
    loss = pm.train_step(x, y)
    torch.testing.assert_close(loss, want.detach(), **TOL, msg=lambda m: f"{what} loss: {m}")
    grads.assert_same_grads(pm, ref, context=f"{what}: ", **TOL)
    pm.zero_grad()


@pytest.mark.parametrize("name", [_params(n) for n in moe_zoo.MODELS])
def test_traced_on_one_routing_trains_exactly_on_any_other(name: str) -> None:
    plain, vocab = moe_zoo.build(name)
    traced_x, _ = _batch(vocab, 4, 1)
    traced = moe_zoo.routing(plain, traced_x)
    pm = replica.auto_parallel(copy.deepcopy(plain), (traced_x,), num_stages=2, num_microbatches=2,
                               loss_fn=_loss, device=COMPUTE_BOUND)
    layers = [1] if name == "deepseek_v3" else [0, 1]  # DeepSeek-V3's first layer is dense
    prefix = "" if name == "plain" else "model."
    where = "moe" if name == "plain" else "mlp"
    assert [b.path for b in pm.plan.experts] == [f"{prefix}layers.{i}.{where}.experts" for i in layers]
    assert all((b.num_experts, b.top_k, b.num_tokens) == (4, 2, 32) for b in pm.plan.experts)
    x, y = _batch(vocab, 6, 2)  # another size, another routing
    assert moe_zoo.routing(plain, x) != traced
    _step(pm, plain, x, y, "natural")
    for mode in ("starve", "hog"):
        moe_zoo.force(plain, name, mode)
        pm.load_state_dict(plain.state_dict())
        counts = moe_zoo.routing(plain, x)
        slots = [sum(layer) for layer in counts]
        if mode == "starve":
            assert all(0 in layer for layer in counts), counts  # an expert without a token
        else:
            assert all(max(layer) == s // 2 for layer, s in zip(counts, slots)), counts  # one on every token (top-2)
        _step(pm, plain, x, y, mode)


@pytest.mark.skipif(not moe.HAS_GROUPED_MM, reason="no fp32 torch.nn.functional.grouped_mm on CPU in this torch")
def test_the_grouped_mm_experts_train_exactly_when_one_expert_takes_every_token() -> None:
    torch.manual_seed(0)
    plain = moe.moe_transformer(1, experts="grouped_mm", num_experts=4, vocab_size=moe_zoo.VOCAB).model
    traced_x, _ = _batch(moe_zoo.VOCAB, 4, 1)
    pm = replica.auto_parallel(copy.deepcopy(plain), (traced_x,), num_stages=2, num_microbatches=2,
                               loss_fn=_loss, device=COMPUTE_BOUND)
    x, y = _batch(moe_zoo.VOCAB, 6, 2)
    moe_zoo.force(plain, "plain", "hog")
    pm.load_state_dict(plain.state_dict())
    _step(pm, plain, x, y, "hog")


@pytest.mark.skipif(moe_zoo.missing("mixtral") is not None, reason=str(moe_zoo.missing("mixtral")))
def test_the_routers_auxiliary_loss_flows_through_the_pipeline() -> None:
    """Mixtral's load-balancing loss (``output_router_logits``) is part of the loss: its gradient
    reaches every router (one micro-batch: the loss is not a mean over samples)."""
    plain, vocab = moe_zoo.build("mixtral")
    plain.config.output_router_logits = True
    traced_x, _ = _batch(vocab, 4, 1)
    pm = replica.auto_parallel(copy.deepcopy(plain), (traced_x,), num_stages=2, num_microbatches=1,
                               loss_fn=_loss, device=COMPUTE_BOUND)
    x, y = _batch(vocab, 6, 2)
    out = plain(x)
    assert out.aux_loss is not None and out.aux_loss.requires_grad
    _step(pm, plain, x, y, "aux")
