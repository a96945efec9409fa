"""replica.hpo: every trial's result equals the same configuration trained alone, whether trials
run 2 at a time on 1 rank or 1 at a time on 2 ranks; a setup too large for its memory budget is
pruned before it trains; a crash fails its trial only; a restarted study repeats nothing."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from replica.defaults import default_config
from replica.errors import ConfigError
from replica.hpo import TrialSetup, open_storage, search
from replica.hpo.space import as_space, suggest
from replica.train.trainer import get_trainer

optuna.logging.set_verbosity(optuna.logging.ERROR)
REPO = Path(__file__).resolve().parents[1]

SPACE = {"lr": CategoricalDistribution([0.02, 0.05, 0.1]), "crash": [False, True],
         "num_stages": [1, 2], "batch_size": [16, 32]}


class Net(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, width), torch.nn.Linear(width, width)
        self.fc3 = torch.nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))  # (B, 3)


def exploding_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("the loss exploded on purpose")


def hanging_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    time.sleep(600)
    raise AssertionError("unreachable: the trial's timeout kills its ranks first")


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 6, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def build(trial: optuna.Trial, width: int = 16) -> TrialSetup:
    model = Net(width)
    loss = {False: torch.nn.CrossEntropyLoss(), True: exploding_loss, "hang": hanging_loss}[trial.params["crash"]]
    return TrialSetup(model=model, loss=loss, optimizer=torch.optim.SGD(model.parameters(), lr=trial.params["lr"]),
                      train=data(0), valid=data(1), epochs=2,
                      config=default_config(progress=False, log_every_steps=1000))


def alone(params: dict, seed: int = 0) -> list[float]:
    """The configuration trained by itself in this process: the reference each trial must equal."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        trial = optuna.trial.FixedTrial(params)
        suggest(trial, as_space(SPACE))  # a FixedTrial lists the parameters suggested
        setup = build(trial)
        setup = setup.with_config(num_stages=params["num_stages"], batch_size=params["batch_size"])
        torch.manual_seed(seed)
        trainer = get_trainer(setup.config, setup.model, setup.loss, setup.optimizer)
        values = []
        for _ in range(setup.epochs):
            trainer.train_dataset(*setup.train, epochs=1)
            values.append(trainer.evaluate(*setup.valid, metrics="loss"))
        return values


class PruneLr002(optuna.pruners.BasePruner):
    """Prunes the trials with lr=0.02 (each time asked: after their first epoch), no other."""

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        return trial.params.get("lr") == 0.02


def study_with(path: Path, *trials: dict) -> str:
    """A journal file holding a study with ``trials`` queued: they run first, in this order."""
    study = optuna.create_study(storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(path))), study_name="s")
    for params in trials:
        study.enqueue_trial(params)
    return str(path)


@pytest.mark.distributed
@pytest.mark.parametrize("workers, ranks", [(2, 1), (1, 2)])
def test_each_trial_equals_its_configuration_alone(tmp_path: Path, workers: int, ranks: int) -> None:
    queued = [{"lr": 0.1, "crash": False, "num_stages": ranks, "batch_size": 16},  # with 2 workers, side by side
              {"lr": 0.05, "crash": True, "num_stages": 1, "batch_size": 32},  # with a crashing trial
              {"lr": 0.02, "crash": False, "num_stages": 1, "batch_size": 32}][: 3 if workers == 2 else 1]
    storage = study_with(tmp_path / "study.log", *queued)
    page = tmp_path / "study.html"
    study = search(build, SPACE, n_trials=len(queued), workers=workers, ranks_per_trial=ranks, storage=storage,
                   study_name="s", world_size=2, pruner=PruneLr002(), report=page,
                   trial_timeout_s=120)
    trials = sorted(study.trials, key=lambda t: t.number)
    assert [t.params for t in trials] == queued
    for t in trials:
        if t.params["crash"]:  # failed with its error; the others still ran
            assert t.state == TrialState.FAIL and "the loss exploded on purpose" in t.user_attrs["error"]
            continue
        reference = alone(t.params)
        if t.params["lr"] == 0.02:  # stopped by the pruner after its first epoch
            assert t.state == TrialState.PRUNED and t.intermediate_values == {0: reference[0]}
            assert t.user_attrs["pruned_reason"].startswith("pruned by PruneLr002 after epoch 0")
            continue
        assert t.state == TrialState.COMPLETE, t.user_attrs
        seen = [t.intermediate_values[e] for e in range(2)]  # every epoch reported to the pruner
        if ranks == 1:
            assert seen == reference
        else:
            assert seen == pytest.approx(reference, rel=1e-5)
        assert t.value == seen[-1]
        assert t.user_attrs["predicted_step_time_s"] > 0 and t.user_attrs["ranks"] == ranks
    assert trials[0].user_attrs["layout"]["num_stages"] == ranks
    assert "Optimization history" in page.read_text()
    if workers == 2:
        assert "the loss exploded on purpose" in page.read_text()

    # restarted on the same storage: the finished trials are not run again
    again = search(build, SPACE, n_trials=len(queued), workers=workers, ranks_per_trial=ranks, storage=storage,
                   study_name="s", world_size=2)
    assert [(t.number, t.state, t.value) for t in again.trials] == [(t.number, t.state, t.value) for t in trials]


