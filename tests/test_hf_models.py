"""Hugging Face models (GPT-2, Llama, T5, ViT) from tiny configs: exact pipelined gradients, ModelOutput forwards."""

from __future__ import annotations

import copy
import os
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import replica  # noqa: E402
from tests import grads
from tests.conftest import COMPUTE_BOUND  # noqa: E402

ATOL, RTOL = 1e-5, 1e-4
MODELS = ("gpt2", "llama", "t5", "vit")


def gpt2(pdrop: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                     resid_pdrop=pdrop, embd_pdrop=pdrop, attn_pdrop=pdrop, use_cache=False)
    return transformers.GPT2LMHeadModel(config)


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


def t5() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                   num_decoder_layers=2, num_heads=4, dropout_rate=0.0, use_cache=False,
                                   decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(config)


def vit() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64,
                                    num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
                                    num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.ViTForImageClassification(config)


BUILDERS: dict[str, Callable[[], torch.nn.Module]] = {"gpt2": gpt2, "llama": llama, "t5": t5, "vit": vit}
_BUILT: dict[str, torch.nn.Module] = {}


def fresh(name: str) -> torch.nn.Module:
    """A fresh copy of the model, built (seeded) once per module."""
    if name not in _BUILT:
        _BUILT[name] = BUILDERS[name]()
    return copy.deepcopy(_BUILT[name])


def mask(n: int, t: int) -> torch.Tensor:
    m = torch.ones(n, t, dtype=torch.long)
    m[1::2, t - 3:] = 0  # trailing padding on every other sample
    return m


def data(name: str) -> tuple[tuple[torch.Tensor, ...], dict[str, Any], torch.Tensor]:
    """(positional inputs, keyword inputs, target) for a batch of 8."""
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        return (torch.randn(8, 3, 32, 32, generator=g),), {}, torch.randint(0, 10, (8,), generator=g)
    ids = torch.randint(0, 128, (8, 16), generator=g)
    if name == "t5":
        dec = torch.randint(0, 128, (8, 12), generator=g)
        kwargs = dict(attention_mask=mask(8, 16), decoder_input_ids=dec, use_cache=False)
        return (ids,), kwargs, torch.randint(0, 128, (8, 12), generator=g)
    return (ids,), dict(attention_mask=mask(8, 16)), torch.randint(0, 128, (8, 16), generator=g)


def logits_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy over every token (or image); checks the stage hands over the model's own output type."""
    assert isinstance(out, transformers.modeling_outputs.ModelOutput), type(out)
    assert out["logits"] is out.logits
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def plain_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def pipeline(model: torch.nn.Module, name: str, **kw: Any) -> replica.PipelineModel:
    args, kwargs, _ = data(name)
    kw = {**dict(num_stages=2, num_microbatches=4, schedule="1f1b", loss_fn=logits_loss, device=COMPUTE_BOUND), **kw}
    return replica.auto_parallel(model, args, example_kwargs=kwargs or None, **kw)


def assert_same_grads(model: torch.nn.Module, ref: torch.nn.Module, **tol: float) -> None:
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()]  # and in the plain model's order
    grads.assert_same_grads(model, ref, **(tol or dict(atol=ATOL, rtol=RTOL)))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("name", MODELS)
def test_train_step_matches_plain_model(name: str, num_stages: int, schedule: str):
    model, ref = fresh(name), fresh(name)
    args, kwargs, target = data(name)
    ref_loss = logits_loss(ref(*args, **kwargs), target)
    ref_loss.backward()
    pm = pipeline(model, name, num_stages=num_stages, schedule=schedule)
    assert pm.plan.num_stages == num_stages
    loss = pm.train_step(args, target, **kwargs)
    torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=RTOL)
    assert pm.model is model
    assert_same_grads(pm.model, ref)


def test_tied_weights_are_planned_once():
    pm = pipeline(fresh("llama"), "llama", num_stages=3)
    assert pm.plan.tied_parameters == {"model.embed_tokens.weight": ("lm_head.weight",)}
    assert isinstance(pm.plan.summary(), str)
    names = [n for n, _ in pm.named_parameters()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names)) == len(list(pm.model.named_parameters()))


@pytest.mark.parametrize("name", MODELS)
def test_forward_returns_the_model_output(name: str):
    model, ref = fresh(name), fresh(name)
    args, kwargs, _ = data(name)
    pm = pipeline(model, name)
    with torch.no_grad():
        out, expected = pm(*args, **kwargs), ref(*args, **kwargs)
    assert type(out) is type(expected)
    assert isinstance(out, transformers.modeling_outputs.ModelOutput)
    torch.testing.assert_close(out.logits, expected.logits, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out["logits"], expected["logits"], atol=ATOL, rtol=RTOL)


