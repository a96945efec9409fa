"""Mixed precision in one process: ``mixed_precision="bf16"``, the caller's own
``torch.autocast`` and bf16 weights, under every schedule, leave the gradients of the plain
model run micro-batch by micro-batch under the same autocast (tight), and the whole batch's
within bf16's round-off; fp16 asks for a loss scaler; bad arguments are named."""

from __future__ import annotations

import copy

import pytest
import torch

import replica
from replica.layout import schedule_names
from replica.runtime import microbatch
from tests import models
from tests.distributed.test_mixed_precision_distributed import microbatch_reference

SCHEDULES = [s for s in schedule_names() if s != "auto"]
TIGHT = dict(rtol=2e-3, atol=1e-6)  # the same bf16 ops; fp32 sums in another order
BF16 = dict(rtol=5e-2, atol=2e-3)  # against the whole batch at once: bf16 round-off


def _case(dtype: torch.dtype = torch.float32, batch: int = 8) -> models.ModelCase:
    torch.manual_seed(0)
    case = models.tiny_gpt(batch, num_layers=4)
    return case._replace(model=case.model.to(dtype))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters()}


def _assert_close(pm: replica.PipelineModel, want: dict[str, torch.Tensor], *, scaled: bool = False,
                  **tolerance: float) -> None:
    """Every gradient the pipeline holds against ``want``; ``scaled``: ``atol`` is relative to
    the largest element (sums in bf16 round each partial sum to 8 bits, whatever its size)."""
    for name, p in pm.named_parameters():
        assert p.grad.dtype == want[name].dtype, (name, p.grad.dtype, want[name].dtype)
        atol = tolerance["atol"] * float(want[name].abs().max()) if scaled else tolerance["atol"]
        torch.testing.assert_close(p.grad, want[name], msg=lambda m: f"{name}: {m}", rtol=tolerance["rtol"],
                                   atol=atol)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("how", ["mixed_precision", "autocast"])
def test_bf16_autocast_gives_the_plain_models_gradients(schedule: str, how: str) -> None:
    model, inputs, target, loss_fn = _case()
    plain = copy.deepcopy(model)
    pm = replica.auto_parallel(model, inputs, num_stages=4, num_microbatches=4, schedule=schedule, loss_fn=loss_fn,
                               mixed_precision="bf16" if how == "mixed_precision" else None)
    assert pm.plan.precision == ("bf16" if how == "mixed_precision" else "fp32")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "autocast"):
        loss = pm.train_step(inputs, target)
    _assert_close(pm, _grads(microbatch_reference(plain, inputs, target, loss_fn, pm.plan, torch.bfloat16)), **TIGHT)
    whole = copy.deepcopy(plain)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_loss = loss_fn(whole(*inputs), target)
    want_loss.backward()
    _assert_close(pm, _grads(whole), **BF16)
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-2, atol=0)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-v"])
def test_bf16_weights_train_in_bf16(schedule: str) -> None:
    model, inputs, target, loss_fn = _case(torch.bfloat16)
    plain = copy.deepcopy(model)
    pm = replica.auto_parallel(model, inputs, num_stages=4, num_microbatches=4, schedule=schedule, loss_fn=loss_fn)
    pm.train_step(inputs, target)
    want = _grads(microbatch_reference(plain, inputs, target, loss_fn, pm.plan, None))
    assert all(g.dtype == torch.bfloat16 for g in want.values())
    _assert_close(pm, want, rtol=1.6e-2, atol=1.6e-2, scaled=True)  # bf16 sums in another order: 2 ulps


@pytest.mark.skipif(not hasattr(torch.Tensor, "grad_dtype"), reason="this torch has no Tensor.grad_dtype")
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_bf16_weights_can_accumulate_fp32_gradients(schedule: str) -> None:
    model, inputs, target, loss_fn = _case(torch.bfloat16)
    plain = copy.deepcopy(model)
    pm = replica.auto_parallel(model, inputs, num_stages=4, num_microbatches=4, schedule=schedule, loss_fn=loss_fn,
                               grad_dtype=torch.float32)
    pm.train_step(inputs, target)
    for p in plain.parameters():
        p.grad_dtype = torch.float32
    want = _grads(microbatch_reference(plain, inputs, target, loss_fn, pm.plan, None))
    assert all(g.dtype == torch.float32 for g in want.values())
    _assert_close(pm, want, **TIGHT)