def test_a_setup_too_large_for_its_budget_is_pruned_before_it_trains(tmp_path: Path) -> None:
    def large(trial: optuna.Trial) -> TrialSetup:
        setup = build(trial, width=trial.params["width"])
        return setup.with_config(memory_budget=64 * 1024)  # 64 KiB per device

    study = search(large, {"width": [256], "lr": [0.1], "crash": [False]}, n_trials=1, world_size=1,
                   storage=str(tmp_path / "s.log"))
    (t,) = study.trials
    assert t.state == TrialState.PRUNED
    assert "Net does not fit in 1 stage of" in t.user_attrs["pruned_reason"]
    assert "seconds" not in t.user_attrs and not t.intermediate_values  # never trained


def test_bad_input_is_a_clear_config_error() -> None:
    with pytest.raises(ConfigError, match=r"'lrr' \(did you mean 'lr'\?\).*Fix the name"):
        search(build, {**SPACE, "lrr": [0.1]}, n_trials=1, world_size=1)
    with pytest.raises(ConfigError, match=r"ranks_per_trial=3 is more than the world_size=2.*ranks_per_trial <= 2"):
        search(build, SPACE, n_trials=1, ranks_per_trial=3, world_size=2)
    with pytest.raises(ConfigError, match=r"workers=2 x ranks_per_trial=2 = 4 ranks.*use workers <= 1"):
        search(build, SPACE, n_trials=1, workers=2, ranks_per_trial=2, world_size=2)
    with pytest.raises(ConfigError, match="must return a replica.hpo.TrialSetup"):
        search(lambda trial: None, n_trials=1, world_size=1)
    with pytest.raises(ConfigError, match="space.*optuna distribution"):
        search(build, {"lr": 0.1}, n_trials=1, world_size=1)
    with pytest.raises(ConfigError, match=r"build read trial.params\['crash'\].*add 'crash' to the space"):
        search(build, {"lr": [0.1]}, n_trials=1, world_size=1)
    with pytest.raises(ConfigError, match="storage must be None, a database URL"):
        search(build, SPACE, n_trials=1, world_size=1, storage=42)
    with pytest.raises(ConfigError, match="module-level function"):
        search(build, SPACE, n_trials=1, world_size=1, objective=lambda trainer, setup: 0.0)


@pytest.mark.distributed
def test_a_hanging_trial_fails_with_its_timeout_and_the_study_goes_on() -> None:
    space = {"lr": [0.1], "crash": ["hang"], "num_stages": [1], "batch_size": [16]}
    start = time.perf_counter()
    study = search(build, space, n_trials=1, world_size=1, trial_timeout_s=3)
    (t,) = study.trials
    assert t.state == TrialState.FAIL and "outlived trial_timeout_s=3 s" in t.user_attrs["error"]
    assert time.perf_counter() - start < 60


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_a_trial_left_running_by_a_killed_study_runs_again(tmp_path: Path) -> None:
    storage = open_storage(tmp_path / "study.db", heartbeat_s=1)  # a .db path: sqlite, with heartbeats
    killed = optuna.create_study(storage=storage, study_name="s")
    trial = killed.ask({"width": CategoricalDistribution([256]), "lr": CategoricalDistribution([0.1]),
                        "crash": CategoricalDistribution([False])})
    storage.record_heartbeat(trial._trial_id)  # its process beat once, then died
    time.sleep(4.5)  # past the grace period (3 heartbeats), which the database counts in whole seconds

    def large(trial: optuna.Trial) -> TrialSetup:  # pruned before training: no process to start
        return build(trial, width=trial.params["width"]).with_config(memory_budget=64 * 1024)

    study = search(large, {"width": [256], "lr": [0.1], "crash": [False]}, n_trials=2, world_size=1,
                   storage=storage, study_name="s")
    first, again = sorted(study.trials, key=lambda t: t.number)
    assert first.state == TrialState.FAIL and again.state == TrialState.PRUNED
    assert again.params == first.params and again.system_attrs["failed_trial"] == first.number


