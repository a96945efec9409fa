"""``search``: an Optuna study whose trials are planned first, then trained on their own group of ranks.

Each trial: ``build(trial)`` (under the search's seed) gives a :class:`TrialSetup`; the
planner lays it out on ``ranks_per_trial`` ranks within ``config.memory_budget``: a setup
that cannot fit is pruned before it trains, the planner's reason in the trial's
``pruned_reason`` user attribute, and a plan's predicted step time is recorded. Then
``ranks_per_trial`` fresh processes (gloo on 127.0.0.1; NCCL on a group of GPUs) train it through the Trainer, and
after every epoch the objective is reported to Optuna, whose pruner may stop the trial.
``workers`` trials run at a time (Optuna's threads, each waiting on its own ranks). A
trial that crashes or outlives ``trial_timeout_s`` fails with its error (user attribute
``error``) and the study goes on. With ``storage`` the study lives in a file that another
``search`` call (a restart, or another machine) continues: finished trials are not run again.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping

import optuna
import torch
from optuna.storages import BaseStorage, JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import JournalFileBackend
from optuna.study import MaxTrialsCallback
from optuna.trial import TrialState

from replica.api import plan as make_plan
from replica.errors import ConfigError, PartitionError, ReplicaError
from replica.hpo.ranks import Objective, layout_of, train_trial
from replica.hpo.report import write_report
from replica.hpo.setup import TrialSetup, first_batch
from replica.hpo.space import Reading, as_space, check_read, config_params, suggest
from replica.launch import run_local

__all__ = ["search", "open_storage", "FINISHED"]

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)  # what n_trials counts
_ERROR_CHARS = 4000  # an error kept in the trial's user attributes is cut to this length
_GRACE_S = 5.0  # a trial's ranks still running this long past trial_timeout_s are killed


class _TrialFailed(Exception):
    """A trial's own failure (a crash, a hang, a setup that cannot be planned): the study goes on."""


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def open_storage(storage: Any, heartbeat_s: int = 10) -> BaseStorage | None:
    """Optuna's storage for ``storage``: None (in memory), an Optuna storage as it is, a database URL
    (``"sqlite:///study.db"``, or a path ending in ``.db`` / ``.sqlite``: a trial whose process was
    killed stops beating and is run again), or any other file path (Optuna's journal file, which
    processes on several machines may share over NFS)."""
    if storage is None or isinstance(storage, BaseStorage):
        return storage
    if isinstance(storage, (str, os.PathLike)) and "://" not in str(storage) \
            and Path(storage).suffix in (".db", ".sqlite", ".sqlite3"):
        storage = f"sqlite:///{Path(storage).resolve()}"  # a database file named as one
    if isinstance(storage, str) and "://" in storage:
        with warnings.catch_warnings():  # Optuna calls its heartbeat experimental
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return RDBStorage(storage, heartbeat_interval=heartbeat_s, grace_period=3 * heartbeat_s,
                              heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1))
    if isinstance(storage, (str, os.PathLike)) and str(storage):
        return JournalStorage(JournalFileBackend(str(storage)))
    raise ConfigError(f"storage must be None, a database URL ('sqlite:///study.db'), a journal file path or an "
                      f"optuna storage, got {storage!r}")


