"""Replica's graph IR: ops in topological order with shapes, bytes, FLOPs and parameters.

Nothing from ``torch.fx`` leaks into these types: the solver, the plan and the
visualizer read only this. Parameter accesses (``get_attr``) are not nodes; they
are recorded on the ops that use them, so a parameter read by two distant ops
(a tied embedding and head) costs no cut.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterator

__all__ = ["TensorInfo", "Node", "ParameterInfo", "Graph", "fingerprint"]

# Node kinds.
INPUT = "input"
OP = "op"
OUTPUT = "output"


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one tensor a node produces."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    @property
    def is_floating(self) -> bool:
        return self.dtype.startswith(("float", "bfloat", "complex"))


_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "float32": 4,
    "int64": 8, "float64": 8, "complex64": 8, "complex128": 16,
}


def _itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype, 4)


@dataclass
class Node:
    """One operation (or the graph's input / output).

    ``name`` is unique and stable for a given model and tracer; ``target`` names
    the op (``linear``, ``add``, ``transformer.h.0.attn.c_attn``...). ``outputs``
    lists every tensor the node produces (empty for a Python value such as a size);
    ``value_kind`` is ``"tensor"``, ``"value"`` (a Python value) or ``"container"``
    (a tuple of tensors, as ``split`` makes: never cut between it and its readers);
    ``writes_into`` names the value an in-place write through a view changes (never
    cut between that value and this node).

    Under autocast (a graph from :func:`replica.partition.autocast.autocast_graph`)
    ``outputs`` carry autocast's dtypes, ``compute_dtype`` is the dtype most of the op's
    FLOPs run in ("": the model's, as without autocast) and ``weight_casts`` the
    ``(parameter, dtype)`` copies autocast makes of the weights it reads, once per forward.
    """

    name: str
    kind: str
    target: str
    module_path: str
    inputs: tuple[str, ...]
    outputs: tuple[TensorInfo, ...] = ()
    value_kind: str = "tensor"
    writes_into: str | None = None
    flops: float = 0.0
    bytes_accessed: float = 0.0
    parameters: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()
    users: list[str] = field(default_factory=list)
    compute_dtype: str = ""
    weight_casts: tuple[tuple[str, str], ...] = ()

    @property
    def output_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)

    @property
    def is_tensor(self) -> bool:
        return bool(self.outputs)


@dataclass(frozen=True)
class ParameterInfo:
    """A parameter (or buffer) by its canonical name, with every other name it is reachable by."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    aliases: tuple[str, ...] = ()
    is_buffer: bool = False

    @property
    def nbytes(self) -> int:
        return TensorInfo(self.shape, self.dtype).nbytes


@dataclass
class Graph:
    """Nodes in topological order: the inputs first, the single output last."""

    nodes: list[Node]
    parameters: dict[str, ParameterInfo]
    model_name: str = ""

    def __post_init__(self) -> None:
        self._index = {n.name: i for i, n in enumerate(self.nodes)}
        for n in self.nodes:
            n.users.clear()
        for n in self.nodes:
            for a in n.inputs:
                self.nodes[self._index[a]].users.append(n.name)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, name: str) -> Node:
        return self.nodes[self._index[name]]

    def index(self, name: str) -> int:
        return self._index[name]

    @property
    def input_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == INPUT]

    @property
    def op_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == OP]

    @property
    def output_node(self) -> Node:
        return self.nodes[-1]

    def canonical(self, name: str) -> str:
        """The canonical name of a parameter reachable as ``name`` (tied weights share one)."""
        if name in self.parameters:
            return name
        for p in self.parameters.values():
            if name in p.aliases:
                return p.name
        raise KeyError(name)

    @property
    def total_flops(self) -> float:
        return sum(n.flops for n in self.nodes)

    @property
    def parameter_bytes(self) -> int:
        return sum(p.nbytes for p in self.parameters.values() if not p.is_buffer)


def fingerprint(graph: Graph) -> str:
    """A hash of the ops, their wiring and shapes: a plan only applies to the graph it was made for."""
    h = hashlib.sha256()
    for n in graph:
        h.update(f"{n.name}|{n.kind}|{n.target}|{','.join(n.inputs)}|{[t.shape for t in n.outputs]}\n".encode())
    return h.hexdigest()[:16]
