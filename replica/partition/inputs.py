"""How a model is called: positional and keyword inputs, checked against ``forward``'s signature.

The traced graph takes its inputs as one tuple: the positional inputs, then the tensor
keyword inputs in the order ``example_kwargs`` gave them (for ``torch.export``, every
tensor leaf of nested tuples and dicts, flattened). Keywords that are not tensors
(``use_cache=False``) are fixed while tracing. :class:`InputSpec` turns a later call's
``(*args, **kwargs)`` into that tuple, and names what differs from the trace.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch.utils._pytree import tree_flatten, tree_leaves

from replica.errors import ConfigError

__all__ = ["InputSpec", "normalize_inputs"]


def _as_tuple(example_inputs: Any) -> tuple[Any, ...]:
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return () if example_inputs is None else (example_inputs,)


def _check_tensors(value: Any, what: str) -> None:
    if isinstance(value, torch.Tensor):
        return
    leaves = tree_leaves(value)
    if isinstance(value, (tuple, list, dict)) and leaves and all(isinstance(x, torch.Tensor) for x in leaves):
        return
    raise ConfigError(
        f"{what} is a {type(value).__name__}; Replica traces tensor inputs (or tuples, lists and dicts of "
        "tensors). Pass tensors (real, meta or fake) in the order of model.forward's arguments; a fixed "
        "non-tensor setting goes into example_kwargs (e.g. use_cache=False)."
    )


@dataclass
class InputSpec:
    """The call signature a plan was traced with."""

    model_name: str
    positional: int  # how many positional inputs
    keywords: tuple[str, ...] = ()  # tensor keyword inputs, in graph order after the positional ones
    constants: dict[str, Any] = field(default_factory=dict)  # non-tensor keywords, fixed while tracing
    arg_names: tuple[str, ...] = ()  # forward's names for the positional inputs
    flat: bool = False  # the graph takes every tensor leaf separately (torch.export)
    fixed_dims: tuple[dict[int, int], ...] = ()  # per graph input: {dim: size} the tracer specialised

    def pack(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], what: str = "inputs") -> tuple[Any, ...]:
        """The graph's input tuple for ``model(*args, **kwargs)``; a ConfigError names any mismatch."""
        named = list(self.arg_names[len(args):])  # model(**batch) names the positional ones too
        if named and all(n in kwargs for n in named):
            args = (*args, *(kwargs[n] for n in named))
            kwargs = {k: v for k, v in kwargs.items() if k not in named}
        if len(args) != self.positional:
            raise ConfigError(
                f"the pipeline of {self.model_name} was traced with {self.positional} positional input(s) but "
                f"the {what} have {len(args)}; pass the same arguments as example_inputs (a tensor, or a tuple "
                "with one tensor per input)"
            )
        missing = [k for k in self.keywords if k not in kwargs]
        unknown = [k for k in kwargs if k not in self.keywords and k not in self.constants]
        if missing or unknown:
            raise ConfigError(
                f"the pipeline of {self.model_name} was traced with keyword inputs {list(self.keywords)}"
                f"{f' and fixed {self.constants}' if self.constants else ''}; the {what} "
                f"{f'lack {missing}' if missing else ''}{' and ' if missing and unknown else ''}"
                f"{f'add {unknown}' if unknown else ''}. Pass the same keywords as example_kwargs, or re-plan "
                "with the new ones."
            )
        for k, fixed in self.constants.items():
            if k in kwargs and not _same(kwargs[k], fixed):
                raise ConfigError(
                    f"{k}={kwargs[k]!r} but the pipeline of {self.model_name} was traced with {k}={fixed!r}, "
                    "which is fixed in its graph; pass the traced value, or re-plan with "
                    f"example_kwargs={{{k!r}: {kwargs[k]!r}, ...}}"
                )
        values = (*args, *(kwargs[k] for k in self.keywords))
        packed = tuple(tree_flatten(values)[0]) if self.flat else values
        self._check_dims(packed, what)
        return packed

    def _check_dims(self, packed: tuple[Any, ...], what: str) -> None:
        for i, (x, fixed) in enumerate(zip(packed, self.fixed_dims)):
            if not isinstance(x, torch.Tensor):
                continue
            for dim, size in fixed.items():
                if dim < x.dim() and int(x.shape[dim]) != size:
                    raise ConfigError(
                        f"graph input {i} of {self.model_name} ({what}) has size {int(x.shape[dim])} in dimension "
                        f"{dim}, but torch.export fixed that dimension at {size} when tracing (the model's code "
                        f"depends on it). Pass inputs with dimension {dim} = {size}, or re-plan with example "
                        "inputs of the new shape."
                    )


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 - objects without a plain == are compared by identity
        return a is b


def normalize_inputs(
    model: torch.nn.Module, example_inputs: Any, example_kwargs: Mapping[str, Any] | None = None
) -> tuple[tuple[Any, ...], dict[str, Any], InputSpec]:
    """Check ``example_inputs`` / ``example_kwargs`` against ``model.forward``'s signature.

    Returns the graph's inputs (positional, then tensor keywords), the values fixed while
    tracing (non-tensor keywords, and the defaults of the parameters not given) and the
    :class:`InputSpec` that packs later calls alike."""
    inputs = _as_tuple(example_inputs)
    kwargs = dict(example_kwargs or {})
    for i, x in enumerate(inputs):
        _check_tensors(x, f"example_inputs[{i}]")
    sig = inspect.signature(model.forward)
    params = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    variadic = any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values())
    var_keyword = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    by_name = {p.name: p for p in sig.parameters.values()}
    taken = {p.name for p in params[: len(inputs)]}
    for k in kwargs:
        if k in taken:
            raise ConfigError(f"example_kwargs gives {k!r}, which example_inputs already give by position")
        if k not in by_name and not var_keyword:
            raise ConfigError(
                f"example_kwargs gives {k!r}, but {type(model).__name__}.forward has no such parameter; "
                f"it takes {[p for p in by_name if by_name[p].kind not in (inspect.Parameter.VAR_POSITIONAL,)]}"
            )
    required = [p for p in params if p.default is p.empty and p.name not in kwargs]
    if len(inputs) < len(required) or (len(inputs) > len(params) and not variadic):
        names = ", ".join(p.name for p in params)
        raise ConfigError(
            f"{type(model).__name__}.forward({names}) takes {len(required)}"
            f"{'' if len(required) == len(params) else f' to {len(params)}'} positional inputs, "
            f"but example_inputs has {len(inputs)}. Pass a tuple with one tensor per argument, "
            f"e.g. example_inputs=({', '.join(p.name for p in required)},)."
        )
    tensors = {k: v for k, v in kwargs.items() if not _is_constant(v)}
    for k, v in tensors.items():
        _check_tensors(v, f"example_kwargs[{k!r}]")
    constants = {k: v for k, v in kwargs.items() if k not in tensors}
    concrete = {p.name: p.default for p in params[len(inputs):] if p.name not in kwargs}
    concrete.update(constants)
    spec = InputSpec(type(model).__name__, len(inputs), tuple(tensors), constants,
                     tuple(p.name for p in params[: len(inputs)]))
    return (*inputs, *tensors.values()), concrete, spec


def _is_constant(value: Any) -> bool:
    """A keyword fixed in the graph: anything without a tensor in it (a flag, a number, None)."""
    return not any(isinstance(x, torch.Tensor) for x in tree_leaves(value))
