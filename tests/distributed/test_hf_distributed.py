"""A tiny Hugging Face GPT-2 pipelined over 2 gloo ranks: exact loss and gradients, ModelOutput forwards."""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import replica  # noqa: E402
from replica.launch import run_local  # noqa: E402
from tests.conftest import COMPUTE_BOUND  # noqa: E402
from tests.grads import assert_same_grads
from tests.test_hf_models import data, gpt2, plain_loss  # noqa: E402

pytestmark = pytest.mark.distributed


def job(rank: int, world: int, schedule: str) -> bytes:
    model = gpt2()  # seeded: every rank builds the same weights
    ref = copy.deepcopy(model)
    (ids,), kwargs, target = data("gpt2")
    mask = kwargs["attention_mask"]
    ref_loss = plain_loss(ref(ids, attention_mask=mask), target)
    ref_loss.backward()
    pm = replica.auto_parallel(model, (ids,), example_kwargs=dict(attention_mask=mask), num_stages=2,
                               num_microbatches=4, schedule=schedule, loss_fn=plain_loss, device=COMPUTE_BOUND,
                               timeout_s=60)
    assert pm.plan.num_stages == 2
    loss = pm.train_step(ids, target, attention_mask=mask)
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-5, rtol=1e-4)
    assert_same_grads(pm, ref, subset=True, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        out, expected = pm(ids, attention_mask=mask), ref(ids, attention_mask=mask)
    assert type(out) is type(expected)
    torch.testing.assert_close(out.logits, expected.logits, atol=1e-5, rtol=1e-4)
    return pickle.dumps(sorted(n for n, _ in pm.named_parameters()))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt2_on_two_ranks(schedule: str):
    held = [pickle.loads(r) for r in run_local(job, 2, schedule, timeout_s=120)]
    assert held[0] != held[1]
    assert "transformer.wte.weight" in held[0] and "transformer.wte.weight" in held[1]
    assert "lm_head.weight" not in held[0] + held[1]
    assert set(held[0]) | set(held[1]) == {n for n, _ in gpt2().named_parameters()}
