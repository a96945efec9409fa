"""A model built on meta goes through ``auto_parallel`` without its weights: planned on meta,
then materialized (in one process: every stage) with ``replica.materialize``'s weights under
the same seed, and trained with the plain model's gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import replica
from replica.errors import ConfigError
from replica.partition.partitioner import fingerprint
from replica.partition.trace import trace
from tests import models

SEED = 1234


def tiny_gpt_init(module: nn.Module) -> None:
    """What TinyGPT's constructor computes into buffers, which a model built on meta loses."""
    if isinstance(module, models.TinyGPT):
        module.pos.copy_(torch.arange(module.pos.numel()))
    if isinstance(module, models.CausalSelfAttention):
        n = module.bias.shape[-1]
        module.bias.copy_(torch.tril(torch.ones(n, n)).view(1, 1, n, n))


def build(kind: str) -> nn.Module:
    if kind == "deferred":
        with replica.deferred_init():
            return models.TinyGPT()
    with torch.device("meta"):
        return models.TinyGPT()


INIT = {"deferred": None, "meta": tiny_gpt_init}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 64, (8, 17), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def reference(kind: str) -> tuple[nn.Module, torch.Tensor]:
    """replica.materialize of the same meta model under the same seed, after one plain backward."""
    x, y = batch()
    torch.manual_seed(SEED)
    ref = replica.materialize(build(kind), init=INIT[kind])
    loss = models.lm_loss(ref(x), y)
    loss.backward()
    return ref, loss.detach()


def assert_same(pm: replica.PipelineModel, ref: nn.Module) -> None:
    want = dict(ref.named_parameters())
    names = []
    for name, p in pm.named_parameters():
        assert p.device.type == "cpu", name
        torch.testing.assert_close(p.detach(), want[name].detach(), rtol=0, atol=0, msg=name)
        torch.testing.assert_close(p.grad, want[name].grad, msg=name)
        names.append(name)
    assert sorted(names) == sorted(want)


@pytest.mark.parametrize("kind", ["deferred", "meta"])
def test_meta_trace_plans_like_the_real_model(kind: str) -> None:
    x, _ = batch()
    real = trace(models.TinyGPT(), (x,))
    meta = trace(build(kind), (x,))
    assert fingerprint(meta.graph) == fingerprint(real.graph)


@pytest.mark.parametrize("kind", ["deferred", "meta"])
@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_meta_model_trains_like_materialize(kind: str, num_stages: int) -> None:
    ref, ref_loss = reference(kind)
    x, y = batch()
    torch.manual_seed(SEED)
    model = build(kind)
    pm = replica.auto_parallel(model, (x,), num_stages=num_stages, num_microbatches=4, init=INIT[kind],
                               loss_fn=models.lm_loss)
    assert pm.plan.num_stages == num_stages
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    loss = pm.train_step(x, y)
    torch.testing.assert_close(loss, ref_loss)
    assert_same(pm, ref)


def test_meta_model_loads_weights(tmp_path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    x, y = batch()
    torch.manual_seed(7)
    plain = models.TinyGPT()
    state = {k: v.contiguous() for k, v in plain.state_dict().items() if k != "lm_head.weight"}  # tied: once
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(state, str(path))
    ref = copy.deepcopy(plain)
    ref_loss = models.lm_loss(ref(x), y)
    ref_loss.backward()
    with torch.device("meta"):
        model = models.TinyGPT()
    pm = replica.auto_parallel(model, (x,), num_stages=2, num_microbatches=2, weights=path,
                               init=tiny_gpt_init, loss_fn=models.lm_loss)
    loss = pm.train_step(x, y)
    torch.testing.assert_close(loss, ref_loss.detach())
    assert_same(pm, ref)


def test_init_or_weights_for_a_real_model_is_refused() -> None:
    x, _ = batch()
    with pytest.raises(ConfigError, match="no tensor on the meta device"):
        replica.auto_parallel(models.TinyGPT(), (x,), num_stages=2, init=tiny_gpt_init)
    with pytest.raises(ConfigError, match="weights="):
        replica.auto_parallel(models.TinyGPT(), (x,), num_stages=2, weights="nowhere.safetensors")


def test_hugging_face_gpt2_on_meta_loads_save_pretrained_weights(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager",
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    saved = transformers.GPT2LMHeadModel(cfg)
    saved.save_pretrained(tmp_path, max_shard_size="20KB")  # a sharded index
    ids = torch.randint(0, 128, (4, 16))
    target = torch.randint(0, 128, (4, 16))

    def loss_fn(out, y):
        return models.lm_loss(out.logits, y)

    ref_loss = loss_fn(saved(ids, use_cache=False), target)
    ref_loss.backward()
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    pm = replica.auto_parallel(model, (ids,), example_kwargs={"use_cache": False}, num_stages=2, num_microbatches=2,
                               weights=tmp_path, loss_fn=loss_fn)
    loss = pm.train_step(ids, target)
    torch.testing.assert_close(loss, ref_loss.detach())
    want = dict(saved.named_parameters())
    names = [n for n, _ in pm.named_parameters()]
    assert sorted(names) == sorted(want)
    for name, p in pm.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, msg=name)


def test_nccl_lets_a_meta_model_through(monkeypatch) -> None:
    """Under NCCL a CPU model is refused before any collective; a meta model has no device yet:
    each rank materializes its stages on its current GPU after planning."""
    from replica.planner import agree

    monkeypatch.setattr(agree.dist, "get_backend", lambda group=None: "nccl")
    agree.use_the_model_device(build("meta"))
    agree.use_the_model_device(build("deferred"))  # real buffers, parameters on meta
    with pytest.raises(ConfigError, match="NCCL"):
        agree.use_the_model_device(models.TinyGPT())


def test_a_module_init_cannot_reach_is_named_before_planning(monkeypatch) -> None:
    """init=None needs each parameter-owning module's reset_parameters(): one without it is named,
    with the fix, before any tracing or planning."""
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.gain

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16), Scale(), nn.Linear(16, 4))
    monkeypatch.setattr(replica.api, "trace", lambda *a, **k: pytest.fail("traced before the check"))
    with pytest.raises(ConfigError, match=r"1 module\(s\) own parameters without one: 1 \(Scale\).*init="):
        replica.auto_parallel(model, (torch.randn(8, 16),), num_stages=2)


