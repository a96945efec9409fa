"""The search space: Optuna distributions by name, config fields applied, unknown names refused."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import BaseTrial

from replica.defaults import TrainerConfig
from replica.errors import ConfigError

__all__ = ["CONFIG_FIELDS", "Reading", "as_space", "check_read", "config_params", "suggest"]

CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainerConfig))


def as_space(space: Mapping[str, Any] | None) -> dict[str, BaseDistribution] | None:
    """``{name: distribution}``: Optuna's distributions, or a list of choices (categorical)."""
    if space is None:
        return None
    if not isinstance(space, Mapping) or not space:
        raise ConfigError(f"space must be a non-empty dict {{name: optuna distribution or list of choices}} or None "
                          f"(build(trial) calls trial.suggest_* itself), got {space!r}")
    out: dict[str, BaseDistribution] = {}
    for name, dist in space.items():
        if isinstance(dist, (list, tuple)) and dist:
            dist = CategoricalDistribution(list(dist))
        if not isinstance(name, str) or not isinstance(dist, (FloatDistribution, IntDistribution,
                                                             CategoricalDistribution)):
            raise ConfigError(
                f"space[{name!r}] = {dist!r}: give an optuna distribution (optuna.distributions.FloatDistribution"
                "(1e-4, 1e-1, log=True), IntDistribution(1, 4), CategoricalDistribution([...])) or a list of choices"
            )
        out[name] = dist
    return out


def suggest(trial: BaseTrial, space: Mapping[str, BaseDistribution]) -> None:
    """Sample every parameter of ``space`` for ``trial`` through Optuna's public ``suggest_*``."""
    for name, dist in space.items():
        if isinstance(dist, FloatDistribution):
            trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)
        elif isinstance(dist, IntDistribution):
            trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
        else:
            assert isinstance(dist, CategoricalDistribution)
            trial.suggest_categorical(name, dist.choices)


def config_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The sampled parameters that name a ``TrainerConfig`` field: applied to the trial's config."""
    return {k: v for k, v in params.items() if k in CONFIG_FIELDS}


class _Noted(dict):  # type: ignore[type-arg]
    """``trial.params`` as ``build`` sees it: a dict that notes the names read."""

    def __init__(self, params: Mapping[str, Any], read: set[str]) -> None:
        super().__init__(params)
        self._read = read

    def __getitem__(self, name: str) -> Any:
        self._read.add(name)
        if name not in self:
            raise ConfigError(f"build read trial.params[{name!r}], but the trial has no such parameter (it has "
                              f"{sorted(self)}): add {name!r} to the space, or call trial.suggest_*({name!r}, ...) "
                              "before reading it")
        return super().__getitem__(name)

    def get(self, name: str, default: Any = None) -> Any:
        self._read.add(name)
        return super().get(name, default)


class Reading:
    """The trial ``build`` is given: Optuna's own (every method and attribute), noting which
    parameters ``build`` reads through ``trial.params[...]`` or ``trial.suggest_*(name, ...)``."""

    def __init__(self, trial: BaseTrial) -> None:
        self._trial = trial
        self.read: set[str] = set()

    @property
    def params(self) -> dict[str, Any]:
        return _Noted(self._trial.params, self.read)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._trial, name)
        if not name.startswith("suggest_"):
            return attr

        def suggest(param: str, *args: Any, **kwargs: Any) -> Any:
            self.read.add(param)
            return attr(param, *args, **kwargs)
        return suggest


def check_read(space: Mapping[str, BaseDistribution], read: set[str]) -> None:
    """Every name of the space must be a config field or read by ``build``: else a typo."""
    unknown = sorted(set(space) - CONFIG_FIELDS - read)
    if not unknown:
        return
    known = sorted(CONFIG_FIELDS | read)
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ConfigError(
        f"the space names {', '.join(hints)}, which is neither a TrainerConfig field (applied to the trial's config) "
        "nor read by build(trial) (through trial.params[name] or trial.suggest_*(name, ...)): it would be sampled "
        "and never used. Fix the name, read it in build, or drop it from the space"
    )
