"""What a stage keeps for backward under each recompute mode, and what its backward runs again.

The modes (``recompute=``), per stage, on its blocks (:mod:`replica.partition.blocks`; a stage
holding none is one block, the whole stage):

- ``False``: every op keeps what autograd saves (its saved activations);
- ``True``: each block fully checkpointed (torchtitan's "full"): a block keeps only its inputs,
  and its backward first runs its forward again, holding one block's activations at a time;
- ``"selective"``: each block keeps its matmul and attention outputs and recomputes the rest
  (torchtitan's op-level selective checkpointing; Megatron keeps the same products);
- ``int k``: the first ``k`` blocks of each stage fully, the others as ``False`` (Megatron's
  recompute-num-layers).

:func:`stage_activations` prices a stage's ops under a mode at the traced batch: the bytes kept
from forward to backward (per micro-batch in flight, after scaling), the bytes one recomputed
block holds at its peak (once), and the ops run again. A block's span is its first op to its
last, as the runtime cuts it (:mod:`replica.stage.checkpoint`). Nothing here imports torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from replica.errors import ConfigError
from replica.partition.blocks import block_of
from replica.partition.graph import INPUT, OP, Graph, Node, TensorInfo

__all__ = ["MODES", "check_mode", "saves_activation", "kept_by_selective", "stage_activations", "Activations",
           "regions", "describe_mode", "needs_blocks", "defers_weight_grad", "weight_grad_bytes"]

MODES = (False, True, "selective")  # and any int k >= 0
# a recomputed block's backward holds its rebuilt activations and, as it walks them, gradients of
# about a quarter as many bytes again (measured 0.95-1.26x the rebuilt bytes, benchmarks/RESULTS.md,
# activation_memory.py)
REBUILT_HELD = 1.25
# ops whose outputs selective checkpointing keeps (the traced graph's names; stage/checkpoint.py
# keeps the aten ops they run as)
_KEPT = frozenset({"linear", "addmm", "mm", "bmm", "baddbmm", "matmul", "einsum", "conv1d", "conv2d", "conv3d",
                   "convolution", "scaled_dot_product_attention", "scaled_dot_product_flash_attention",
                   "scaled_dot_product_efficient_attention", "scaled_dot_product_cudnn_attention",
                   "scaled_dot_product_flash_attention_for_cpu"})


def check_mode(mode: object) -> bool | str | int:
    """``mode`` if it is a recompute mode (False, True, "selective", an int k >= 0), else a ConfigError."""
    if mode in MODES or (isinstance(mode, int) and not isinstance(mode, bool) and mode >= 0):
        return mode  # type: ignore[return-value]
    raise ConfigError(f"a stage's recompute must be False, True (every block checkpointed), 'selective' (keep "
                      f"matmul and attention outputs) or an int k >= 0 (the first k blocks), got {mode!r}")


def needs_blocks(mode: object) -> bool:
    """Whether ``mode`` means nothing on a model without blocks (selective, or k blocks)."""
    return mode == "selective" or (isinstance(mode, int) and not isinstance(mode, bool) and mode > 0)


def describe_mode(mode: object, num_blocks: int) -> str:
    """A few words for the summary: ``"-"``, ``"4 blocks"``, ``"2 of 4 blocks"``, ``"selective"``, ``"stage"``."""
    if mode is False or mode == 0:
        return "-"
    if mode is True:
        return f"{num_blocks} block{'s' if num_blocks != 1 else ''}" if num_blocks else "stage"
    if mode == "selective":
        return "selective" if num_blocks else "selective stage"
    return f"{mode} of {num_blocks} blocks"


# ops whose output no backward reads: an embedding's backward needs only its indices, and the op
# that reads the embedding (an add, a dropout) keeps nothing of it either (benchmarks/RESULTS.md,
# activation_memory.py: the Megatron 1T row's first stage held 26 GiB of these in the plan, none measured)
_NOT_SAVED = frozenset({"embedding"})


def saves_activation(n: Node) -> bool:
    """Whether autograd keeps ``n``'s output for backward (an op with work and a floating output,
    but an embedding's)."""
    return n.kind == OP and (n.flops > 0 or n.bytes_accessed > 0) and any(t.is_floating for t in n.outputs) \
        and n.target.split(".")[0].lstrip("_") not in _NOT_SAVED


def kept_by_selective(n: Node) -> bool:
    """Whether selective checkpointing keeps ``n``'s output (a matmul's or attention's)."""
    base = n.target.split(".")[0].lstrip("_")
    return n.kind == OP and base in _KEPT and any(t.is_floating for t in n.outputs)


@dataclass(frozen=True)
class Activations:
    """A stage's activations under a mode, at the traced batch: ``kept`` from each forward to its
    backward, ``peak`` held at once while one block is recomputed and backpropagated (the largest
    block's: its rebuilt activations and gradients of about a quarter as many bytes while its
    backward walks it, :data:`REBUILT_HELD`, as measured in benchmarks/activation_memory.py), and
    ``again``: the ops whose forward runs again in backward. Autocast's copies of the weights a
    checkpointed region reads are not kept either: made again in its recomputation."""

    kept: int
    peak: int
    again: frozenset[str]
    by_node: "dict[str, int] | None" = None  # ``kept`` by the node whose output it is
    inside: frozenset[str] = frozenset()  # the ops in checkpointed regions (their weight casts are rebuilt too)
    # what rebuilding a region holds beyond ``kept`` at that moment (the forward's kept bytes after
    # the region are freed by then): the stage's peak is ``kept`` in flight plus this, once
    extra: int = 0


