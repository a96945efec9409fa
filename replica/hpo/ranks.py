"""What each rank of a trial runs: train epoch by epoch through the Trainer, report, stop when pruned."""

from __future__ import annotations

import time
from typing import Any, Callable, Union

import torch
import torch.distributed as dist

from replica.hpo.setup import TrialSetup
from replica.partition.plan import Plan
from replica.train.trainer import Trainer, get_trainer

__all__ = ["Objective", "layout_of", "measure", "train_trial"]

Objective = Union[str, Callable[[Trainer, TrialSetup], float]]  # a metric of Trainer.evaluate, or a function


def measure(trainer: Trainer, setup: TrialSetup, objective: Objective) -> float:
    """The objective after an epoch: a metric of ``trainer.evaluate`` on the validation data
    (the training data when there is none), or ``objective(trainer, setup)``."""
    if callable(objective):
        return float(objective(trainer, setup))
    x, y = setup.valid if setup.valid is not None else setup.train
    return float(trainer.evaluate(x, y, metrics=objective))


def train_trial(rank: int, world_size: int, setup: TrialSetup, seed: int, objective: Objective,
                progress: Any, verdicts: Any, wait_s: float) -> dict[str, Any]:
    """One rank of a trial (started by ``replica.launch.run_local``): after every epoch rank 0
    puts ``(epoch, value)`` on ``progress`` and waits on ``verdicts`` for whether to go on,
    which every rank then follows. Returns the values of the epochs run."""
    torch.manual_seed(seed)  # the same stream as running the setup alone
    start = time.perf_counter()
    trainer = get_trainer(setup.config, setup.model, setup.loss, setup.optimizer)
    values: list[float] = []
    pruned = False
    for epoch in range(setup.epochs):
        trainer.train_dataset(*setup.train, epochs=1)
        values.append(measure(trainer, setup, objective))
        go = [True]
        if rank == 0:
            progress.put((epoch, values[-1]))
            go = [bool(verdicts.get(timeout=wait_s))]
        if world_size > 1:
            dist.broadcast_object_list(go, src=0)
        if not go[0]:
            pruned = True
            break
    assert trainer.pipeline is not None
    return {"values": values, "pruned": pruned, "seconds": time.perf_counter() - start,
            "layout": layout_of(trainer.pipeline.plan)}


def layout_of(plan: Plan) -> dict[str, Any]:
    """What a trial's table shows of its plan (JSON, for Optuna's user attributes)."""
    return {"num_stages": plan.num_stages, "data_parallel_size": plan.data_parallel_size,
            "num_microbatches": plan.num_microbatches, "schedule": plan.schedule}
