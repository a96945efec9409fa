"""Tests of the exact min–max partition solver (``replica.partition.solver``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from replica.partition.solver import INF, Partition, Transfer, brute_force, interval_costs, solve


def cut(
    items: list[float], num_stages: int, transfers: tuple[Transfer, ...] = (), **kw: object
) -> tuple[int, ...]:
    """Bounds of the best partition of ``items`` into ``num_stages``."""
    return solve(interval_costs(items, transfers), num_stages, **kw).bounds  # type: ignore[arg-type]


# ---------------------------------------------------------------- hand examples


def test_even_split() -> None:
    assert cut([1, 1, 1, 1], 2) == (0, 2, 4)


def test_one_stage_takes_everything() -> None:
    p = solve(interval_costs([1, 2, 3]), 1)
    assert p == Partition((0, 3), 6.0, (6.0,))
    assert p.num_stages == 1


def test_one_item_per_stage() -> None:
    assert cut([5, 1, 3], 3) == (0, 1, 2, 3)


def test_heavy_item_alone() -> None:
    assert cut([1, 1, 10, 1, 1], 3) == (0, 2, 3, 5)


def test_uneven_items() -> None:
    p = solve(interval_costs([1, 2, 3, 4, 5, 6]), 3)
    assert p.bounds == (0, 3, 5, 6) and p.bottleneck == 9.0 and p.stage_costs == (6.0, 9.0, 6.0)


def test_bottleneck_on_first_stage() -> None:
    assert solve(interval_costs([4, 1, 1, 1, 1]), 2).bottleneck == 4.0


def test_ties_broken_towards_even_stages() -> None:
    # every partition with stage 0 = [5] has bottleneck 5; the rest split evenly
    p = solve(interval_costs([5, 1, 1, 1, 1]), 3)
    assert p.bounds == (0, 1, 3, 5) and p.stage_costs == (5.0, 2.0, 2.0)
    assert cut([1, 1, 1, 1, 1, 1, 6], 3) == (0, 3, 6, 7)


def test_transfer_moves_cut() -> None:
    # without it the cut falls at 2; a value made by item 1 and read by item 2 makes
    # that cut cost 10 on both sides, so the cut moves to a free position
    assert cut([1, 1, 1, 1], 2) == (0, 2, 4)
    big = (Transfer(producer=1, consumers=(2,), cost=10.0),)
    assert cut([1, 1, 1, 1], 2, big) in {(0, 1, 4), (0, 3, 4)}
    assert solve(interval_costs([1, 1, 1, 1], big), 2).bottleneck == 3.0


def test_long_skip_is_paid_by_every_stage_it_crosses_into() -> None:
    # item 0's value is read by item 3: the producer's stage sends it once,
    # and the stage that reads it receives it; a middle stage that does not read it pays nothing
    skip = (Transfer(producer=0, consumers=(3,), cost=5.0),)
    c = interval_costs([1, 1, 1, 1], skip)
    assert c[0, 1] == 1 + 5  # sends
    assert c[1, 3] == 2  # passes over: not charged
    assert c[3, 4] == 1 + 5  # receives
    assert c[0, 4] == 4  # inside one stage: free


def test_multi_consumer_received_once_per_stage() -> None:
    fan = (Transfer(producer=0, consumers=(1, 2, 3), cost=2.0),)
    c = interval_costs([1, 1, 1, 1], fan)
    assert c[0, 1] == 1 + 2  # sent once
    assert c[1, 4] == 3 + 2  # received once though read three times
    assert c[1, 2] == 1 + 2 and c[2, 4] == 2 + 2


def test_backward_and_self_consumers_ignored() -> None:
    odd = (Transfer(producer=2, consumers=(0, 2), cost=7.0), Transfer(producer=1, consumers=(3,), cost=0.0))
    assert np.array_equal(interval_costs([1, 1, 1, 1], odd), interval_costs([1, 1, 1, 1]))


def test_interval_costs_shape_and_lower_triangle() -> None:
    c = interval_costs([1, 2, 3])
    assert c.shape == (4, 4)
    assert np.all(np.isinf(c[np.tril_indices(4)]))
    assert c[0, 3] == 6 and c[1, 2] == 2


def test_heterogeneous_stages() -> None:
    # stage 1 is four times slower: it should get the smallest share
    base = interval_costs([1.0] * 5)
    cost = np.stack([base, 4 * base])
    p = solve(cost, 2)
    assert p.bounds == (0, 4, 5) and p.stage_costs == (4.0, 4.0)


def test_per_stage_memory_limit() -> None:
    # stage 0 can hold at most one item
    base = interval_costs([1.0] * 4)
    first = base.copy()
    first[:, 2:] = INF
    p = solve(np.stack([first, base]), 2)
    assert p.bounds == (0, 1, 4) and p.bottleneck == 3.0


def test_allowed_cuts() -> None:
    allowed = [True, False, False, True, True]
    assert cut([1, 1, 1, 1], 2, allowed_cuts=allowed) == (0, 3, 4)
    assert cut([1, 1, 1, 1], 2, allowed_cuts=np.array(allowed)) == (0, 3, 4)


def test_allowed_cuts_ends_need_not_be_set() -> None:
    assert cut([1, 1, 1, 1], 2, allowed_cuts=[False, False, True, False, False]) == (0, 2, 4)


def test_too_many_stages() -> None:
    with pytest.raises(ValueError, match="3 items into 4 non-empty"):
        solve(interval_costs([1, 1, 1]), 4)


def test_zero_stages() -> None:
    with pytest.raises(ValueError):
        solve(interval_costs([1, 1, 1]), 0)


def test_all_infinite() -> None:
    cost = np.full((4, 4), INF)
    with pytest.raises(ValueError, match="finite"):
        solve(cost, 2)


def test_memory_too_small_everywhere() -> None:
    cost = interval_costs([1, 1, 1, 1])
    cost[cost > 1] = INF  # every stage holds one item: 4 items cannot fit 2 stages
    with pytest.raises(ValueError, match="finite"):
        solve(cost, 2)
    assert solve(cost, 4).bounds == (0, 1, 2, 3, 4)


def test_no_allowed_cut_leaves_too_few_positions() -> None:
    with pytest.raises(ValueError):
        solve(interval_costs([1, 1, 1, 1]), 3, allowed_cuts=[True, False, True, False, True])


def test_bad_shapes() -> None:
    with pytest.raises(ValueError, match="shape"):
        solve(np.zeros((3, 4)), 1)
    with pytest.raises(ValueError, match="shape"):
        solve(np.stack([interval_costs([1, 1, 1])] * 3), 2)


def test_brute_force_hand_example() -> None:
    assert brute_force(interval_costs([1, 2, 3, 4, 5, 6]), 3) == 9.0
    assert brute_force(interval_costs([1, 1, 1, 1]), 2, [True, False, False, True, True]) == 3.0


# ---------------------------------------------------------------- properties


def naive_interval_costs(items: list[float], transfers: list[Transfer]) -> np.ndarray:
    """The definition, term by term: O(n² · E)."""
    n = len(items)
    c = np.full((n + 1, n + 1), INF)
    for i in range(n + 1):
        for j in range(i + 1, n + 1):
            total = float(sum(items[i:j]))
            for t in transfers:
                later = [k for k in t.consumers if k > t.producer]
                if i <= t.producer < j and any(k >= j for k in later):
                    total += t.cost  # sent once
                if t.producer < i and any(i <= k < j for k in later):
                    total += t.cost  # received once
            c[i, j] = total
    return c


item_lists = st.lists(st.integers(0, 20).map(float), min_size=1, max_size=8)


@st.composite
def transfer_lists(draw: st.DrawFn, n: int) -> list[Transfer]:
    out = []
    for _ in range(draw(st.integers(0, 6))):
        producer = draw(st.integers(0, n - 1))
        consumers = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=4))
        out.append(Transfer(producer, tuple(consumers), float(draw(st.integers(0, 10)))))
    return out


@st.composite
def problems(draw: st.DrawFn) -> tuple[np.ndarray, int, list[bool] | None]:
    """A random priced partition problem: transfers, infinities, per-stage costs, cuts."""
    items = draw(item_lists)
    n = len(items)
    num_stages = draw(st.integers(1, n))
    base = interval_costs(items, draw(transfer_lists(n)))
    if draw(st.booleans()):  # heterogeneous: stage k slowed by a factor, own memory limit
        layers = []
        for _ in range(num_stages):
            c = base * draw(st.sampled_from([0.5, 1.0, 2.0, 3.0]))
            if draw(st.booleans()):
                c[c > draw(st.integers(0, 60))] = INF
            layers.append(c)
        cost = np.stack(layers)
    else:
        cost = base.copy()
        if draw(st.booleans()):  # a memory limit shared by all stages
            cost[cost > draw(st.integers(0, 60))] = INF
    allowed = draw(st.none() | st.lists(st.booleans(), min_size=n + 1, max_size=n + 1))
    return cost, num_stages, allowed


@settings(max_examples=300, deadline=None)
@given(problems())
def test_solve_matches_brute_force(problem: tuple[np.ndarray, int, list[bool] | None]) -> None:
    cost, num_stages, allowed = problem
    best = brute_force(cost, num_stages, allowed)
    if not np.isfinite(best):
        with pytest.raises(ValueError):
            solve(cost, num_stages, allowed_cuts=allowed)
        return
    p = solve(cost, num_stages, allowed_cuts=allowed)
    assert p.bottleneck == pytest.approx(best, rel=1e-9, abs=0)
    check_partition(p, cost, num_stages, allowed)
    # among the optimal partitions, the most even one (least sum of squared stage costs)
    assert sum(c * c for c in p.stage_costs) == pytest.approx(min_squares(cost, num_stages, allowed, best))


def min_squares(cost: np.ndarray, num_stages: int, allowed: list[bool] | None, bottleneck: float) -> float:
    n = cost.shape[-1] - 1
    positions = [q for q in range(1, n) if allowed is None or allowed[q]]
    best = INF
    for cuts in itertools.combinations(positions, num_stages - 1):
        bounds = (0, *cuts, n)
        pairs = enumerate(itertools.pairwise(bounds))
        costs = [float((cost[k] if cost.ndim == 3 else cost)[a, b]) for k, (a, b) in pairs]
        if max(costs) <= bottleneck:
            best = min(best, sum(c * c for c in costs))
    return best


def check_partition(p: Partition, cost: np.ndarray, num_stages: int, allowed: list[bool] | None) -> None:
    n = cost.shape[-1] - 1
    assert p.num_stages == num_stages == len(p.stage_costs)
    assert p.bounds[0] == 0 and p.bounds[-1] == n
    assert all(a < b for a, b in itertools.pairwise(p.bounds))
    if allowed is not None:
        assert all(allowed[b] for b in p.bounds[1:-1])
    for k, (a, b) in enumerate(itertools.pairwise(p.bounds)):
        assert p.stage_costs[k] == (cost[k] if cost.ndim == 3 else cost)[a, b]
    assert p.bottleneck == max(p.stage_costs)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_interval_costs_matches_naive(data: st.DataObject) -> None:
    items = data.draw(item_lists)
    transfers = data.draw(transfer_lists(len(items)))
    np.testing.assert_allclose(interval_costs(items, transfers), naive_interval_costs(items, transfers))


@settings(max_examples=100, deadline=None)
@given(items=st.lists(st.floats(0.0, 1e3, allow_nan=False), min_size=1, max_size=12), data=st.data())
def test_bounds_strictly_increasing_and_costs_consistent(items: list[float], data: st.DataObject) -> None:
    num_stages = data.draw(st.integers(1, len(items)))
    cost = interval_costs(items)
    p = solve(cost, num_stages)
    check_partition(p, cost, num_stages, None)
    assert p.bottleneck >= max(items) - 1e-9
    assert p.bottleneck >= sum(items) / num_stages - 1e-6


@settings(max_examples=50, deadline=None)
@given(items=item_lists, data=st.data())
def test_more_stages_never_worse(items: list[float], data: st.DataObject) -> None:
    assume(len(items) >= 2)
    k = data.draw(st.integers(1, len(items) - 1))
    cost = interval_costs(items)
    assert solve(cost, k + 1).bottleneck <= solve(cost, k).bottleneck


def test_balance_groups_evens_out_ranks_holding_two_stages():
    """V placement: stages 0 and 3 share a rank, so its load is their sum; starting from
    cuts that load rank 0 twice as much as rank 1, moving the cuts evens the ranks out."""
    from replica.partition.solver import balance_groups

    weights = [1.0] * 6 + [2.0] * 6  # later items cost twice as much
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cost(k: int, i: int, j: int) -> float:
        return prefix[j] - prefix[i]

    groups = [[0, 3], [1, 2]]
    loads = lambda b: [sum(cost(k, b[k], b[k + 1]) for k in g) for g in groups]  # noqa: E731
    out = balance_groups(cost, [0, 4, 6, 8, 12], groups)  # rank 0: 4 + 8 = 12, rank 1: 2 + 4 = 6
    assert max(loads(out)) == pytest.approx(9.0) and out[0] == 0 and out[-1] == 12
    assert all(a < b for a, b in zip(out, out[1:]))


def test_balance_groups_never_ends_worse_and_respects_infeasible_stages():
    from replica.partition.solver import balance_groups

    def cost(k: int, i: int, j: int) -> float:
        return float("inf") if k == 1 and j - i > 2 else float(j - i)

    out = balance_groups(cost, [0, 2, 4, 6, 8], [[0, 3], [1, 2]])
    assert out[2] - out[1] <= 2  # stage 1 never takes more than it can
    assert max(cost(k, out[k], out[k + 1]) for k in range(4)) < float("inf")


def test_within_the_tie_a_preferred_cut_wins_and_beyond_it_the_optimum_stands():
    # blocks of (norm, layer): block boundaries before items 0, 2, 4, 6, 8
    cost = interval_costs([1.0, 10.0, 1.0, 10.0, 1.0, 10.0, 4.0, 10.0])
    blocks = [p % 2 == 0 for p in range(9)]
    best = solve(cost, 2)  # 23 | 24 after the third block's norm: inside the block
    assert best.bounds == (0, 5, 8) and best.bottleneck == 24.0
    assert solve(cost, 2, preferred_cuts=blocks, tie=0.0) == best
    assert solve(cost, 2, preferred_cuts=blocks, tie=0.01) == best  # the boundary's 22 | 25 is 4% worse
    near = solve(cost, 2, preferred_cuts=blocks, tie=0.05)  # within 5%: the block boundary
    assert near.bounds == (0, 4, 8) and near.bottleneck == 25.0
    assert solve(cost, 2, preferred_cuts=[True] * 9, tie=0.05) == best  # nothing to gain: the optimum