def test_gpt2_forward_on_shorter_sequences_without_replanning():
    model, ref = fresh("gpt2"), fresh("gpt2")
    pm = pipeline(model, "gpt2")
    ids = torch.randint(0, 128, (4, 10))
    with torch.no_grad():
        out = pm(ids, attention_mask=mask(4, 10))
        expected = ref(ids, attention_mask=mask(4, 10))
    assert type(out) is type(expected)
    assert out.logits.shape == (4, 10, 128)
    torch.testing.assert_close(out.logits, expected.logits, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("schedule,num_stages", [("zb-h1", 2), ("zb-v", 4)])
def test_zero_bubble_gpt2_exact_grads(schedule: str, num_stages: int):
    model, ref = fresh("gpt2"), fresh("gpt2")
    args, kwargs, target = data("gpt2")
    ref_loss = plain_loss(ref(*args, **kwargs), target)
    ref_loss.backward()
    pm = pipeline(model, "gpt2", num_stages=num_stages, schedule=schedule, loss_fn=plain_loss)
    assert pm.plan.num_stages == num_stages and pm.plan.schedule == schedule
    loss = pm.train_step(args, target, **kwargs)
    torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=RTOL)
    assert_same_grads(pm.model, ref)


def test_dropout_is_seeded_alike_across_schedules_and_follows_train_eval():
    base = gpt2(pdrop=0.1)
    args, kwargs, target = data("gpt2")
    pms = [pipeline(copy.deepcopy(base), "gpt2", schedule="gpipe"),
           pipeline(copy.deepcopy(base), "gpt2", schedule="1f1b"),
           pipeline(copy.deepcopy(base), "gpt2", schedule="1f1b", recompute=True)]
    assert [pm.plan.num_stages for pm in pms] == [2, 2, 2] and pms[2].plan.recompute
    losses = []
    for pm in pms:
        assert pm.model.training
        torch.manual_seed(123)
        losses.append(pm.train_step(args, target, **kwargs))
    for pm, loss in zip(pms[1:], losses[1:]):
        torch.testing.assert_close(loss, losses[0], atol=0, rtol=0)
        assert_same_grads(pm.model, pms[0].model, atol=0, rtol=0)

    # Dropout really is on: the plain model without dropout, and another seed, both differ.
    no_dropout = plain_loss(gpt2()(*args, **kwargs), target)
    assert not torch.allclose(losses[0], no_dropout.detach())
    torch.manual_seed(124)
    assert not torch.allclose(pms[0].train_step(args, target, **kwargs), losses[0])

    pm, ref = pms[1], copy.deepcopy(base).eval()
    pm.eval()
    assert not pm.model.training
    with torch.no_grad():
        evaluated = pm(*args, **kwargs).logits
        torch.testing.assert_close(evaluated, ref(*args, **kwargs).logits, atol=ATOL, rtol=RTOL)
        pm.train()
        assert pm.model.training
        assert not torch.allclose(pm(*args, **kwargs).logits, evaluated)


def test_missing_or_changed_keywords_raise_config_error():
    args, kwargs, target = data("gpt2")
    pm = replica.auto_parallel(fresh("gpt2"), args, example_kwargs=dict(kwargs, use_cache=False), num_stages=2,
                               num_microbatches=4, loss_fn=plain_loss, device=COMPUTE_BOUND)
    assert pm.input_spec.keywords == ("attention_mask",) and pm.input_spec.constants == {"use_cache": False}
    with pytest.raises(replica.ConfigError, match="attention_mask"):
        pm.train_step(args, target)
    with pytest.raises(replica.ConfigError, match="use_cache"):
        pm.train_step(args, target, attention_mask=kwargs["attention_mask"], use_cache=True)
    with pytest.raises(replica.ConfigError, match="attention_mask"):
        with torch.no_grad():
            pm(*args)
    # The traced constant itself is accepted, as is leaving it out.
    loss = pm.train_step(args, target, attention_mask=kwargs["attention_mask"], use_cache=False)
    assert torch.isfinite(loss)


def test_a_model_that_returns_its_key_value_cache_is_told_to_turn_it_off():
    """use_cache is on by default in a transformers config (a model from save_pretrained keeps it):
    the error names the cache and use_cache=False, not control flow."""
    from replica.partition.trace import trace

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    assert config.use_cache
    model = transformers.LlamaForCausalLM(config)
    with pytest.raises(replica.TraceError, match=r"returns a key/value cache \(DynamicCache.*use_cache = False"):
        trace(model, (torch.randint(0, 64, (2, 8)),), tracer="export", dynamic_dims="batch")
