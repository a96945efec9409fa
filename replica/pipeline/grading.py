"""Graded micro-batches: smaller ones where the pipeline fills and drains.

With even micro-batches of ``n`` samples a pipeline idles for about ``p - 1`` micro-batch
times while it fills and drains (the bubble ``(p-1)/(m+p-1)``). The bubble is made of the
first micro-batch's forwards and the last one's backwards, so it shrinks with their size:
if the first micro-batches are smaller, the next stage starts sooner; if the last ones
are smaller, the drain is shorter. The middle ones grow to keep the batch, which the
steady state absorbs. Each action still pays its fixed per-call cost, so the sizes that
win depend on the plan's measured costs; :func:`grade` finds them by simulation.

Gradients stay exact: each micro-batch's loss is weighted by its share of the batch.
"""

from __future__ import annotations

from typing import Sequence

from replica.pipeline.schedule import Action
from replica.pipeline.simulate import StageCosts, simulate

__all__ = ["grade"]

MAX_GROWTH = 1.25  # the largest micro-batch holds at most this many times the even size (memory)
MIN_GAIN = 0.01  # graded sizes must beat even ones by this fraction of the step to be used
MAX_ACTIONS = 4096  # larger schedules keep even micro-batches (the search simulates many times)
MAX_SIMULATIONS = 1500


def grade(schedule: Sequence[Sequence[Action]], costs: Sequence[StageCosts], batch: int,
          num_microbatches: int) -> tuple[tuple[int, ...], float, float]:
    """Micro-batch sizes (samples, summing to ``batch``) that minimise the simulated step of
    ``schedule`` with ``costs`` (per even micro-batch, fixed parts included). Returns
    ``(sizes, step_s, even_step_s)``; the sizes are even unless grading gains ``MIN_GAIN``.

    Local search: move samples between two micro-batches (any two for m <= 16, else
    neighbours and the ends) while the simulated step shrinks, coarse moves first, then
    single samples; no micro-batch grows past
    ``MAX_GROWTH`` times the even size, none shrinks below one sample."""
    m = num_microbatches
    even = [batch // m + (1 if i < batch % m else 0) for i in range(m)]

    def step(sizes: Sequence[int]) -> float:
        return simulate(schedule, costs, sizes=[s * m / batch for s in sizes]).step_time_s

    base = step(even)
    if m < 2 or batch < 2 * m or sum(len(a) for a in schedule) > MAX_ACTIONS:
        return tuple(even), base, base
    cap = max(int(MAX_GROWTH * batch / m), max(even))
    best, best_s = list(even), base
    if m <= 16:
        moves = [(i, j) for i in range(m) for j in range(m) if i != j]
    else:  # neighbours, and the ends to and from anywhere
        ends = {0, 1, m - 2, m - 1}
        moves = sorted({(i, j) for i in range(m) for j in range(m)
                        if i != j and (abs(i - j) == 1 or i in ends or j in ends)})
    delta, budget = max(1, batch // (2 * m)), MAX_SIMULATIONS
    while delta >= 1 and budget > 0:
        found = None
        for src, dst in moves:
            if best[src] - delta < 1 or best[dst] + delta > cap:
                continue
            trial = list(best)
            trial[src] -= delta
            trial[dst] += delta
            t = step(trial)
            budget -= 1
            if t < best_s * (1 - 1e-9) and (found is None or t < found[1]):
                found = (trial, t)
        if found is None:
            delta //= 2  # no move of this many samples helps: try finer ones
        else:
            best, best_s = found
    if best_s > base * (1 - MIN_GAIN):
        return tuple(even), base, base
    return tuple(best), best_s, base
