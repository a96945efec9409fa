"""Sharded data parallelism (FSDP2) on gloo ranks: each replica holds 1/d of its stages'
weights, gradients and optimizer state, and the gradients (gathered with ``full_tensor()``)
are the plain model's on the whole batch: FSDP alone, and pipeline stages × sharded
replicas; our GPT (tied weights), a Hugging Face Llama (grouped-query attention), in fp32
and under bf16 autocast."""

from __future__ import annotations

import copy

import pytest
import torch

import replica
from replica.parallel.fsdp import local_tensor
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.distributed.test_distributed import STEP_TIMEOUT_S, _portable, _run
from tests.distributed.test_mixed_precision_distributed import microbatch_reference

pytestmark = pytest.mark.distributed


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _gpt() -> tuple:
    torch.manual_seed(0)
    model, inputs, target, loss_fn = models.tiny_gpt(16, num_layers=4)
    return model, inputs, target, loss_fn, {}


def _llama() -> tuple:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
                                   attn_implementation="eager", tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids, target = torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)
    return model, (ids,), target, lambda out, y: models.lm_loss(out.logits, y), {"example_kwargs": {"use_cache": False}}


def _check(case: tuple, precision: str | None = None, **layout) -> dict:
    """Train one step sharded; compare every gradient this rank holds (gathered) with the plain
    model's, the weights' and the optimizer state's local bytes with the whole stages'."""
    model, inputs, target, loss_fn, extra = case
    plain = copy.deepcopy(model)
    pm = replica.auto_parallel(model, inputs, loss_fn=loss_fn, device=COMPUTE_BOUND, timeout_s=STEP_TIMEOUT_S,
                               sharded_data_parallel=True, mixed_precision=precision, **layout, **extra)
    kwargs = extra.get("example_kwargs", {})
    loss = pm.train_step(inputs, target, **kwargs)
    if precision is None:
        ref = copy.deepcopy(plain)
        want_loss = loss_fn(ref(*inputs, **kwargs), target)
        want_loss.backward()
        tolerance: dict = {}
    else:  # micro-batch by micro-batch under the same autocast; FSDP gathers the weights in bf16 (a norm's
        # gain too, which autocast would have kept fp32) and reduces in fp32: bf16's round-off
        ref = microbatch_reference(plain, inputs, target, loss_fn, pm.plan, torch.bfloat16, **kwargs)
        tolerance = dict(rtol=5e-2, atol=5e-2)  # atol relative to the largest element: bf16 norms and sums
    want = dict(ref.named_parameters())
    whole = local = 0
    for name, p in pm.named_parameters():
        assert p.grad is not None, name
        grad = _full(p.grad)
        atol = tolerance["atol"] * float(want[name].grad.abs().max()) if tolerance else None
        torch.testing.assert_close(grad, want[name].grad, msg=lambda m: f"{name}: {m}",
                                   **({} if atol is None else dict(rtol=tolerance["rtol"], atol=atol)))
        whole += _full(p.detach()).numel()
        local += local_tensor(p.detach()).numel()
    opt = torch.optim.Adam(pm.parameters(), lr=1e-3)
    opt.step()
    state = sum(local_tensor(v).numel() for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"loss": float(loss), "whole": whole, "local": local, "state": state, "layout": pm.plan.layout.describe()}


def sharded_job(rank: int, world: int, runs: tuple[tuple[str, str | None, dict], ...]) -> bytes:
    cases = {"gpt": _gpt, "llama": _llama}
    return _portable([_check(cases[name](), precision, **layout) for name, precision, layout in runs])


def _assert_sharded(reports: list[list[dict]], replicas: int) -> None:
    for run in zip(*reports):
        assert len({r["loss"] for r in run}) == 1, run
        for r in run:  # a replica holds 1/d of its stages' weights and Adam's two moments of them
            assert r["local"] <= r["whole"] / replicas + 64, r
            assert r["state"] == 2 * r["local"], r
            assert "sharded" in r["layout"], r


def test_fsdp_alone_on_two_ranks() -> None:
    runs = (("gpt", None, dict(num_stages=1, num_microbatches=2)),
            ("gpt", "bf16", dict(num_stages=1, num_microbatches=2)),
            ("llama", None, dict(num_stages=1, num_microbatches=2)))
    _assert_sharded(_run(sharded_job, 2, runs), 2)


