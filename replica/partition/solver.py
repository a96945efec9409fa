"""Exact min–max partition of a sequence of priced items into contiguous stages.

Torch-free. The caller prices every candidate stage ``[i, j)`` (compute of the
items in it plus whatever it must send and receive) in a matrix ``C[i, j]`` and
:func:`solve` returns the cut positions that minimise the slowest stage.

Complexity: ``interval_costs`` is O(n² + E) time and O(n²) memory for n items and
E producer→consumer edges (2-D difference arrays); ``solve`` is O(K·n²) time for
K stages (one vectorised min–max step per stage, then one min-sum-of-squares step
per stage to pick, among the optimal partitions, the most even), exact over every
cut position that ``allowed_cuts`` admits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

__all__ = ["Transfer", "Partition", "interval_costs", "solve", "brute_force", "add_rectangle"]

INF = float("inf")


@dataclass(frozen=True)
class Transfer:
    """A value made by item ``producer`` and read by items ``consumers``.

    ``cost`` is charged to every stage that sends it and to every stage that
    receives it (a value read by several later stages is received by each).
    """

    producer: int
    consumers: tuple[int, ...]
    cost: float


@dataclass(frozen=True)
class Partition:
    """``bounds[k]:bounds[k+1]`` are the items of stage k; ``bottleneck`` its max cost."""

    bounds: tuple[int, ...]
    bottleneck: float
    stage_costs: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1


def add_rectangle(d: np.ndarray, r0: int, r1: int, c0: int, c1: int, w: float) -> None:
    """Add ``w`` to rows r0..r1 × cols c0..c1 (inclusive) of a 2-D difference array."""
    if r0 > r1 or c0 > c1:
        return
    d[r0, c0] += w
    d[r0, c1 + 1] -= w
    d[r1 + 1, c0] -= w
    d[r1 + 1, c1 + 1] += w


def interval_costs(item_costs: Sequence[float], transfers: Sequence[Transfer] = ()) -> np.ndarray:
    """``C[i, j]`` = cost of one stage holding items ``[i, j)``; ``inf`` where ``j <= i``.

    A stage pays for its items, for every transfer produced inside it and read at or
    after ``j`` (sent once), and for every transfer produced before ``i`` and read
    inside it (received once).
    """
    n = len(item_costs)
    d = np.zeros((n + 2, n + 2))
    for t in transfers:
        later = sorted(c for c in set(t.consumers) if c > t.producer)
        if not later or t.cost == 0:
            continue
        p = t.producer
        # sent: producer in [i, j), some consumer at >= j  ->  i <= p < j <= last
        add_rectangle(d, 0, p, p + 1, later[-1], t.cost)
        # received: producer < i, some consumer c in [i, j); split by the first
        # consumer at or after i so each (i, j) is counted once.
        prev = p
        for c in later:
            add_rectangle(d, prev + 1, c, c + 1, n, t.cost)
            prev = c
    comm = np.cumsum(np.cumsum(d, axis=0), axis=1)[: n + 1, : n + 1]
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(item_costs, dtype=float))])
    cost = prefix[None, :] - prefix[:, None] + comm
    cost[np.tril_indices(n + 1)] = INF
    return cost


def solve(
    cost: "np.ndarray | Callable[[int], np.ndarray]",
    num_stages: int,
    *,
    allowed_cuts: Sequence[bool] | np.ndarray | None = None,
    preferred_cuts: Sequence[bool] | np.ndarray | None = None,
    tie: float = 0.0,
) -> Partition:
    """Cut items ``0..n-1`` into ``num_stages`` non-empty contiguous stages minimising
    the most expensive stage.

    ``cost`` is ``(n+1, n+1)`` (one matrix for every stage), ``(K, n+1, n+1)`` (stage k
    priced by ``cost[k]``: heterogeneous devices, per-stage memory), or a function
    ``k -> (n+1, n+1)`` computing stage k's matrix on demand (O(n²) memory for any K).
    An infeasible stage is ``inf``. ``allowed_cuts[p]`` says whether a cut may fall
    before item p (positions 0 and n are always the ends). Raises ``ValueError`` when
    no finite partition exists.

    ``preferred_cuts[p]``: a cut before item p is preferred (a block boundary). Among the
    partitions whose bottleneck is within ``tie`` (relative) of the optimum, the fewest cuts
    that are not preferred win where that takes fewer than the optimal bottleneck's own best;
    else the optimum stands. Either way the most even of them (sum of squares) is returned.
    """
    if callable(cost):
        first = np.asarray(cost(0), dtype=float)
        n = first.shape[-1] - 1
        if first.shape != (n + 1, n + 1):
            raise ValueError(f"cost(0) has shape {first.shape}; expected (n+1, n+1)")
        keep = num_stages * first.nbytes <= 512 * 2**20  # both phases read each matrix: keep them if small
        cache: dict[int, np.ndarray] = {0: first}

        def stage_cost(k: int) -> np.ndarray:
            if k in cache:
                return cache[k]
            c = np.asarray(cost(k), dtype=float)  # type: ignore[operator]
            if keep:
                cache[k] = c
            return c
    else:
        cost = np.asarray(cost, dtype=float)
        per_stage = cost.ndim == 3
        n = cost.shape[-1] - 1
        if cost.shape[-2:] != (n + 1, n + 1) or (per_stage and cost.shape[0] != num_stages):
            raise ValueError(f"cost has shape {cost.shape}; expected ({num_stages}, n+1, n+1) or (n+1, n+1)")
        stage_cost = (lambda k: cost[k]) if per_stage else (lambda k: cost)  # noqa: E731
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} items into {num_stages} non-empty stages")
    mask = np.ones(n + 1, dtype=bool) if allowed_cuts is None else np.asarray(allowed_cuts, dtype=bool).copy()
    mask[0] = mask[n] = True

    bottleneck = _min_max(stage_cost, num_stages, n, mask)
    if not np.isfinite(bottleneck):
        raise ValueError(f"no partition of {n} items into {num_stages} stages has finite cost")
    # Many partitions share the optimal bottleneck; among them take the one with the
    # smallest sum of squared stage costs, so the other stages are balanced too.
    limit = bottleneck * (1 + 1e-9) + 1e-300
    other = None if preferred_cuts is None else ~np.asarray(preferred_cuts, dtype=bool)
    bounds, stray = _min_squares(stage_cost, num_stages, n, mask, limit, other)
    if stray and tie > 0:  # some optimal cut falls off a block boundary: is one within the tie on it?
        near, fewer = _min_squares(stage_cost, num_stages, n, mask, bottleneck * (1 + tie) + 1e-300, other)
        if fewer < stray:
            bounds = near
    stage_costs = tuple(float(stage_cost(k)[bounds[k], bounds[k + 1]]) for k in range(num_stages))
    return Partition(tuple(bounds), max(stage_costs), stage_costs)


def _min_max(stage_cost: "Callable[[int], np.ndarray]", num_stages: int, n: int, mask: np.ndarray) -> float:
    """The optimal bottleneck: f_k(j) = min_i max(f_{k-1}(i), C_k[i, j])."""
    best = np.full(n + 1, INF)
    best[0] = 0.0
    for k in range(num_stages):
        start = np.where(mask, best, INF)  # a stage starts only at an allowed cut
        best = np.min(np.maximum(start[:, None], stage_cost(k)), axis=0)
    return float(best[n])


def _min_squares(
    stage_cost: "Callable[[int], np.ndarray]", num_stages: int, n: int, mask: np.ndarray, limit: float,
    other: np.ndarray | None = None,
) -> tuple[list[int], int]:
    """Bounds with every stage at most ``limit`` minimising, first, the cuts at positions ``other``
    marks (none: no such count), then the sum of squared stage costs; and that count. One key
    ``count × big + squares``, ``big`` above any sum of squares under ``limit``."""
    big = 2.0 * num_stages * limit * limit + 1.0 if other is not None else 0.0
    penalty = np.zeros(n + 1) if other is None else np.where(other, big, 0.0)
    best = np.full(n + 1, INF)
    best[0] = 0.0
    choice = np.zeros((num_stages, n + 1), dtype=np.int64)
    c, squared = None, None
    for k in range(num_stages):
        previous, c = c, stage_cost(k)
        if c is not previous:  # the same matrix for every stage (one device, no budget): squared once
            squared = np.where(c <= limit, c * c, INF)
        start = np.where(mask, best, INF) + (penalty if k > 0 else 0.0)  # stage k > 0 starts at a cut
        trial = start[:, None] + squared
        choice[k] = np.argmin(trial, axis=0)
        best = trial[choice[k], np.arange(n + 1)]
    bounds = [n]
    for k in range(num_stages - 1, -1, -1):
        bounds.append(int(choice[k, bounds[-1]]))
    bounds.reverse()
    stray = 0 if other is None else sum(bool(other[b]) for b in bounds[1:-1])
    return bounds, stray


def brute_force(cost: np.ndarray, num_stages: int, allowed_cuts: Sequence[bool] | None = None) -> float:
    """The optimal bottleneck by trying every cut set: the reference :func:`solve` is tested against."""
    cost = np.asarray(cost, dtype=float)
    n = cost.shape[-1] - 1
    positions = [p for p in range(1, n) if allowed_cuts is None or allowed_cuts[p]]
    best = INF
    for cuts in itertools.combinations(positions, num_stages - 1):
        bounds = (0, *cuts, n)
        worst = max(
            float((cost[k] if cost.ndim == 3 else cost)[bounds[k], bounds[k + 1]]) for k in range(num_stages)
        )
        best = min(best, worst)
    return best


def balance_groups(
    cost: "Callable[[int, int, int], float]",
    bounds: Sequence[int],
    groups: Sequence[Sequence[int]],
    *,
    max_rounds: int = 50,
) -> list[int]:
    """Move the cuts of ``bounds`` so that the costliest *group* of stages is as cheap as
    possible: a rank holding several stages (V placement: stages r and 2P-1-r) is busy for
    their sum, which a min-max over single stages does not balance. ``cost(k, i, j)`` is
    stage k over items i..j-1 (``inf`` where infeasible). Coordinate descent: each cut in
    turn goes to the position between its neighbours that lowers (the worst group, then the
    worst stage), until no cut moves. Starts from, and never ends worse than, ``bounds``."""
    b = list(bounds)
    num_stages = len(b) - 1

    def score(bs: Sequence[int]) -> tuple[float, float]:
        per_stage = [cost(k, bs[k], bs[k + 1]) for k in range(num_stages)]
        return max(sum(per_stage[k] for k in g) for g in groups), max(per_stage)

    best = score(b)
    for _ in range(max_rounds):
        moved = False
        for j in range(1, num_stages):
            for pos in range(b[j - 1] + 1, b[j + 1]):
                if pos == b[j]:
                    continue
                trial = b[:j] + [pos] + b[j + 1:]
                s = score(trial)
                if s < best:
                    best, b, moved = s, trial, True
        if not moved:
            break
    return b
