"""The user's optimizer, rebuilt for the parameters one rank holds, and its state keyed by parameter name."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, Mapping

import torch

from replica.checkpoint.optimizer import by_name
from replica.errors import ConfigError
from replica.parallel.fsdp import full_tensor, shard_like

__all__ = ["rebuild_optimizer", "make_optimizer", "state_by_name", "load_state_by_name"]

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def _constructor_kwargs(cls: type, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The ``defaults`` the constructor accepts (``AdamW`` keeps keys in ``defaults`` it does not take)."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return dict(defaults)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer,
    model_names: Mapping[int, str],
    held: Mapping[str, torch.nn.Parameter],
) -> torch.optim.Optimizer | None:
    """``optimizer``'s class, ``defaults`` and param groups (with their hyper-parameters) over
    the parameters in ``held`` (name -> parameter); ``model_names`` maps ``id(p)`` of the
    optimizer's parameters to their names. State already built up carries over. ``None`` when
    this rank holds none of the optimizer's parameters."""
    groups, state = [], {}
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            name = model_names.get(id(p))
            if name is None:
                raise ConfigError(
                    f"the optimizer holds a tensor of shape {tuple(p.shape)} that is not a parameter of the model; "
                    "build it on model.parameters() (or pass optimizer=lambda params: torch.optim.Adam(params, ...))"
                )
            if name in held:
                params.append(held[name])
                if p in optimizer.state:
                    state[held[name]] = optimizer.state[p]
        if params:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    if not groups:
        return None
    cls = type(optimizer)
    try:
        rebuilt = cls(groups, **_constructor_kwargs(cls, optimizer.defaults))
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"cannot rebuild {cls.__name__} for this rank's parameters ({exc}); pass a factory instead: "
            f"optimizer=lambda params: {cls.__name__}(params, ...)"
        ) from exc
    rebuilt.defaults.update(optimizer.defaults)
    for p, s in state.items():
        rebuilt.state[p] = s
    return rebuilt


def make_optimizer(
    optimizer: torch.optim.Optimizer | OptimizerFactory,
    model_names: Mapping[int, str],
    held: Mapping[str, torch.nn.Parameter],
) -> torch.optim.Optimizer | None:
    """The optimizer for the parameters ``held`` here: the user's own object when it already
    covers exactly them (one process), else rebuilt, or made by the user's factory."""
    if isinstance(optimizer, torch.optim.Optimizer):
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if mine and mine <= {id(p) for p in held.values()}:
            return optimizer
        return rebuild_optimizer(optimizer, model_names, held)
    if not held:
        return None
    made = optimizer(list(held.values()))
    if not isinstance(made, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer(params) must return a torch.optim.Optimizer, got {type(made).__name__}"
        )
    return made


def _names(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> Iterable[tuple[int, str, Any]]:
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            yield g, names[id(p)], p


def state_by_name(optimizer: torch.optim.Optimizer | None, names: Mapping[int, str]) -> dict[str, Any]:
    """``{"state": {name: {...}}, "param_groups": [{hyper-parameters..., "params": [names]}]}``."""
    if optimizer is None:
        return {"state": {}, "param_groups": []}
    # a sharded parameter's state is gathered whole (every replica of its stage calls this)
    state = {name: {k: full_tensor(v) for k, v in optimizer.state[p].items()}
             for _, name, p in _names(optimizer, names) if p in optimizer.state}
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
              for group in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def load_state_by_name(
    optimizer: torch.optim.Optimizer | None, saved: Iterable[Mapping[str, Any]], names: Mapping[int, str]
) -> None:
    """Load the state saved by :func:`state_by_name` on any layout (one mapping per shard):
    each parameter takes its own state, each group the hyper-parameters its parameters had."""
    if optimizer is None:
        return
    state, hyper = by_name(saved)
    torch_state: dict[int, Any] = {}
    torch_groups = []
    index = 0
    for group in optimizer.param_groups:
        ids = []
        saved_hyper: dict[str, Any] | None = None
        for p in group["params"]:
            name = names[id(p)]
            if name in state:  # a sharded parameter's state cut as it is
                torch_state[index] = {k: shard_like(v, p) if isinstance(v, torch.Tensor) and v.shape == p.shape else v
                                      for k, v in state[name].items()}
            saved_hyper = saved_hyper or hyper.get(name)
            ids.append(index)
            index += 1
        mine = {k: v for k, v in group.items() if k != "params"}
        torch_groups.append({**mine, **(saved_hyper or {}), "params": ids})
    optimizer.load_state_dict({"state": torch_state, "param_groups": torch_groups})
