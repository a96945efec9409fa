"""A model built on meta across gloo ranks: rank 0 plans it without weights, each rank
allocates and initializes only its own stages' tensors (the others stay on meta, never
allocated), and one step gives ``replica.materialize``'s model's loss and gradients."""

from __future__ import annotations

import pickle

import pytest
import torch

import replica
from replica.launch import run_local
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.test_meta_models import INIT, SEED, batch, build, reference

pytestmark = pytest.mark.distributed

RUN_TIMEOUT_S = 60
STEP_TIMEOUT_S = 30


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
        want = dict(ref.named_parameters())
        names = []
        for name, p in pm.named_parameters():
            torch.testing.assert_close(p.detach(), want[name].detach(), rtol=0, atol=0, msg=name)
            torch.testing.assert_close(p.grad, want[name].grad, msg=name)
            names.append(name)
        # what this rank holds for real: exactly its own stages' parameters; the rest stays on meta
        sizes = {n: p.nbytes for n, p in ref.named_parameters(remove_duplicate=False)}
        canonical = {id(p): n for n, p in ref.named_parameters()}
        alias = {n: canonical[id(p)] for n, p in ref.named_parameters(remove_duplicate=False)}
        own = {alias[n] for s in pm.plan.stages if s.stage_index in {t.stage_index for t in pm.stages}
               for n in s.parameter_names if n in sizes}
        real = {id(p): p.nbytes for p in model.parameters() if not p.is_meta}
        reports.append({"kind": kind, "names": sorted(names), "real_bytes": sum(real.values()),
                        "own_bytes": sum(sizes[n] for n in own), "total_bytes": sum(sizes[n] for n in canonical.values()),
                        "stages": sorted(s.stage_index for s in pm.stages), "loss": loss.item()})
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


def test_meta_model_two_stages_two_replicas_on_four_ranks() -> None:
    results = _run(4, 2)
    assert sorted(tuple(r[0]["stages"]) for r in results) == [(0,), (0,), (1,), (1,)]
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
