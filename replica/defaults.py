"""The trainer's configuration: one kw-only dataclass, checked when it is made."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from replica.errors import ConfigError
from replica.layout import schedule_names
from replica.precision import precision_name

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
class TrainerConfig:
    """How :func:`replica.get_trainer` trains. ``None`` means "Replica chooses".

    - ``num_stages``, ``num_microbatches``, ``schedule``, ``data_parallel_size``: the
      pipeline, as for :func:`replica.auto_parallel` (one stage in one process; under
      ``torchrun`` one stage per rank unless ``data_parallel_size`` leaves replicas).
    - ``batch_size``: samples per optimizer step over all data-parallel replicas;
      ``shuffle``: a new order every epoch, drawn from ``seed`` and the epoch number.
    - ``checkpoint_dir``: where ``step-XXXXXXXX/`` checkpoints go and resume from;
      ``checkpoint_every_steps`` (None: at the end of every epoch); ``keep_checkpoints``.
    - ``log_every_steps``, ``metrics_file`` (JSONL, appended), ``progress`` (a bar on a terminal).
    - ``device``: where the model and batches live (None: where the model's parameters are).
    - ``timeout_s``: the longest wait on another rank before a clear error.
    - ``sharded_data_parallel``: the replicas shard their stages (FSDP2; None: the planner
      decides), as for :func:`replica.auto_parallel`.
    - ``tensor_parallel_size``: the ranks each stage's layers are cut across (None: the
      planner decides; 1: off), as for :func:`replica.auto_parallel`; checkpoints hold whole
      tensors, so a run resumes under another tensor-parallel size.
    - ``precision``: ``"fp32"`` (the weights' own dtype), ``"bf16"`` or ``"fp16"``: autocast,
      as :func:`replica.auto_parallel`'s ``mixed_precision``; fp16 steps through a
      :class:`replica.GradScaler`, whose state the checkpoints keep.
    """

    num_stages: int | None = None
    num_microbatches: int | None = None
    schedule: str = "1f1b"
    data_parallel_size: int | None = None
    batch_size: int = 32
    shuffle: bool = True
    checkpoint_dir: "str | os.PathLike[str] | None" = None
    checkpoint_every_steps: int | None = None
    keep_checkpoints: int = 3
    log_every_steps: int = 10
    metrics_file: "str | os.PathLike[str] | None" = None
    seed: int = 0
    device: "str | torch.device | None" = None
    progress: bool = True
    timeout_s: float = 300.0
    precision: str = "fp32"
    sharded_data_parallel: bool | None = None
    tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        _count("num_stages", self.num_stages, optional=True)
        _count("num_microbatches", self.num_microbatches, optional=True)
        _count("data_parallel_size", self.data_parallel_size, optional=True)
        _count("tensor_parallel_size", self.tensor_parallel_size, optional=True)
        _count("batch_size", self.batch_size, optional=False)
        _count("checkpoint_every_steps", self.checkpoint_every_steps, optional=True)
        _count("keep_checkpoints", self.keep_checkpoints, optional=False)
        _count("log_every_steps", self.log_every_steps, optional=False)
        _flag("shuffle", self.shuffle)
        _flag("progress", self.progress)
        _path("checkpoint_dir", self.checkpoint_dir)
        _path("metrics_file", self.metrics_file)
        self.precision = precision_name(self.precision, argument="precision")
        if self.sharded_data_parallel not in (None, True, False):
            raise ConfigError(f"sharded_data_parallel must be True, False or None (the planner decides), got "
                              f"{self.sharded_data_parallel!r}")
        known = schedule_names(auto=True)
        if not isinstance(self.schedule, str) or self.schedule.lower() not in known:
            raise ConfigError(f"schedule must be one of {known}, got {self.schedule!r}")
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
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise ConfigError(
                    f"device={self.device!r} is not a torch device ({exc}); use e.g. 'cpu', 'cuda' or 'cuda:1', "
                    "or None for where the model's parameters are"
                ) from None


def default_config(**overrides: Any) -> TrainerConfig:
    """The defaults, with any field replaced: ``default_config(batch_size=64, checkpoint_dir="ckpt")``."""
    names = {f.name for f in dataclasses.fields(TrainerConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ConfigError(f"TrainerConfig has no field(s) {unknown}; the fields are {sorted(names)}")
    return TrainerConfig(**overrides)
