"""What a trial trains: the model, loss, optimizer, config and data ``build(trial)`` returns."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from replica.defaults import TrainerConfig, default_config
from replica.errors import ConfigError
from replica.train.data import make_source, pad

__all__ = ["TrialSetup", "first_batch"]


@dataclass(kw_only=True)
class TrialSetup:
    """One trial's run: what :func:`replica.get_trainer` takes (``config``, ``model``, ``loss``,
    ``optimizer``), the data (``train=(x, y)``, ``valid=(x, y)``; None: measured on ``train``) and
    ``epochs``. Each epoch ends with the objective measured on ``valid`` (the value pruners see).
    ``config.memory_budget`` (bytes per device) is what the trial must fit before it trains."""

    model: torch.nn.Module
    loss: Callable[[Any, Any], torch.Tensor]
    optimizer: Any  # a torch.optim.Optimizer on model.parameters(), or a factory params -> optimizer
    train: tuple[Any, Any]
    valid: tuple[Any, Any] | None = None
    config: TrainerConfig = field(default_factory=default_config)
    epochs: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise ConfigError(f"TrialSetup.model must be a torch.nn.Module, got {type(self.model).__name__}")
        if not isinstance(self.config, TrainerConfig):
            raise ConfigError(f"TrialSetup.config must be a replica.defaults.TrainerConfig (default_config(...)), "
                              f"got {type(self.config).__name__}")
        for name in ("train", "valid"):
            data = getattr(self, name)
            if data is None and name == "valid":
                continue
            if not isinstance(data, (tuple, list)) or len(data) != 2:
                raise ConfigError(f"TrialSetup.{name} must be a pair (x, y) of inputs and targets, "
                                  f"got {type(data).__name__}")
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1:
            raise ConfigError(f"TrialSetup.epochs must be a positive int, got {self.epochs!r}")

    def with_config(self, **fields: Any) -> "TrialSetup":
        """This setup with ``config`` fields replaced (checked as ``default_config`` checks them)."""
        if not fields:
            return self
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **fields))


def first_batch(setup: TrialSetup) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
    """``(args, kwargs)`` of the batch the Trainer plans on: the first ``batch_size`` samples, in
    order, repeated to fill the batch when the data set is smaller (as ``Trainer`` does)."""
    size = setup.config.batch_size
    source = make_source(*setup.train, need_target=True)
    inputs = pad(next(source.batches(epoch=0, batch_size=size, shuffle=False, seed=0, merge_last=False))[0],
                 size)[0]
    return ((), inputs) if isinstance(inputs, dict) else (tuple(inputs), None)
