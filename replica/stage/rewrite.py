"""Swap calls in a stage's fx graph for Replica's own (deferrable linears, rebuildable norms)."""

from __future__ import annotations

from typing import Callable

import torch.fx as fx

__all__ = ["rewrite_calls"]


def rewrite_calls(module: fx.GraphModule, replace: Callable[[fx.Graph, fx.Node], fx.Node | None]) -> int:
    """Give every node of ``module`` to ``replace``, called with the graph's insertion point
    before that node; where it returns a new node, the new node takes the old one's place.
    Recompiles ``module`` if anything changed; returns how many nodes were replaced."""
    graph = module.graph
    count = 0
    for n in list(graph.nodes):
        with graph.inserting_before(n):
            new = replace(graph, n)
        if new is None:
            continue
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        count += 1
    if count:
        graph.lint()
        module.recompile()
    return count
