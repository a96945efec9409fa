"""A model built on meta goes through ``auto_parallel`` without its weights: planned on meta,
then materialized (in one process: every stage) with ``replica.materialize``'s weights under
the same seed, and trained with the plain model's gradients."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from torch import nn

import replica
from replica.errors import ConfigError
from replica.partition.partitioner import fingerprint
from replica.partition.trace import trace
from tests import models
from tests.grads import assert_same_grads

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
    assert all(p.device.type == "cpu" for p in pm.parameters())
    assert_same_grads(pm, want, weights=True)


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
    assert_same_grads(pm, want)


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


# --------------------------------------------------------------------------- the Trainer, checkpoints, export


def meta_trainer(directory, *, seed: int, stop_at: int | None = None, epochs: int = 2, **config):
    """The small CNN built on meta, trained through get_trainer on 2 stages (3 steps an epoch; with
    a directory, a checkpoint every 2 steps); with ``stop_at`` the run dies after that step."""
    from replica.defaults import default_config
    from tests.train_cases import small_cnn, train_until

    torch.manual_seed(seed)
    with torch.device("meta"):
        model = small_cnn()
    config.setdefault("num_stages", 2)
    trainer = replica.get_trainer(
        config=default_config(batch_size=32, progress=False, checkpoint_dir=directory,
                              checkpoint_every_steps=2 if directory is not None else None, **config),
        model=model, loss=nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(model.parameters(), lr=1e-2))
    return train_until(trainer, stop_at, epochs)


def spy_on_builds(monkeypatch) -> list[tuple[object, dict[str, torch.Tensor]]]:
    """(weights=, the pipeline's parameters as built) for each auto_parallel the Trainer calls."""
    from replica.train import trainer as trainer_module

    built, real = [], trainer_module.auto_parallel

    def spy(*args, **kwargs):
        pm = real(*args, **kwargs)
        built.append((kwargs.get("weights"), {n: p.detach().clone() for n, p in pm.named_parameters()}))
        return pm

    monkeypatch.setattr(trainer_module, "auto_parallel", spy)
    return built


def test_a_trainer_trains_a_meta_model_and_resumes_it_from_its_own_checkpoint(tmp_path, monkeypatch) -> None:
    """From init, the Trainer's meta model holds materialize's weights; a fresh meta model resumed from
    the checkpoint is materialized from it (weights= the step, no init), then ends as the
    uninterrupted run, bit for bit."""
    from replica.checkpoint import tensors
    from tests.train_cases import small_cnn

    built = spy_on_builds(monkeypatch)
    full = meta_trainer(None, seed=0)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = small_cnn()
    want = replica.materialize(model)
    assert built[0][0] is None
    for name, p in want.named_parameters():
        torch.testing.assert_close(built[0][1][name], p.detach(), rtol=0, atol=0, msg=name)

    meta_trainer(tmp_path, seed=0, stop_at=3)  # saved step 2, died after step 3
    resumed = meta_trainer(tmp_path, seed=1)  # another seed: every weight must come from the checkpoint
    assert resumed.resumed_from.name == "step-00000002" and resumed.step == full.step == 6
    weights, first = built[-1]
    assert weights == resumed.resumed_from
    saved = tensors.StoredWeights(resumed.resumed_from)
    for name, t in first.items():
        torch.testing.assert_close(t, saved.read(name), rtol=0, atol=0, msg=name)
    got, end = dict(resumed.pipeline.named_parameters()), dict(full.pipeline.named_parameters())
    assert got.keys() == end.keys()
    for name, p in end.items():
        torch.testing.assert_close(got[name], p, rtol=0, atol=0, msg=name)


def test_a_meta_trainer_refuses_real_models_with_init_and_devices_it_cannot_use() -> None:
    from tests.train_cases import small_cnn

    model = small_cnn()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(ConfigError, match="init= initialize or load a model built on meta"):
        replica.get_trainer(model=model, loss=nn.CrossEntropyLoss(), optimizer=opt, init=lambda m: None)
    with pytest.raises(ConfigError, match="init must be callable"):
        replica.get_trainer(model=model, loss=nn.CrossEntropyLoss(), optimizer=opt, init="normal")
    with pytest.raises(ConfigError, match=r"config.device='cuda:1'.*materialized .* cpu .*Leave config.device None"):
        meta_trainer(None, seed=0, device="cuda:1")


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory):
    """A tiny HF GPT-2 (tied embedding and head) trained 2 steps through the Trainer on 2 stages:
    (checkpoint_dir, config, the pipeline's state_dict, token ids, its logits on them)."""
    transformers = pytest.importorskip("transformers")
    from replica.defaults import default_config

    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, use_cache=False,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (8, 16))

    def next_token_loss(out, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), target[:, 1:].flatten())

    directory = tmp_path_factory.mktemp("gpt2-checkpoints")
    trainer = replica.get_trainer(
        config=default_config(batch_size=4, num_stages=2, num_microbatches=2, progress=False, checkpoint_dir=directory),
        model=model, loss=next_token_loss, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2))
    trainer.train_dataset({"input_ids": ids}, ids, epochs=1)
    with torch.no_grad():
        logits = trainer.predict({"input_ids": ids}).logits
    state = {k: v.detach().clone() for k, v in trainer.pipeline.state_dict().items()}
    return directory, cfg, state, ids, logits


