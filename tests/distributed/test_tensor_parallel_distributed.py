"""Tensor parallelism on gloo ranks (DTensor): the planner cuts MLPs, attention heads, the token
embedding and the head across the tensor-parallel ranks of each stage, and every gradient
(gathered with ``full_tensor()``) is the plain model's on the whole batch: tp=2 alone,
tp=2 × 2 pipeline stages and tp=2 × 2 replicas; our GPT (tied embedding and head), Hugging
Face GPT-2 and Llama (grouped-query attention, traced by torch.export), under 1F1B and
zero-bubble schedules, in fp32 and bf16 autocast; a model with an op the planner cannot cut
still trains, that part replicated; a checkpoint of a tp=2 run holds whole tensors under the
original names and resumes at tp=1."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import replica
from replica.parallel.compile import compile_backend
from replica.parallel.fsdp import local_tensor
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.distributed.test_distributed import STEP_TIMEOUT_S, _portable, _run
from tests.distributed.test_mixed_precision_distributed import microbatch_reference
from tests.distributed.test_sharded_distributed import _gpt, _llama

pytestmark = pytest.mark.distributed


def _gpt2() -> tuple:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1)
    ids, target = torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)
    return model, (ids,), target, lambda out, y: models.lm_loss(out.logits, y), {"example_kwargs": {"use_cache": False}}


class Unshardable(nn.Module):
    """A pair of linears with a cumulative sum over the features between them (no cut keeps
    it exact without gathering), then an ordinary MLP the planner can cut."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down(torch.cumsum(self.up(x), dim=-1))
        return self.fc2(torch.relu(self.fc1(x)))


def _unshardable() -> tuple:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    return Unshardable(), (x,), y, models.mse_loss, {}


def _example_gpt() -> tuple:
    """The example GPT: a fused q/k/v projection split in three, scaled_dot_product_attention."""
    from examples.gpt.model import GPT, GPTConfig, loss_fn

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 64, (8, 17), generator=g)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32))
    return model, (data[:, :-1].contiguous(),), data[:, 1:].contiguous(), loss_fn, {}


CASES = {"gpt": _gpt, "gpt2": _gpt2, "llama": _llama, "unshardable": _unshardable, "example": _example_gpt}


class CollectiveCounter(TorchDispatchMode):
    """Counts the functional collectives DTensor dispatches (``_c10d_functional``), by name."""

    def __enter__(self) -> Counter:
        super().__enter__()
        self.counts: Counter = Counter()
        return self.counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func.namespace == "_c10d_functional" and not func.__name__.startswith("wait"):
            self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _check(name: str, precision: str | None, layout: dict) -> dict:
    """Train one step with tensor parallelism; compare every gradient this rank holds (gathered)
    with the plain model's, count what it holds, take an Adam step."""
    model, inputs, target, loss_fn, extra = CASES[name]()
    plain = copy.deepcopy(model)
    with compile_backend("aot_eager"):  # where the layout compiles: the same graphs without inductor's C++ build
        pm = replica.auto_parallel(model, inputs, loss_fn=loss_fn, device=COMPUTE_BOUND, timeout_s=STEP_TIMEOUT_S,
                                   mixed_precision=precision, **layout, **extra)
    kwargs = extra.get("example_kwargs", {})
    with CollectiveCounter() as counts:  # what DTensor sends: the blocks' borders only, no weight gathered
        loss = pm.train_step(inputs, target, **kwargs)
    if precision is None:
        ref = copy.deepcopy(plain)
        loss_fn(ref(*inputs, **kwargs), target).backward()
        rtol = atol = None
        with torch.no_grad():  # inference through the cut stages: the plain model's output
            got, want_out = pm(*inputs, **kwargs), plain(*inputs, **kwargs)
        got, want_out = (getattr(o, "logits", o) for o in (got, want_out))
        torch.testing.assert_close(got, want_out, msg=lambda m: f"{name} output: {m}")
    else:  # micro-batch by micro-batch under the same autocast; the partial sums add in bf16
        ref = microbatch_reference(plain, inputs, target, loss_fn, pm.plan, torch.bfloat16, **kwargs)
        rtol, atol = 5e-2, 5e-2
    want = dict(ref.named_parameters())
    cut = whole = local = 0
    for pname, p in pm.named_parameters():
        assert p.grad is not None, pname
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        tol = {} if rtol is None else dict(rtol=rtol, atol=atol * float(want[pname].grad.abs().max()))
        torch.testing.assert_close(grad, want[pname].grad, msg=lambda m: f"{name} {pname}: {m}", **tol)
        mine = local_tensor(p.detach()).numel()
        cut += mine < p.numel()
        whole += p.numel()
        local += mine
    torch.optim.Adam(pm.parameters(), lr=1e-3).step()
    state, plain_state = pm.state_dict(), plain.state_dict()  # whole tensors under the original names
    held = {n for n, _ in pm.named_parameters()}
    assert held <= set(state) & set(plain_state), sorted(held - set(state))
    assert all(state[k].shape == plain_state[k].shape and type(state[k]) is torch.Tensor for k in held)
    with pytest.raises(replica.ConfigError, match="1 keys are not the model's"):
        pm.load_state_dict({**plain_state, "no.such.weight": torch.zeros(1)})
    pm.load_state_dict(plain_state)  # back to the plain model's weights: each rank copies its part
    for pname, p in pm.named_parameters():
        loaded = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
        assert torch.equal(loaded, plain_state[pname]), pname
    return {"case": name, "loss": float(loss), "cut": cut, "whole": whole, "local": local,
            "blocks": sorted(b.kind for b in pm.plan.tensor_parallel), "layout": pm.plan.layout.describe(),
            "tp": pm.plan.layout.tensor_parallel_size, "comms": dict(counts)}


