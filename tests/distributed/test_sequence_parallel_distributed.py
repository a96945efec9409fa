"""Sequence parallelism on gloo ranks: tensor parallelism at tp=2 with the norms, dropouts and
residual adds between its blocks on shards of the tokens (each block's entry all-gathered,
its exit reduce-scattered). Every gradient (gathered) equals the plain model's on the same
batch, the example GPT and Hugging Face Llama (grouped-query attention, traced by
torch.export), fp32 to round-off and bf16 autocast within its round-off; one spawned job
runs every case."""

from __future__ import annotations

import pytest

from tests.distributed.test_distributed import _run
from tests.distributed.test_tensor_parallel_distributed import _check, _portable

pytestmark = pytest.mark.distributed

SP = dict(tensor_parallel_size=2, num_stages=1, num_microbatches=2, schedule="1f1b", sequence_parallel=True)


def sp_job(rank: int, world: int, runs: tuple[tuple[str, str | None, dict], ...]) -> bytes:
    return _portable([_check(name, precision, layout) for name, precision, layout in runs])


def test_sequence_parallel_gradients_on_two_ranks() -> None:
    runs = (("example", None, SP), ("example", "bf16", SP), ("llama", None, SP), ("llama", "bf16", SP))
    reports = _run(sp_job, 2, runs)
    for run in zip(*reports):
        assert len({r["loss"] for r in run}) == 1, run
    for r in reports[0]:
        assert "sequence parallel" in r["layout"], r
        assert r["cut"] > 0 and r["local"] < r["whole"], r
        # the blocks' exits reduce-scatter their partial sums into token shards, their entries gather them
        assert r["comms"].get("reduce_scatter_tensor", 0) > 0, r
