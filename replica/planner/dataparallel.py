"""What the data-parallel replicas cost a step: their collectives, priced and overlapped as the runtimes run them.

Replicated stages (sharding "none", :mod:`replica.parallel.gradsync`) all-reduce their
gradients once a step, in buckets of ``BUCKET_BYTES``, each started as soon as the stage's
last backward of the step has made it. Sharded stages (FSDP2, :mod:`replica.parallel.fsdp`)
all-gather their weights whenever an action finds them resharded — zero3 reshards after every
forward and after the step's last backward, zero2 only after the last backward; every other
backward keeps them gathered — and reduce-scatter their gradients once, after the last backward;
or, a stage whose ``grad_sync`` is "microbatch", after every backward, which then frees the
gathered weights too (the next action gathers them again): ``m`` reduce-scatters a step.

HSDP (``Layout.shard_group_size``): a stage shards over its group of ``g`` replicas (gathers
and reduce-scatters within the group, ``g × P × t`` consecutive ranks) and all-reduces its
shard of the gradients (``1 / g`` of them) over the ``d / g`` groups, which span the world.

Bytes: an all-gather moves the stage's weights in the dtype FSDP gathers them in (bf16 under
bf16 mixed precision, FSDP's ``MixedPrecisionPolicy.param_dtype``; else their own), a
reduce-scatter or an all-reduce the gradients in the weights' own dtype (fp32 reduction,
``MixedPrecisionPolicy.reduce_dtype``, as torchtitan and LLM Foundry run it). Time: ring
collectives (:func:`~replica.partition.cost.ring_collective_time`) over the stage's group of
replicas, which strides the world (rank = (replica × pipeline ranks + pipeline rank) ×
tensor-parallel size + tensor-parallel rank: the group's ranks are P × t apart, its span the
whole world): at the node's link rate while the world fits a node, at the network's once it
spans nodes. With tensor parallelism each rank reduces (and all-gathers) only its shards:
the stage's weights with its blocks' parameters at ``1 / t`` (``StageWeights`` of the graph one
tensor-parallel rank holds, :meth:`replica.planner.pricing.Pricing.stage_weights`); the t groups
of a stage's shards run at the same time, each device on its own share of the network.

Overlap, one rule for both: a collective runs under the action it belongs to — a gather under
the forward or backward (of one micro-batch) that needs the weights, the reduction under the
step's last backward (under each backward, "microbatch") — and of the collectives of an action
``a`` the step waits for
``head + max(0, comm(a) - head - compute(a))``. ``head`` is what no compute hides: for a
sharded stage one FSDP unit's share of the action's collectives (its first unit's gather, its
last unit's reduce-scatter; the units taken as equal), as FSDP gathers the next unit while one
computes and reduce-scatters a unit's gradients while the next one's backward runs; for a
replicated stage the last bucket, started when the backward ends, or all of them where that
backward defers its weight gradients (W actions, or its input gradient sent first: the
runtime starts every bucket after the action then). Latency: each collective
pays ``group - 1`` link latencies per pass, once per FSDP unit (a sharded stage) or per bucket
(a replicated one). What a running collective takes from the compute it overlaps (memory
bandwidth, SMs) is not priced. The simulator adds each rank's exposed seconds after its last
action (``simulate(allreduce_s=)``): exact for one stage, where nothing waits on the rank;
in a pipeline a gather exposed at the start of a stage's forward would delay the next stage
too, which this leaves out.

Fixed costs: a sharded stage also pays FSDP2's own host work per unit on each of its forwards
and backwards (``DeviceSpec.unit_overhead_s``: hooks, state changes, the copies around its
collectives; measured on CPU ranks, 0 on the GPU presets), counted with its collectives, all
of it exposed: it runs in the rank's own stream, not beside its compute.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

from replica.layout import Layout
from replica.parallel.gradsync import BUCKET_BYTES
from replica.partition.cost import DeviceSpec, ring_collective_time
from replica.partition.plan import Plan
from replica.schedules.actions import BACKWARD, FORWARD, WEIGHT, Action, placement

__all__ = ["StageWeights", "Collectives", "gathers_per_step", "price_collectives", "with_collectives",
           "exposed_per_rank"]


@dataclass(frozen=True)
class StageWeights:
    """A stage's weights as its collectives move them: bytes in their own dtype (the
    gradients'), bytes as FSDP gathers them, and how many FSDP units hold them."""

    nbytes: float
    gathered_bytes: float
    units: int


@dataclass(frozen=True)
class Collectives:
    """One stage's data-parallel collectives over a step."""

    total_s: float = 0.0
    exposed_s: float = 0.0
    gathers: int = 0


def gathers_per_step(kinds: Sequence[str], sharding: str, grad_sync: str = "step") -> int:
    """How many times a sharded stage's weights are all-gathered in a step whose actions on
    the stage are ``kinds`` ("F", "B"), in order."""
    return sum(gathers for gathers, _ in _actions(kinds, sharding, grad_sync))