def regions(members: Sequence[Node], blocks: Sequence[str]) -> list[list[Node]]:
    """Each block's span of ``members`` (its first op to its last), in order; the whole stage
    when it holds no block."""
    if not blocks:
        return [[n for n in members if n.kind == OP]]
    span: dict[str, list[int]] = {}  # block -> [its first op, its last op], one pass over the members
    for i, n in enumerate(members):
        if n.kind == OP and (b := _block_of(n.module_path)) is not None:
            span.setdefault(b, [i, i])[1] = i
    return [[n for n in members[span[b][0]:span[b][1] + 1] if n.kind == OP] for b in blocks if b in span]


@functools.lru_cache(maxsize=1 << 16)
def _block_of(module_path: str) -> str | None:
    """:func:`block_of` once per module path (every cut and layout of the tuner asks for the same ones)."""
    return block_of(module_path)


def stage_activations(members: Sequence[Node], blocks: Sequence[str], mode: object) -> Activations:
    """What ``members`` (a stage's nodes, in order) keep and rebuild under ``mode``, with ``blocks``
    the stage's blocks. A block's inputs made on another stage arrive as the stage's inputs and
    are priced as received, not here; the stage's own outputs are kept (the runtime holds them
    for their gradients) even where a checkpointed block made them."""
    mode = check_mode(mode)
    saved_all = {n.name: n.output_bytes for n in members if saves_activation(n)}
    if mode is False or mode == 0:
        return Activations(sum(saved_all.values()), 0, frozenset(), saved_all)
    if isinstance(mode, int) and not isinstance(mode, bool) and not blocks:
        return Activations(sum(saved_all.values()), 0, frozenset(), saved_all)  # k blocks of none: nothing
    spans = regions(members, blocks)
    chosen = spans[:mode] if isinstance(mode, int) and not isinstance(mode, bool) else spans
    here = {n.name: n for n in members}
    inside: set[str] = set()
    kept_inputs: dict[str, int] = {}
    rebuilt: list[tuple[str, int]] = []  # (a region's last op, what rebuilding it holds)
    again: set[str] = set()
    kept_selective: dict[str, int] = {}
    for span in chosen:
        names = {n.name for n in span}
        inside |= names
        saved = sum(saved_all.get(n.name, 0) for n in span)
        if mode == "selective":
            keep = {n.name for n in span if kept_by_selective(n)}
            kept_selective.update((x, here[x].output_bytes) for x in keep)
            rebuilt.append((span[-1].name, REBUILT_HELD * (saved - sum(saved_all.get(x, 0) for x in keep))))
            again |= names - keep
        else:
            rebuilt.append((span[-1].name, REBUILT_HELD * saved))
            again |= names
        for n in span:  # the block's inputs made on this stage (received ones are priced as received)
            for a in n.inputs:
                src = here.get(a)
                if a not in names and src is not None and src.kind != INPUT and any(t.is_floating for t in src.outputs):
                    kept_inputs[a] = src.output_bytes
    by_node = {name: b for name, b in saved_all.items() if name not in inside}
    by_node.update((name, b) for name, b in kept_inputs.items() if name in inside or name not in saved_all)
    for name, b in kept_selective.items():
        by_node[name] = max(by_node.get(name, 0), b)  # an output both kept and a block's input: once
    for n in members:  # what the stage hands on is held from its forward to its backward (the
        # gradient of its outputs flows into them), checkpointed or not
        if n.kind == OP and any(u not in here for u in n.users) and any(t.is_floating for t in n.outputs):
            by_node[n.name] = max(by_node.get(n.name, 0), n.output_bytes)
    # a region is rebuilt when backward reaches it: what the forward kept after it is freed by then
    order = {n.name: i for i, n in enumerate(members)}
    total = sum(by_node.values())
    extra = max((held + sum(b for name, b in by_node.items() if order[name] <= order[last]) - total
                 for last, held in rebuilt), default=0)
    return Activations(total, max((held for _, held in rebuilt), default=0), frozenset(again), by_node,
                       frozenset(inside), max(extra, 0))


def defers_weight_grad(n: Node) -> bool:
    """Whether ``n`` is a linear layer whose weight gradient a split backward defers to W
    (:func:`replica.stage.weightgrad.defer_linear_weight_grads`, outside checkpointed blocks)."""
    return n.kind == OP and n.target.split(".")[0] in ("linear", "addmm") and bool(n.parameters)


def weight_grad_bytes(members: Sequence[Node], graph: Graph, inside: frozenset[str]) -> int:
    """What a split backward holds of ``members`` (a stage's nodes) from a micro-batch's B to its W,
    at the traced batch: each deferred linear's input, as it saves it (cast to its compute dtype:
    under autocast a copy per linear, else the input itself, once), and its output's gradient.
    A checkpointed block's linears (``inside``) compute their weight gradients in B: none."""
    held: dict[str, int] = {}
    grads = 0
    for n in members:
        if not defers_weight_grad(n) or n.name in inside or not n.outputs:
            continue
        out = n.outputs[0]
        grads += out.nbytes
        x = next((graph[a] for a in n.inputs if graph[a].outputs), None)
        if x is None:
            continue
        t = x.outputs[0]
        if t.dtype == out.dtype:
            held[x.name] = t.nbytes
        else:  # autocast's cast of the input: one per linear
            held[f"{n.name}:input"] = TensorInfo(t.shape, out.dtype).nbytes
    return grads + sum(held.values())
