"""A model built on meta across gloo ranks: rank 0 plans it without weights, each rank
allocates and initializes only its own stages' tensors (the others stay on meta, never
allocated), and one step gives ``replica.materialize``'s model's loss and gradients: TinyGPT,
a Hugging Face Llama (grouped-query attention, traced by torch.export) and the U-Net with long
skips, on 2 ranks and on 4 (4 stages, or 2 stages x 2 replicas). The Trainer trains a meta
model and resumes a fresh one from its checkpoint, each rank reading only its own share.

One ``run_local`` job per test checks several models: starting ranks costs seconds here.
"""

from __future__ import annotations

import pickle

import pytest
import torch

import replica
from replica.launch import run_local
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.grads import assert_same_grads
from tests.test_meta_models import INIT, SEED, batch, build, reference

pytestmark = pytest.mark.distributed

RUN_TIMEOUT_S = 60
STEP_TIMEOUT_S = 30


def _holding(pm: replica.PipelineModel, model: torch.nn.Module, ref: torch.nn.Module) -> dict:
    """What this rank holds for real, against exactly its own stages' parameters (the rest on meta)."""
    sizes = {n: p.nbytes for n, p in ref.named_parameters(remove_duplicate=False)}
    canonical = {id(p): n for n, p in ref.named_parameters()}
    alias = {n: canonical[id(p)] for n, p in ref.named_parameters(remove_duplicate=False)}
    own = {alias[n] for s in pm.plan.stages if s.stage_index in {t.stage_index for t in pm.stages}
           for n in s.parameter_names if n in sizes}
    real = {id(p): p.nbytes for p in model.parameters() if not p.is_meta}
    return {"names": sorted(n for n, _ in pm.named_parameters()), "real_bytes": sum(real.values()),
            "own_bytes": sum(sizes[n] for n in own), "total_bytes": sum(sizes[n] for n in canonical.values()),
            "stages": sorted(s.stage_index for s in pm.stages), "replica": pm.data_parallel_rank}


def _assert_grads(pm: replica.PipelineModel, ref: torch.nn.Module) -> None:
    assert_same_grads(pm, ref, subset=True, weights=True)


def meta_job(rank: int, world: int, num_stages: int, weights: str | None = None) -> bytes:
    reports = []
    for kind in ("deferred", "meta"):
        x, y = batch()
        if weights is None:
            ref, ref_loss = reference(kind)
        else:  # the saved model's weights
            torch.manual_seed(7)
            ref = models.TinyGPT()
            ref_loss = models.lm_loss(ref(x), y)
            ref_loss.backward()
            ref_loss = ref_loss.detach()
        torch.manual_seed(SEED + rank if weights is None and rank else SEED)  # rank 0's seed is the one
        model = build(kind)
        pm = replica.auto_parallel(model, (x,), num_stages=num_stages, num_microbatches=2, init=INIT[kind],
                                   weights=weights, loss_fn=models.lm_loss, device=COMPUTE_BOUND,
                                   timeout_s=STEP_TIMEOUT_S)
        loss = pm.train_step(x, y)
        torch.testing.assert_close(loss, ref_loss)
        _assert_grads(pm, ref)
        reports.append({"kind": kind, **_holding(pm, model, ref), "loss": loss.item()})
    return pickle.dumps(reports)


def _run(world: int, *args) -> list[list[dict]]:
    return [pickle.loads(r) for r in run_local(meta_job, world, *args, timeout_s=RUN_TIMEOUT_S)]


def _check(results: list[list[dict]], num_stages: int) -> None:
    for reports in results:
        for r in reports:
            assert r["real_bytes"] == r["own_bytes"] < r["total_bytes"], r
    for i in range(2):
        held = set()
        for reports in results:
            held |= set(reports[i]["names"])
        assert len(held) == len({n for n, _ in models.TinyGPT().named_parameters()})
        assert len({reports[i]["loss"] for reports in results}) == 1


def test_meta_model_two_stages_on_two_ranks() -> None:
    results = _run(2, 2)
    assert [r[0]["stages"] for r in results] == [[0], [1]]
    _check(results, 2)