@pytest.mark.parametrize("recompute", [True, "pointwise"])
def test_recompute_under_autocast(recompute) -> None:
    model, inputs, target, loss_fn = _case()
    plain = copy.deepcopy(model)
    pm = replica.auto_parallel(model, inputs, num_stages=2, num_microbatches=4, schedule="1f1b", loss_fn=loss_fn,
                               mixed_precision="bf16", recompute=recompute)
    pm.train_step(inputs, target)
    _assert_close(pm, _grads(microbatch_reference(plain, inputs, target, loss_fn, pm.plan, torch.bfloat16)), **TIGHT)


def test_inference_under_autocast_matches_the_plain_model() -> None:
    model, inputs, _, _ = _case()
    plain = copy.deepcopy(model)
    pm = replica.auto_parallel(model, inputs, num_stages=2, num_microbatches=2, mixed_precision="bf16")
    with torch.no_grad():
        out = pm(*inputs)  # the plan's autocast, without a context of the caller's
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = plain(*inputs)
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, rtol=2e-2, atol=1e-2)


def test_fp16_needs_a_loss_scaler() -> None:
    model, inputs, target, loss_fn = _case()
    pm = replica.auto_parallel(model, inputs, num_stages=2, num_microbatches=2, loss_fn=loss_fn,
                               mixed_precision="fp16")
    with pytest.raises(replica.ConfigError, match="scaler=") as info:
        pm.train_step(inputs, target)
    assert "GradScaler" in str(info.value)
    with pytest.raises(replica.ConfigError, match="scaler must be"):
        pm.train_step(inputs, target, scaler=object())


def test_fp16_with_a_scaler_scales_the_gradients_and_returns_the_loss() -> None:
    model, inputs, target, loss_fn = _case()
    plain = copy.deepcopy(model)
    pm = replica.auto_parallel(model, inputs, num_stages=2, num_microbatches=2, loss_fn=loss_fn,
                               mixed_precision="fp16")
    scaler = replica.GradScaler(device="cpu", init_scale=1024.0)
    loss = pm.train_step(inputs, target, scaler=scaler)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ref = plain
    for *x, y in microbatch.split([*inputs, target], 2, shares=pm.plan.microbatch_shares):
        with torch.autocast("cpu", dtype=torch.float16):
            part = loss_fn(ref(*x), y) * (y.shape[0] / target.shape[0])
        ref_scaler.scale(part).backward()
    _assert_close(pm, _grads(ref), **TIGHT)  # both scaled by 1024
    with torch.autocast("cpu", dtype=torch.float16):
        torch.testing.assert_close(loss, loss_fn(copy.deepcopy(plain)(*inputs), target).detach(), rtol=1e-2, atol=0)


@pytest.mark.parametrize("value, match", [(True, "does not say which"), ("int8", "unknown mixed_precision"),
                                          (torch.float64, "unknown mixed_precision")])
def test_bad_mixed_precision_is_named(value, match) -> None:
    model, inputs, _, loss_fn = _case()
    with pytest.raises(replica.ConfigError, match=match):
        replica.auto_parallel(model, inputs, num_stages=2, mixed_precision=value)


def test_bad_grad_dtype_is_named() -> None:
    model, inputs, _, _ = _case()
    with pytest.raises(replica.ConfigError, match="grad_dtype must be a floating"):
        replica.auto_parallel(model, inputs, num_stages=2, grad_dtype=torch.int32)


