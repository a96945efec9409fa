"""Swap calls in a stage's fx graph for Replica's own (deferrable linears, rebuildable norms)."""

from __future__ import annotations

from typing import Callable

import torch.fx as fx

__all__ = ["rewrite_calls", "node_module_path"]

_PATH = "replica_module_path"  # a replacement node's note of the module path of the node it replaced


def node_module_path(n: fx.Node) -> str:
    """The module path an fx node runs in: a called module's own, else the innermost module on
    its ``nn_module_stack`` ("" at the top); a replacement keeps its original's."""
    if _PATH in n.meta:
        return n.meta[_PATH]
    if n.op == "call_module":
        return str(n.target)
    stack = n.meta.get("nn_module_stack") or {}
    path = str(next(reversed(stack.values()))[0]) if stack else ""
    return "" if path.startswith("_") else path


def rewrite_calls(module: fx.GraphModule, replace: Callable[[fx.Graph, fx.Node], fx.Node | None]) -> int:
    """Give every node of ``module`` to ``replace``, called with the graph's insertion point
    before that node; where it returns a new node, the new node takes the old one's place (and
    its module path). Recompiles ``module`` if anything changed; returns how many nodes were replaced."""
    graph = module.graph
    count = 0
    for n in list(graph.nodes):
        with graph.inserting_before(n):
            new = replace(graph, n)
        if new is None:
            continue
        new.meta = {**n.meta, **new.meta, _PATH: node_module_path(n)}
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        count += 1
    if count:
        graph.lint()
        module.recompile()
    return count
