"""Shared fixtures: a device spec under which compute, not latency, decides the cuts."""

from __future__ import annotations

import pytest
import torch

import replica

# Tiny tensors run ~50x slower with two OpenMP threads than with one on these 2-core
# machines, and the multi-process tests give each rank one core anyway.
torch.set_num_threads(1)

# Imported here, before any test starts ranks, so that the fork server every rank forks from holds it
# (replica.launch): about 40 ranks build Hugging Face models, each saved 2.8 CPU-s of importing it.
try:
    import transformers.modeling_utils  # noqa: F401
except ImportError:  # the test extra is not installed: those tests skip
    pass

# Tiny test models are latency-bound on a real CPU spec (the best plan keeps them whole);
# this spec makes ops expensive and transfers free so plans cut through the middle of
# every model, across skips and tied weights, which is what the transparency tests need.
COMPUTE_BOUND = replica.DeviceSpec(
    name="compute-bound-test", flops=1e6, half_flops=1e6, memory_bandwidth=1e9, memory_bytes=1e12,
    link_bandwidth=1e12, link_latency_s=0.0, op_overhead_s=1e-6,
)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
