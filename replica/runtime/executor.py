"""The one interpreter of pipeline actions, for both runtimes: forwards, backwards and weight
gradients of the stages this process holds.

A value crossing a cut reaches its reader as a fresh leaf, detached from the sender's graph,
whether the reader runs in this process (kept in the step's ``values``) or on another rank
(sent through the step's ``Mailbox``), so every stage's backward sees only its own graph and
hands the gradients of its inputs back to the stages that made them. The reference runtime
(:mod:`.local`) runs every stage here in one serial order of the schedule; the distributed
one (:mod:`.distributed`) runs one rank's action list, with a mailbox, the shapes of each
micro-batch's messages and the data-parallel reducer.

One rule for a missing gradient: a reader whose backward left no gradient for an input
hands none back, and its producer backpropagates only the gradients that exist. Across
processes the message was agreed before the step, so it travels as zeros, which add nothing.

When weight gradients run is decided once, at construction, per stage: with W actions in the
schedule a backward leaves them to its W (unless the W follows at once: one backward); a
stage that sends an input gradient to another process computes them right after sending it
(``early``); otherwise inside the backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

import torch
import torch.utils.checkpoint

from replica.errors import PipelineError
from replica.parallel.fsdp import reduce_now, set_last_backward
from replica.partition.modes import microbatch_seed, seeded
from replica.partition.split import StageModule
from replica.precision import autocast_for
from replica.runtime.clock import NO_CLOCK, StepClock
from replica.runtime.mailbox import Mailbox
from replica.runtime.p2p import BWD, FWD
from replica.runtime.shapes import TensorMeta
from replica.schedules.schedule import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Action,
    Schedule,
    execution_order,
    fused_weight_grads,
    max_in_flight,
    placement,
    splits_backward,
)
from replica.stage.checkpoint import checkpointed
from replica.stage.remat import KINDS, pointwise_recompute
from replica.stage.weightgrad import WeightGrads, collecting

__all__ = ["Executor", "StepResult", "RandomStreams", "LossFn", "run_stage", "weighted_loss"]

LossFn = Callable[[Any, Any], torch.Tensor]


class StepResult:
    """What one training step leaves behind: the loss (a detached scalar)."""

    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


def run_stage(stage: StageModule, args: tuple[Any, ...], recompute: bool | str, seed: int | None = None,
              pointwise: bool | Collection[str] = True, precision: str = "fp32") -> Any:
    """A stage's forward; with ``recompute`` (True, or "selective") the whole stage is
    checkpointed (:func:`replica.stage.checkpoint.checkpointed`: RNG and autocast state preserved;
    its blocks are checkpointed inside its graph instead, by the parallelize step); otherwise the
    outputs of the ``pointwise`` kinds of ops (:func:`.remat.pointwise_recompute`: True for every
    kind) are rebuilt in backward. ``seed`` seeds the random ops of a stage that has any (see
    :class:`RandomStreams`); ``precision`` "bf16" / "fp16" runs it under autocast."""
    with seeded(seed if stage.uses_rng else None, stage.device), autocast_for(_device(stage), precision):
        if recompute and torch.is_grad_enabled():
            return checkpointed(stage.module, args, selective=recompute == "selective")
        with pointwise_recompute(pointwise):
            return stage.module(*args)


def _device(stage: StageModule) -> torch.device:
    return stage.device if stage.device is not None else torch.device("cpu")


def weighted_loss(loss_fn: LossFn, out: Any, target: Any, weight: float) -> torch.Tensor:
    """A micro-batch's loss, checked to be a scalar, times its share of the batch."""
    loss = loss_fn(out, target)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise PipelineError(
            f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
            f"{'' if not isinstance(loss, torch.Tensor) else f' of shape {tuple(loss.shape)}'}"
            "; reduce it inside loss_fn (e.g. .mean(), or reduction='mean')"
        )
    return loss.reshape(()) * weight


