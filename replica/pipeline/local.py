"""Run every stage of a pipeline in this process: the reference runtime.

Actions run in one deadlock-free serial order of the schedule. Values crossing a
cut are detached into fresh leaves exactly as they would be on the wire, so a
stage's backward sees only its own graph and hands input gradients to the stages
that produced them (long skips go straight to their producer).
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Iterable, Sequence

import torch
import torch.utils.checkpoint

from replica.errors import PipelineError
from replica.partition.modes import microbatch_seed, seeded
from replica.partition.split import StageModule
from replica.pipeline.batchnorm import recompute_context
from replica.pipeline.clock import NO_CLOCK, StepClock, timing
from replica.pipeline.remat import KINDS, pointwise_recompute
from replica.pipeline.schedule import (BACKWARD, FORWARD, Action, Schedule, execution_order, fused_weight_grads,
                                       max_in_flight, placement, splits_backward)
from replica.pipeline.simulate import Event, Timeline
from replica.pipeline.weightgrad import WeightGrads, collecting

__all__ = ["LocalRuntime", "StepResult", "RandomStreams"]

LossFn = Callable[[Any, Any], torch.Tensor]


class StepResult:
    """What one training step leaves behind: the loss (a detached scalar) and, if kept, outputs."""

    def __init__(self, loss: torch.Tensor, outputs: list[Any]) -> None:
        self.loss = loss
        self.outputs = outputs


def _as_leaf(value: Any) -> Any:
    """What the receiving stage sees: a tensor cut from the sender's autograd graph."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    return value


def run_stage(stage: StageModule, args: tuple[Any, ...], recompute: bool, seed: int | None = None,
              pointwise: bool | Collection[str] = True) -> Any:
    """A stage's forward; with ``recompute`` only its inputs are kept and the forward runs
    again inside backward (``torch.utils.checkpoint``, RNG state preserved); otherwise the
    outputs of the ``pointwise`` kinds of ops (:func:`.remat.pointwise_recompute`: True for
    every kind) are rebuilt in backward. ``seed``
    seeds the random ops of a stage that has any (see :class:`RandomStreams`)."""
    with seeded(seed if stage.uses_rng else None, stage.device):
        if recompute and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(stage.module, *args, use_reentrant=False,
                                                     context_fn=recompute_context)  # counts no batch norm twice
        with pointwise_recompute(pointwise):
            return stage.module(*args)


def rebuild_map(every_kind: Iterable[int], rebuilds: Iterable[tuple[int, str]]) -> dict[int, frozenset[str]]:
    """Stage -> the kinds of ops whose outputs it rebuilds: every kind on ``every_kind``'s
    stages, and the ``(stage, kind)`` pairs of ``rebuilds``."""
    out: dict[int, set[str]] = {k: set(KINDS) for k in every_kind}
    for k, kind in rebuilds:
        out.setdefault(k, set()).add(kind)
    return {k: frozenset(kinds) for k, kinds in out.items()}


def holding_several(schedule: Schedule, num_stages: int) -> set[int]:
    """The stages that hold more than one micro-batch's activations at once, where a memory
    saving per micro-batch adds up."""
    return {k for k, n in enumerate(max_in_flight(schedule, num_stages)) if n > 1}


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


