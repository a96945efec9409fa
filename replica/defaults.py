"""The trainer's configuration: one kw-only dataclass, checked when it is made."""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from replica.errors import ConfigError
from replica.partition.cost import torch_device_of
from replica.planner.request import PlanningOptions

__all__ = ["TrainerConfig", "default_config"]


def _count(name: str, value: Any, *, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "a positive int or None" if optional else "a positive int"
        raise ConfigError(f"{name} must be {allowed}, got {value!r}")


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")


def _path(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{name} must be a path (str or os.PathLike) or None, got {type(value).__name__}")
    if isinstance(value, str) and not value:
        raise ConfigError(f"{name} is the empty string; give a directory or file path, or None")


@dataclass(kw_only=True)
class TrainerConfig(PlanningOptions):
    """How :func:`replica.get_trainer` trains. ``None`` means "Replica chooses".

    - Every planning keyword of :func:`replica.auto_parallel` (``num_stages``,
      ``num_microbatches``, ``schedule``, ``data_parallel_size``, ``tensor_parallel_size``,
      ``sharded_data_parallel``, ``recompute``, ``mixed_precision``, ``device``, ...), with the
      same names, meanings and checks (:class:`replica.planner.PlanningOptions`). Under
      ``torchrun`` the planner chooses the replicas, stages and schedule as ``auto_parallel``
      does. ``device``: a torch device (``"cuda"``, ``"cpu"``) moves the model there and
      prices it as that device; a preset name prices the plan as that machine, the model
      staying where it is. fp16 steps through a :class:`replica.GradScaler`, whose state the
      checkpoints keep. Checkpoints hold each rank's own shards (torch.distributed.checkpoint),
      and a run resumes under any other layout.
    - ``batch_size``: samples per optimizer step over all data-parallel replicas;
      ``shuffle``: a new order every epoch, drawn from ``seed`` and the epoch number.
    - ``checkpoint_dir``: where ``step-XXXXXXXX/`` checkpoints go and resume from, written by
      one job at a time (``.writer.lock``); ``checkpoint_every_steps`` (None: at the end of every
      epoch); ``keep_checkpoints``; ``checkpoint_async``: write in the background (DCP's
      ``async_save``; the next save, or the end of ``train_dataset``, waits for it and publishes it).
    - ``log_every_steps``, ``metrics_file`` (JSONL, appended), ``progress`` (rank 0 prints the
      layout and where the weights came from, then a bar on a terminal, elsewhere a line every
      ``log_every_steps`` steps; an epoch line either way).
    - ``timeout_s``: the longest wait on another rank before a clear error.
    """

    batch_size: int = 32
    shuffle: bool = True
    checkpoint_dir: "str | os.PathLike[str] | None" = None
    checkpoint_every_steps: int | None = None
    keep_checkpoints: int = 3
    checkpoint_async: bool = False
    log_every_steps: int = 10
    metrics_file: "str | os.PathLike[str] | None" = None
    seed: int = 0
    progress: bool = True
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _count("batch_size", self.batch_size, optional=False)
        _count("checkpoint_every_steps", self.checkpoint_every_steps, optional=True)
        _count("keep_checkpoints", self.keep_checkpoints, optional=False)
        _count("log_every_steps", self.log_every_steps, optional=False)
        _flag("shuffle", self.shuffle)
        _flag("progress", self.progress)
        _flag("checkpoint_async", self.checkpoint_async)
        _path("checkpoint_dir", self.checkpoint_dir)
        _path("metrics_file", self.metrics_file)
        if self.batch != "global":
            raise ConfigError(
                f"batch={self.batch!r}: the Trainer feeds every rank the whole batch (each replica trains its slice), "
                "so its config takes batch='global' only; shard a loader per rank with auto_parallel(batch='per_rank')"
            )
        if self.checkpoint_every_steps is not None and self.checkpoint_dir is None:
            raise ConfigError(
                f"checkpoint_every_steps={self.checkpoint_every_steps} but checkpoint_dir is None: "
                "set checkpoint_dir='checkpoints' (or any directory) to save checkpoints"
            )
        if self.num_microbatches is not None and self.num_microbatches > self.batch_size:
            raise ConfigError(
                f"num_microbatches={self.num_microbatches} but batch_size={self.batch_size}: each micro-batch "
                f"needs at least one sample. Use num_microbatches <= {self.batch_size} or a larger batch_size."
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool) or not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be a number of seconds > 0, got {self.timeout_s!r}")

    @property
    def model_device(self) -> torch.device | None:
        """Where the Trainer puts the model: ``device`` where it names a torch device, else None."""
        return torch_device_of(self.device)


def default_config(**overrides: Any) -> TrainerConfig:
    """The defaults, with any field replaced: ``default_config(batch_size=64, checkpoint_dir="ckpt")``.
    ``precision=`` is still taken, as the old name of ``mixed_precision`` (changed: one planning
    vocabulary with ``auto_parallel``)."""
    if "precision" in overrides:
        if "mixed_precision" in overrides:
            raise ConfigError("give mixed_precision= only (precision= is its old name)")
        warnings.warn("default_config(precision=...) is now mixed_precision=..., as auto_parallel names it",
                      FutureWarning, stacklevel=2)
        overrides["mixed_precision"] = overrides.pop("precision")
    names = {f.name for f in dataclasses.fields(TrainerConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ConfigError(f"TrainerConfig has no field(s) {unknown}; the fields are {sorted(names)}")
    return TrainerConfig(**overrides)