def _check_agreed(value: torch.Tensor, meta: Any, name: str, stage: int, readers: Sequence[int],
                  microbatch: int) -> None:
    """A tensor about to cross to another process must be what both ends agreed before the
    step (its reader's buffer is that shape and dtype): otherwise say so here, before sending."""
    if isinstance(meta, TensorMeta) and (value.dtype != meta.dtype or not meta.agrees(value.shape)):
        raise PipelineError(
            f"stage {stage} made {name!r} of micro-batch {microbatch} as {value.dtype} {tuple(value.shape)}, but "
            f"the ranks agreed before the step that it crosses to stage(s) {list(readers)} as {meta.dtype} "
            f"{meta.shape} (None: a size that depends on the data). " + (
                "The step's dtypes were worked out under the autocast in force when it started: run every rank's "
                "train_step under the same torch.autocast (or pass mixed_precision= to auto_parallel), and do "
                "not change autocast inside the model's forward based on data" if value.dtype != meta.dtype else
                "Its shape was worked out from the micro-batch's input shapes on fake tensors: the forward takes "
                "a size from elsewhere (a Python value or global state that differs from rank to rank), or a module "
                "kept whole (leaf_modules=) whose output's size depends on the data (the ranks ran it on zeros): "
                "move the cut so that the module's output does not cross it, or pad that output to a fixed size")
        )


class RandomStreams:
    """Seeds for the random ops of a step: one per (stage, micro-batch, replica), derived from
    one number drawn from torch's default generator when the step starts, so a seeded run
    gives the same result under any schedule, placement or recompute."""

    def __init__(self, stages: Sequence[StageModule], replica: int = 0) -> None:
        self.used = any(s.uses_rng for s in stages)  # over every stage, so each rank draws alike
        self.replica = replica
        self.base: int | None = None

    def new_step(self) -> None:
        self.base = int(torch.randint(0, 2**62, ()).item()) if self.used else None

    def seed(self, stage: int, microbatch: int) -> int | None:
        return None if self.base is None else microbatch_seed(self.base, stage, microbatch, self.replica)


def _rebuilt_kinds(every_kind: Iterable[int], rebuilds: Iterable[tuple[int, str]]) -> dict[int, frozenset[str]]:
    """Stage -> the kinds of ops whose outputs it rebuilds in backward: every kind on
    ``every_kind``'s stages, and the ``(stage, kind)`` pairs of ``rebuilds``."""
    out: dict[int, set[str]] = {k: set(KINDS) for k in every_kind}
    for k, kind in rebuilds:
        out.setdefault(k, set()).add(kind)
    return {k: frozenset(kinds) for k, kinds in out.items()}


@dataclass
class Step:
    """Everything in flight during one step. ``metas[i]`` (across processes) says, per value
    of micro-batch ``i``, its tensor meta or the Python value itself; in one process the
    values say it themselves (``metas`` None, no mailbox)."""

    metas: Sequence[dict[str, Any]] | None = None
    mail: Mailbox | None = None
    values: dict[tuple[str, int], Any] = field(default_factory=dict)  # (name, micro-batch)
    grads: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)  # (name, mb, reader)
    saved: dict[tuple[int, int], tuple[tuple[Any, ...], Any]] = field(default_factory=dict)