class LocalRuntime:
    """Executes a schedule's actions over ``stages`` (all in this process)."""

    def __init__(self, stages: Sequence[StageModule], schedule: Schedule, *, recompute: bool = False,
                 pointwise_recompute: bool = False, rebuilds: Iterable[tuple[int, str]] = ()) -> None:
        self.stages = list(stages)
        self.recompute = recompute
        # stage -> the kinds of ops whose outputs it rebuilds in backward (pipeline/remat.py):
        # with pointwise_recompute every kind on every stage that holds several micro-batches,
        # else the plan's rebuilds (replica.planner.refine.finish)
        self.pointwise_recompute = rebuild_map(holding_several(schedule, len(stages)) if pointwise_recompute
                                               else (), rebuilds)
        self.schedule = schedule
        self.order: list[Action] = execution_order(schedule, len(self.stages))
        self.split_backward = splits_backward(schedule)
        self.fused = fused_weight_grads(self.order)  # W right after its B: one backward
        self.random = RandomStreams(self.stages)
        self.clock: StepClock = NO_CLOCK  # measure_step's, while it runs

    def forward(self, microbatches: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Pipelined forward without cutting autograd: the result backpropagates like the model's."""
        outputs = []
        self.random.new_step()
        for i, inputs in enumerate(microbatches):
            values: dict[str, Any] = {}
            out: Any = None
            for stage in self.stages:
                args = inputs if stage.is_first else tuple(values[n] for n in stage.input_names)
                out = run_stage(stage, args, False, self.random.seed(stage.stage_index, i),
                                pointwise=self.pointwise_recompute.get(stage.stage_index, False))
                if not stage.is_last:
                    values.update(zip(stage.output_names, out))
            outputs.append(out)
        return outputs

    def train_step(
        self,
        microbatches: Sequence[tuple[Any, ...]],
        targets: Sequence[Any],
        loss_fn: LossFn,
        weights: Sequence[float],
        keep_outputs: bool = False,
    ) -> StepResult:
        """Forward and backward of every micro-batch; gradients accumulate in the parameters."""
        m = len(microbatches)
        values: list[dict[str, Any]] = [{} for _ in range(m)]  # what each stage sent, per micro-batch
        grads: list[dict[str, torch.Tensor]] = [{} for _ in range(m)]  # gradients flowing back
        received: dict[tuple[int, int], tuple[Any, ...]] = {}
        produced: dict[tuple[int, int], Any] = {}
        losses: list[torch.Tensor] = []
        outputs: list[Any] = [None] * m
        deferred: dict[tuple[int, int], WeightGrads] = {}
        self.random.new_step()
        clock = self.clock
        for action in self.order:
            clock.begin()
            stage = self.stages[action.stage_index]
            i = action.microbatch_index
            key = (stage.stage_index, i)
            if action.kind == FORWARD:
                if stage.is_first:
                    args = microbatches[i]
                else:
                    args = tuple(_as_leaf(values[i][n]) for n in stage.input_names)
                out = run_stage(stage, args, self.recompute, self.random.seed(stage.stage_index, i),
                                pointwise=self.pointwise_recompute.get(stage.stage_index, False))
                received[key] = args
                if stage.is_last:
                    produced[key] = weighted_loss(loss_fn, out, targets[i], weights[i])
                    losses.append(produced[key].detach())
                    if keep_outputs:
                        outputs[i] = out.detach() if isinstance(out, torch.Tensor) else out
                else:
                    produced[key] = out
                    values[i].update(zip(stage.output_names, out))
                clock.end(action)
            elif action.kind == BACKWARD:
                # deferred to its W; else straight into .grad inside this backward
                sink = deferred[key] = WeightGrads(now=not self.split_backward or key in self.fused)
                with collecting(sink):
                    self._backward(stage, i, received.pop(key), produced.pop(key), grads[i])
                for n in stage.output_names:
                    values[i].pop(n, None)
                    grads[i].pop(n, None)
                clock.end(action)
            elif key not in self.fused:  # W: the weight gradients B left for later
                deferred.pop(key).apply()
                clock.end(action)
        loss = torch.stack(losses).sum() if losses else torch.zeros(())
        return StepResult(loss, outputs)

    def measure_step(self, microbatches: Sequence[tuple[Any, ...]], targets: Sequence[Any], loss_fn: LossFn,
                     weights: Sequence[float]) -> tuple[StepResult, Timeline]:
        """:meth:`train_step`, timing every action. One process runs them one after another,
        so the timeline puts each on its schedule rank but no two overlap."""
        with timing(self) as clock:
            result = self.train_step(microbatches, targets, loss_fn, weights)
        place = placement(self.schedule)
        events = [Event(place[a.stage_index], a, start, end) for a, start, end in clock.records]
        return result, Timeline.from_events(events, num_ranks=len(self.schedule), step_time_s=clock.now())

    @staticmethod
    def _backward(
        stage: StageModule, i: int, args: tuple[Any, ...], out: Any, grads: dict[str, torch.Tensor]
    ) -> None:
        if stage.is_last:
            tensors, grad_tensors = [out], [None]
        else:
            tensors, grad_tensors = [], []
            for name, value in zip(stage.output_names, out):
                g = grads.get(name)
                if g is not None and isinstance(value, torch.Tensor) and value.requires_grad:
                    tensors.append(value)
                    grad_tensors.append(g)
        if tensors and any(t.requires_grad for t in tensors):
            torch.autograd.backward(tensors, grad_tensors)
        if stage.is_first:
            return
        for name, leaf in zip(stage.input_names, args):
            if isinstance(leaf, torch.Tensor) and leaf.grad is not None:
                grads[name] = grads[name] + leaf.grad if name in grads else leaf.grad
