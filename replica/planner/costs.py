"""The one price of a plan's stages per micro-batch, read by the tuner, refinement, the report and the planner.

A :class:`~replica.partition.plan.Plan` prices each stage over a whole step (all its
micro-batches); :func:`stage_costs_from_plan` turns that into one micro-batch's
:class:`~replica.schedules.simulate.StageCosts` under a schedule, and :func:`rank_memory`
gives what each pipeline rank holds at its fullest. Every place that predicts a step or a
peak from a plan goes through these two, so the tuner's ranking, the refined plan, the
summary and the HTML report agree about the same plan.

Per micro-batch: forward and backward are the step's over ``num_microbatches`` (the
backward split ``1 - WEIGHT_SHARE`` / ``WEIGHT_SHARE`` into B and W where the schedule has W
actions), their per-call parts (launches) kept apart so that graded micro-batches price
right; a stage's outputs cross to the next stage's rank over ``device``'s link; a stage
holds what one micro-batch's forward keeps (its saved activations, or under activation
checkpointing its blocks' inputs: :mod:`replica.partition.recompute`) and its inputs received
from another rank from its forward to its backward (under a split backward, its deferred
linears' inputs and output gradients on to W), its recomputed block while a backward runs, the
next micro-batch's inputs (received ahead), and its state (weights, optimizer; gradients from
its first backward). :func:`rank_memory` walks each rank's actions in order
(:func:`replica.schedules.simulate.peak_memory`): a rank's stages are full at different times.
"""

from __future__ import annotations

from typing import Sequence

from replica.errors import ConfigError
from replica.partition.cost import DeviceSpec, device_spec
from replica.partition.plan import Plan
from replica.schedules.actions import Action, placement, splits_backward
from replica.schedules.schedule import WEIGHT_SHARE, max_in_flight
from replica.schedules.simulate import StageCosts, peak_memory

__all__ = ["stage_costs_from_plan", "rank_memory"]


def stage_costs_from_plan(plan: Plan, schedule: Sequence[Sequence[Action]], *,
                          device: DeviceSpec | None = None) -> list[StageCosts]:
    """Per-micro-batch costs of ``plan``'s stages under ``schedule`` (see the module's
    docstring); transfers priced on ``device``'s link (default: the stage's, else the plan's
    device, by preset name)."""
    where = placement(schedule)
    if sorted(where) != list(range(plan.num_stages)):
        raise ConfigError(
            f"the schedule runs stages {sorted(where)} but the plan has {plan.num_stages}; make the schedule "
            f"with make_schedule(name, {plan.num_stages}, {plan.num_microbatches})"
        )
    m = plan.num_microbatches
    split = splits_backward(schedule)
    share = 1 - WEIGHT_SHARE if split else 1.0
    flights = max_in_flight(schedule, plan.num_stages)
    costs = []
    for stage in plan.stages:
        k = stage.stage_index
        forward, backward = stage.forward_time_s / m, stage.backward_time_s / m
        send = 0.0
        if k + 1 in where and where[k + 1] != where[k]:
            link = device or _device(stage.device or plan.device)
            send = sum(b.nbytes for b in stage.outputs) / m / link.link_bandwidth + link.link_latency_s
        memory = stage.memory
        one = int(stage.activation_bytes / m)  # what one micro-batch's forward keeps
        # one micro-batch's inputs from other ranks (one made on this rank is its producer's output,
        # held there until the producer's backward, which comes after this stage's)
        received = sum(b.nbytes for b in stage.inputs if where[b.source_stage] != where[k]) / m
        costs.append(StageCosts(
            forward_s=forward,
            backward_s=backward * share,
            weight_s=backward * WEIGHT_SHARE if split else 0.0,
            send_s=send,
            # per micro-batch in flight: what its forward keeps and its received inputs (under a
            # split backward its deferred linears' share until W); while its backward runs: its
            # recomputed block; once: the next micro-batch's inputs, received ahead
            activation_bytes=int(one + received),
            weight_bytes=int(stage.weight_grad_bytes / m) if split else 0,
            backward_bytes=int(stage.recompute_bytes / m),
            gradient_bytes=int(memory.gradients),
            static_bytes=int(memory.parameters + memory.gradients + memory.optimizer
                             + (received if flights[k] < m else 0)),
            forward_fixed_s=min(stage.fixed_forward_s, forward),
            backward_fixed_s=min(stage.fixed_backward_s * share, backward * share),
            input_grad_share=1 - WEIGHT_SHARE if plan.sends_input_grads_early and not split else 1.0,
        ))
    return costs


def rank_memory(costs: Sequence[StageCosts], schedule: Sequence[Sequence[Action]]) -> list[float]:
    """Per pipeline rank of ``schedule``, the bytes it holds at its fullest: its stages' static
    bytes, and the activations its actions hold at once, walked in its order
    (:func:`replica.schedules.simulate.peak_memory`)."""
    return [float(b) for b in peak_memory(schedule, costs)]


def _device(name: str) -> DeviceSpec:
    try:
        return device_spec(name)
    except ConfigError as exc:
        raise ConfigError(
            f"the plan was made for device {name!r}, which is not a preset; pass "
            f"stage_costs_from_plan(plan, schedule, device=<the DeviceSpec it was planned with>)"
        ) from exc