class Executor:
    """Runs ``actions`` over the ``stages`` this process holds (of all of a schedule's).

    ``ranks``: the schedule's pipeline ranks this process runs (all of them in one process,
    whose actions then run in one deadlock-free serial order). ``recompute``: the stages
    checkpointed whole, each ``"full"`` (keeps only its inputs) or ``"selective"`` (True: every
    stage fully); ``pointwise`` rebuilds every kind of op output on the stages that hold several
    micro-batches (or send input gradients first); ``rebuilds`` are the plan's (stage, kind)
    pairs; ``early_input_grads`` lets a backward send its input gradient before computing
    its weight gradients; ``replica`` seeds this data-parallel replica's random ops;
    ``precision`` ("bf16" / "fp16") runs every forward and the loss under autocast;
    ``sharded``: the stage modules are FSDP2 roots, told before each backward whether it is
    their last of the step (only then are gradients reduce-scattered), but the stages in
    ``every_microbatch``, which reduce-scatter after each backward; where a W action computes a
    micro-batch's weight gradients after its B, the reduce-scatter follows that W instead.
    """

    def __init__(self, stages: Sequence[StageModule], schedule: Schedule, ranks: Collection[int], *,
                 recompute: bool | Mapping[int, str] = False, pointwise: bool = False,
                 rebuilds: Iterable[tuple[int, str]] = (),
                 early_input_grads: bool = False, replica: int = 0, precision: str = "fp32",
                 sharded: bool = False, every_microbatch: Collection[int] = ()) -> None:
        self.precision = precision
        self.sharded = sharded  # stage modules under FSDP2: see parallel/fsdp.py
        self.every_microbatch = frozenset(every_microbatch)
        self.place = placement(schedule)
        self.stages = {s.stage_index: s for s in stages if self.place[s.stage_index] in ranks}
        self.actions: list[Action] = (list(schedule[next(iter(ranks))]) if len(ranks) == 1
                                      else [a for a in execution_order(schedule, len(stages))
                                            if self.place[a.stage_index] in ranks])
        self.recompute: dict[int, str] = dict.fromkeys(self.stages, "full") if recompute is True else \
            {k: mode for k, mode in (recompute or {}).items() if k in self.stages}
        self.random = RandomStreams(stages, replica=replica)
        self.split_backward = splits_backward(schedule)
        # the stages that send an input gradient to another process; a W right after its own
        # B runs inside that backward, unless the B sends one: that gradient would wait
        self.sends_back = {k for k, st in self.stages.items()
                           if any(src not in self.stages for src in st.input_sources)}
        self.fused = {key for key in fused_weight_grads(self.actions) if key[0] not in self.sends_back}
        # Without W actions (GPipe, 1F1B, interleaved) a backward that sends an input gradient
        # to another process still runs in two parts, inside its own action: input gradients,
        # sent at once, then the weight gradients while the upstream rank already works.
        self.early = self.sends_back if early_input_grads and not self.split_backward else set()
        # stage -> the kinds of ops whose outputs it rebuilds in backward (stage/remat.py):
        # with pointwise every kind on the stages that hold several micro-batches at once and
        # those that hold a backward's layer inputs and output gradients until the input
        # gradients have left (early); else the plan's rebuilds (replica.planner.refine.finish)
        several = {k for k, n in enumerate(max_in_flight(schedule, len(stages))) if n > 1}
        every = (several | self.early) if pointwise else set()
        self.rebuilt = {k: kinds for k, kinds in _rebuilt_kinds(every, rebuilds).items() if k in self.stages}
        # the action after which a stage's gradients are final (its last B, or W when split)
        self.last_backward = {s: max(n for n, a in enumerate(self.actions) if a.stage_index == s and a.kind != FORWARD)
                              for s in self.stages}
        self.clock: StepClock = NO_CLOCK  # measure_step's, while it runs

    # --- a training step ---------------------------------------------------------------
    def train_step(self, microbatches: Sequence[tuple[Any, ...]], targets: Sequence[Any], loss_fn: LossFn,
                   weights: Sequence[float], step: Step, reducer: Any = None) -> list[torch.Tensor]:
        """Forward and backward of every micro-batch over this process's actions; gradients
        accumulate in the parameters. Returns the last stage's weighted losses (detached), if
        it is here. ``reducer`` (data parallel) is armed before each stage's last backward
        and flushed after it."""
        self.random.new_step()
        losses: list[torch.Tensor] = []
        attached: dict[int, torch.Tensor] = {}  # a last stage's losses until their backward
        deferred: dict[tuple[int, int], WeightGrads] = {}
        clock = self.clock
        for n, action in enumerate(self.actions):
            clock.begin()
            k, i = action.stage_index, action.microbatch_index
            stage = self.stages[k]
            last = n == self.last_backward[k] and reducer is not None
            split = self.split_backward and (k, i) not in self.fused
            early = k in self.early
            if last:  # hooks only see final gradients when autograd makes them all
                reducer.arm(k, listen=action.kind == BACKWARD and not (split or early))
            if action.kind == FORWARD:
                out = self.forward(step, action, microbatches[i], train=True)
                if stage.is_last:
                    with autocast_for(_device(stage), self.precision):  # the loss too, as torch's recipe
                        attached[i] = weighted_loss(loss_fn, out, targets[i], weights[i])
                    losses.append(attached[i].detach().float())  # summed in fp32, whatever autocast gave
                del out  # the graph stays only where its backward will let go of it
                clock.end(action)
            elif action.kind == BACKWARD:
                if self.sharded:  # a B whose W comes later reduces nothing: its gradients are not final
                    final = n == self.last_backward[k] or (k, i) in self.fused and n + 1 == self.last_backward[k]
                    set_last_backward(stage.module, final and not split, k in self.every_microbatch and not split)
                # W inside B: weight gradients straight into .grad, unless the reducer's hooks
                # must see autograd accumulate them (the last backward, data-parallel)
                sink = WeightGrads() if split or early else (None if last else WeightGrads(now=True))
                with collecting(sink):
                    self.backward(step, action, attached.pop(i) if stage.is_last else None)
                clock.end(action)
                if early:
                    assert sink is not None
                    sink.apply()
                    clock.end(Action(k, WEIGHT, i))  # the weight gradients, after the send
                elif sink is not None:
                    deferred[(k, i)] = sink
            elif (k, i) not in self.fused:  # W: the weight gradients B left for later
                deferred.pop((k, i)).apply()
                if self.sharded and (n == self.last_backward[k] or k in self.every_microbatch):
                    reduce_now(stage.module)  # no autograd pass follows W to run FSDP's hooks
                clock.end(action)
            if last:
                reducer.flush(k)
        return losses

    # --- actions -----------------------------------------------------------------------
    def _received(self, step: Step, key: tuple[str, int, int, int], action: Action) -> torch.Tensor:
        assert step.mail is not None
        what = f"{'activation' if key[3] == FWD else 'gradient'} {key[0]!r} of micro-batch {key[2]} (for {action})"
        value = step.mail.receive(key, what)
        self.clock.ready()
        return value

    def forward(self, step: Step, action: Action, inputs: tuple[Any, ...], train: bool,
                keep_graph: bool = False) -> Any:
        """Stage ``action.stage_index``'s forward of its micro-batch: its inputs from the
        batch (the first stage), from this process or from the mailbox; its outputs kept for
        readers here and sent to the others. ``keep_graph`` (one process's inference) hands
        values on without cutting autograd, so the output backpropagates like the model's."""
        stage = self.stages[action.stage_index]
        k, i = action.stage_index, action.microbatch_index
        meta = step.metas[i] if step.metas is not None else None
        if stage.is_first:
            args = inputs
        else:
            values = []
            for name, src in zip(stage.input_names, stage.input_sources):
                m = meta[name] if meta is not None else None
                if meta is not None and not isinstance(m, TensorMeta):
                    values.append(m)  # a Python value: worked out here, never sent
                    continue
                value = step.values[(name, i)] if src in self.stages else \
                    self._received(step, (name, k, i, FWD), action)
                if isinstance(value, torch.Tensor) and not keep_graph:
                    needs_grad = m.requires_grad if m is not None else value.requires_grad
                    value = value.detach().requires_grad_(train and needs_grad)
                values.append(value)
            args = tuple(values)
        again = self.recompute.get(k, False) if train else False
        out = run_stage(stage, args, again, self.random.seed(k, i),
                        pointwise=self.rebuilt.get(k, False), precision=self.precision)
        if not stage.is_last:
            for name, readers, value in zip(stage.output_names, stage.output_destinations, out):
                tensor = isinstance(value, torch.Tensor)
                if any(d in self.stages for d in readers) and (tensor or meta is None):
                    step.values[(name, i)] = value
                if tensor and step.mail is not None:
                    _check_agreed(value, meta[name] if meta is not None else None, name, k, readers, i)
                    for d in readers:
                        if d not in self.stages:
                            step.mail.send((name, d, i, FWD), value)
        if train:
            step.saved[(k, i)] = (args, out)
        return out

    def _expects_grad(self, step: Step, i: int, name: str, value: Any) -> bool:
        """Whether a value's gradient is part of the step (as its meta says across processes)."""
        if step.metas is not None:
            m = step.metas[i][name]
            return isinstance(m, TensorMeta) and m.requires_grad
        return isinstance(value, torch.Tensor) and value.requires_grad

    def backward(self, step: Step, action: Action, loss: torch.Tensor | None) -> None:
        """Stage ``action.stage_index``'s backward of its micro-batch: its outputs' gradients
        from their readers (here or the mailbox), its inputs' gradients to their producers."""
        stage = self.stages[action.stage_index]
        k, i = action.stage_index, action.microbatch_index
        args, out = step.saved.pop((k, i))
        if stage.is_last:
            tensors, grads = [loss], [None]
        else:
            tensors, grads = [], []
            for name, readers, value in zip(stage.output_names, stage.output_destinations, out):
                step.values.pop((name, i), None)
                if not self._expects_grad(step, i, name, value):
                    continue
                total = None
                for d in readers:
                    g = step.grads.pop((name, i, d), None) if d in self.stages else \
                        self._received(step, (name, d, i, BWD), action)
                    if g is not None:
                        total = g if total is None else total + g
                if total is not None and value.requires_grad:
                    tensors.append(value)
                    grads.append(total)
        if tensors and any(t.requires_grad for t in tensors):
            torch.autograd.backward(tensors, grads)
        if stage.is_first:
            return
        for name, src, leaf in zip(stage.input_names, stage.input_sources, args):
            if not self._expects_grad(step, i, name, leaf):
                continue
            if src in self.stages:
                if leaf.grad is not None:
                    step.grads[(name, i, k)] = leaf.grad
            else:
                assert step.mail is not None  # the message was agreed: a missing gradient travels as zeros
                step.mail.send((name, k, i, BWD), leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
