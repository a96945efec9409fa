"""The Keras-like trainer in one process: the seed snippet as written, data in every form, evaluation,
prediction, progress and metrics, and a ReplicaError with the fix for every bad argument."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import replica
import replica.defaults
from replica.train.trainer import Trainer, get_trainer
from tests.train_cases import assert_same_weights, images, make_trainer, small_cnn, weights

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
