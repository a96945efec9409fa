"""Activation checkpointing per block: a block's region of the stage graph runs under ``torch.utils.checkpoint``.

:func:`checkpoint_blocks` cuts each chosen block's span of the stage's fx graph (from its first
node to its last, every node between them included) into a sub-``GraphModule`` and calls it
through ``torch.utils.checkpoint.checkpoint`` (non-reentrant; RNG and autocast state kept).
The stage's other ops run as before. The parameters the region reads by ``get_attr`` are read
in the stage graph and handed in, so a parameter swapped later (FSDP2's shards) is the one the
region sees (buffers stay inside: a batch norm's running statistics, updated in place, must not
be a checkpoint's input); called modules are shared by reference, so their hooks fire in the forward and
again in the recomputation, as torchtitan's checkpoint wrappers let FSDP2's do.

Two ways per block (torchtitan's names):

- **full**: only the block's inputs are kept; backward runs the block's forward again.
- **selective**: the outputs of matmuls and attention are kept
  (``create_selective_checkpoint_contexts``, :data:`SAVED_OPS`); norms, activations and other
  pointwise ops are recomputed from them. Megatron's selective recompute keeps the same products.

A batch norm's recomputation counts no statistics (:func:`.batchnorm.recompute_context`).
"""

from __future__ import annotations

import contextlib
import operator
from functools import partial
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch
import torch.fx as fx
import torch.utils.checkpoint as ckpt

from replica.stage.batchnorm import recompute_context
from replica.stage.rewrite import node_module_path

__all__ = ["checkpoint_blocks", "checkpointed", "checkpointed_modules", "SAVED_OPS", "block_nodes", "CHECKPOINTED"]

_aten = torch.ops.aten
# the products selective checkpointing keeps (torchtitan's save list: matmuls and attention)
SAVED_OPS = frozenset(op for op in (
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    getattr(_aten, "_scaled_mm", None) and _aten._scaled_mm.default,
    _aten.convolution.default,
    *(getattr(_aten, name).default for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
      if hasattr(_aten, name)),
) if op)

CHECKPOINTED = "replica_checkpointed"  # the sub-GraphModule a region's call carries, by this attribute


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> ckpt.CheckpointPolicy:
    return ckpt.CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else ckpt.CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def _both(first: ContextManager[Any], second: ContextManager[Any]) -> Iterator[None]:
    with first, second:
        yield


def _contexts(selective: bool) -> tuple[ContextManager[Any], ContextManager[Any]]:
    """``context_fn`` for a block's checkpoint: the selective policy where asked, and batch
    norms that count no statistics in the recomputation."""
    norm_forward, norm_again = recompute_context()
    if not selective:
        return norm_forward, norm_again
    forward, again = ckpt.create_selective_checkpoint_contexts(_policy)
    return _both(forward, norm_forward), _both(again, norm_again)


def checkpointed(module: torch.nn.Module, args: tuple[Any, ...], *, selective: bool = False) -> Any:
    """``module(*args)`` under activation checkpointing (full, or ``selective``): a stage without
    blocks, checkpointed whole; what each block's region runs."""
    if not torch.is_grad_enabled():
        return module(*args)
    return ckpt.checkpoint(module, *args, use_reentrant=False, context_fn=partial(_contexts, selective))


def _run(region: fx.GraphModule, selective: bool, *args: Any) -> Any:
    return checkpointed(region, args, selective=selective)


def block_nodes(module: fx.GraphModule, block: str) -> list[fx.Node]:
    """The ops of ``module``'s graph that lie in ``block`` (by module path), in graph order."""
    return [n for n in module.graph.nodes if n.op not in ("placeholder", "output", "get_attr")
            and ((p := node_module_path(n)) == block or p.startswith(block + "."))]


def checkpoint_blocks(module: fx.GraphModule, blocks: Sequence[str], *, selective: bool = False) -> int:
    """Run each of ``blocks`` (module paths, :mod:`replica.partition.blocks`) of ``module``
    under activation checkpointing: full, or ``selective``. Recompiles ``module``; returns how
    many regions it made (a block with no op here makes none)."""
    graph = module.graph
    made = 0
    for block in blocks:
        members = block_nodes(module, block)
        if not members:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        first, last = order[members[0]], order[members[-1]]
        span = [n for n in graph.nodes if first <= order[n] <= last]
        hoisted = [n for n in span if n.op == "get_attr" and _is_parameter(module, str(n.target))]
        for n in hoisted:  # parameters are read outside, handed in
            members[0].prepend(n)
        region = [n for n in span if n not in hoisted]
        inside = set(region)
        inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in inside))
        outputs = [n for n in region if any(u not in inside for u in n.users)]
        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {a: sub.placeholder(a.name) for a in inputs}
        for n in region:
            env[n] = sub.node_copy(n, env.__getitem__)
        sub.output(tuple(env[n] for n in outputs))
        sub_module = fx.GraphModule(module, sub, class_name=f"Checkpointed_{block.replace('.', '_')}")
        call: Callable[..., Any] = partial(_run, sub_module, selective)
        run = _named(call, block, sub_module)
        with graph.inserting_before(region[0]):
            node = graph.call_function(run, tuple(inputs))
            for i, n in enumerate(outputs):
                got = graph.call_function(operator.getitem, (node, i))
                got.meta = dict(n.meta)
                n.replace_all_uses_with(got, delete_user_cb=lambda u: u not in inside)
        for n in reversed(region):
            graph.erase_node(n)
        made += 1
    if made:
        graph.lint()
        module.recompile()
    return made


def _is_parameter(module: torch.nn.Module, target: str) -> bool:
    path, _, name = target.rpartition(".")
    try:
        return isinstance(getattr(module.get_submodule(path), name), torch.nn.Parameter)
    except AttributeError:
        return False


def _named(call: Callable[..., Any], block: str, sub_module: fx.GraphModule) -> Callable[..., Any]:
    """A plain function (fx names it in the generated code) that calls ``call``."""

    def run(*args: Any) -> Any:
        return call(*args)

    run.__name__ = run.__qualname__ = f"checkpointed_{block.replace('.', '_')}"
    setattr(run, CHECKPOINTED, sub_module)
    return run


def checkpointed_modules(module: fx.GraphModule) -> list[fx.GraphModule]:
    """The sub-GraphModules of ``module``'s checkpointed regions, in graph order."""
    return [getattr(n.target, CHECKPOINTED) for n in module.graph.nodes
            if n.op == "call_function" and hasattr(n.target, CHECKPOINTED)]
