"""``train()`` / ``eval()`` and random numbers in traced graphs.

A tracer freezes ``self.training`` into the graph: dropout traced in training mode would
keep dropping after ``model.eval()``. :func:`follow_mode` rewrites every dropout so that it
reads, when it runs, the ``training`` flag of the module that called it in the user's model
(the runtime says which model with :func:`following`). Ops whose mode cannot follow (batch
norm's statistics) are listed by :func:`frozen_mode_ops`, so a run in the other mode fails
loudly instead of computing the wrong thing.

Random ops draw from a generator seeded per stage and micro-batch (:func:`seeded`), so a
pipelined step gives the same result under any schedule, stage placement or recompute.
"""

from __future__ import annotations

import operator
import re
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn.functional as F

from replica.scoped import Scoped

__all__ = ["follow_mode", "following", "frozen_mode_ops", "uses_rng", "seeded", "microbatch_seed"]

_model: Scoped[torch.nn.Module | None] = Scoped(None)  # the model whose mode dropouts follow

_ATEN_DROPOUTS = {torch.ops.aten.dropout.default: "dropout", torch.ops.aten.alpha_dropout.default: "alpha",
                  torch.ops.aten.feature_dropout.default: "feature",
                  torch.ops.aten.feature_alpha_dropout.default: "feature_alpha"}
_FUNCTIONAL_DROPOUTS = {F.dropout: "dropout", F.dropout1d: "dropout1d", F.dropout2d: "dropout2d",
                        F.dropout3d: "dropout3d", F.alpha_dropout: "alpha", F.feature_alpha_dropout: "feature_alpha",
                        torch.dropout: "dropout", torch.alpha_dropout: "alpha", torch.feature_dropout: "feature"}
_KINDS = {"dropout": F.dropout, "dropout1d": F.dropout1d, "dropout2d": F.dropout2d, "dropout3d": F.dropout3d,
          "alpha": F.alpha_dropout, "feature_alpha": F.feature_alpha_dropout}
_FROZEN = {torch.ops.aten._native_batch_norm_legit_no_training.default,
           torch.ops.aten._native_batch_norm_legit.no_stats}
_NORMS = {F.batch_norm, F.instance_norm, torch.ops.aten.batch_norm.default, torch.ops.aten.instance_norm.default}
_RANDOM = re.compile(r"(^|[._])(dropout\w*|rand\w*|bernoulli\w*|normal_?|uniform_?|multinomial|randperm|"
                     r"exponential_|geometric_|cauchy_|log_normal_|rrelu\w*)($|[._])")


def _training_of(path: str, traced: bool) -> bool:
    model = _model.get()
    if model is None:
        return traced
    try:
        return bool(model.get_submodule(path).training)
    except AttributeError:
        return bool(model.training)


def dropout(x: torch.Tensor, p: float, path: str, traced: bool, kind: str = "dropout", inplace: bool = False) -> Any:
    """Dropout of ``kind`` in the mode of the module at ``path`` of the running model
    (``traced``, the mode while tracing, outside a pipeline)."""
    training = _training_of(path, traced)
    if kind == "feature":
        return torch.feature_dropout(x, p, training)
    return _KINDS[kind](x, p, training, inplace)


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any, dropout_p: float,
                                 is_causal: bool, path: str, traced: bool, **kwargs: Any) -> torch.Tensor:
    """Attention whose dropout applies only while the module at ``path`` trains."""
    p = dropout_p if _training_of(path, traced) else 0.0
    return F.scaled_dot_product_attention(q, k, v, attn_mask, p, is_causal, **kwargs)


_ATTENTION = {torch.ops.aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention}
_ATTENTION_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def _module_path(n: fx.Node) -> str:
    stack = n.meta.get("nn_module_stack") or {}
    return str(next(reversed(stack.values()))[0]) if stack else ""


