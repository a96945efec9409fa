"""The model graph collapsed to modules: each stage's ops grouped into boxes by module path.

A box is a run of consecutive ops of one stage whose module paths share their first
``depth`` parts (``transformer.h.3`` at depth 3); it opens into the runs one level
deeper, down to single ops. :func:`stage_boxes` picks the depth: the shallowest one at
which no stage is a single box that could be opened and there are at least
``max(8, 2 × num_stages)`` boxes, kept under ``max_boxes`` (a 96-layer GPT shows its
blocks, ~110 boxes, not its 3,000 ops). Where even depth 1 has too many boxes, each
stage's runs are bundled. O(ops × depth). Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from replica.errors import ConfigError

if TYPE_CHECKING:
    from replica.partition.graph import Graph
    from replica.partition.plan import Plan

__all__ = ["OpInfo", "ModuleBox", "ops_of", "group", "stage_boxes", "MAX_TOP_LEVEL_BOXES"]

MAX_TOP_LEVEL_BOXES = 199


@dataclass(frozen=True)
class OpInfo:
    """One op as the report shows it; ``target`` and ``shape`` are known only from a graph."""

    name: str
    module_path: str
    stage_index: int
    target: str = ""
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    flops: float = 0.0


@dataclass
class ModuleBox:
    """Consecutive ops under module ``path`` (``""``: the model's own ops), and what it opens into."""

    path: str
    depth: int
    ops: list[OpInfo]
    children: list[Union["ModuleBox", OpInfo]] = field(default_factory=list)
    label: str = ""

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    @property
    def title(self) -> str:
        return self.label or self.path or "(model)"


def _parts(path: str) -> list[str]:
    return path.split(".") if path else []


def _key(path: str, depth: int) -> str:
    return ".".join(_parts(path)[:depth])


def ops_of(plan: "Plan", graph: "Graph | None" = None) -> list[OpInfo]:
    """Every op of ``plan`` in order, with its stage. With ``graph`` (the traced graph the plan
    was made from) module paths, targets and shapes are exact; without it each op's module is
    inferred from its name and the stage's ``module_paths`` (fx names a module call after it)."""
    if graph is not None:
        stage_of = {name: s.stage_index for s in plan.stages for name in s.node_names}
        ops = []
        for n in graph.op_nodes:
            if n.name not in stage_of:
                raise ConfigError(
                    f"graph op {n.name!r} is in no stage of the plan: pass the graph the plan was made from "
                    "(replica.partition.trace.trace(model, example_inputs).graph), or graph=None"
                )
            out = n.outputs[0] if n.outputs else None
            ops.append(OpInfo(n.name, n.module_path, stage_of[n.name], n.target,
                              out.shape if out else None, out.dtype if out else None, n.flops))
        return ops
    return [op for s in plan.stages for op in _infer_paths(s.stage_index, s.node_names, s.module_paths)]


def _infer_paths(stage_index: int, node_names: tuple[str, ...], module_paths: tuple[str, ...]) -> list[OpInfo]:
    """Module paths for a stage's ops without the graph. A node named like a path (``transformer_h_0_ln_1``)
    is that module's call; a path no node is named after (a block's ``add``) first appears at the next
    unnamed node, in ``module_paths`` order; after a module call, unnamed nodes belong to the nearest
    enclosing module seen so far."""
    by_name = {_fx_name(p): p for p in module_paths}
    named = {by_name[n] for n in node_names if n in by_name}
    pending = list(module_paths)
    seen: list[str] = []
    current = ""
    ops = []
    for name in node_names:
        path = by_name.get(name)
        if path is not None:
            if path in pending:
                pending.remove(path)
            seen.append(path)
            enclosing = [p for p in seen if path.startswith(p + ".")]
            current = max(enclosing, key=len, default="")
        else:
            if pending and pending[0] not in named:
                current = pending.pop(0)
                seen.append(current)
            path = current
        ops.append(OpInfo(name, path, stage_index))
    return ops


def _fx_name(path: str) -> str:
    """The name torch.fx gives a call of the module at ``path`` (``layers.0`` → ``layers_0``, ``0`` → ``_0``)."""
    name = path.replace(".", "_")
    return "_" + name if name[:1].isdigit() else name


def group(ops: list[OpInfo], depth: int) -> list[ModuleBox]:
    """Runs of consecutive ops sharing the first ``depth`` parts of their module path, each
    opening into its runs one level deeper (its own ops listed directly)."""
    boxes: list[ModuleBox] = []
    for op in ops:
        key = _key(op.module_path, depth)
        if boxes and boxes[-1].path == key:
            boxes[-1].ops.append(op)
        else:
            boxes.append(ModuleBox(key, depth, [op]))
    for box in boxes:
        box.children = _children(box)
    return boxes


def _children(box: ModuleBox) -> list[Union[ModuleBox, OpInfo]]:
    if all(op.module_path == box.path for op in box.ops):
        return list(box.ops)
    out: list[Union[ModuleBox, OpInfo]] = []
    inner: list[OpInfo] = []
    for op in [*box.ops, None]:
        if op is not None and op.module_path != box.path:
            inner.append(op)
            continue
        if inner:
            out += group(inner, box.depth + 1)
            inner = []
        if op is not None:
            out.append(op)
    return out


def _expandable(box: ModuleBox) -> bool:
    return any(isinstance(c, ModuleBox) for c in box.children) or (
        box.num_ops > 1 and any(op.module_path != box.path for op in box.ops))


def stage_boxes(
    ops: list[OpInfo], num_stages: int, *, max_boxes: int = MAX_TOP_LEVEL_BOXES
) -> tuple[int, list[list[ModuleBox]]]:
    """``(depth, boxes[stage_index])``: each stage's ops collapsed to the depth described in the
    module docstring, with fewer than ``max_boxes + 1`` top-level boxes in all."""
    by_stage: list[list[OpInfo]] = [[] for _ in range(num_stages)]
    for op in ops:
        by_stage[op.stage_index].append(op)
    deepest = max((len(_parts(op.module_path)) for op in ops), default=0)
    wanted = max(8, 2 * num_stages)
    depth, boxes = 1, [group(s, 1) for s in by_stage]
    while depth < deepest:
        single = any(len(b) == 1 and _expandable(b[0]) for b in boxes)
        if not single and sum(map(len, boxes)) >= wanted:
            break
        deeper = [group(s, depth + 1) for s in by_stage]
        if sum(map(len, deeper)) > max_boxes:
            break
        depth, boxes = depth + 1, deeper
    if sum(map(len, boxes)) > max_boxes:
        boxes = _bundle(boxes, max_boxes)
    return depth, boxes


def _bundle(boxes: list[list[ModuleBox]], max_boxes: int) -> list[list[ModuleBox]]:
    """Each stage's runs bundled into consecutive groups, stages sharing ``max_boxes`` by their runs."""
    total = sum(map(len, boxes))
    out = []
    for runs in boxes:
        allowed = max(1, max_boxes * len(runs) // total)
        size = -(-len(runs) // allowed)
        bundles = []
        for i in range(0, len(runs), size):
            part = runs[i:i + size]
            label = part[0].title if len(part) == 1 else f"{part[0].title} … {part[-1].title}"
            bundles.append(part[0] if len(part) == 1 else ModuleBox(
                part[0].path, part[0].depth, [op for b in part for op in b.ops], list(part), label=label))
        out.append(bundles)
    return out
