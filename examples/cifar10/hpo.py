"""Search the CIFAR-10 CNN's hyper-parameters with Optuna through Replica: each trial planned first
(a setup too large for --memory-budget is pruned before it trains), then trained by the trainer
on its own ranks; pruners stop poor trials after an epoch; the page shows the trials and plots.

    python examples/cifar10/hpo.py                                  # synthetic data, 8 trials, 2 at a time
    python examples/cifar10/hpo.py --ranks-per-trial 2 --workers 1  # each trial a 2-rank pipeline
    python examples/cifar10/hpo.py --storage hpo.log                # resumable: run it again to continue
    python examples/cifar10/hpo.py --data-dir ~/data/cifar-10-batches-py --trials 30 --epochs 10

Several machines join one study by sharing --storage (a database URL, or a journal file on a shared disk).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import optuna
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `replica`, `examples` uninstalled

from examples.cifar10.data import load_cifar10, synthetic_cifar  # noqa: E402
from examples.cifar10.model import CifarCNN  # noqa: E402
from replica.defaults import default_config  # noqa: E402
from replica.hpo import TrialSetup, search  # noqa: E402

MIB = 2**20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=None, help="the real CIFAR-10 (python batches); default: synthetic data")
    p.add_argument("--train-size", type=int, default=1024, help="training images (synthetic, or the first N real)")
    p.add_argument("--trials", type=int, default=8, help="trials in the study in all (those in --storage count)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="trials at a time")
    p.add_argument("--ranks-per-trial", type=int, default=1)
    p.add_argument("--memory-budget-mib", type=float, default=32.0, help="per device: larger setups are pruned")
    p.add_argument("--storage", default=None, help="hpo.db (sqlite) or a journal file (hpo.log); default: in memory")
    p.add_argument("--report", default="hpo.html", help="the study's page: trials table and Optuna's plots")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.data_dir:
        x_train, y_train, x_valid, y_valid = load_cifar10(args.data_dir)
        x_train, y_train = x_train[:args.train_size], y_train[:args.train_size]
    else:
        x_train, y_train = synthetic_cifar(args.train_size, image_size=16, seed=args.seed)  # (N, 3, 16, 16), (N,)
        x_valid, y_valid = synthetic_cifar(max(1, args.train_size // 4), image_size=16, seed=args.seed + 1)
    image_size = x_train.shape[-1]

    space = {
        "lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True),
        "width": [8, 16, 32],                # channels of the first block; doubled per block
        "hidden": [64, 256, 8192],           # 8192: too large for the default budget, pruned unplanned
        "batch_size": [32, 64],              # a TrainerConfig field: applied to the trial's config
    }

    def build(trial: optuna.Trial) -> TrialSetup:
        p = trial.params
        w = p["width"]
        model = CifarCNN(channels=(w, 2 * w, 4 * w), hidden=p["hidden"], image_size=image_size)
        config = default_config(memory_budget=args.memory_budget_mib * MIB, progress=False, seed=args.seed)
        return TrialSetup(model=model, loss=torch.nn.CrossEntropyLoss(),
                          optimizer=torch.optim.Adam(model.parameters(), lr=p["lr"]),
                          train=(x_train, y_train), valid=(x_valid, y_valid), epochs=args.epochs, config=config)

    study = search(build, space, n_trials=args.trials, workers=args.workers, ranks_per_trial=args.ranks_per_trial,
                   storage=args.storage, objective="accuracy", seed=args.seed, report=args.report,
                   pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1))
    for t in sorted(study.trials, key=lambda t: t.number):
        note = (t.user_attrs.get("pruned_reason") or t.user_attrs.get("error") or "").strip()
        value = f"{t.value:.2%}" if t.value is not None else "-"
        why = note.splitlines()[0][:90] if note else ""
        print(f"trial {t.number}: {t.state.name:8s} accuracy {value:>7s}  {t.params}  {why}")
    if any(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials):
        print(f"best: trial {study.best_trial.number}, accuracy {study.best_value:.2%}, {study.best_params}")
    print(f"report: {args.report}")


if __name__ == "__main__":
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    main()