def from_pretrained(directory, cfg):
    import transformers

    cfg.save_pretrained(directory)
    model, info = transformers.GPT2LMHeadModel.from_pretrained(directory, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mis-shaped
    return model


def assert_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)


def test_an_exported_checkpoint_loads_with_from_pretrained(gpt2_checkpoint, tmp_path) -> None:
    """model.safetensors with the original names, the tied head left out as save_pretrained does:
    from_pretrained gives the pipeline's weights and logits."""
    from safetensors import safe_open

    from replica.checkpoint import store as ckpt

    directory, cfg, state, ids, logits = gpt2_checkpoint
    assert ckpt.read_manifest(directory / "step-00000002")["tied_parameters"] == {
        "transformer.wte.weight": ["lm_head.weight"]}
    written = replica.export_safetensors(directory, tmp_path)
    assert written == tmp_path / "model.safetensors"
    with safe_open(str(written), framework="pt") as f:
        assert "lm_head.weight" not in f.keys() and "transformer.wte.weight" in f.keys()
        assert f.metadata() == {"format": "pt", "replica_step": "2",  # what `replica export` names
                                "replica_checkpoint": str(directory / "step-00000002")}
    model = from_pretrained(tmp_path, cfg)
    assert_state(model.state_dict(), state)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, logits, rtol=1e-5, atol=1e-5)


def test_a_sharded_export_loads_with_from_pretrained_and_into_a_meta_model(gpt2_checkpoint, tmp_path) -> None:
    import json

    import transformers

    directory, cfg, state, ids, _ = gpt2_checkpoint
    written = replica.export_safetensors(directory / "step-00000002", tmp_path, max_shard_bytes="20KB")
    index = json.loads(written.read_text())
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert written.name == "model.safetensors.index.json" and len(shards) > 2
    assert sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == sum(t.nbytes for k, t in state.items() if k != "lm_head.weight")
    assert_state(from_pretrained(tmp_path, cfg).state_dict(), state)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    pm = replica.auto_parallel(model, (ids,), num_stages=2, num_microbatches=2, weights=tmp_path)
    assert_state(pm.state_dict(), state)


