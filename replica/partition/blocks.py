"""Blocks: the repeated modules of a model (``transformer.h.3``), by module path.

A block is the first ``<container>.<index>`` of a module path whose container holds at
least two indexed children in the graph (a transformer's layers, an encoder's layers): the
unit Replica checkpoints, and the unit FSDP2 shards (:mod:`replica.parallel.fsdp` groups by
the same pattern). Reading only module paths, it serves fx and exported graphs alike, and
Hugging Face models whose layers live under ``model.layers`` or ``encoder.layer``. Nothing
here imports torch.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

__all__ = ["block_of", "find_blocks", "repeated_containers"]

_BLOCK = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")  # the first "<container>.<index>" of a module path


def block_of(module_path: str, containers: "frozenset[str] | set[str] | None" = None) -> str | None:
    """The block ``module_path`` lies in (``"transformer.h.3"`` for ``"transformer.h.3.mlp.c_fc"``),
    or None; with ``containers``, only a block of one of them."""
    m = _BLOCK.match(module_path)
    if m is None or (containers is not None and m[1] not in containers):
        return None
    return f"{m[1]}.{m[2]}"


def repeated_containers(module_paths: Iterable[str]) -> frozenset[str]:
    """The containers (``"transformer.h"``) with at least two indexed children among ``module_paths``."""
    seen: dict[str, set[str]] = {}
    for path in module_paths:
        m = _BLOCK.match(path)
        if m is not None:
            seen.setdefault(m[1], set()).add(m[2])
    return frozenset(c for c, indices in seen.items() if len(indices) > 1)


def find_blocks(module_paths: Sequence[str], containers: "frozenset[str] | None" = None) -> tuple[str, ...]:
    """The blocks of a sequence of ops' module paths (a stage's, in graph order), in order of
    first appearance; ``containers``: the repeated ones of the whole model (default: those of
    ``module_paths`` themselves)."""
    chosen = repeated_containers(module_paths) if containers is None else containers
    return tuple(dict.fromkeys(b for p in module_paths if (b := block_of(p, chosen)) is not None))