def test_two_stages_by_two_sharded_replicas_on_four_ranks() -> None:
    runs = (("gpt", None, dict(num_stages=2, num_microbatches=4, schedule="1f1b")),
            ("gpt", "bf16", dict(num_stages=2, num_microbatches=2, schedule="gpipe")),
            ("llama", None, dict(num_stages=2, num_microbatches=2, schedule="1f1b")),
            ("llama", "bf16", dict(num_stages=2, num_microbatches=2, schedule="1f1b")))
    _assert_sharded(_run(sharded_job, 4, runs), 2)


def test_sharding_refuses_one_replica() -> None:
    model, inputs, _, _ = models.tiny_gpt(8)
    with pytest.raises(replica.ConfigError, match="one"):
        replica.plan(model, inputs, world_size=2, num_stages=2, sharded_data_parallel=True)


def sharded_trainer_job(rank: int, world: int, directory: str) -> bytes:
    """The Trainer on 2 stages × 2 sharded replicas: its checkpoint (each rank's shards, DCP) loads
    under the original names into the plain model as the tensors whole, and a new Trainer resumes from it."""
    from replica.defaults import default_config
    from replica.train.trainer import get_trainer

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return models.tiny_gpt(8, num_layers=4).model

    _, inputs, target, loss_fn = models.tiny_gpt(16, num_layers=4)
    config = default_config(batch_size=8, num_stages=2, num_microbatches=2, sharded_data_parallel=True,
                            checkpoint_dir=directory, progress=False, timeout_s=STEP_TIMEOUT_S)
    trainer = get_trainer(config, build(), loss_fn, lambda params: torch.optim.Adam(params, lr=1e-2))
    trainer.train_dataset(inputs[0], target, epochs=1)
    saved = trainer.pipeline.state_dict()  # gathered whole, on every replica
    plain = build()
    replica.load_into_plain_model(directory, plain)
    want = plain.state_dict()
    same = all(torch.equal(v, want[k]) for k, v in saved.items() if k in want)
    resumed = get_trainer(config, build(), loss_fn, lambda params: torch.optim.Adam(params, lr=1e-2))
    resumed.train_dataset(inputs[0], target, epochs=2)  # the first epoch is done: it trains the second
    return _portable({"layout": trainer.pipeline.plan.layout.describe(), "same": same, "keys": len(saved),
                      "steps": (trainer.step, resumed.step)})


def test_a_sharded_trainer_checkpoints_and_resumes(tmp_path) -> None:
    reports = _run(sharded_trainer_job, 4, str(tmp_path))
    for r in reports:
        assert "sharded" in r["layout"] and r["same"] and r["keys"] > 0, r
        assert r["steps"] == (2, 4), r
    # and on another layout: one process, 4 stages, no replicas, from the sharded run's checkpoint
    from replica.defaults import default_config
    from replica.train.trainer import get_trainer

    _, inputs, target, loss_fn = models.tiny_gpt(16, num_layers=4)
    config = default_config(batch_size=8, num_stages=4, num_microbatches=2, checkpoint_dir=str(tmp_path),
                            progress=False)
    torch.manual_seed(1)  # another model: what it ends with comes from the checkpoint
    elsewhere = get_trainer(config, models.tiny_gpt(8, num_layers=4).model, loss_fn,
                            lambda params: torch.optim.Adam(params, lr=1e-2))
    elsewhere.train_dataset(inputs[0], target, epochs=3)
    assert elsewhere.step == 6  # resumed at the 4th step of the sharded runs, then one more epoch


def test_a_block_whose_output_is_written_in_place_joins_the_root_unit() -> None:
    import torch.fx as fx

    from replica.parallel.fsdp import block_groups

    class Block(torch.nn.Module):
        def __init__(self, inplace: bool) -> None:
            super().__init__()
            self.fc, self.inplace = torch.nn.Linear(4, 4), inplace

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            if self.inplace:
                h.view(-1).add_(1.0)  # a write through a view of the linear's output
                return h
            return h + 1.0

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(False), Block(True)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x

    groups = block_groups(fx.symbolic_trace(Net()))
    assert groups == {"blocks.0": ["blocks.0.fc"]}, groups


