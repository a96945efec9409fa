"""Run every stage of a pipeline in this process: the reference runtime.

The :class:`~replica.runtime.executor.Executor` runs the schedule's actions in one
deadlock-free serial order; values crossing a cut are detached into fresh leaves exactly as
they would be on the wire, so a stage's backward sees only its own graph and hands input
gradients to the stages that produced them (long skips go straight to their producer).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

from replica.partition.split import StageModule
from replica.runtime.clock import timing
from replica.runtime.executor import Executor, LossFn, Step, StepResult
from replica.schedules.schedule import FORWARD, Action, Schedule, placement
from replica.schedules.simulate import Event, Timeline

__all__ = ["LocalRuntime", "LossFn", "StepResult"]


class LocalRuntime:
    """Executes a schedule's actions over ``stages`` (all in this process)."""

    def __init__(self, stages: Sequence[StageModule], schedule: Schedule, *,
                 recompute: bool | Mapping[int, str] = False,
                 pointwise_recompute: bool = False, rebuilds: Iterable[tuple[int, str]] = (),
                 precision: str = "fp32") -> None:
        self.stages = list(stages)
        self.schedule = schedule
        self.executor = Executor(self.stages, schedule, range(len(schedule)), recompute=recompute,
                                 pointwise=pointwise_recompute, rebuilds=rebuilds, precision=precision)

    def forward(self, microbatches: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Pipelined forward without cutting autograd: the result backpropagates like the model's."""
        step = Step()
        self.executor.random.new_step()
        outputs = []
        for i, inputs in enumerate(microbatches):
            for stage in self.stages:
                out = self.executor.forward(step, Action(stage.stage_index, FORWARD, i), inputs, train=False,
                                            keep_graph=True)
            outputs.append(out)
        return outputs

    def train_step(self, microbatches: Sequence[tuple[Any, ...]], targets: Sequence[Any], loss_fn: LossFn,
                   weights: Sequence[float]) -> StepResult:
        """Forward and backward of every micro-batch; gradients accumulate in the parameters."""
        losses = self.executor.train_step(microbatches, targets, loss_fn, weights, Step())
        return StepResult(torch.stack(losses).sum() if losses else torch.zeros(()))

    def measure_step(self, microbatches: Sequence[tuple[Any, ...]], targets: Sequence[Any], loss_fn: LossFn,
                     weights: Sequence[float]) -> tuple[StepResult, Timeline]:
        """:meth:`train_step`, timing every action. One process runs them one after another,
        so the timeline puts each on its schedule rank but no two overlap."""
        with timing(self.executor) as clock:
            result = self.train_step(microbatches, targets, loss_fn, weights)
        place = placement(self.schedule)
        events = [Event(place[a.stage_index], a, start, end) for a, start, end in clock.records]
        return result, Timeline.from_events(events, num_ranks=len(self.schedule), step_time_s=clock.now())
