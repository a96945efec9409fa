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

from replica.errors import ConfigError
from replica.schedules.actions import Action
from replica.schedules.simulate import StageCosts, simulate

__all__ = ["grade", "sizes"]

MAX_GROWTH = 1.25  # the largest micro-batch holds at most this many times the even size (memory)
MIN_SHRINK = 0.5  # the smallest at least this share of it: per-call costs the profile underrates
# (the runtime's own per-action work) make tiny micro-batches slower than simulated
MIN_GAIN = 0.01  # graded sizes must beat even ones by this fraction of the step to be used
MAX_ACTIONS = 4096  # larger schedules keep even micro-batches (the search simulates many times)
MAX_SIMULATIONS = 1500
MAX_WORK = 300_000  # simulated actions in all: big schedules try fewer sizes (about a second)


def sizes(n: int, num_microbatches: int, shares: Sequence[float] = ()) -> list[int]:
    """Samples per micro-batch for a batch of ``n``: even (differing by at most one), or in
    proportion to ``shares`` (largest remainders), every micro-batch at least one sample."""
    m = num_microbatches
    if not shares:
        return [n // m + (1 if i < n % m else 0) for i in range(m)]
    if len(shares) != m or min(shares) <= 0:
        raise ConfigError(f"micro-batch shares {list(shares)} must be {m} positive numbers")
    total = float(sum(shares))
    exact = [n * s / total for s in shares]
    out = [max(1, int(e)) for e in exact]
    while sum(out) < n:  # hand out what rounding down kept back, largest remainder first
        i = max(range(m), key=lambda j: exact[j] - out[j])
        out[i] += 1
    while sum(out) > n:  # the at-least-one rule overshot: take from the largest
        i = max(range(m), key=lambda j: (out[j] - exact[j], out[j]))
        out[i] -= 1
    return out


def grade(schedule: Sequence[Sequence[Action]], costs: Sequence[StageCosts], batch: int,
          num_microbatches: int, memory_limit: float = float("inf"),
          min_gain: float = MIN_GAIN) -> tuple[tuple[int, ...], float, float]:
    """Micro-batch sizes (samples, summing to ``batch``) that minimise the simulated step of
    ``schedule`` with ``costs`` (per even micro-batch, fixed parts included). Returns
    ``(sizes, step_s, even_step_s)``; the sizes are even unless grading gains ``min_gain``.

    Larger middle micro-batches hold more activations: no rank's simulated peak may pass
    ``memory_limit`` (bytes per device). The search starts from even sizes and from seeds
    with both ends shrunk, then moves samples between two micro-batches (any two for
    m <= 16, else neighbours and the ends) while the simulated step shrinks, coarse moves
    first, then single samples. No micro-batch grows past ``MAX_GROWTH`` times the even
    size or shrinks below ``MIN_SHRINK`` of it (or one sample)."""
    m = num_microbatches
    even = sizes(batch, m)

    def step(sizes: Sequence[int]) -> float:
        """The simulated step; infinite where a rank's simulated peak memory (its stages'
        weights, gradients, optimizer state and live activations) passes ``memory_limit``."""
        timeline = simulate(schedule, costs, sizes=[s * m / batch for s in sizes])
        if max(timeline.peak_memory_bytes, default=0) > memory_limit:
            return float("inf")
        return timeline.step_time_s

    base = simulate(schedule, costs).step_time_s
    if m < 2 or batch < 2 * m or sum(len(a) for a in schedule) > MAX_ACTIONS:
        return tuple(even), base, base
    cap = max(int(MAX_GROWTH * batch / m), max(even))
    floor = max(1, min(int(MIN_SHRINK * batch / m), min(even)))
    if m <= 16:
        moves = [(i, j) for i in range(m) for j in range(m) if i != j]
    else:  # neighbours, and the ends to and from anywhere
        ends = {0, 1, m - 2, m - 1}
        moves = sorted({(i, j) for i in range(m) for j in range(m)
                        if i != j and (abs(i - j) == 1 or i in ends or j in ends)})
    budget = [min(MAX_SIMULATIONS, MAX_WORK // sum(len(a) for a in schedule))]

    def improve(sizes: list[int], t_sizes: float) -> tuple[list[int], float]:
        delta = max(1, batch // (4 * m))
        while delta >= 1 and budget[0] > 0:
            found = None
            for src, dst in moves:
                if sizes[src] - delta < floor or sizes[dst] + delta > cap:
                    continue
                trial = list(sizes)
                trial[src] -= delta
                trial[dst] += delta
                t = step(trial)
                budget[0] -= 1
                if t < t_sizes * (1 - 1e-9) and (found is None or t < found[1]):
                    found = (trial, t)
            if found is None:
                delta //= 2  # no move of this many samples helps: try finer ones
            else:
                sizes, t_sizes = found
        return sizes, t_sizes

    # Start from even sizes and from "both ends shrunk" seeds; polish the best few.
    seeds = {tuple(even): base}
    for first in _levels(floor, min(even)):
        for last in _levels(floor, min(even)):
            seed = _with_ends(batch, m, first, last, cap)
            if seed is not None and tuple(seed) not in seeds and budget[0] > 0:
                seeds[tuple(seed)] = step(seed)
                budget[0] -= 1
    best, best_s = list(even), base
    for seed, t_seed in sorted(seeds.items(), key=lambda kv: kv[1])[:3]:
        got, t_got = improve(list(seed), t_seed)
        if t_got < best_s:
            best, best_s = got, t_got
    if best_s > base * (1 - min_gain):
        return tuple(even), base, base
    return tuple(best), best_s, base


def _levels(low: int, high: int) -> list[int]:
    """Up to four sizes from ``low`` to ``high``."""
    return sorted({low + (high - low) * k // 3 for k in range(4)})


def _with_ends(batch: int, m: int, first: int, last: int, cap: int) -> list[int] | None:
    """``first`` and ``last`` samples at the ends, the rest spread evenly over the middle."""
    rest, middle = batch - first - last, m - 2
    if middle < 1 or rest < middle:
        return None
    sizes = [first] + [rest // middle + (1 if i < rest % middle else 0) for i in range(middle)] + [last]
    return sizes if max(sizes) <= cap else None
