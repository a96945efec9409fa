"""Sequence parallelism on gloo ranks: tensor parallelism at tp=2 with the norms, dropouts and
residual adds between its blocks on shards of the tokens (each block's entry all-gathered,
its exit reduce-scattered). Every gradient (gathered) equals the plain model's on the same
batch, the example GPT and Hugging Face Llama (grouped-query attention, traced by
torch.export), fp32 to round-off and bf16 autocast within its round-off; under bf16 the
collectives of the blocks' borders move bf16, not fp32 (a block's entry enters in autocast's
dtype); the Trainer trains and checkpoints with it and resumes without it. On four ranks:
with FSDP2 (2-D), and across two pipeline stages (a token shard leaving a stage is gathered
whole) under zero-bubble, recompute and rebuilt norms. One spawned job per world size."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import replica
from tests.conftest import COMPUTE_BOUND
from tests.distributed.test_distributed import STEP_TIMEOUT_S, _run
from tests.distributed.test_tensor_parallel_distributed import CASES, _check, _portable

pytestmark = pytest.mark.distributed

SP = dict(tensor_parallel_size=2, num_stages=1, num_microbatches=2, schedule="1f1b", sequence_parallel=True)


class CollectiveDtypes(TorchDispatchMode):
    """Counts the functional collectives DTensor dispatches by (name, dtype of the tensor sent)."""

    def __enter__(self) -> Counter:
        super().__enter__()
        self.counts: Counter = Counter()
        return self.counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func.namespace == "_c10d_functional" and not func.__name__.startswith(("wait", "_wrap")):
            self.counts[f"{func.__name__.split('.')[0]} {str(args[0].dtype).removeprefix('torch.')}"] += 1
        return func(*args, **(kwargs or {}))


def _dtypes(name: str, sequence_parallel: bool) -> dict:
    """The collectives of one bf16 training step, by dtype."""
    model, inputs, target, loss_fn, extra = CASES[name]()
    pm = replica.auto_parallel(model, inputs, loss_fn=loss_fn, device=COMPUTE_BOUND, timeout_s=STEP_TIMEOUT_S,
                               mixed_precision="bf16", **{**SP, "sequence_parallel": sequence_parallel}, **extra)
    with CollectiveDtypes() as counts:
        pm.train_step(inputs, target, **extra.get("example_kwargs", {}))
    return dict(counts)


def _trainer(directory: str) -> dict:
    """The Trainer at tp=2 with sequence parallelism trains an epoch and checkpoints whole tensors
    under the original names (the plain model loads them); one without it resumes from there."""
    from replica.defaults import default_config
    from replica.train.trainer import get_trainer
    from tests import models

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return models.tiny_gpt(8, num_layers=2).model

    _, inputs, target, loss_fn = models.tiny_gpt(16, num_layers=2)

    def trainer(sequence_parallel: bool) -> object:
        config = default_config(batch_size=8, num_stages=1, num_microbatches=2, tensor_parallel_size=2,
                                sequence_parallel=sequence_parallel, checkpoint_dir=directory, progress=False,
                                timeout_s=STEP_TIMEOUT_S)
        return get_trainer(config, build(), loss_fn, lambda params: torch.optim.Adam(params, lr=1e-2))

    first = trainer(True)
    first.train_dataset(inputs[0], target, epochs=1)
    saved = first.pipeline.state_dict()
    plain = build()
    replica.load_into_plain_model(directory, plain)
    want = plain.state_dict()
    resumed = trainer(False)
    resumed.train_dataset(inputs[0], target, epochs=1)  # resumes at the end of epoch 1
    again = resumed.pipeline.state_dict()
    return {"same": all(torch.equal(v, want[k]) for k, v in saved.items() if k in want),
            "kept": all(torch.equal(v, want[k]) for k, v in again.items() if k in want),
            "layouts": [t.pipeline.plan.layout.describe() for t in (first, resumed)]}


def sp_job(rank: int, world: int, runs: tuple[tuple[str, str | None, dict], ...], directory: str = "") -> bytes:
    torch.set_num_threads(1)
    checks = [_check(name, precision, layout) for name, precision, layout in runs]
    if world != 2:
        return _portable({"checks": checks})
    return _portable({"checks": checks, "sp": _dtypes("example", True), "tp": _dtypes("example", False),
                      "trainer": _trainer(directory)})


def test_sequence_parallel_gradients_on_two_ranks(tmp_path) -> None:
    runs = (("example", None, SP), ("example", "bf16", SP), ("llama", None, SP), ("llama", "bf16", SP))
    reports = _run(sp_job, 2, runs, str(tmp_path / "ckpt"))
    for r in reports:
        t = r["trainer"]
        assert t["same"] and t["kept"], t
        assert "sequence parallel" in t["layouts"][0] and "sequence parallel" not in t["layouts"][1], t
    for run in zip(*(r["checks"] for r in reports)):
        assert len({r["loss"] for r in run}) == 1, run
    for r in reports[0]["checks"]:
        assert "sequence parallel" in r["layout"], r
        assert r["cut"] > 0 and r["local"] < r["whole"], r
        # the blocks' exits reduce-scatter their partial sums into token shards, their entries gather them
        assert r["comms"].get("reduce_scatter_tensor", 0) > 0, r
    example = reports[0]["checks"][0]["comms"]
    # per micro-batch (2): the embedding's, 2 attention and 2 MLP exits reduce-scattered in forward,
    # 2 + 2 entries and the head's reduce-scattered in backward; the head's logits all-gathered
    assert example["reduce_scatter_tensor"] == 2 * (5 + 5), example
    sp, tp = reports[0]["sp"], reports[0]["tp"]
    # bf16, per micro-batch (2): the 4 blocks' exits and the 5 entries' gradients (cast to bf16 on
    # entering) move bf16; only the embedding's output is fp32, as in the plain model (autocast
    # leaves embeddings alone). Without sequence parallelism the same as all-reduces.
    assert sp["reduce_scatter_tensor bfloat16"] == 2 * (4 + 5) and sp["reduce_scatter_tensor float32"] == 2, sp
    assert tp["all_reduce bfloat16"] == 2 * (4 + 5) and tp["all_reduce float32"] == 2, tp
    # with it, the norms' replicated weights and biases (5 LayerNorms) sum their gradients once a step
    assert sp["all_reduce float32"] == 10, sp


def test_sequence_parallel_with_fsdp_and_pipeline_on_four_ranks() -> None:
    fsdp = {**SP, "data_parallel_size": 2, "sharded_data_parallel": "zero3"}
    pipeline = {**SP, "num_stages": 2, "schedule": "zb-h1"}  # deferred weight gradients inside the blocks
    runs = (("example", None, fsdp), ("llama", "bf16", fsdp), ("gpt", None, pipeline),
            ("gpt", None, {**SP, "num_stages": 2, "recompute": True}),  # each stage's forward again in backward
            ("gpt", None, {**SP, "num_stages": 2, "recompute": "pointwise"}))  # norms that can rebuild
    reports = _run(sp_job, 4, runs)
    for run in zip(*(r["checks"] for r in reports)):
        assert len({r["loss"] for r in run}) == 1, run
    for r in reports[0]["checks"]:
        assert "x 2 tensor (sequence parallel)" in r["layout"] and r["comms"]["reduce_scatter_tensor"] > 0, r
    example, llama, gpt = reports[0]["checks"][:3]
    assert "2 data (zero3 sharded)" in example["layout"] and 0.25 <= example["local"] / example["whole"] < 0.5
    assert "2 pipeline" in gpt["layout"], gpt
