"""The MoE test model itself (tests/moe.py): both expert paths compute the same mixture as a
per-token reference, with the same gradients; routing and starving an expert do what they say."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests import moe

PATHS = ["loop", pytest.param("grouped_mm", marks=pytest.mark.skipif(
    not moe.HAS_GROUPED_MM, reason="no fp32 torch.nn.functional.grouped_mm on CPU in this torch"))]


def _per_token(block: moe.MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its top-k experts one at a time, weighed by its softmax scores."""
    B, S, D = x.shape
    tokens = x.reshape(-1, D)
    scores = F.softmax(block.router.gate(tokens), dim=-1)
    chosen = torch.topk(scores + block.router.expert_bias, block.config.top_k, dim=-1).indices
    rows = []
    for n in range(tokens.shape[0]):
        rows.append(sum(scores[n, e] * block.experts.expert(int(e), tokens[n:n + 1])[0] for e in chosen[n]))
    return torch.stack(rows).reshape(B, S, D)


@pytest.mark.parametrize("experts", PATHS)
@pytest.mark.parametrize("num_experts,top_k", [(4, 2), (3, 1)])
def test_the_block_is_the_per_token_mixture(experts: str, num_experts: int, top_k: int) -> None:
    block = moe.MoE(moe.MoEConfig(dim=8, hidden_dim=12, num_experts=num_experts, top_k=top_k, experts=experts))
    ref = copy.deepcopy(block)
    x = torch.randn(2, 5, 8)
    out, want = block(x), _per_token(ref, x)
    torch.testing.assert_close(out, want)
    grad = torch.randn_like(out)
    out.backward(grad)
    want.backward(grad)
    for (name, p), q in zip(block.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}: {m}")


def test_a_starved_expert_gets_no_token_and_routing_counts_slots() -> None:
    case = moe.moe_transformer(4, num_layers=2, num_experts=4, top_k=2)
    (ids,) = case.example_inputs
    counts = moe.routing(case.model, ids)
    assert len(counts) == 2 and all(sum(layer) == ids.numel() * 2 for layer in counts)
    moe.starve(case.model, 1, layer=1)
    assert moe.routing(case.model, ids)[1][1] == 0
    assert case.model(ids).shape == (4, 8, 32)


@pytest.mark.parametrize("bad,match", [(dict(top_k=5), "top_k"), (dict(experts="dense"), "experts"),
                                       (dict(dim=6), "multiples of 4"), (dict(num_experts=0), "num_experts")])
def test_config_errors_name_the_field(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        moe.MoEConfig(**bad)
