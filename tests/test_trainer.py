"""The Keras-like trainer in one process: the seed snippet as written, data in every form, evaluation,
prediction, progress and metrics, and a ReplicaError with the fix for every bad argument."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import replica
import replica.defaults
from replica.train.trainer import Trainer, get_trainer
from tests.train_cases import Stop, assert_same_weights, images, make_trainer, small_cnn, weights

# Until replica/__init__.py exports them, the seed snippet reaches the front door here.
if not hasattr(replica, "get_trainer"):
    replica.get_trainer = get_trainer  # type: ignore[attr-defined]


def test_the_seed_snippet_runs_as_written_and_learns() -> None:
    x_train, y_train = images(512, seed=0)
    x_test, y_test = images(256, seed=1)
    torch.manual_seed(0)
    model = small_cnn()

    trainer = replica.get_trainer(config=replica.defaults.default_config(), model=model,
                                  loss=torch.nn.CrossEntropyLoss(),
                                  optimizer=torch.optim.Adam(model.parameters(), lr=1e-3))
    trainer.train_dataset(x_train, y_train, epochs=10)
    accuracy = trainer.evaluate(x_test, y_test)

    assert isinstance(accuracy, float) and accuracy > 0.9
    assert trainer.step == 10 * 16 and trainer.epoch == 10
    assert [h["epoch"] for h in trainer.history] == list(range(10))
    assert trainer.history[-1]["loss"] < trainer.history[0]["loss"]


def test_evaluate_metrics_and_predict() -> None:
    trainer = make_trainer(batch_size=16)
    x, y = images(96)
    trainer.train_dataset(x, y, epochs=1)
    both = trainer.evaluate(x, y, metrics=("loss", "accuracy"))
    assert set(both) == {"loss", "accuracy"}
    with torch.no_grad():
        logits = trainer.model(x)
    torch.testing.assert_close(both["loss"], float(torch.nn.functional.cross_entropy(logits, y)), rtol=1e-5, atol=1e-6)
    assert both["accuracy"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))
    assert trainer.evaluate(x, y, metrics="loss") == pytest.approx(both["loss"])
    torch.testing.assert_close(trainer.predict(x), logits)
    torch.testing.assert_close(trainer.predict(TensorDataset(x, y), batch_size=40), logits)
    assert trainer.model.training, "evaluate and predict leave the model in train mode"


def test_evaluate_before_training_and_a_regression_loss_reports_the_mean_loss() -> None:
    x, y = images(40)
    target = torch.nn.functional.one_hot(y, 10).float()
    trainer = make_trainer(loss=torch.nn.MSELoss(), num_stages=2, num_microbatches=4, batch_size=16)
    value = trainer.evaluate(x, target, batch_size=3)  # batches of 3 (and 1) are padded to 4 micro-batches
    with torch.no_grad():
        want = float(torch.nn.functional.mse_loss(trainer.model(x), target))
    assert value == pytest.approx(want, rel=1e-5)


def test_a_multi_stage_pipeline_trains_like_one_stage() -> None:
    x, y = images(100)
    one = make_trainer(batch_size=32)
    one.train_dataset(x, y, epochs=2)
    three = make_trainer(batch_size=32, num_stages=3, num_microbatches=4, schedule="gpipe")
    three.train_dataset(x, y, epochs=2)
    assert three.pipeline.plan.num_stages == 3 and one.pipeline.plan.num_stages == 1
    assert_same_weights(weights(three.model), weights(one.model))


def test_a_batch_smaller_than_the_micro_batches_is_merged_not_dropped() -> None:
    x, y = images(70)
    trainer = make_trainer(batch_size=32, num_stages=2, num_microbatches=8)
    history = trainer.train_dataset(x, y, epochs=2)
    assert trainer.step == 4  # batches of 32 and 38 (32 + the 6 left over) per epoch
    assert [h["samples"] for h in history] == [70, 70]


def test_datasets_and_loaders_train_like_tensors() -> None:
    x, y = images(80)
    tensors = make_trainer(batch_size=16)
    tensors.train_dataset(x, y, epochs=2)
    dataset = make_trainer(batch_size=16)
    dataset.train_dataset(TensorDataset(x, y), epochs=2)
    assert_same_weights(weights(dataset.model), weights(tensors.model))

    ordered = make_trainer(batch_size=16)
    ordered.train_dataset(x, y, epochs=2, shuffle=False)
    loader = make_trainer()
    loader.train_dataset(DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False), epochs=2)
    assert_same_weights(weights(loader.model), weights(ordered.model))


def test_calls_add_epochs_and_call_back_after_every_step() -> None:
    x, y = images(64)
    trainer = make_trainer(batch_size=16)
    seen = []
    trainer.train_dataset(x, y, epochs=1, on_step_end=lambda t: seen.append(t.step))
    trainer.train_dataset(x, y, epochs=2)
    assert seen == [1, 2, 3, 4] and trainer.step == 12 and trainer.epoch == 3


def test_an_optimizer_factory_and_param_groups_are_used() -> None:
    x, y = images(32)
    trainer = make_trainer(batch_size=16, optimizer=lambda m: (lambda params: torch.optim.SGD(params, lr=0.05)))
    trainer.train_dataset(x, y, epochs=1)
    assert isinstance(trainer.optimizer, torch.optim.SGD) and trainer.optimizer.defaults["lr"] == 0.05

    def grouped(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD([{"params": m.features.parameters(), "lr": 0.1},
                                {"params": m.classifier.parameters(), "lr": 0.01, "momentum": 0.9}], lr=1.0)
    trainer = make_trainer(batch_size=16, optimizer=grouped, num_stages=2)
    trainer.train_dataset(x, y, epochs=1)
    assert [(g["lr"], g["momentum"]) for g in trainer.optimizer.param_groups] == [(0.1, 0), (0.01, 0.9)]


def test_metrics_file_is_jsonl(tmp_path) -> None:
    path = tmp_path / "logs" / "metrics.jsonl"
    x, y = images(64)
    trainer = make_trainer(batch_size=16, log_every_steps=2, metrics_file=str(path))
    trainer.train_dataset(x, y, epochs=2)
    trainer.evaluate(x, y)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    events = [r["event"] for r in records]
    assert events.count("train") == 4 and events.count("epoch") == 2 and events[0] == "plan"
    assert events[-1] == "evaluate" and 0.0 <= records[-1]["accuracy"] <= 1.0
    train = [r for r in records if r["event"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6, 8] and all(r["loss"] > 0 and r["lr"] == 1e-2 for r in train)


def test_progress_prints_an_epoch_line_off_a_terminal_and_a_bar_on_one(capsys, monkeypatch) -> None:
    x, y = images(64)
    make_trainer(batch_size=16, progress=True).train_dataset(x, y, epochs=2)
    out = capsys.readouterr().out
    assert "epoch 1/2: loss" in out and "samples/s" in out
    make_trainer(batch_size=16, progress=False).train_dataset(x, y, epochs=1)
    assert capsys.readouterr().out == ""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    make_trainer(batch_size=16, progress=True).train_dataset(x, y, epochs=1)
    assert "epoch 1/1" in screen.getvalue() and "samples/s" in screen.getvalue()


@pytest.mark.parametrize(("call", "says"), [
    (lambda t, x, y: t.train_dataset(x, y, epochs=0), "epochs must be a positive int"),
    (lambda t, x, y: t.train_dataset(x, y[:10]), "x has 64 samples but y has 10"),
    (lambda t, x, y: t.train_dataset(x, y, batch_size=0), "batch_size must be a positive int"),
    (lambda t, x, y: t.evaluate(x, y, metrics=("f1",)), r"unknown metrics \['f1'\]"),
    (lambda t, x, y: t.evaluate(x, y.float(), metrics="accuracy"), "accuracy compares argmax"),
])
def test_bad_arguments_raise_replica_errors(call, says: str) -> None:
    x, y = images(64)
    with pytest.raises(replica.ReplicaError, match=says):
        call(make_trainer(), x, y)


@pytest.mark.parametrize(("kwargs", "says"), [
    (dict(config={"batch_size": 4}), "config must be a replica.defaults.TrainerConfig"),
    (dict(model="cnn"), "model must be a torch.nn.Module"),
    (dict(model=torch.nn.ReLU()), "has no parameters"),
    (dict(loss=None), "loss must be callable"),
    (dict(loss=torch.nn.CrossEntropyLoss(reduction="none")), "reduction='none'"),
    (dict(optimizer=0.001), "optimizer must be a torch.optim.Optimizer"),
])
def test_bad_trainer_arguments_raise_config_error(kwargs, says: str) -> None:
    model = small_cnn()
    args = dict(config=replica.defaults.default_config(), model=model, loss=torch.nn.CrossEntropyLoss(),
                optimizer=torch.optim.Adam(model.parameters())) | kwargs
    with pytest.raises(replica.ConfigError, match=says):
        get_trainer(**args)


def test_repr_and_type() -> None:
    trainer = make_trainer()
    assert isinstance(trainer, Trainer) and "step=0" in repr(trainer) and trainer.pipeline is None


def test_a_loader_whose_batches_are_smaller_than_the_micro_batches_is_refused_with_the_fix() -> None:
    x, y = images(32)
    trainer = make_trainer(num_stages=2, num_microbatches=8)
    with pytest.raises(replica.ConfigError, match=r"num_microbatches=8 .* batch of 4"):
        trainer.train_dataset(DataLoader(TensorDataset(x, y), batch_size=4))


# --- keyword inputs: a dict of tensors, as Hugging Face batches are ---------------------------

class KeywordNet(torch.nn.Module):
    """Called as ``model(input_ids=..., mask=...)``: a masked bag of embeddings, then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.hidden = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = (self.embed(input_ids) * mask.unsqueeze(-1)).sum(1)  # (B, 8)
        return self.out(torch.relu(self.hidden(h)))  # (B, 4)


