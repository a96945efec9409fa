"""Tests of how ``replica/`` imports itself: no circle anywhere, and the schedule layers in order.

The graph is read from the source with ``ast`` (and searched with networkx): every
``import`` statement counts for circles, at module level, inside functions and under
``if TYPE_CHECKING:`` alike. An edge goes to the module named (``from replica.schedules
import grading`` names ``replica.schedules.grading``), not to the packages Python
runs on the way there.
"""

from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "replica"


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _inside(name: str) -> str | None:
    """The module of ``replica`` that importing ``name`` names (a longest existing prefix)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_only(tree: ast.AST) -> set[int]:
    """Line numbers of the imports under ``if TYPE_CHECKING:``."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lines |= {n.lineno for stmt in node.body for n in ast.walk(stmt)
                      if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def _imports(module: str, path: pathlib.Path) -> list[tuple[str, int]]:
    """``(imported name, line)`` of every import in ``path``; names outside replica stay as written."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # ``from pkg import sub`` names the submodule when there is one
                full = f"{base}.{alias.name}"
                found.append((full if full in MODULES else base, node.lineno))
    return found


def import_graph(*, type_only: bool = True) -> nx.DiGraph:
    """Modules of replica as nodes; an edge per import, with the lines that make it (without
    ``type_only``, none under ``if TYPE_CHECKING:``). Imports from outside replica end at
    their top-level name (``torch``)."""
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for module, path in MODULES.items():
        skip = set() if type_only else _type_only(ast.parse(path.read_text(), str(path)))
        for name, line in _imports(module, path):
            target = _inside(name) if name.split(".")[0] == "replica" else name.split(".")[0]
            if target and target != module and line not in skip:
                graph.add_edge(module, target)
                graph.edges[module, target].setdefault("lines", []).append(line)
    return graph


GRAPH = import_graph()
RUNTIME = import_graph(type_only=False)  # what importing a module runs


def test_the_graph_sees_the_package():
    assert {"replica", "replica.schedules.schedule", "replica.schedules.simulate"} <= set(GRAPH)
    assert GRAPH.has_edge("replica.schedules.grading", "replica.schedules.simulate")
    assert GRAPH.has_edge("replica.schedules.schedule", "replica.schedules.actions")


def test_the_graph_reads_every_kind_of_import(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import actions\n"
        "from ..partition.plan import Plan\n"
        "if TYPE_CHECKING:\n"
        "    import replica.schedules.simulate\n"
        "def f():\n"
        "    from replica.schedules import grading, schedule\n"
        "    import torch.nn\n"
    )
    found = _imports("replica.schedules.mod", path)
    assert found == [("typing", 1), ("replica.schedules.actions", 2), ("replica.partition.plan", 3),
                     ("replica.schedules.simulate", 5), ("replica.schedules.grading", 7),
                     ("replica.schedules.schedule", 7), ("torch.nn", 8)]
    assert _type_only(ast.parse(path.read_text())) == {5}


def test_no_import_circle_inside_replica():
    cycles = list(nx.simple_cycles(GRAPH))
    described = [
        " -> ".join(f"{a} (line {GRAPH.edges[a, b]['lines'][0]})" for a, b in zip(c, c[1:] + c[:1]))
        for c in sorted(cycles, key=len)[:5]
    ]
    assert not cycles, "import circles inside replica/ (each module, and the line that imports the next):\n" + \
        "\n".join(described)


@pytest.mark.parametrize("module, allowed", [
    ("replica.schedules.actions", {"replica.errors"}),
    ("replica.schedules.replay", {"replica.errors", "replica.schedules.actions"}),
    ("replica.schedules.zerobubble", {"replica.errors", "replica.schedules.actions", "replica.schedules.replay"}),
])
def test_the_schedule_base_layer_stands_alone(module, allowed):
    inside = {n for n in nx.descendants(GRAPH, module) if n.startswith("replica")}
    assert inside <= allowed, f"{module} reaches {sorted(inside - allowed)}"


@pytest.mark.parametrize("module", ["replica.schedules.actions", "replica.schedules.replay",
                                    "replica.schedules.zerobubble", "replica.schedules.schedule"])
def test_schedules_never_reach_torch_or_the_simulator(module):
    assert "replica.schedules.simulate" not in nx.descendants(GRAPH, module)
    reached = nx.descendants(RUNTIME, module)
    assert "torch" not in reached, [p for p in nx.all_simple_paths(RUNTIME, module, "torch")][:3]


def _package(module: str) -> str:
    """``replica.partition.plan`` -> ``replica.partition``; top-level modules stay themselves."""
    parts = module.split(".")
    return ".".join(parts[:2])


# The layering DESIGN.md draws, bottom to top: what a package may never reach (through any chain of
# imports that runs): partition (tracing, costs, the cut) knows nothing of how stages run; the
# stage rewrites, parallel wrappers, schedules and runtime never reach the search that chose the
# plan; nothing but the front doors reaches the Trainer.
NEVER = {
    "replica.partition": {"replica.runtime", "replica.parallel", "replica.planner", "replica.train", "replica.api",
                          "replica.pipeline_model", "replica.checkpoint", "replica.hpo"},
    "replica.schedules": {"replica.runtime", "replica.parallel", "replica.planner", "replica.partition",
                          "replica.stage", "replica.train", "replica.api", "replica.pipeline_model"},
    "replica.stage": {"replica.runtime", "replica.parallel", "replica.planner", "replica.train", "replica.api",
                      "replica.pipeline_model"},
    "replica.parallel": {"replica.runtime", "replica.planner", "replica.train", "replica.api", "replica.pipeline_model"},
    "replica.runtime": {"replica.planner", "replica.train", "replica.api", "replica.pipeline_model"},
    "replica.planner": {"replica.train", "replica.api", "replica.pipeline_model", "replica.hpo"},
    "replica.checkpoint": {"replica.train", "replica.api", "replica.planner", "replica.runtime", "replica.hpo"},
    "replica.train": {"replica.hpo"},  # the search drives the Trainer, never the other way
}


@pytest.mark.parametrize("package", sorted(NEVER))
def test_no_layer_reaches_up(package):
    mine = [m for m in RUNTIME if _package(m) == package]
    reached = {_package(r) for m in mine for r in nx.descendants(RUNTIME, m) if r.startswith("replica.")}
    wrong = sorted(reached & NEVER[package])
    paths = []
    for target in wrong:
        for m in mine:
            hits = [t for t in RUNTIME if _package(t) == target and nx.has_path(RUNTIME, m, t)]
            if hits:
                paths.append(" -> ".join(nx.shortest_path(RUNTIME, m, hits[0])))
                break
    assert not wrong, f"{package} reaches {wrong}, against the layering:\n" + "\n".join(paths)
