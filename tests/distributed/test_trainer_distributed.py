"""The trainer on gloo ranks: the seed snippet learns, each rank's optimizer keeps its groups'
hyper-parameters, and checkpoints move between layouts (4 stages in one process -> 2 ranks ->
4 stages again, and 4 ranks -> 2 ranks) continuing as the uninterrupted run.

One ``run_local`` job per test: starting ranks costs seconds here, a step milliseconds.
Ranks return plain Python values (never tensors) and write checkpoints the parent reads.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from replica.checkpoint.tensors import load_into_plain_model
from replica.launch import run_local
from tests.train_cases import (
    ACROSS_LAYOUTS,
    DATA,
    EPOCHS,
    assert_same_weights,
    images,
    make_trainer,
    run,
    small_cnn,
    weights,
)

pytestmark = pytest.mark.distributed

RUN_TIMEOUT_S = 120


# --------------------------------------------------------------------------- in the ranks


def _seed_snippet() -> dict:
    import replica.defaults
    from replica.train.trainer import get_trainer

    x_train, y_train = images(512, seed=0)
    x_test, y_test = images(256, seed=1)
    torch.manual_seed(0)
    model = small_cnn()
    trainer = get_trainer(config=replica.defaults.default_config(), model=model,
                          loss=torch.nn.CrossEntropyLoss(),
                          optimizer=torch.optim.Adam(model.parameters(), lr=1e-3))
    trainer.train_dataset(x_train, y_train, epochs=10)
    accuracy = trainer.evaluate(x_test, y_test)
    both = trainer.evaluate(x_test, y_test, metrics=("loss", "accuracy"))
    return {"accuracy": accuracy, "both": both, "num_stages": trainer.pipeline.plan.num_stages,
            "replicas": trainer.pipeline.plan.data_parallel_size,
            "step": trainer.step, "predict": tuple(trainer.predict(x_test[:7]).shape),
            "held": sorted(n for n, _ in trainer.pipeline.named_parameters())}


def _param_groups() -> list:
    def grouped(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD([{"params": m.features.parameters(), "lr": 0.1},
                                {"params": m.classifier.parameters(), "lr": 0.01, "momentum": 0.9}], lr=1.0)

    trainer = make_trainer(optimizer=grouped, batch_size=16, num_stages=2)  # a stage on each rank
    x, y = images(32)
    trainer.train_dataset(x, y, epochs=1)
    names = {id(p): n for n, p in trainer.pipeline.named_parameters()}
    return [(g["lr"], g["momentum"], sorted(names[id(p)] for p in g["params"]))
            for g in trainer.optimizer.param_groups]


def _job(rank: int, world_size: int, resume_dir: str, fresh_dir: str, replicas_dir: str) -> dict:
    report = {"snippet": _seed_snippet(), "groups": _param_groups()}
    replicas = run(replicas_dir, num_stages=1, model_seed=0)  # one stage, two data-parallel replicas
    report["replicas"] = (replicas.pipeline.data_parallel_size, replicas.pipeline.data_parallel_rank)
    report["replicas_eval"] = replicas.evaluate(*DATA, metrics=("loss", "accuracy"), batch_size=20)
    resumed = run(resume_dir, num_stages=2)  # from the 4-stage, one-process checkpoint of step 4, on 2 ranks
    report["resumed_from"] = resumed.resumed_from.name
    report["resumed_stages"] = resumed.pipeline.plan.num_stages
    fresh = run(fresh_dir, keep_checkpoints=10, model_seed=0, num_stages=2)  # uninterrupted, on 2 ranks
    report["fresh_step"] = fresh.step
    return report


def _save_on_four(rank: int, world_size: int, directory: str) -> int:
    return run(directory, stop_at=5, num_stages=4, schedule="1f1b").step


def _resume_on_two(rank: int, world_size: int, directory: str) -> str:
    return run(directory, num_stages=2).resumed_from.name


# --------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, torch.Tensor]:
    trainer = run(None, model_seed=0)
    assert trainer.step == 3 * EPOCHS
    return weights(trainer.model)


def test_the_trainer_on_two_ranks(tmp_path: Path, uninterrupted) -> None:
    resume_dir, fresh_dir, replicas_dir = tmp_path / "resume", tmp_path / "fresh", tmp_path / "replicas"
    run(resume_dir, stop_at=5, num_stages=4)  # one process, 4 stages: one shard

    reports = run_local(_job, 2, str(resume_dir), str(fresh_dir), str(replicas_dir), timeout_s=RUN_TIMEOUT_S)

    # the seed snippet learns, and every rank reports the same numbers
    snippet = [r["snippet"] for r in reports]
    # the planner lays the two ranks out (stages or replicas), as auto_parallel does
    assert snippet[0]["accuracy"] > 0.9 and snippet[0]["step"] == 160
    assert snippet[0]["num_stages"] * snippet[0]["replicas"] == 2, snippet[0]
    assert all(s["accuracy"] == snippet[0]["accuracy"] and s["both"] == snippet[0]["both"] for s in snippet)
    assert all(s["predict"] == (7, 10) for s in snippet)
    held = [set(s["held"]) for s in snippet]
    everything = {n for n, _ in small_cnn().named_parameters()}
    if snippet[0]["num_stages"] == 2:  # each rank holds its stage
        assert held[0] and held[1] and not held[0] & held[1] and held[0] | held[1] == everything
    else:  # each replica holds the whole model
        assert held[0] == held[1] == everything

    # each rank's optimizer: only its parameters, each group with the hyper-parameters it was given
    for r in reports:
        for lr, momentum, names in r["groups"]:
            expected = (0.1, 0) if names[0].startswith("features.") else (0.01, 0.9)
            assert (lr, momentum) == expected and all(n.split(".")[0] == names[0].split(".")[0] for n in names)
    assert sorted(n for r in reports for g in r["groups"] for n in g[2]) == sorted(held[0] | held[1])

    # two data-parallel replicas train as one process does; evaluate splits batches between them
    assert [r["replicas"] for r in reports] == [(2, 0), (2, 1)]
    assert_same_weights(weights(load_into_plain_model(replicas_dir, small_cnn())), uninterrupted, **ACROSS_LAYOUTS)
    assert reports[0]["replicas_eval"] == reports[1]["replicas_eval"]
    here = make_trainer()
    load_into_plain_model(replicas_dir, here.model)
    want = here.evaluate(*DATA, metrics=("loss", "accuracy"))
    assert reports[0]["replicas_eval"]["accuracy"] == want["accuracy"]
    assert reports[0]["replicas_eval"]["loss"] == pytest.approx(want["loss"], rel=1e-5)

    # 4 stages in one process -> 2 ranks: resumed from step 4, ends as the uninterrupted run
    assert all(r["resumed_from"] == "step-00000004" and r["resumed_stages"] == 2 for r in reports)
    assert_same_weights(weights(load_into_plain_model(resume_dir, small_cnn())), uninterrupted, **ACROSS_LAYOUTS)
    # 2 ranks uninterrupted == one process
    assert reports[0]["fresh_step"] == 9
    assert_same_weights(weights(load_into_plain_model(fresh_dir, small_cnn())), uninterrupted, **ACROSS_LAYOUTS)

    # 2 ranks (two shards) -> 4 stages in one process
    again = tmp_path / "again"
    again.mkdir()
    shutil.copytree(fresh_dir / "step-00000004", again / "step-00000004")
    resumed = run(again, num_stages=4)
    assert resumed.resumed_from.name == "step-00000004"
    assert_same_weights(weights(resumed.model), uninterrupted, **ACROSS_LAYOUTS)


@pytest.mark.slow
def test_four_ranks_to_two(tmp_path: Path, uninterrupted) -> None:
    assert run_local(_save_on_four, 4, str(tmp_path), timeout_s=RUN_TIMEOUT_S) == [5] * 4
    step = tmp_path / "step-00000004"
    assert (step / "__3_0.distcp").is_file() and (step / "rank-00003.pt").is_file()  # every rank wrote its own
    assert run_local(_resume_on_two, 2, str(tmp_path), timeout_s=RUN_TIMEOUT_S) == ["step-00000004"] * 2
    assert_same_weights(weights(load_into_plain_model(tmp_path, small_cnn())), uninterrupted, **ACROSS_LAYOUTS)