class KeywordItems(Dataset):
    """Items ``({"input_ids": ..., "mask": ...}, label)``, as a tokenized dataset gives them."""

    def __init__(self, x: dict[str, torch.Tensor], y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return {key: t[i] for key, t in self.x.items()}, self.y[i]


def tokens(num_samples: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 16, (num_samples, 6), generator=g)  # (B, T)
    mask = (torch.rand(num_samples, 6, generator=g) > 0.2).float()  # (B, T)
    return {"input_ids": ids, "mask": mask}, ids[:, 0] % 4


def keyword_trainer(*, model_seed: int = 0, **config) -> Trainer:
    torch.manual_seed(model_seed)
    model = KeywordNet()
    config.setdefault("progress", False)
    return get_trainer(config=replica.defaults.default_config(**config), model=model,
                       loss=torch.nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_one_step_on_a_dict_of_inputs_equals_plain_torch() -> None:
    x, y = tokens(16)
    trainer = keyword_trainer(batch_size=16, num_stages=2, num_microbatches=4)
    history = trainer.train_dataset(x, y, epochs=1, shuffle=False)
    assert trainer.step == 1 and trainer.pipeline.plan.num_stages == 2
    assert trainer.pipeline.input_spec.positional == 0 and trainer.pipeline.input_spec.keywords == ("input_ids", "mask")

    torch.manual_seed(0)
    reference = KeywordNet()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss = torch.nn.functional.cross_entropy(reference(**x), y)
    loss.backward()
    optimizer.step()
    assert history[0]["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert_same_weights(weights(trainer.model), weights(reference))


def test_a_dict_of_inputs_trains_like_the_positional_tuple() -> None:
    x, y = tokens(40)  # batches of 16 and 24 (the 8 left over merged)
    keywords = keyword_trainer(batch_size=16, num_stages=2, num_microbatches=2)
    history = keywords.train_dataset(x, y, epochs=2)
    positional = keyword_trainer(batch_size=16, num_stages=2, num_microbatches=2)
    positional.train_dataset((x["input_ids"], x["mask"]), y, epochs=2)
    assert keywords.step == 4 and all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert_same_weights(weights(keywords.model), weights(positional.model))


def test_datasets_and_loaders_of_dict_items_train_like_a_dict_of_tensors() -> None:
    x, y = tokens(40)
    tensors = keyword_trainer(batch_size=16)
    tensors.train_dataset(x, y, epochs=1)
    dataset = keyword_trainer(batch_size=16)
    history = dataset.train_dataset(KeywordItems(x, y), epochs=1)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert_same_weights(weights(dataset.model), weights(tensors.model))

    ordered = keyword_trainer(batch_size=16, num_stages=2, num_microbatches=2)
    ordered.train_dataset(x, y, epochs=1, shuffle=False)
    loader = keyword_trainer(num_stages=2, num_microbatches=2)
    history = loader.train_dataset(DataLoader(KeywordItems(x, y), batch_size=16), epochs=1)  # 16, 16 + 8
    assert loader.step == 2 and [h["samples"] for h in history] == [40]
    assert_same_weights(weights(loader.model), weights(ordered.model))


def test_evaluate_and_predict_take_a_dict_and_pad_its_short_batches() -> None:
    x, y = tokens(10)
    trainer = keyword_trainer(batch_size=8, num_stages=2, num_microbatches=4)
    both = trainer.evaluate(x, y, metrics=("loss", "accuracy"), batch_size=3)  # batches of 3 (and 1) padded to 4
    with torch.no_grad():
        logits = trainer.model(**x)
    assert both["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, y)), rel=1e-5)
    assert both["accuracy"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))
    torch.testing.assert_close(trainer.predict(x, batch_size=3), logits)
    torch.testing.assert_close(trainer.predict(DataLoader(KeywordItems(x, y), batch_size=3)), logits)


def test_a_dict_trainer_resumes_from_its_checkpoint_like_an_uninterrupted_run(tmp_path) -> None:
    x, y = tokens(40)
    whole = keyword_trainer(batch_size=16)
    whole.train_dataset(x, y, epochs=3)

    def die(t: Trainer) -> None:
        if t.step == 3:
            raise Stop

    first = keyword_trainer(batch_size=16, checkpoint_dir=str(tmp_path), checkpoint_every_steps=1)
    with pytest.raises(Stop):
        first.train_dataset(x, y, epochs=3, on_step_end=die)
    second = keyword_trainer(batch_size=16, checkpoint_dir=str(tmp_path), checkpoint_every_steps=1, model_seed=1)
    second.train_dataset(x, y, epochs=3)
    assert second.resumed_from.name == "step-00000003" and second.step == 6
    assert_same_weights(weights(second.model), weights(whole.model))


@pytest.mark.parametrize(("x", "says"), [
    ({"input_ids": torch.zeros(8, 6, dtype=torch.long), "mask": torch.ones(7, 6)},
     r"x\['mask'\] has 7 samples along dim 0 but x\['input_ids'\] has 8"),
    ({"input_ids": torch.zeros(8, 6, dtype=torch.long), "mask": True}, r"x\['mask'\] is a bool"),
])
def test_a_bad_dict_of_inputs_raises_config_error_naming_the_key(x, says: str) -> None:
    with pytest.raises(replica.ConfigError, match=says):
        keyword_trainer().train_dataset(x, torch.zeros(8, dtype=torch.long))


def test_a_tiny_gpt2_trains_and_predicts_on_hugging_face_style_batches() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, use_cache=False,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (12, 16))  # (B, T)
    batch = transformers.BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})  # a tokenizer's

    def next_token_loss(out, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), target[:, 1:].flatten())

    trainer = get_trainer(config=replica.defaults.default_config(batch_size=4, num_stages=2, num_microbatches=4,
                                                                 progress=False),
                          model=model, loss=next_token_loss, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3))
    history = trainer.train_dataset(batch, ids, epochs=1)
    assert trainer.step == 3 and trainer.pipeline.plan.num_stages == 2
    assert torch.isfinite(torch.tensor(history[0]["loss"]))
    out = trainer.predict(batch, batch_size=5)  # a last batch of 2 is padded to the 4 micro-batches
    with torch.no_grad():
        torch.testing.assert_close(out.logits, model(**batch).logits, rtol=1e-4, atol=1e-5)
