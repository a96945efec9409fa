"""What crosses a cut under autocast (replica/partition/crossing.py): a value every reader casts leaves cast."""

from __future__ import annotations

import copy

import torch
from torch import nn

import replica
from replica.partition.crossing import crossing_bytes, crossing_dtype
from replica.partition.graph import OP, Node, TensorInfo
from tests.conftest import COMPUTE_BOUND
from tests.distributed.test_mixed_precision_distributed import microbatch_reference


def _node(name: str, target: str, dtype: str = "float32", compute: str = "") -> Node:
    return Node(name, OP, target, "", (), (TensorInfo((4, 8), dtype),), compute_dtype=compute)


def test_a_value_every_reader_casts_crosses_in_their_dtype():
    norm = _node("ln", "layer_norm")
    q, k = _node("q", "linear", "bfloat16", "bfloat16"), _node("k", "linear", "bfloat16", "bfloat16")
    add = _node("add", "add")
    assert crossing_dtype(norm, [q, k]) == "bfloat16" and crossing_bytes(norm, [q, k]) == 4 * 8 * 2
    assert crossing_dtype(norm, [q, add]) == "float32"  # a reader takes it in fp32: as it is
    assert crossing_dtype(norm, [_node("fc", "linear", "float32", "float32")]) == "float32"  # no autocast
    assert crossing_dtype(_node("x", "gelu", "float64"), [q]) == "float64"  # autocast leaves fp64 alone
    assert crossing_dtype(norm, [q, _node("h", "linear", "float16", "float16")]) == "float32"
    assert crossing_bytes(norm, []) == 4 * 8 * 4


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x).float())  # a norm of fp32 (a residual stream's dtype) in fp32, on any device


class _Blocks(nn.Module):
    """Linear -> LayerNorm blocks: each norm's fp32 output is read by the next linear alone."""

    def __init__(self, width: int = 32, num_blocks: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(width) for _ in range(num_blocks))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, width) -> (B, T, 8)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def casts(module: torch.fx.GraphModule) -> int:
    """How many values a stage module casts to bf16 (the cuts' casts)."""
    return sum(1 for n in module.graph.nodes if n.op == "call_method" and n.target == "to"
               and torch.bfloat16 in n.args)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), target)


def test_a_norm_output_crosses_in_bf16_with_the_plain_gradients():
    torch.manual_seed(0)
    model, x, y = _Blocks(), torch.randn(8, 16, 32), torch.randn(8, 16, 8)
    plain = copy.deepcopy(model)
    pm = replica.auto_parallel(model, (x,), num_stages=2, num_microbatches=4, schedule="1f1b", loss_fn=_mse,
                               mixed_precision="bf16", device=COMPUTE_BOUND)
    (sent,) = pm.plan.stages[0].outputs
    assert sent.dtype == "bfloat16" and sent.nbytes == x.numel() * 2, sent  # a LayerNorm's fp32 output, cast
    assert pm.plan.stages[1].inputs == (sent,)
    assert casts(pm.stages[0].module) == 1  # the stage casts it: the norm itself computes in fp32
    pm.train_step((x,), y)
    ref = microbatch_reference(plain, (x,), y, _mse, pm.plan, torch.bfloat16)
    want = dict(ref.named_parameters())
    for name, p in pm.named_parameters():  # one reader: the same arithmetic
        torch.testing.assert_close(p.grad, want[name].grad, rtol=2e-3, atol=1e-6, msg=lambda m: f"{name}: {m}")
    fp32 = replica.plan(plain, (x,), num_stages=2, num_microbatches=4, schedule="1f1b", device=COMPUTE_BOUND)
    assert fp32.stages[0].outputs[0].dtype == "float32"  # without autocast nothing is cast