def test_meta_model_loads_its_stages_weights(tmp_path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    torch.manual_seed(7)
    state = {k: v.contiguous() for k, v in models.TinyGPT().state_dict().items() if k != "lm_head.weight"}
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(state, str(path))
    results = _run(2, 2, str(path))
    _check(results, 2)


def hf_meta_job(rank: int, world: int, directory: str) -> bytes:
    """A Hugging Face GPT-2 (traced by torch.export) built on meta, loaded by each rank for its stages."""
    import transformers

    cfg = transformers.GPT2Config.from_pretrained(directory)
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (4, 16))
    target = torch.randint(0, 128, (4, 16))

    def loss_fn(out, y):
        return models.lm_loss(out.logits, y)

    saved = transformers.GPT2LMHeadModel.from_pretrained(directory)
    ref_loss = loss_fn(saved(ids, use_cache=False), target)
    ref_loss.backward()
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    pm = replica.auto_parallel(model, (ids,), example_kwargs={"use_cache": False}, num_stages=2, num_microbatches=2,
                               weights=directory, loss_fn=loss_fn, device=COMPUTE_BOUND, timeout_s=STEP_TIMEOUT_S)
    loss = pm.train_step(ids, target)
    torch.testing.assert_close(loss, ref_loss.detach())
    want = dict(saved.named_parameters())
    names = []
    for name, p in pm.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, msg=name)
        names.append(name)
    real = sum(p.nbytes for p in model.parameters() if not p.is_meta)
    return pickle.dumps({"names": names, "real_bytes": real, "total_bytes": sum(p.nbytes for p in saved.parameters())})


def test_hugging_face_gpt2_on_meta_over_two_ranks(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager",
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    results = [pickle.loads(r) for r in run_local(hf_meta_job, 2, str(tmp_path), timeout_s=RUN_TIMEOUT_S * 2)]
    for r in results:
        assert 0 < r["real_bytes"] < r["total_bytes"], r
    held = {n for r in results for n in r["names"]}
    with torch.device("meta"):
        assert held == {n for n, _ in transformers.GPT2LMHeadModel(cfg).named_parameters()}


# --------------------------------------------------------------------------- Llama and the U-Net


def _llama() -> tuple:
    """(build, init_of, inputs, target, loss_fn, extra auto_parallel arguments): a tiny Llama with
    grouped-query attention (4 heads, 2 key/value heads), built on meta, initialized by its own
    ``_init_weights`` (which recomputes rotary ``inv_freq``)."""
    import transformers

    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
                                   attn_implementation="eager")

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(cfg)

    g = torch.Generator().manual_seed(1)
    ids, target = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
    return (build, lambda m: m._init_weights, ids, target, lambda out, y: models.lm_loss(out.logits, y),
            {"example_kwargs": {"use_cache": False}})


def _unet() -> tuple:
    """The U-Net: convolutions and group norms (each with reset_parameters), skips across the net."""
    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return models.UNet()

    g = torch.Generator().manual_seed(2)
    x, target = torch.randn(8, 3, 16, 16, generator=g), torch.randn(8, 3, 16, 16, generator=g)
    return build, lambda m: None, x, target, models.mse_loss, {}


def _like_materialize(case: tuple, **layout) -> dict:
    """One step of the case's meta model through auto_parallel: loss, weights and the ``.grad``
    this rank holds equal ``replica.materialize``'s plain model's under the same seed."""
    build, init_of, x, target, loss_fn, extra = case
    torch.manual_seed(SEED)
    ref = build()
    replica.materialize(ref, init=init_of(ref))
    ref_loss = loss_fn(ref(x, **extra.get("example_kwargs", {})), target)
    ref_loss.backward()
    torch.manual_seed(SEED)
    model = build()
    pm = replica.auto_parallel(model, (x,), init=init_of(model), loss_fn=loss_fn, device=COMPUTE_BOUND,
                               timeout_s=STEP_TIMEOUT_S, **extra, **layout)
    torch.testing.assert_close(pm.train_step(x, target), ref_loss.detach())
    _assert_grads(pm, ref)
    return {**_holding(pm, model, ref), "num_stages": pm.plan.num_stages,
            "replicas": pm.data_parallel_size}


def _check_holdings(reports: list[dict], num_stages: int, replicas: int) -> None:
    """Every rank holds exactly its own stages; each replica's ranks hold every parameter once."""
    for r in reports:
        assert (r["num_stages"], r["replicas"]) == (num_stages, replicas), r
        assert r["real_bytes"] == r["own_bytes"] < r["total_bytes"], r
    for k in range(replicas):
        mine = [r for r in reports if r["replica"] == k]
        assert sorted(s for r in mine for s in r["stages"]) == list(range(num_stages))
        held = [n for r in mine for n in r["names"]]
        assert len(held) == len(set(held)) == len(set().union(*(r["names"] for r in reports)))


# --------------------------------------------------------------------------- the Trainer


