"""What replica.hpo.search costs per trial over training the same configuration alone, and what
running trials side by side (workers=2) gains on this machine.

    python benchmarks/hpo_overhead.py --rounds 5

Each round, back to back: the configuration trained alone in this process (get_trainer, as a
user would), then a 1-trial search of it (a fresh rank: spawn, imports, planning, the data sent,
training, reports); then 4 trials with workers=1 and with workers=2. Per-round ratios, their
median and a 95% bootstrap interval (pipeline_vs_torch.median_interval).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import optuna
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, uninstalled

from benchmarks.pipeline_vs_torch import median_interval  # noqa: E402
from examples.cifar10.data import synthetic_cifar  # noqa: E402
from examples.cifar10.model import CifarCNN  # noqa: E402
from replica.defaults import default_config  # noqa: E402
from replica.hpo import TrialSetup, search  # noqa: E402
from replica.hpo.space import as_space, suggest  # noqa: E402
from replica.train.trainer import get_trainer  # noqa: E402

DATA = synthetic_cifar(512, image_size=16, seed=0), synthetic_cifar(128, image_size=16, seed=1)
SPACE = {"lr": [1e-3, 2e-3, 3e-3, 4e-3]}


def build(trial: optuna.Trial) -> TrialSetup:
    model = CifarCNN(channels=(8, 16, 32), hidden=64, image_size=16)  # (B, 3, 16, 16) -> (B, 10)
    return TrialSetup(model=model, loss=torch.nn.CrossEntropyLoss(),
                      optimizer=torch.optim.Adam(model.parameters(), lr=trial.params["lr"]),
                      train=DATA[0], valid=DATA[1], epochs=2, config=default_config(progress=False, batch_size=32))


def alone(lr: float) -> None:
    """The configuration trained in this process, as search's ranks do (seeded, epoch by epoch)."""
    trial = optuna.trial.FixedTrial({"lr": lr})
    suggest(trial, as_space({"lr": [lr]}))  # a FixedTrial lists the parameters suggested
    torch.manual_seed(0)
    setup = build(trial)
    torch.manual_seed(0)
    trainer = get_trainer(setup.config, setup.model, setup.loss, setup.optimizer)
    for _ in range(setup.epochs):
        trainer.train_dataset(*setup.train, epochs=1)
        trainer.evaluate(*setup.valid, metrics="loss")


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)  # as each rank runs
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    one = {"lr": [2e-3]}
    search(build, one, n_trials=1, world_size=2)  # warm: the profile cache, imports
    rows: dict[str, list[float]] = {"alone": [], "search": [], "w1": [], "w2": []}
    for r in range(args.rounds):
        rows["alone"].append(timed(alone, 2e-3))
        rows["search"].append(timed(search, build, one, n_trials=1, world_size=2))
        rows["w1"].append(timed(search, build, SPACE, n_trials=4, workers=1, world_size=2, seed=r))
        rows["w2"].append(timed(search, build, SPACE, n_trials=4, workers=2, world_size=2, seed=r))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in rows.items()), flush=True)

    def cell(values: list[float]) -> str:
        low, high = median_interval(values)
        return f"{statistics.median(values):.3g} ({low:.3g}-{high:.3g})"

    extra = [s - a for s, a in zip(rows["search"], rows["alone"])]
    print("\n| alone (s) | 1-trial search (s) | search - alone (s) | search / alone | 4 trials, workers=1 (s) "
          "| workers=2 (s) | workers=1 / workers=2 |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {cell(rows['alone'])} | {cell(rows['search'])} | {cell(extra)} | "
          f"{cell([s / a for s, a in zip(rows['search'], rows['alone'])])} | {cell(rows['w1'])} | {cell(rows['w2'])} | "
          f"{cell([a / b for a, b in zip(rows['w1'], rows['w2'])])} |")


if __name__ == "__main__":
    main()
