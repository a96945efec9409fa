"""In-place ops in traced graphs: which value each one writes into, and cuts that stay safe.

Eager PyTorch lets ``F.relu(h, inplace=True)`` change ``h`` for every later reader.
A pipeline copies values between stages, so Replica makes such writes explicit:
readers after a direct in-place op read the op's result (the same tensor in eager),
and a write through a view (or ``x[i] = y``) pins its base to the writer's stage.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

__all__ = ["mutates_first_argument", "is_view", "make_writes_explicit", "view_writes", "mutated_inputs"]

INPLACE_FUNCTIONS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul, operator.setitem,
}
VIEWS = frozenset(
    "view view_as reshape transpose permute expand expand_as narrow select squeeze unsqueeze flatten "
    "unflatten t split chunk unbind getitem as_strided diagonal movedim swapaxes unfold "
    # may return their input itself (already contiguous, already that dtype or device)
    "contiguous float double half bfloat16 to type type_as detach".split()
)


def _name(n: fx.Node) -> str:
    return str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", "")


def _first_alias(n: fx.Node) -> Any:
    """The alias annotation of an aten op's first argument (exported graphs): ``Tensor(a!)``
    is written into, ``Tensor(a)`` is viewed; None for other targets."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return None
    arguments = n.target._schema.arguments
    return arguments[0].alias_info if arguments else None


def is_view(n: fx.Node) -> bool:
    alias = _first_alias(n)
    if alias is not None:
        return not alias.is_write
    return n.op in ("call_method", "call_function") and _name(n) in VIEWS


def mutates_first_argument(n: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether ``n`` writes into its first argument (``x.add_``, ``relu(inplace=True)``, ``x += y``)."""
    if n.op == "call_module":
        return bool(getattr(gm.get_submodule(str(n.target)), "inplace", False))
    if n.op == "call_method":
        name = str(n.target)
        return name.endswith("_") and not name.startswith("_")
    if n.op == "call_function":
        alias = _first_alias(n)
        if alias is not None:
            return bool(alias.is_write)
        if n.target in INPLACE_FUNCTIONS or n.kwargs.get("inplace", False):
            return True
        name = getattr(n.target, "__name__", "")
        return name.endswith("_") and not name.startswith("_")
    return False


def _first(n: fx.Node) -> fx.Node | None:
    return n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None


def make_writes_explicit(gm: fx.GraphModule) -> None:
    """Readers of ``x`` after an op that writes into ``x`` and returns it read that op instead."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in list(gm.graph.nodes):
        x = _first(n)
        if x is None or n.target is operator.setitem or not mutates_first_argument(n, gm):
            continue
        for user in list(x.users):
            if user is not n and order[user] > order[n]:
                user.replace_input_with(x, n)
    gm.recompile()


def view_writes(gm: fx.GraphModule) -> dict[str, str]:
    """``{writer: base}`` for every write into a view of ``base`` (or ``base[i] = y``): the base
    must be made in the writer's stage, so no cut may fall between them."""
    root: dict[str, str] = {}
    out: dict[str, str] = {}
    for n in gm.graph.nodes:
        x = _first(n)
        if x is None:
            continue
        if mutates_first_argument(n, gm):
            base = root.get(x.name)
            if base is not None or n.target is operator.setitem:
                out[n.name] = base or x.name
        elif is_view(n):
            root[n.name] = root.get(x.name, x.name)
    return out


def mutated_inputs(nodes: list[fx.Node], received: set[str], gm: fx.GraphModule) -> set[str]:
    """Received values that an in-place op of this stage writes into, directly or through views:
    the stage must write into a copy, not into the leaf autograd sees."""
    root = {name: name for name in received}
    mutated: set[str] = set()
    for n in nodes:
        x = _first(n)
        if x is None or x.name not in root:
            continue
        if mutates_first_argument(n, gm):
            mutated.add(root[x.name])
        elif is_view(n):
            root[n.name] = root[x.name]
    return mutated
