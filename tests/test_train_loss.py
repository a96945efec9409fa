"""The Trainer's loss on a model's output: a torch loss scores a ``ModelOutput``'s logits position by position;
a loss of your own gets the output as is, and a TypeError on a ``ModelOutput`` names ``out.logits``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import replica
from replica.train.loss import ModelLoss
from tests.train_cases import assert_same_weights, weights


def test_a_torch_loss_scores_the_logits_of_every_position() -> None:
    logits, y = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))
    expected = F.cross_entropy(logits.reshape(-1, 7), y.reshape(-1))
    for loss in (torch.nn.CrossEntropyLoss(), F.cross_entropy):
        torch.testing.assert_close(ModelLoss(loss)({"logits": logits, "past": None}, y), expected)
    torch.testing.assert_close(ModelLoss(torch.nn.CrossEntropyLoss())(logits[:, 0], y[:, 0]),
                               F.cross_entropy(logits[:, 0], y[:, 0]))  # plain (batch, classes): as it is
    mse = ModelLoss(torch.nn.MSELoss())({"logits": logits}, torch.zeros_like(logits))
    torch.testing.assert_close(mse, logits.pow(2).mean())


def test_a_loss_of_your_own_that_cannot_take_the_output_names_out_logits() -> None:
    class Output(dict):
        pass

    def mine(out, y):
        return F.cross_entropy(out, y)  # out is not a tensor: torch's TypeError

    with pytest.raises(replica.ConfigError, match=r"out\.logits"):
        ModelLoss(mine)(Output(logits=torch.randn(2, 3)), torch.zeros(2, dtype=torch.long))
    assert ModelLoss(lambda out, y: out["logits"].sum())(Output(logits=torch.ones(2)), None) == 2


def test_the_trainer_trains_a_hugging_face_model_with_cross_entropy_as_plain_torch_does() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8, use_cache=False,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model, plain = transformers.GPT2LMHeadModel(config), transformers.GPT2LMHeadModel(config)
    plain.load_state_dict(model.state_dict())
    ids, labels = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
    trainer = replica.get_trainer(
        config=replica.defaults.default_config(batch_size=4, num_stages=2, num_microbatches=2, progress=False),
        model=model, loss=torch.nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.train_dataset(ids, labels, epochs=1)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    F.cross_entropy(plain(ids).logits.reshape(-1, 32), labels.reshape(-1)).backward()
    opt.step()
    assert_same_weights(weights(model), weights(plain), rtol=1e-5, atol=1e-6)
    accuracy = trainer.evaluate(ids, labels)  # per position, over the logits
    with torch.no_grad():
        expected = (plain(ids).logits.argmax(-1) == labels).float().mean().item()
    assert accuracy == pytest.approx(expected)