@pytest.mark.slow
def test_the_cifar10_example_searches_and_writes_its_page(tmp_path: Path) -> None:
    page = tmp_path / "hpo.html"  # 1 trial, 1 epoch on 64 images
    done = subprocess.run([sys.executable, str(REPO / "examples" / "cifar10" / "hpo.py"), "--trials", "1",
                           "--workers", "1", "--train-size", "64", "--epochs", "1", "--report", str(page)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trial 0:" in done.stdout and page.exists()


def test_gpu_trials_take_their_own_group_of_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine with 4 GPUs (faked here: the ranks are not started), 2 workers x 2 ranks: each
    running trial holds its own 2 GPUs, no GPU is in two trials at once, and the model goes to
    ``"cuda"`` (the rank's current GPU); a setup that puts it on the CPU is refused."""
    import importlib
    import threading

    from replica.launch import run_local

    search_module = importlib.import_module("replica.hpo.search")  # the module: replica.hpo.search is the function

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(search_module, "make_plan", lambda *a, **k: replica_plan_on_cpu(*a, **k))
    held: set[int] = set()
    seen: list[tuple[tuple[int, ...], str]] = []
    lock = threading.Lock()

    def fake_run_local(fn, world, setup, *args, gpus=None, **kwargs):  # noqa: ANN001
        with lock:
            assert gpus is not None and len(gpus) == world == 2 and not held & set(gpus), (gpus, held)
            held.update(gpus)
            seen.append((gpus, setup.config.device))
        time.sleep(0.05)  # side by side with the other worker's trial
        with lock:
            held.difference_update(gpus)
        return [{"values": [1.0], "pruned": False, "seconds": 0.0, "layout": {}}] * world

    monkeypatch.setattr(search_module, "run_local", fake_run_local)
    space = {**SPACE, "crash": [False], "num_stages": [1]}
    study = search(build, space, n_trials=6, workers=2, ranks_per_trial=2)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 6
    assert {g for g, _ in seen} == {(0, 1), (2, 3)} and {d for _, d in seen} == {"cuda"}, seen
    assert {tuple(t.user_attrs["gpus"]) for t in study.trials} == {(0, 1), (2, 3)}

    with pytest.raises(ConfigError, match=r"workers=3 x ranks_per_trial=2 = 6 GPUs.*4.*use workers <= 2"):
        search(build, space, n_trials=1, workers=3, ranks_per_trial=2)
    with pytest.raises(ConfigError, match=r"ranks_per_trial=3 is more than the 2 GPUs.*\[1, 3\]"):
        search(build, space, n_trials=1, ranks_per_trial=3, devices=[1, 3])
    with pytest.raises(ConfigError, match=r"names GPU 7, but this machine has 4 CUDA"):
        search(build, space, n_trials=1, devices=[0, 7])
    with pytest.raises(ConfigError, match=r"devices must be 'auto', 'cpu' or a list"):
        search(build, space, n_trials=1, devices="gpu")
    with pytest.raises(ConfigError, match=r"world_size=8 is more than the 4 GPUs"):
        search(build, space, n_trials=1, world_size=8)

    def on_cpu(trial: optuna.Trial) -> TrialSetup:
        return build(trial).with_config(device="cpu")

    failed = search(on_cpu, space, n_trials=1)
    assert "device='cpu'" in failed.trials[0].user_attrs["error"] and "devices='cpu'" in \
        failed.trials[0].user_attrs["error"]
    with pytest.raises(ConfigError, match=r"run_local\(gpus=\[0\]\) must name 2 different GPU indices"):
        run_local(print, 2, gpus=[0])


def replica_plan_on_cpu(*args, **kwargs):  # noqa: ANN002, ANN003
    """The trial's plan as the CPU prices it: "cuda" names no preset where CUDA is faked."""
    from replica.api import plan

    return plan(*args, **{**kwargs, "device": None})


def test_gpu_trials_need_gpus() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from replica.launch import run_local

    with pytest.raises(ConfigError, match=r"names GPU 0, but this machine has 0 CUDA device\(s\): pass devices='cpu'"):
        search(build, SPACE, n_trials=1, devices=[0])
    with pytest.raises(ConfigError, match=r"run_local\(gpus=\[0\]\) names GPU 0.*no CUDA: leave gpus=None"):
        run_local(print, 1, gpus=[0])
