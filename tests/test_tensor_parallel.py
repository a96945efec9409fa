"""The tensor-parallel structures the planner finds in traced graphs (replica.partition.
tensor_parallel.find_blocks): which linears are cut by columns and rows, along which dim,
how many ways they can be cut, and what stays whole."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from replica.partition.plan import Plan
from replica.partition.tensor_parallel import ShardedBlock, find_blocks
from replica.partition.trace import trace
from tests import models


def _blocks(model: nn.Module, inputs: tuple, **kwargs) -> list[ShardedBlock]:
    traced = trace(model, inputs, **kwargs)
    return find_blocks(traced.graph, traced.module)


def _kinds(blocks: list[ShardedBlock]) -> list[str]:
    return [b.kind for b in blocks]


@pytest.mark.parametrize("size_ops", [False, True])
def test_tiny_gpt_cuts_fused_attention_mlp_embedding_and_tied_head(size_ops: bool) -> None:
    model, inputs, _, _ = models.tiny_gpt(4, num_layers=2, size_ops=size_ops)
    blocks = _blocks(model, inputs)
    assert _kinds(blocks) == ["embedding", "attention", "mlp", "attention", "mlp", "head"]
    attention, mlp = blocks[1], blocks[2]
    # the fused q/k/v projection, cut part by part (three parts), then the output projection by rows
    assert attention.parameters == (("transformer.h.0.attn.c_attn.weight", 0), ("transformer.h.0.attn.c_attn.bias", 0),
                                    ("transformer.h.0.attn.c_proj.weight", 1))
    assert attention.strided == (("transformer.h.0.attn.c_attn.weight", 3), ("transformer.h.0.attn.c_attn.bias", 3))
    assert attention.exits == ("transformer_h_0_attn_c_proj",) and attention.units == 4  # by heads
    assert attention.fits(2) and attention.fits(4) and not attention.fits(3) and not attention.fits(1)
    assert mlp.parameters == (("transformer.h.0.mlp.c_fc.weight", 0), ("transformer.h.0.mlp.c_fc.bias", 0),
                              ("transformer.h.0.mlp.c_proj.weight", 1))
    assert mlp.entries == ("transformer_h_0_ln_2",) and mlp.units == 128 and not mlp.strided
    # the tied weight is cut one way for both its uses: the embedding and the head, by vocabulary
    assert blocks[0].parameters == blocks[-1].parameters == (("transformer.wte.weight", 0),)
    assert blocks[-1].gathers and not blocks[0].gathers


def test_llama_attention_is_cut_by_kv_heads() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=False, tie_word_embeddings=True)
    blocks = _blocks(transformers.LlamaForCausalLM(cfg), (torch.randint(0, 64, (2, 8)),),
                     example_kwargs={"use_cache": False})
    assert _kinds(blocks) == ["embedding", "attention", "mlp", "attention", "mlp", "head"]
    attention, mlp = blocks[1], blocks[2]
    assert [p for p, _ in attention.parameters] == [f"model.layers.0.self_attn.{n}_proj.weight"
                                                    for n in ("q", "k", "v", "o")]
    assert [d for _, d in attention.parameters] == [0, 0, 0, 1]
    assert attention.units == 2  # two kv heads: at most 2 ways
    assert [d for _, d in mlp.parameters] == [0, 0, 1]  # gate and up by columns, down by rows


def test_gpt2_conv1d_weights_are_cut_along_their_own_dims() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=32, use_cache=False)
    blocks = _blocks(transformers.GPT2LMHeadModel(cfg), (torch.randint(0, 64, (2, 8)),),
                     example_kwargs={"use_cache": False})
    assert _kinds(blocks) == ["embedding", "attention", "mlp", "head"]
    # Conv1D keeps (in, out) weights: columns are dim 1, rows dim 0
    assert dict(blocks[2].parameters) == {"transformer.h.0.mlp.c_fc.weight": 1, "transformer.h.0.mlp.c_fc.bias": 0,
                                          "transformer.h.0.mlp.c_proj.weight": 0}
    assert dict(blocks[1].strided) == {"transformer.h.0.attn.c_attn.weight": 3, "transformer.h.0.attn.c_attn.bias": 3}


class _Mixing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.norm = nn.LayerNorm(16)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down(self.norm(self.up(x)))  # a norm over the cut features: not cut
        return x + self.b(torch.softmax(self.a(x), dim=-1))  # a softmax over them: not cut either


def test_ops_that_mix_the_cut_dim_leave_their_linears_whole() -> None:
    assert find_blocks(trace(_Mixing(), (torch.randn(2, 8),)).graph) == []
    traced = trace(_Mixing(), (torch.randn(2, 8),))
    assert find_blocks(traced.graph, traced.module) == []


def test_blocks_round_trip_through_the_plan_json() -> None:
    import replica

    model, inputs, _, _ = models.tiny_gpt(4, num_layers=1)
    plan = replica.plan(model, inputs, world_size=2, num_stages=1, tensor_parallel_size=2, device="a100-80gb")
    assert plan.layout.tensor_parallel_size == 2 and plan.tensor_parallel
    again = Plan.from_json(plan.to_json())
    assert again.tensor_parallel == plan.tensor_parallel and again.layout == plan.layout
