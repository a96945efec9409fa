"""Expert parallelism in the plan: which experts the layout spreads over how many replicas, checked once.

:func:`plan_experts` finds the traced graph's expert blocks (:mod:`replica.partition.experts`),
settles ``expert_parallel_size`` (the user's number; None: the largest that :func:`expert_choices`
allows and :mod:`replica.planner.expert_pricing` says pays) and records both on the plan. Every
number that cannot work is a ``ConfigError`` here, before any rank starts: no expert block, an
expert count or a replica count it does not divide, a stage cut inside a block.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from replica.errors import ConfigError
from replica.partition.experts import ExpertBlock, find_expert_blocks
from replica.partition.graph import Graph
from replica.partition.plan import Plan

__all__ = ["plan_experts", "expert_choices", "check_experts"]


def expert_choices(blocks: Sequence[ExpertBlock], data_parallel_size: int) -> tuple[int, ...]:
    """The expert-parallel sizes a layout of ``data_parallel_size`` replicas can run: the
    divisors of the replicas that divide every block's expert count."""
    if not blocks:
        return (1,)
    experts = math.gcd(*(b.num_experts for b in blocks))
    return tuple(e for e in range(1, data_parallel_size + 1) if data_parallel_size % e == 0 and experts % e == 0)


def check_experts(blocks: Sequence[ExpertBlock], plan: Plan, expert_parallel_size: int, model_name: str = "") -> None:
    """A ``ConfigError`` naming the numbers and the fix unless ``plan`` can spread every block's
    experts over ``expert_parallel_size`` replicas."""
    e, d = expert_parallel_size, plan.data_parallel_size
    if e == 1:
        return
    if not blocks:
        raise ConfigError(
            f"expert_parallel_size={e} spreads a mixture of experts' experts over ranks, but "
            f"{model_name or 'the model'} has no expert block (a module of weights stacked [num_experts, ...] "
            "called as experts(tokens, index, weights) after a top-k router); use expert_parallel_size=1 or None")
    for b in blocks:
        if b.num_experts % e:
            fits = [k for k in range(1, b.num_experts + 1) if b.num_experts % k == 0]
            raise ConfigError(
                f"expert_parallel_size={e} does not divide the {b.num_experts} experts of {b.path}: each rank holds "
                f"num_experts / expert_parallel_size of them. Use expert_parallel_size in {fits} (a divisor of every "
                f"MoE layer's experts and of the {d} data-parallel replicas)")
    if d % e:
        raise ConfigError(
            f"expert_parallel_size={e} does not divide the plan's {d} data-parallel replicas "
            f"({plan.layout.describe()}): the experts spread over groups of {e} replicas of each stage. Give "
            f"data_parallel_size= a multiple of {e} (or num_stages= that leaves one), or expert_parallel_size in "
            f"{list(expert_choices(blocks, d))}")
    stage_of = {n: s.stage_index for s in plan.stages for n in s.node_names}
    for b in blocks:
        stages = sorted({stage_of[n] for n in b.nodes if n in stage_of})
        if len(stages) > 1:
            raise ConfigError(
                f"the plan cuts expert block {b.path} between stages {stages}: its experts' all-to-all runs inside "
                "one stage. Use another num_stages, or expert_parallel_size=1")


def plan_experts(graph: Graph, plan: Plan, expert_parallel_size: int | None) -> Plan:
    """``plan`` with the expert blocks of ``graph`` and its layout's ``expert_parallel_size``:
    the one asked, checked; None keeps 1 (whole experts on every replica)."""
    blocks = find_expert_blocks(graph)
    e = 1 if expert_parallel_size is None else expert_parallel_size
    check_experts(blocks, plan, e, graph.model_name)
    layout = dataclasses.replace(plan.layout, expert_parallel_size=e)
    return dataclasses.replace(plan, layout=layout, experts=blocks)
