"""The expert-block finder (replica/partition/experts.py): each MoE layer's stacked experts, their
router's top-k, dispatch and combine, on fx and exported graphs; nothing in a dense model. (The
Hugging Face MoE models' blocks are checked on the plans of tests/test_moe_routing.py, which
trace them anyway.)"""

from __future__ import annotations

import pytest
import torch

from replica.partition.experts import ExpertBlock, find_expert_blocks
from replica.partition.trace import trace
from tests import models, moe_zoo


def _blocks(name: str, tracer: str) -> tuple[ExpertBlock, ...]:
    model, vocab = moe_zoo.build(name)
    return find_expert_blocks(trace(model, (torch.randint(0, vocab, (4, 8)),), tracer=tracer).graph)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_the_plain_moe_has_one_expert_block_per_layer(tracer: str) -> None:
    blocks = _blocks("plain", tracer)
    assert [b.path for b in blocks] == ["layers.0.moe.experts", "layers.1.moe.experts"]
    for b in blocks:
        assert (b.num_experts, b.top_k, b.num_tokens, b.token_bytes) == (4, 2, 32, 16 * 4)
        assert b.parameters == tuple(f"{b.path}.{w}" for w in ("w1", "w2", "w3"))
        assert b.router.startswith("topk") and b.exit.startswith("index_add") and b.flops > 0
        assert b.fits(2) and b.fits(4) and not b.fits(3)
        assert ExpertBlock.from_dict(b.__dict__) == b


def test_a_dense_model_has_none() -> None:
    case = models.tiny_gpt(4)
    assert find_expert_blocks(trace(case.model, case.example_inputs).graph) == ()
