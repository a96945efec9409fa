"""Per-block activation checkpointing (full, selective, the first k blocks): the plain model's gradients."""

from __future__ import annotations

import copy

import pytest
import torch.fx as fx

from replica.partition.blocks import block_of, find_blocks, repeated_containers
from replica.stage.checkpoint import checkpoint_blocks, checkpointed_modules
from replica.stage.remat import rebuildable_norms
from replica.stage.weightgrad import WeightGrads, collecting, defer_linear_weight_grads
from tests import models
from tests.grads import assert_same_grads


def test_blocks_are_the_repeated_modules():
    paths = ["transformer.wte", "transformer.h.0.ln_1", "transformer.h.0.attn.c_attn", "transformer.h.1.mlp",
             "transformer.ln_f", "lm_head", "heads.0"]
    assert repeated_containers(paths) == {"transformer.h"}
    assert find_blocks(paths) == ("transformer.h.0", "transformer.h.1")
    assert block_of("transformer.h.12.mlp.experts.3.w1") == "transformer.h.12"
    assert block_of("heads.0", repeated_containers(paths)) is None


@pytest.mark.parametrize("selective", [False, True], ids=["full", "selective"])
@pytest.mark.parametrize("defer", [False, True], ids=["autograd", "split-backward"])
def test_a_checkpointed_graph_gives_the_plain_gradients(selective, defer):
    model, inputs, target, loss_fn = models.tiny_gpt(4, num_layers=3)
    ref = copy.deepcopy(model)
    loss_fn(ref(*inputs), target).backward()
    gm = fx.symbolic_trace(model)
    if defer:
        defer_linear_weight_grads(gm)
    rebuildable_norms(gm)
    keys = list(gm.state_dict())
    assert checkpoint_blocks(gm, ["transformer.h.0", "transformer.h.2"], selective=selective) == 2
    assert len(checkpointed_modules(gm)) == 2 and list(gm.state_dict()) == keys  # no new names
    sink = WeightGrads() if defer else None
    with collecting(sink):
        loss_fn(gm(*inputs), target).backward()
    if sink is not None:
        sink.apply()
    assert_same_grads(model, ref)
