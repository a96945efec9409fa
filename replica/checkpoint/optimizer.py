"""An optimizer's state in a checkpoint, by parameter name: what a rank writes, room to load it back, and the load.

Tensors go to torch.distributed.checkpoint as ``optimizer.state.<name>.<key>`` (a sharded
parameter's moments are DTensors cut as it is); the param groups' hyper-parameters and any
non-tensor state go to ``trainer.pt`` by parameter name. Loading allocates each saved tensor
cut as its parameter is now (any layout), lets DCP fill it, then hands the optimizer a
``state_dict`` in its own parameter order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from replica.checkpoint.store import OPTIMIZER_PREFIX, TRAINER_FILE, CheckpointError

__all__ = ["optimizer_tensors", "optimizer_room", "load_optimizer", "by_name"]


def optimizer_tensors(optimizer: torch.optim.Optimizer | None, names: Mapping[int, str]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``optimizer``'s state tensors as ``optimizer.state.<name>.<key>`` (as held: no copy, no gather),
    and the rest (param groups' hyper-parameters, non-tensor state) by parameter name.
    ``names``: ``id(parameter)`` -> its original name."""
    if optimizer is None:
        return {}, {"state": {}, "param_groups": []}
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{OPTIMIZER_PREFIX}{names[id(p)]}.{key}"] = value.detach()
                else:
                    scalars.setdefault(names[id(p)], {})[key] = value
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
              for group in optimizer.param_groups]
    return tensors, {"state": scalars, "param_groups": groups}


def _room(p: torch.Tensor, spec: TensorStorageMetadata) -> torch.Tensor:
    """Room for one saved state tensor of parameter ``p``: cut as ``p`` is when it has its shape
    (Adam's moments), else whole (a step count)."""
    if tuple(spec.size) == tuple(p.shape):
        return torch.zeros_like(p.detach(), dtype=spec.properties.dtype)
    return torch.zeros(tuple(spec.size), dtype=spec.properties.dtype, device=p.device)


def optimizer_room(specs: Mapping[str, Any], optimizer: torch.optim.Optimizer, names: Mapping[int, str]
                   ) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """For each of ``optimizer``'s parameters, tensors to load its saved state into (``specs``: the
    checkpoint's DCP metadata by key): ``(by checkpoint key, by parameter index)``, the same tensors."""
    saved: dict[str, list[str]] = {}
    for key, spec in specs.items():
        if key.startswith(OPTIMIZER_PREFIX) and isinstance(spec, TensorStorageMetadata):
            name, _, what = key[len(OPTIMIZER_PREFIX):].rpartition(".")
            saved.setdefault(name, []).append(what)
    by_key: dict[str, torch.Tensor] = {}
    by_index: dict[int, dict[str, torch.Tensor]] = {}
    i = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            by_index[i] = {}
            for what in saved.get(name, ()):
                key = f"{OPTIMIZER_PREFIX}{name}.{what}"
                by_key[key] = by_index[i][what] = _room(p, specs[key])
            i += 1
    return by_key, by_index


def by_name(records: Iterable[Mapping[str, Any]]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Optimizer states saved by parameter name, one record per rank that wrote (``{"state": {name: ...},
    "param_groups": [{..., "params": [name, ...]}]}``), merged: each parameter's state and its group's
    hyper-parameters, the first record that holds it winning."""
    state: dict[str, Any] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for record in records:
        for name, s in record["state"].items():
            state.setdefault(name, s)
        for group in record["param_groups"]:
            for name in group["params"]:
                hyper.setdefault(name, {k: v for k, v in group.items() if k != "params"})
    return state, hyper


def load_optimizer(path: str | Path, optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                   by_index: dict[int, dict[str, torch.Tensor]]) -> None:
    """Hand ``optimizer`` its state: the tensors DCP filled (``by_index``, from :func:`optimizer_room`),
    the non-tensor state and each group's hyper-parameters by parameter name (``trainer.pt``: one
    entry per rank that wrote)."""
    try:
        extras = torch.load(Path(path) / TRAINER_FILE, map_location="cpu", weights_only=True)
    except Exception as exc:  # missing, unpickling errors, truncated files
        raise CheckpointError(f"{Path(path) / TRAINER_FILE} cannot be read ({type(exc).__name__}: {exc})") from None
    scalars, hyper = by_name(extras)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    i = 0
    for group in optimizer.param_groups:
        ids, saved_hyper = [], None
        for p in group["params"]:
            name = names[id(p)]
            if by_index.get(i) or name in scalars:
                state[i] = {**scalars.get(name, {}), **by_index.get(i, {})}
            saved_hyper = saved_hyper or hyper.get(name)
            ids.append(i)
            i += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, **(saved_hyper or {}), "params": ids})
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (KeyError, RuntimeError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"the optimizer state in {path} does not fit {type(optimizer).__name__} ({type(exc).__name__}: {exc}); "
            "resume with the optimizer (class and param groups) that wrote it"
        ) from None