def test_the_export_command_and_overwrite(gpt2_checkpoint, tmp_path, capsys) -> None:
    """`replica export CHECKPOINT OUT_DIR` refuses to replace weights without --overwrite; with it,
    a sharded export's files give way to one model.safetensors."""
    from replica.cli import main

    directory, cfg, state, _, _ = gpt2_checkpoint
    assert main(["export", str(directory), str(tmp_path), "--max-shard-size", "20000"]) == 0
    assert main(["export", str(directory), str(tmp_path)]) == 2
    assert "already holds model weights" in capsys.readouterr().err
    assert main(["export", str(directory), str(tmp_path), "--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert_state(from_pretrained(tmp_path, cfg).state_dict(), state)


def test_export_errors_name_the_problem_and_the_fix(gpt2_checkpoint, tmp_path) -> None:
    from replica.checkpoint.store import CheckpointError

    directory, *_ = gpt2_checkpoint
    with pytest.raises(CheckpointError, match="does not exist; pass a checkpoint_dir"):
        replica.export_safetensors(tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no complete checkpoint in .*empty \(0 step-XXXXXXXX"):
        replica.export_safetensors(tmp_path / "empty", tmp_path / "out")
    hf = tmp_path / "hf"
    replica.export_safetensors(directory, hf)
    with pytest.raises(CheckpointError, match="already is a Hugging Face directory"):
        replica.export_safetensors(hf, tmp_path / "out")
    with pytest.raises(ConfigError, match=r"already holds model weights \(model.safetensors\); pass overwrite=True"):
        replica.export_safetensors(directory, hf)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file; pass a directory"):
        replica.export_safetensors(directory, tmp_path / "file")
    for bad in (0, -5, "5XB", 1.5, True):
        with pytest.raises(ConfigError, match="max_shard_bytes must be a positive number of bytes"):
            replica.export_safetensors(directory, tmp_path / "out", max_shard_bytes=bad)
    broken = tmp_path / "broken"
    shutil.copytree(directory / "step-00000002", broken / "step-00000002")
    with open(broken / "step-00000002" / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=r"no complete checkpoint .*; pass a checkpoint_dir"):
        with pytest.warns(RuntimeWarning, match="__0_0.distcp has 100 bytes"):
            replica.export_safetensors(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_write_safetensors_streams_every_dtype_and_shape(tmp_path) -> None:
    from safetensors.torch import load_file

    from replica.weights import WeightsError, write_safetensors

    tensors = [("bf16", torch.randn(3, 5).to(torch.bfloat16)), ("scalar", torch.tensor(2.5)),
               ("empty", torch.zeros(0, 4)), ("bool", torch.tensor([True, False, True])),
               ("transposed", torch.arange(12, dtype=torch.int64).reshape(3, 4).t()), ("u8", torch.arange(5).byte())]
    assert write_safetensors(tmp_path / "a.safetensors", tensors) == sum(t.nbytes for _, t in tensors)
    loaded = load_file(str(tmp_path / "a.safetensors"))
    assert list(loaded) == [n for n, _ in tensors] or sorted(loaded) == sorted(n for n, _ in tensors)
    for name, t in tensors:
        assert loaded[name].dtype == t.dtype
        torch.testing.assert_close(loaded[name], t, rtol=0, atol=0)
    with pytest.raises(WeightsError, match="safetensors cannot store"):
        write_safetensors(tmp_path / "b.safetensors", [("sparse", torch.eye(3).to_sparse())])


def test_export_stores_a_weight_tied_across_shards_once(tmp_path) -> None:
    """A tied weight's copy is stored under each of its names: the manifest's record of the ties
    drops the alias; equal values under names not recorded as tied both stay."""
    from safetensors.torch import load_file

    from replica.checkpoint import store as ckpt

    embedding, norm = torch.randn(8, 4), torch.ones(4)
    state = {"wte.weight": embedding, "ln.weight": norm, "head.weight": embedding.clone(), "ln2.weight": norm.clone()}
    for tied, directory in (({"wte.weight": ("head.weight",)}, tmp_path / "tied"), (None, tmp_path / "untied")):
        ckpt.save(directory, 1, state, {}, {}, keep=1, tied=tied)
        loaded = load_file(str(replica.export_safetensors(directory, directory / "hf")))
        assert sorted(loaded) == sorted(["wte.weight", "ln.weight", "ln2.weight"] + ([] if tied else ["head.weight"]))
        torch.testing.assert_close(loaded["wte.weight"], embedding, rtol=0, atol=0)