def tp_job(rank: int, world: int, runs: tuple[tuple[str, str | None, dict], ...]) -> bytes:
    return _portable([_check(name, precision, layout) for name, precision, layout in runs] + [_strided_split(world)])


def _strided_split(world: int) -> list[str]:
    """A fused q/k/v output held part by part (``_StridedShard``, as the plan cuts it), split in its
    three parts by Replica's split: each part's placement (``Shard``: each rank its heads of each
    part, no message; torch's own split would gather it whole, ``Replicate``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from replica.parallel.tensor_parallel import _placement, _strided, split

    mesh = init_device_mesh("cpu", (world,))
    whole = torch.arange(2 * 3 * 4 * world, dtype=torch.float32).reshape(2, 3 * 4 * world)
    fused = distribute_tensor(whole, mesh, [_placement(1, 3)], src_data_rank=None)
    assert _strided(1, 3) is not None and fused.placements == (_strided(1, 3),)
    parts = split(fused, 4 * world, 1)
    torch.testing.assert_close(torch.cat([p.full_tensor() for p in parts], 1), whole, rtol=0, atol=0)
    return [type(p.placements[0]).__name__ + f"({p.placements[0].dim})" for p in parts]


def _tp_run(world: int, runs: tuple[tuple[str, str | None, dict], ...]) -> list[list[dict]]:
    """Each rank's reports of ``runs``, after checking its fused q/k/v split: each rank its share of
    each part (torch 2.13's ``is_shard()`` is False for ``_StridedShard``: until the split stopped
    asking it, every rank gathered q, k and v whole and computed every head)."""
    reports = _run(tp_job, world, runs)
    for r in reports:
        got = r.pop()
        assert got == ["Shard(1)"] * 3, got
    return reports


def _assert_cut(reports: list[list[dict]]) -> None:
    for run in zip(*reports):
        assert len({r["loss"] for r in run}) == 1, run
        for r in run:
            assert r["tp"] == 2 and "2 tensor" in r["layout"], r
            assert r["cut"] > 0 and r["local"] < r["whole"], r  # each rank holds a part of the cut weights


def test_tensor_parallel_alone_on_two_ranks() -> None:
    one = dict(tensor_parallel_size=2, num_stages=1, num_microbatches=2, schedule="1f1b")
    runs = (("gpt", None, one), ("gpt2", None, one), ("llama", None, one), ("unshardable", None, one),
            ("example", None, one))
    reports = _tp_run(2, runs)
    _assert_cut(reports)
    by_case = {r["case"]: r for r in reports[0]}
    assert by_case["llama"]["blocks"].count("attention") == 2, by_case["llama"]  # q/k/v by (kv) heads
    # fused q/k/v projections (split in three after them) cut part by part: GPT-2, ours, the example's
    for case, layers in (("gpt", 4), ("gpt2", 2), ("example", 2)):
        assert by_case[case]["blocks"] == ["attention"] * layers + ["embedding", "head"] + ["mlp"] * layers, \
            by_case[case]
    assert by_case["unshardable"]["blocks"] == ["mlp"], by_case["unshardable"]  # the cumsum pair stays whole
    # two micro-batches: per layer and micro-batch an all-reduce leaving attention and the MLP, and
    # one for each of their entries' gradients; the embedding's; the head's logits gathered (and
    # its entry's gradient all-reduced). No weight is ever gathered.
    example = by_case["example"]["comms"]
    assert example.get("all_gather_into_tensor", 0) == 2, example  # the head's logits, per micro-batch
    assert example.get("all_reduce", 0) == 2 * (2 * 2 * 2 + 1 + 1), example


def test_tensor_by_pipeline_and_by_data_parallel_on_four_ranks() -> None:
    def pp(schedule: str, stages: int = 2) -> dict:
        return dict(tensor_parallel_size=2, num_stages=stages, num_microbatches=2, schedule=schedule)

    dp = dict(tensor_parallel_size=2, num_stages=1, data_parallel_size=2, num_microbatches=2, schedule="1f1b")
    # six runs where there were eight: recompute rides on zero-bubble's split backward (the harder of
    # the two), and Llama (traced by torch.export, the slow trace) runs its fp32 gradients interleaved
    runs = (("gpt", None, pp("1f1b")), ("gpt", None, {**pp("zb-h1"), "recompute": True}),
            ("llama", "bf16", pp("zb-h1")), ("gpt2", None, pp("1f1b")), ("gpt", None, dp),
            ("llama", None, {**pp("interleaved", 4), "num_microbatches": 4}))
    _assert_cut(_tp_run(4, runs))


def test_tensor_parallel_needs_processes_and_a_divisor() -> None:
    model, inputs, target, loss_fn = models.tiny_gpt(8)
    with pytest.raises(replica.ConfigError, match="tensor_parallel_size"):
        replica.plan(model, inputs, world_size=4, tensor_parallel_size=3)
    plan = replica.plan(model, inputs, world_size=4, num_stages=2, tensor_parallel_size=2, device=COMPUTE_BOUND)
    with pytest.raises(replica.ConfigError, match="torchrun"):
        replica.auto_parallel(model, inputs, plan=plan, loss_fn=loss_fn)


def tp_trainer_job(rank: int, world: int, directory: str) -> bytes:
    """The Trainer at tp=2 × 2 stages writes each rank's shards under the original names (the plain
    model loads them whole); a Trainer at tp=1 (2 stages × 2 replicas) resumes from that checkpoint."""
    from replica.defaults import default_config
    from replica.train.trainer import get_trainer

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return models.tiny_gpt(8, num_layers=4).model

    _, inputs, target, loss_fn = models.tiny_gpt(16, num_layers=4)

    def trainer(tp: int) -> object:
        config = default_config(batch_size=8, num_stages=2, num_microbatches=2, tensor_parallel_size=tp,
                                data_parallel_size=4 // (2 * tp), checkpoint_dir=directory, progress=False,
                                timeout_s=STEP_TIMEOUT_S)
        return get_trainer(config, build(), loss_fn, lambda params: torch.optim.Adam(params, lr=1e-2))

    first = trainer(2)
    first.train_dataset(inputs[0], target, epochs=1)
    saved = first.pipeline.state_dict()  # gathered whole on every tensor-parallel rank
    plain = build()
    replica.load_into_plain_model(directory, plain)
    want = plain.state_dict()
    same = all(torch.equal(v, want[k]) for k, v in saved.items() if k in want)
    resumed = trainer(1)
    resumed.train_dataset(inputs[0], target, epochs=1)  # resumes at the end of epoch 1: nothing left to run
    again = resumed.pipeline.state_dict()
    kept = all(torch.equal(v, want[k]) for k, v in again.items() if k in want)
    return _portable({"same": same, "kept": kept, "tp": first.pipeline.plan.layout.tensor_parallel_size,
                      "after": resumed.pipeline.plan.layout.describe()})


def test_trainer_checkpoint_at_tp2_resumes_at_tp1(tmp_path) -> None:
    reports = _run(tp_trainer_job, 4, str(tmp_path / "ckpt"))
    for r in reports:
        assert r["same"] and r["kept"] and r["tp"] == 2, r
        assert "2 data" in r["after"], r