@pytest.mark.parametrize("num_stages", [2, 4])
def test_hugging_face_llama_on_meta_initializes_like_materialize(num_stages: int) -> None:
    """A Llama built on meta with init=its own _init_weights (which recomputes rotary inv_freq):
    the pipeline's weights are replica.materialize's under the same seed, bit for bit, and so
    are the gradients of one step."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=32,
                                   attn_implementation="eager")
    ids, target = torch.randint(0, 128, (4, 16)), torch.randint(0, 128, (4, 16))

    def loss_fn(out, y):
        return models.lm_loss(out.logits, y)

    def built() -> nn.Module:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(cfg)

    torch.manual_seed(SEED)
    ref = built()
    replica.materialize(ref, init=ref._init_weights)
    ref_loss = loss_fn(ref(ids, use_cache=False), target)
    ref_loss.backward()
    torch.manual_seed(SEED)
    model = built()
    pm = replica.auto_parallel(model, (ids,), example_kwargs={"use_cache": False}, num_stages=num_stages,
                               num_microbatches=2, init=model._init_weights, loss_fn=loss_fn)
    torch.testing.assert_close(pm.train_step(ids, target), ref_loss.detach())
    assert_same(pm, ref)


@pytest.mark.parametrize("schedule, num_stages", [("1f1b", 2), ("zb-v", 4), ("interleaved", 4)])
def test_a_unet_with_long_skips_on_meta(schedule: str, num_stages: int) -> None:
    """Convolutions and group norms (each with reset_parameters), skips across the whole net, and
    layouts with two stages a rank: materialize's weights and the plain model's gradients."""
    case = models.unet(8)
    torch.manual_seed(SEED)
    with torch.device("meta"):
        ref = models.UNet()
    replica.materialize(ref)
    ref_loss = case.loss_fn(ref(*case.example_inputs), case.target)
    ref_loss.backward()
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = models.UNet()
    pm = replica.auto_parallel(model, case.example_inputs, num_stages=num_stages, num_microbatches=4,
                               schedule=schedule, loss_fn=case.loss_fn)
    torch.testing.assert_close(pm.train_step(case.example_inputs, case.target), ref_loss.detach())
    assert_same(pm, ref)


def test_a_replica_checkpoint_loads_into_a_meta_model(tmp_path) -> None:
    """weights= a Replica checkpoint directory (written by the Trainer on 2 stages) gives the
    newest step's weights, as load_into_plain_model does, here on 3 stages."""
    from tests.train_cases import IMAGE_SIZE, run, small_cnn

    run(tmp_path, stop_at=5, num_stages=2)
    want = replica.load_into_plain_model(tmp_path, small_cnn()).state_dict()
    with torch.device("meta"):
        model = small_cnn()
    pm = replica.auto_parallel(model, (torch.randn(8, 3, IMAGE_SIZE, IMAGE_SIZE),), num_stages=3,
                               weights=tmp_path, loss_fn=torch.nn.functional.cross_entropy)
    got = pm.state_dict()
    assert got.keys() == want.keys()
    for name, t in got.items():
        torch.testing.assert_close(t, want[name], rtol=0, atol=0, msg=name)