def _meta_trainer_resumes(directory: str) -> dict:
    """The small CNN on meta through get_trainer on 2 ranks: uninterrupted; dies after step 3;
    then a fresh meta model resumes from step 2. Each rank checksums a share of the checkpoint,
    materializes only its stages, from the checkpoint, and ends as the uninterrupted run."""
    from replica.checkpoint import store as ckpt
    from replica.checkpoint.tensors import StoredWeights
    from replica.train import trainer as trainer_module
    from tests.test_meta_models import meta_trainer
    from tests.train_cases import small_cnn

    full = meta_trainer(None, seed=0, num_stages=2, timeout_s=STEP_TIMEOUT_S)
    meta_trainer(directory, seed=0, stop_at=3, num_stages=2, timeout_s=STEP_TIMEOUT_S)
    hashed, sha256 = [], ckpt._sha256
    built, auto_parallel = [], trainer_module.auto_parallel

    def spy_sha256(path):
        if path.parent.name == "step-00000002":
            hashed.append(path.name)
        return sha256(path)

    def spy_build(*args, **kwargs):
        pm = auto_parallel(*args, **kwargs)
        built.append((kwargs["weights"], {n: p.detach().clone() for n, p in pm.named_parameters()}))
        return pm

    ckpt._sha256, trainer_module.auto_parallel = spy_sha256, spy_build
    try:
        resumed = meta_trainer(directory, seed=1, num_stages=2, timeout_s=STEP_TIMEOUT_S)
    finally:
        ckpt._sha256, trainer_module.auto_parallel = sha256, auto_parallel
    [(weights, first)] = built
    assert weights == resumed.resumed_from and resumed.resumed_from.name == "step-00000002"
    saved = StoredWeights(resumed.resumed_from)
    for name, t in first.items():  # as materialized: the saved weights
        torch.testing.assert_close(t, saved.read(name), rtol=0, atol=0, msg=name)
    end = dict(full.pipeline.named_parameters())
    for name, p in resumed.pipeline.named_parameters():
        torch.testing.assert_close(p, end[name], rtol=0, atol=0, msg=name)
    with torch.device("meta"):
        whole = small_cnn()
    return {"hashed": sorted(hashed), "step": resumed.step, "names": sorted(first),
            "real_bytes": sum(p.nbytes for p in resumed.model.parameters() if not p.is_meta),
            "own_bytes": sum(p.nbytes for _, p in resumed.pipeline.named_parameters()),
            "total_bytes": sum(p.nbytes for p in whole.parameters())}


def two_rank_job(rank: int, world: int, directory: str) -> bytes:
    return pickle.dumps({"llama": _like_materialize(_llama(), num_stages=2, num_microbatches=2, schedule="1f1b"),
                         "unet": _like_materialize(_unet(), num_stages=2, num_microbatches=4, schedule="1f1b"),
                         "trainer": _meta_trainer_resumes(directory)})


def four_rank_job(rank: int, world: int) -> bytes:
    return pickle.dumps({"tiny_gpt": pickle.loads(meta_job(rank, world, 2)),
                         "llama": _like_materialize(_llama(), num_stages=2, data_parallel_size=2, num_microbatches=2,
                                                    schedule="1f1b"),
                         "unet": _like_materialize(_unet(), num_stages=4, num_microbatches=4, schedule="1f1b")})


def test_llama_unet_and_a_resumed_meta_trainer_on_two_ranks(tmp_path) -> None:
    pytest.importorskip("transformers")
    from replica.checkpoint import store as ckpt

    results = [pickle.loads(r) for r in run_local(two_rank_job, 2, str(tmp_path), timeout_s=RUN_TIMEOUT_S * 2)]
    _check_holdings([r["llama"] for r in results], 2, 1)
    _check_holdings([r["unet"] for r in results], 2, 1)
    trainers = [r["trainer"] for r in results]
    for t in trainers:
        assert t["step"] == 6 and t["real_bytes"] == t["own_bytes"] < t["total_bytes"], t
    assert not set(trainers[0]["names"]) & set(trainers[1]["names"])
    # the checkpoint's files are checksummed once, each by one rank: none reads the whole of it
    files = sorted(ckpt.read_manifest(tmp_path / "step-00000002")["files"])
    shares = [set(t["hashed"]) for t in trainers]
    assert all(shares) and not shares[0] & shares[1] and sorted(shares[0] | shares[1]) == files


def test_tiny_gpt_and_llama_two_stages_two_replicas_and_unet_four_stages_on_four_ranks() -> None:
    pytest.importorskip("transformers")
    results = [pickle.loads(r) for r in run_local(four_rank_job, 4, timeout_s=RUN_TIMEOUT_S * 2)]
    tiny_gpt = [r["tiny_gpt"] for r in results]
    assert sorted(tuple(r[0]["stages"]) for r in tiny_gpt) == [(0,), (0,), (1,), (1,)]
    _check(tiny_gpt, 2)
    _check_holdings([r["llama"] for r in results], 2, 2)
    _check_holdings([r["unet"] for r in results], 4, 1)
