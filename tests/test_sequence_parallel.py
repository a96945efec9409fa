"""Sequence parallelism in the plan (replica.partition.sequence_parallel, replica.planner.
sequence_parallel): which values between tensor-parallel blocks hold a token shard, what that
saves and costs, the keyword's checks, and the Plan JSON."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import replica
from replica.layout import Layout
from replica.partition.plan import Plan
from replica.partition.sequence_parallel import sequence_region
from replica.partition.tensor_parallel import find_blocks
from replica.partition.trace import trace
from tests import models


def _region(model: nn.Module, inputs: tuple, size: int = 2) -> dict[str, int]:
    traced = trace(model, inputs)
    blocks = [b for b in find_blocks(traced.graph, traced.module) if b.fits(size)]
    return dict(sequence_region(traced.graph, blocks, size))


def test_tiny_gpt_region_is_the_residual_stream_between_blocks() -> None:
    model, inputs, _, _ = models.tiny_gpt(4, num_layers=2)
    region = _region(model, inputs)
    assert set(region.values()) == {1}  # batch-first (batch, tokens, features): the tokens
    # the exits that reduce-scatter: the embedding's, each attention's and MLP's; not the head's (gathered)
    assert {"transformer_wte", "transformer_h_0_attn_c_proj", "transformer_h_0_mlp_c_proj",
            "transformer_h_1_attn_c_proj", "transformer_h_1_mlp_c_proj"} <= region.keys()
    assert "lm_head" not in region
    # the norms and residual adds between them, up to the head's entry
    assert {"transformer_h_0_ln_1", "transformer_h_0_ln_2", "transformer_ln_f", "add_1", "add_2"} <= region.keys()


class _Flat(nn.Module):
    """An MLP on (batch, features): no token dim to cut."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


def test_no_token_dim_no_region() -> None:
    assert _region(_Flat(), (torch.randn(8, 16),)) == {}


def test_sequence_parallel_needs_tensor_parallelism() -> None:
    model, inputs, _, _ = models.tiny_gpt(4, num_layers=1)
    with pytest.raises(replica.ConfigError, match="sequence_parallel=True.*tensor_parallel_size=1"):
        replica.plan(model, inputs, world_size=2, tensor_parallel_size=1, sequence_parallel=True)
    with pytest.raises(replica.ConfigError, match="sequence_parallel=True.*one process"):
        replica.plan(model, inputs, sequence_parallel=True)
    with pytest.raises(replica.ConfigError, match="sequence_parallel=True.*tuner may only use tensor_parallel_size=1"):
        replica.plan(model, inputs, world_size=2, sequence_parallel=True, device="cpu")  # one device per node
    with pytest.raises(replica.ConfigError, match="sequence_parallel must be"):
        replica.plan(model, inputs, world_size=2, sequence_parallel="yes")
    with pytest.raises(replica.ConfigError, match="tensor_parallel_size > 1"):
        Layout(schedule="1f1b", num_stages=1, pipeline_ranks=1, sequence_parallel=True)


def test_plan_holds_the_region_and_prices_it() -> None:
    model, inputs, _, _ = models.tiny_gpt(8, num_layers=2)
    common = dict(world_size=2, num_stages=1, num_microbatches=1, tensor_parallel_size=2, device="a100-80gb")
    sp = replica.plan(model, inputs, sequence_parallel=True, **common)
    tp = replica.plan(model, inputs, sequence_parallel=False, **common)
    assert sp.layout.sequence_parallel and not tp.layout.sequence_parallel and not tp.sequence_shards
    assert "sequence parallel" in sp.layout.describe() and "sequence parallel" in sp.summary()
    assert {n for n, _ in sp.sequence_shards} >= {"transformer_h_0_ln_1", "transformer_h_1_mlp_c_proj"}
    # the activations between blocks are held 1 / tp; each all-reduce (2 ring passes) becomes an
    # all-gather and a reduce-scatter (1 pass each) on the same tensor: twice the calls, as many
    # bytes on the links (the head's entry, all-reduced in backward, now gathered in forward too)
    assert sp.stages[0].activation_bytes < tp.stages[0].activation_bytes
    assert tp.stages[0].tensor_parallel_bytes < sp.stages[0].tensor_parallel_bytes \
        <= 2 * tp.stages[0].tensor_parallel_bytes
    assert tp.stages[0].tensor_parallel_s <= sp.stages[0].tensor_parallel_s
    again = Plan.from_json(sp.to_json())
    assert again.layout == sp.layout and again.sequence_shards == sp.sequence_shards


def test_planner_decides_when_left_open() -> None:
    model, inputs, _, _ = models.tiny_gpt(8, num_layers=2)
    plan = replica.plan(model, inputs, world_size=2, num_stages=1, num_microbatches=1, tensor_parallel_size=2,
                        device="a100-80gb")
    assert isinstance(plan.layout.sequence_parallel, bool)
    assert bool(plan.sequence_shards) == plan.layout.sequence_parallel


def test_at_scale_it_saves_memory_and_the_planner_takes_it() -> None:
    """A 2048-token GPT on a100s (meta weights, analytic): the tokens between blocks cut in two
    hold less and the collectives cost the same; left open, the planner takes it."""
    from examples.gpt.model import GPT, GPTConfig
    from replica.viz.report import render_html

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=1024, n_head=8, vocab_size=8192, block_size=2048))
    idx = torch.randint(0, 8192, (4, 2048), device="meta")
    common = dict(world_size=2, num_stages=1, num_microbatches=2, tensor_parallel_size=2, device="a100-80gb",
                  cost="analytic", mixed_precision="bf16")
    tp, sp, auto = (replica.plan(model, (idx,), sequence_parallel=s, **common) for s in (False, True, None))
    assert sp.stages[0].activation_bytes < 0.9 * tp.stages[0].activation_bytes
    assert sp.stages[0].tensor_parallel_s == pytest.approx(tp.stages[0].tensor_parallel_s, rel=0.05)
    assert sp.predicted_step_time_s <= tp.predicted_step_time_s
    assert auto.layout.sequence_parallel and auto.sequence_shards == sp.sequence_shards
    html = render_html(sp)
    assert "reduce-scatter of" in html and "sequence parallel" in html


def test_left_open_without_a_region_it_is_not_priced() -> None:
    torch.manual_seed(0)
    plan = replica.plan(_Flat(), (torch.randn(8, 16),), world_size=2, num_stages=1, num_microbatches=1,
                        tensor_parallel_size=2, device="a100-80gb")
    assert not plan.layout.sequence_parallel and not plan.sequence_shards