def test_a_given_plan_keeps_its_precision() -> None:
    model, inputs, target, loss_fn = _case()
    planned = replica.plan(model, inputs, num_stages=2, num_microbatches=2, mixed_precision="bf16")
    assert planned.precision == "bf16"
    pm = replica.auto_parallel(model, inputs, plan=planned, loss_fn=loss_fn)
    assert pm.precision == "bf16"
    with pytest.raises(replica.ConfigError, match="precision"):
        replica.auto_parallel(copy.deepcopy(model), inputs, plan=planned, mixed_precision="fp16")


def _sgd(params):
    return torch.optim.SGD(params, lr=1e-2)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_trainer_trains_in_half_precision_and_resumes(tmp_path, precision: str) -> None:
    from replica.defaults import default_config
    from replica.train.trainer import get_trainer
    from tests.train_cases import images, small_cnn

    x, y = images(64)
    config = default_config(batch_size=16, num_stages=2, num_microbatches=2, mixed_precision=precision,
                                    checkpoint_dir=tmp_path, checkpoint_every_steps=2, progress=False)
    torch.manual_seed(0)
    trainer = get_trainer(config, small_cnn(), torch.nn.functional.cross_entropy, _sgd)
    trainer.train_dataset(x, y, epochs=1)
    assert trainer.pipeline.plan.precision == precision
    assert (trainer.scaler is not None) == (precision == "fp16")
    resumed = get_trainer(config, small_cnn(), torch.nn.functional.cross_entropy, _sgd)
    resumed.train_dataset(x, y, epochs=1)  # the epoch is done: it resumes at its end
    assert resumed.step == trainer.step
    if precision == "fp16":
        assert resumed.scaler.get_scale() == trainer.scaler.get_scale()
        # a scale the run changed (not the default a fresh scaler starts with) comes back from the checkpoint
        trainer.scaler.update(new_scale=512.0)
        trainer.save_checkpoint()
        again = get_trainer(config, small_cnn(), torch.nn.functional.cross_entropy, _sgd)
        again.train_dataset(x, y, epochs=1)
        assert again.resumed_from.name == f"step-{trainer.step:08d}"
        assert again.scaler.state_dict() == trainer.scaler.state_dict()
        assert again.scaler.get_scale() == 512.0
    with pytest.raises(replica.ConfigError, match="precision"):
        default_config(mixed_precision="int8")


def test_a_tensor_that_disagrees_with_the_agreed_dtype_is_named_before_it_is_sent() -> None:
    from replica.runtime.executor import _check_agreed
    from replica.runtime.shapes import TensorMeta

    agreed = TensorMeta((4, 8), torch.float32, True)
    _check_agreed(torch.zeros(4, 8), agreed, "add_4", 0, (1,), 2)  # as agreed: nothing to say
    with pytest.raises(replica.PipelineError) as info:
        _check_agreed(torch.zeros(4, 8, dtype=torch.bfloat16), agreed, "add_4", 0, (1,), 2)
    message = str(info.value)
    for part in ("'add_4'", "micro-batch 2", "stage 0", "[1]", "torch.bfloat16", "torch.float32", "autocast"):
        assert part in message, (part, message)


def test_an_exported_model_whose_norm_asserts_fp32_trains_in_bf16() -> None:
    """Qwen3 (HF, torch.export) normalizes q and k in fp32: export writes a check that the norm's
    input is fp32, which bf16 autocast makes bf16 on purpose. The check computes nothing and is
    dropped from every stage: the plain model's gradients under the same autocast."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=16, use_cache=False)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))

    def loss_fn(out, target):
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    plain = copy.deepcopy(model)
    pm = replica.auto_parallel(model, (x,), num_stages=2, num_microbatches=2, loss_fn=loss_fn, mixed_precision="bf16",
                               tracer="export")
    pm.train_step(x, y)
    # the exported graph's aten ops (attention, norms) round in bf16 where HF's eager modules do not, alike:
    # bf16 round-off, not the same-ops tolerance
    _assert_close(pm, _grads(microbatch_reference(plain, (x,), y, loss_fn, pm.plan, torch.bfloat16)), **BF16)