def _reduce_scatters() -> tuple[list[int], object]:
    """Count the reduce-scatters FSDP2 starts (torch's public collectives, looked up on call), and how to stop."""
    import torch.distributed as dist

    count = [0]
    saved = {name: getattr(dist, name) for name in ("reduce_scatter_tensor", "reduce_scatter_single")
             if hasattr(dist, name)}

    def counting(original):
        def call(*args, **kwargs):
            count[0] += 1
            return original(*args, **kwargs)
        return call

    for name, original in saved.items():
        setattr(dist, name, counting(original))
    return count, lambda: [setattr(dist, name, original) for name, original in saved.items()]


def grad_sync_job(rank: int, world: int, runs: tuple[tuple[str | None, dict], ...]) -> bytes:
    """Each run: one step of the tiny GPT sharded, its gradients against the plain model's (fp32: the
    whole batch; bf16: micro-batch by micro-batch under the same autocast), and how many
    reduce-scatters the step started on this rank."""
    from tests.grads import assert_same_grads

    reports = []
    for precision, layout in runs:
        model, inputs, target, loss_fn, _ = _gpt()
        plain = copy.deepcopy(model)
        pm = replica.auto_parallel(model, inputs, loss_fn=loss_fn, device=COMPUTE_BOUND, timeout_s=STEP_TIMEOUT_S,
                                   mixed_precision=precision, **layout)
        count, stop = _reduce_scatters()
        try:
            pm.train_step(inputs, target)
        finally:
            stop()
        if precision is None:
            ref = copy.deepcopy(plain)
            loss_fn(ref(*inputs), target).backward()
            assert_same_grads(pm, ref, subset=True, context=f"{layout}: ")
        else:  # FSDP gathers in bf16 and reduces in fp32 (MixedPrecisionPolicy): bf16's round-off
            ref = microbatch_reference(plain, inputs, target, loss_fn, pm.plan, torch.bfloat16)
            want = dict(ref.named_parameters())
            for name, p in pm.named_parameters():
                atol = 5e-2 * float(want[name].grad.abs().max())
                torch.testing.assert_close(_full(p.grad), want[name].grad, rtol=5e-2, atol=atol,
                                           msg=lambda m, name=name: f"{layout} {name}: {m}")
        reports.append({"syncs": [s.grad_sync for s in pm.plan.stages], "reduce_scatters": count[0],
                        "layout": pm.plan.layout.describe(), "m": pm.plan.num_microbatches})
    return _portable(reports)


def test_reduce_scatter_every_microbatch_gives_the_plain_gradients_on_four_ranks() -> None:
    """grad_sync="microbatch" (#39): every micro-batch's gradients are reduce-scattered once they are
    final, so a step starts m times as many reduce-scatters as grad_sync="step", and every gradient is
    still the plain model's: 2 stages x 2 zero3 replicas under 1F1B, interleaved (2 stages a rank) and
    zb-h1 (after each W); zb-h1 reducing once a step (after the last W) under bf16 with zero2."""
    sharded = dict(sharded_data_parallel="zero3", num_microbatches=4)
    runs = ((None, dict(num_stages=2, schedule="1f1b", grad_sync="step", **sharded)),
            (None, dict(num_stages=2, schedule="1f1b", grad_sync="microbatch", **sharded)),
            (None, dict(num_stages=4, schedule="interleaved", data_parallel_size=2, grad_sync="microbatch",
                        **sharded)),
            (None, dict(num_stages=2, schedule="zb-h1", grad_sync="microbatch", **sharded)),
            ("bf16", dict(num_stages=2, schedule="zb-h1", grad_sync="step", num_microbatches=4,
                          sharded_data_parallel="zero2")))
    reports = _run(grad_sync_job, 4, runs)
    for r in reports:
        step, every, interleaved, zb_every, zb_step = r
        assert step["syncs"] == zb_step["syncs"] == ["step"] * 2, r
        assert every["syncs"] == zb_every["syncs"] == ["microbatch"] * 2, r
        assert interleaved["syncs"] == ["microbatch"] * 4, r
        assert "interleaved" in interleaved["layout"] and "2 data (zero3" in interleaved["layout"], r
        assert "zb-h1" in zb_every["layout"] and "2 data (zero2" in zb_step["layout"], r
        assert step["reduce_scatters"] > 0 and interleaved["reduce_scatters"] % 4 == 0, r
        assert every["reduce_scatters"] == 4 * step["reduce_scatters"], r
        assert zb_every["reduce_scatters"] == 4 * zb_step["reduce_scatters"] > 0, r