def follow_mode(gm: fx.GraphModule) -> int:
    """Make every dropout of ``gm`` follow its module's mode at run time; returns how many."""
    count = 0
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in _ATEN_DROPOUTS:
            kind = _ATEN_DROPOUTS[n.target]
            x, p, train = n.args[:3]
            inplace = False
        elif n.target in _FUNCTIONAL_DROPOUTS:
            kind = _FUNCTIONAL_DROPOUTS[n.target]
            names = ("input", "p", "train" if n.target in (torch.dropout, torch.alpha_dropout,
                                                          torch.feature_dropout) else "training", "inplace")
            bound = {**dict(zip(names, n.args)), **n.kwargs}
            x, p = bound["input"], bound.get("p", 0.5)
            train, inplace = bound.get("training", bound.get("train", True)), bound.get("inplace", False)
        elif n.target in _ATTENTION:
            bound = {**dict(zip(_ATTENTION_ARGS, n.args)),
                     **{k: v for k, v in n.kwargs.items() if k in _ATTENTION_ARGS}}
            p = bound.get("dropout_p", 0.0)
            if not (isinstance(p, float) and p > 0):
                continue  # no dropout (traced in eval mode, the rate is not known)
            n.target = scaled_dot_product_attention
            n.args = (*(bound.get(a) for a in _ATTENTION_ARGS[:3]), bound.get("attn_mask"), p,
                      bound.get("is_causal", False), _module_path(n), True)
            n.kwargs = {k: v for k, v in n.kwargs.items() if k not in _ATTENTION_ARGS}
            count += 1
            continue
        else:
            continue
        if not isinstance(train, bool):
            continue  # already a traced value: it follows by itself
        n.target = dropout
        n.args = (x, p, _module_path(n), train, kind, inplace)
        n.kwargs = {}
        count += 1
    if count:
        gm.recompile()
    return count


def frozen_mode_ops(gm: fx.GraphModule) -> list[str]:
    """Nodes whose behaviour was fixed to the traced mode and cannot follow a change."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _FROZEN:
            out.append(n.name)
        elif n.op == "call_function" and n.target in _NORMS and isinstance(
                n.kwargs.get("training", n.args[5] if len(n.args) > 5 else None), bool):
            out.append(n.name)  # the training flag is argument 5 of each
    return out


def uses_rng(gm: fx.GraphModule) -> bool:
    """Whether running ``gm`` may draw random numbers (dropout, rand*, bernoulli, ...)."""
    for n in gm.graph.nodes:
        if n.op == "call_module":
            module = gm.get_submodule(str(n.target))
            if getattr(module, "p", None) == 0:
                continue  # nn.Dropout(p=0) draws nothing
            name = type(module).__name__.lower()
        elif n.op in ("call_function", "call_method"):
            name = str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))
        else:
            continue
        if n.target is operator.getitem:
            continue
        if n.target is scaled_dot_product_attention:
            return True  # rewritten only when it has dropout
        if n.target is dropout and n.args[1] == 0:
            continue  # p = 0 draws nothing
        if _RANDOM.search(name.lower()):
            return True
    return False


@contextmanager
def following(model: torch.nn.Module | None) -> Iterator[None]:
    """Within: dropouts rewritten by :func:`follow_mode` read their mode from ``model``."""
    with _model.using(model):
        yield


def microbatch_seed(base: int, stage: int, microbatch: int, replica: int = 0) -> int:
    """A seed of its own for each (step, stage, micro-batch, data-parallel replica)."""
    return (((base * 1_000_003 + replica) * 10_007 + stage) * 100_003 + microbatch) % (2**63 - 1)


@contextmanager
def seeded(seed: int | None, device: torch.device | None = None) -> Iterator[None]:
    """Run with the default generator of ``device`` (and the CPU's) seeded by ``seed``,
    restoring them afterwards; ``None`` leaves the generators alone. (Not ``torch.manual_seed``:
    it also queues a seed for every other backend, a millisecond per call.)"""
    if seed is None:
        yield
        return
    generators = [torch.default_generator]
    if device is not None and device.type == "cuda":
        generators.append(torch.cuda.default_generators[device.index or 0])
    states = [g.get_state() for g in generators]
    for g in generators:
        g.manual_seed(seed)
    try:
        yield
    finally:
        for g, state in zip(generators, states):
            g.set_state(state)