def _actions(kinds: Sequence[str], sharding: str, grad_sync: str = "step") -> list[tuple[bool, bool]]:
    """Per action: whether it gathers the stage's weights (it finds them resharded: zero3
    reshards after each forward, both after the step's last backward, or after every backward
    under ``grad_sync`` "microbatch") and whether it reduces the gradients (the step's last
    backward; every backward under "microbatch"; the W actions instead where there are some)."""
    reducer = WEIGHT if WEIGHT in kinds else BACKWARD  # under a split backward the gradients are final after W
    last = max((i for i, k in enumerate(kinds) if k == reducer), default=-1)
    every = grad_sync == "microbatch"
    gathered, out = False, []
    for i, kind in enumerate(kinds):
        reduces = i == last or (every and kind == reducer)
        out.append((not gathered, reduces))
        gathered = not (kind == FORWARD and sharding == "zero3") and not reduces
    return out


def price_collectives(spec: DeviceSpec, layout: Layout, weights: StageWeights, kinds: Sequence[str],
                      forward_s: float, backward_s: float, hooked: bool = True, grad_sync: str = "step") -> Collectives:
    """A stage's collectives in ``layout`` over a step whose actions on it are ``kinds`` ("F",
    "B"), in order, each forward taking ``forward_s`` and each backward ``backward_s`` (see the
    module's docstring for the rules). ``hooked``: whether a replicated stage's last backward
    makes its gradients final as it goes, so that the buckets start under it (not where the
    backward defers weight gradients: W actions, or input gradients sent first). ``grad_sync``:
    a sharded stage's, "step" or "microbatch"."""
    d, span = layout.data_parallel_size, layout.world_size  # the group strides P x t ranks: the world
    if d == 1 or weights.nbytes == 0:
        return Collectives()
    if layout.sharded:
        units = max(1, weights.units)
        # a shard group of g replicas strides P x t ranks (g x P x t consecutive); under HSDP its
        # shards are then all-reduced over the r groups, which span the world
        g, r = layout.dp_shard, layout.dp_replicate
        shard_span = g * layout.pipeline_ranks * layout.tensor_parallel_size
        gather = ring_collective_time(spec, weights.gathered_bytes, g, shard_span, calls=units)
        reduce = ring_collective_time(spec, weights.nbytes, g, shard_span, calls=units) + \
            ring_collective_time(spec, weights.nbytes / g, r, span, passes=2, calls=units)
        per_action = [(gather * gathers + reduce * last, gathers)
                      for gathers, last in _actions(kinds, layout.sharding, grad_sync)]
        heads = [comm / units for comm, _ in per_action]
    else:
        reduce = ring_collective_time(spec, weights.nbytes, d, span, passes=2,
                                      calls=math.ceil(weights.nbytes / BUCKET_BYTES))
        per_action = [(reduce * last, False) for _, last in _actions(kinds, "none")]
        bucket = ring_collective_time(spec, min(weights.nbytes, BUCKET_BYTES), d, span, passes=2)
        heads = [bucket if hooked else reduce] * len(per_action)
    total = exposed = 0.0
    for kind, (comm, _), head in zip(kinds, per_action, heads):
        if comm > 0:
            total += comm
            exposed += head + max(0.0, comm - head - (forward_s if kind == FORWARD else backward_s))
    if layout.sharded:  # FSDP's own work around every action of every unit, in the rank's stream
        fixed = spec.unit_overhead_s * max(1, weights.units) * len(kinds)
        total, exposed = total + fixed, exposed + fixed
    return Collectives(total, exposed, sum(gathers for _, gathers in per_action) if layout.sharded else 0)


def with_collectives(plan: Plan, layout: Layout, schedule: Sequence[Sequence[Action]], spec: DeviceSpec,
                     weights: Sequence[StageWeights]) -> tuple[Plan, list[float]]:
    """``plan`` with its stages' collectives in ``layout`` under ``schedule`` (``weights[k]``:
    stage k's), and the seconds each rank waits for its own at the end of the step."""
    m = plan.num_microbatches
    kinds: dict[int, list[str]] = {}
    for actions in schedule:
        for a in actions:
            kinds.setdefault(a.stage_index, []).append(a.kind)
    where = placement(schedule)
    stages = []
    for st in plan.stages:
        k = st.stage_index
        early = plan.sends_input_grads_early and k > 0 and where[k - 1] != where[k]  # as the executor arms its reducer
        c = price_collectives(spec, layout, weights[k], kinds.get(k, ()), st.forward_time_s / m,
                              st.backward_time_s / m, hooked=WEIGHT not in kinds.get(k, ()) and not early,
                              grad_sync=st.grad_sync)
        stages.append(dataclasses.replace(st, collective_s=c.total_s, exposed_collective_s=c.exposed_s,
                                          gathers=c.gathers))
    plan = dataclasses.replace(plan, stages=tuple(stages))
    waits = exposed_per_rank(plan, schedule)
    busiest = max(range(len(waits)), key=lambda r: waits[r], default=0)
    total = sum(s.collective_s for s in plan.stages if where.get(s.stage_index) == busiest)
    return dataclasses.replace(plan, collective_s=total, exposed_collective_s=max(waits, default=0.0)), waits


def exposed_per_rank(plan: Plan, schedule: Sequence[Sequence[Action]]) -> list[float]:
    """Per rank of ``schedule``, the seconds of its stages' collectives its compute does not hide."""
    where = placement(schedule)
    waits = [0.0] * len(schedule)
    for st in plan.stages:
        waits[where[st.stage_index]] += st.exposed_collective_s
    return waits