def trial_gpus(devices: Any) -> tuple[int, ...] | None:
    """The GPUs trials run on: ``"auto"`` every GPU of this machine (None where it has no CUDA: CPU
    ranks), ``"cpu"`` None, a list of GPU indices those."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices == "auto":
        return tuple(range(have)) or None
    if devices == "cpu":
        return None
    if isinstance(devices, (str, bytes)) or not isinstance(devices, (list, tuple, range)) or not devices \
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices) \
            or len(set(devices)) != len(devices):
        raise ConfigError(f"devices must be 'auto', 'cpu' or a list of different GPU indices, got {devices!r}")
    if max(devices) >= have:
        hint = "" if have else ": pass devices='cpu' (or leave it 'auto') for CPU trials"
        raise ConfigError(f"devices={list(devices)} names GPU {max(devices)}, but this machine has {have} CUDA "
                          f"device(s){hint}")
    return tuple(devices)


def gpu_groups(gpus: tuple[int, ...], ranks_per_trial: int, workers: int) -> list[tuple[int, ...]]:
    """The GPUs split into ``workers`` groups of ``ranks_per_trial``, one a running trial, in order."""
    if workers * ranks_per_trial > len(gpus):
        raise ConfigError(f"workers={workers} x ranks_per_trial={ranks_per_trial} = {workers * ranks_per_trial} GPUs "
                          f"at once, but the trials have {len(gpus)} ({list(gpus)}): use workers <= "
                          f"{len(gpus) // ranks_per_trial}" if ranks_per_trial <= len(gpus) else
                          f"ranks_per_trial={ranks_per_trial} is more than the {len(gpus)} GPUs the trials have "
                          f"({list(gpus)}): use ranks_per_trial <= {len(gpus)}, or more devices")
    return [gpus[i * ranks_per_trial:(i + 1) * ranks_per_trial] for i in range(workers)]


def _check(build: Any, n_trials: Any, workers: Any, ranks_per_trial: Any, world_size: int | None,
           objective: Any, trial_timeout_s: Any, seed: Any, gpus: tuple[int, ...] | None = None) -> int:
    if not callable(build):
        raise ConfigError(f"build must be callable(trial) -> replica.hpo.TrialSetup, got {type(build).__name__}")
    _count("n_trials", n_trials)
    _count("workers", workers)
    _count("ranks_per_trial", ranks_per_trial)
    if gpus is not None:  # the GPUs bound the ranks at once
        gpu_groups(gpus, ranks_per_trial, workers)
        if world_size is not None and _count("world_size", world_size) > len(gpus):
            raise ConfigError(f"world_size={world_size} is more than the {len(gpus)} GPUs the trials run on "
                              f"({list(gpus)}): leave world_size out with GPU trials, or pass devices='cpu'")
    world = (len(gpus) if gpus is not None else (os.cpu_count() or 1)) if world_size is None \
        else _count("world_size", world_size)
    said = f"world_size={world}" + ("" if world_size is not None else " (the trials' GPUs)" if gpus is not None
                                    else " (this machine's CPU cores)")
    if ranks_per_trial > world:
        raise ConfigError(f"ranks_per_trial={ranks_per_trial} is more than the {said} ranks this machine runs: use "
                          f"ranks_per_trial <= {world}, or pass world_size= if it runs more")
    if workers * ranks_per_trial > world:
        raise ConfigError(f"workers={workers} x ranks_per_trial={ranks_per_trial} = {workers * ranks_per_trial} ranks "
                          f"at once, more than the {said}: use workers <= {world // ranks_per_trial}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ConfigError(f"seed must be an int in [0, 2**32), got {seed!r}")
    if isinstance(trial_timeout_s, bool) or not isinstance(trial_timeout_s, (int, float)) or not trial_timeout_s > 0:
        raise ConfigError(f"trial_timeout_s must be a number of seconds > 0, got {trial_timeout_s!r}")
    if not callable(objective) and objective not in ("loss", "accuracy"):
        raise ConfigError(f"objective must be 'loss', 'accuracy' (Trainer.evaluate's metrics) or "
                          f"callable(trainer, setup) -> float, got {objective!r}")
    if callable(objective):
        try:
            pickle.dumps(objective)
        except Exception as exc:
            raise ConfigError(f"objective {objective!r} cannot be sent to the trials' ranks ({exc}): make it a "
                              "module-level function (not a lambda or a local function)") from None
    return world


def search(
    build: Callable[[Any], TrialSetup],
    space: Mapping[str, Any] | None = None,
    *,
    n_trials: int,
    workers: int = 1,
    ranks_per_trial: int = 1,
    storage: Any = None,
    study_name: str = "replica-hpo",
    objective: Objective = "loss",
    direction: str | None = None,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
    seed: int = 0,
    world_size: int | None = None,
    trial_timeout_s: float = 600.0,
    report: str | os.PathLike[str] | None = None,
    devices: Any = "auto",
) -> optuna.Study:
    """Run an Optuna study of ``n_trials`` trials in all (those ``storage`` already holds count),
    ``workers`` at a time, each on ``ranks_per_trial`` ranks, and return it.

    ``build(trial) -> TrialSetup``: what ``get_trainer`` takes plus data and epochs (``trial`` is
    Optuna's, seen through a wrapper that notes the parameters ``build`` reads). ``space``:
    ``{name: optuna distribution or list of choices}``, sampled before ``build`` runs (which reads
    ``trial.params[name]``); a name that is a ``TrainerConfig`` field (``batch_size``,
    ``num_microbatches``, ``schedule``, ...) is applied to the setup's config. Without ``space``,
    ``build`` calls ``trial.suggest_*`` itself. ``objective``: ``"loss"`` (minimized) or
    ``"accuracy"`` (maximized) of ``Trainer.evaluate`` on the validation data, or
    ``callable(trainer, setup) -> float`` (a module-level function: it runs in the ranks).
    ``direction``: None minimizes (maximizes ``"accuracy"``). ``world_size``: the ranks this
    machine runs at once (default: its CPU cores). Each trial starts fresh processes (a few
    seconds of imports on a CPU core): give trials more training than that.
    ``report``: write the study's HTML page there at the end (:func:`replica.hpo.write_report`).
    ``devices``: ``"auto"`` (every GPU of this machine where it has CUDA, else CPU ranks), ``"cpu"``,
    or a list of GPU indices: each running trial takes its own ``ranks_per_trial`` of them (NCCL,
    rank r on the group's r-th GPU, the model on it: a config without a ``device`` gets ``"cuda"``).
    """
    gpus = trial_gpus(devices)
    _check(build, n_trials, workers, ranks_per_trial, world_size, objective, trial_timeout_s, seed, gpus)
    free: queue.Queue[tuple[int, ...] | None] = queue.Queue()  # the GPU groups no trial holds (CPU: None)
    for group in (gpu_groups(gpus, ranks_per_trial, workers) if gpus is not None else [None] * workers):
        free.put(group)
    distributions = as_space(space)
    if direction is None:
        direction = "maximize" if objective == "accuracy" else "minimize"
    study = optuna.create_study(storage=open_storage(storage), study_name=study_name, direction=direction,
                                sampler=sampler or optuna.samplers.TPESampler(seed=seed),
                                pruner=pruner or optuna.pruners.MedianPruner(), load_if_exists=True)
    lock = threading.Lock()  # build and plan one trial at a time: torch's RNG and tracing are process-wide

    def run(trial: optuna.Trial) -> float:
        with lock:
            setup, planned = _prepare(trial, build, distributions, ranks_per_trial, seed, gpus is not None)
        trial.set_user_attr("ranks", ranks_per_trial)
        trial.set_user_attr("predicted_step_time_s", planned.predicted_step_time_s)
        trial.set_user_attr("predicted_memory_bytes", max(s.predicted_memory_bytes for s in planned.stages))
        trial.set_user_attr("planned_layout", layout_of(planned))
        group = free.get()
        try:
            if group is not None:
                trial.set_user_attr("gpus", list(group))
            return _train(trial, setup, ranks_per_trial, seed, objective, trial_timeout_s, group)
        finally:
            free.put(group)

    left = n_trials - len(study.get_trials(deepcopy=False, states=FINISHED))
    if left > 0:
        study.optimize(run, n_trials=left, n_jobs=workers, catch=(_TrialFailed,),
                       callbacks=[MaxTrialsCallback(n_trials, states=FINISHED)])
    if report is not None:
        write_report(study, Path(report))
    return study


def _fail(trial: optuna.Trial, error: str) -> _TrialFailed:
    trial.set_user_attr("error", error[-_ERROR_CHARS:])
    return _TrialFailed(error)


def _prepare(trial: optuna.Trial, build: Callable[[Any], TrialSetup], space: Mapping[str, Any] | None,
             ranks: int, seed: int, on_gpus: bool = False) -> tuple[TrialSetup, Any]:
    """Sample, build (under ``seed``, the caller's RNG untouched) and plan one trial; a setup
    that cannot fit its memory budget is pruned with the planner's reason. ``on_gpus``: the trial
    trains on GPUs, its model on the rank's current one (a config without a device gets ``"cuda"``)."""
    if space is not None:
        suggest(trial, space)
    reading = Reading(trial)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        setup = build(reading)
    if not isinstance(setup, TrialSetup):
        raise ConfigError(f"build(trial) must return a replica.hpo.TrialSetup(model=, loss=, optimizer=, train=, ...), "
                          f"got {type(setup).__name__}")
    if space is not None:
        check_read(space, reading.read)  # a typo in the space stops the study: every trial would carry it
    try:
        setup = setup.with_config(**config_params(trial.params))
        if on_gpus:
            setup = _on_gpu(setup)
        args, kwargs = first_batch(setup)
        planned = make_plan(setup.model, args, example_kwargs=kwargs, world_size=ranks if ranks > 1 else None,
                            **setup.config.planning())
    except PartitionError as exc:
        trial.set_user_attr("pruned_reason", str(exc))
        raise optuna.TrialPruned(f"does not fit before training: {exc}") from None
    except ReplicaError as exc:  # this sample's configuration is impossible (its own error says why)
        raise _fail(trial, f"{type(exc).__name__}: {exc}") from None
    return setup, planned


def _on_gpu(setup: TrialSetup) -> TrialSetup:
    if setup.config.device is None:
        return setup.with_config(device="cuda")
    device = setup.config.model_device
    if device is None or device.type != "cuda":  # the CPU, or a cost preset (the model would stay on the CPU)
        raise ConfigError(f"the trials run on GPUs (search(devices=...)) but the setup's config has "
                          f"device={setup.config.device!r}, which leaves the model off the GPU: leave config.device "
                          "out (or 'cuda'), or pass devices='cpu' to search")
    return setup


def _train(trial: optuna.Trial, setup: TrialSetup, ranks: int, seed: int, objective: Objective,
           timeout_s: float, gpus: tuple[int, ...] | None = None) -> float:
    """Train ``setup`` on ``ranks`` fresh processes, reporting each epoch's value to Optuna and
    answering whether to go on; the last epoch's value is the trial's."""
    ctx = mp.get_context("spawn")
    progress, verdicts = ctx.Queue(), ctx.Queue()
    start = time.perf_counter()
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(run_local, train_trial, ranks, setup, seed, objective, progress, verdicts, timeout_s,
                           timeout_s=timeout_s, grace_s=_GRACE_S, gpus=gpus)
        while True:
            try:
                epoch, value = progress.get(timeout=0.2)
            except queue.Empty:
                if done.done():
                    break
                continue
            try:
                trial.report(value, epoch)
                go = epoch == setup.epochs - 1 or not trial.should_prune()  # a finished trial completes
            except BaseException:
                verdicts.put(False)  # the ranks stop instead of waiting for an answer
                raise
            verdicts.put(go)
        try:
            result = done.result()[0]
        except Exception as exc:  # a rank raised, died or hung (run_local's report), or the setup did not pickle
            late = time.perf_counter() - start >= timeout_s
            said = (f"the trial outlived trial_timeout_s={timeout_s:g} s and was stopped (raise trial_timeout_s if "
                    "it was only slow); " if late else "")
            raise _fail(trial, f"{said}{type(exc).__name__}: {exc}") from None
        finally:
            for q in (progress, verdicts):  # their feeder threads end with the trial
                q.close()
    values = result["values"]
    trial.set_user_attr("epoch_values", values)
    trial.set_user_attr("seconds", result["seconds"])
    trial.set_user_attr("layout", result["layout"])
    if result["pruned"]:
        reason = f"pruned by {type(trial.study.pruner).__name__} after epoch {len(values) - 1}: value {values[-1]:.6g}"
        trial.set_user_attr("pruned_reason", reason)
        raise optuna.TrialPruned(reason)
    return values[-1]
