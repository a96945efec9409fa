"""Tests of schedules as data (``replica.schedules.schedule``, its base ``actions`` and ``replay``, and
``zerobubble``): golden grids, parsing, the dependency rule, validation."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import replica
from replica.schedules.actions import dependencies, dependents
from replica.schedules.replay import play
from replica.schedules.schedule import (
    INTERLEAVED,
    SCHEDULES,
    V_SHAPED,
    Action,
    execution_order,
    format_grid,
    gpipe,
    interleaved_one_f_one_b,
    list_schedule,
    make_schedule,
    one_f_one_b,
    placement,
    validate,
)


def docstring_grid(fn) -> str:
    """The ``rank r: ...`` lines drawn in ``fn``'s docstring."""
    return "\n".join(line.strip() for line in fn.__doc__.splitlines() if line.strip().startswith("rank "))


def parse(rows: list[str]) -> list[list[Action]]:
    return [[Action.parse(a) for a in row.split()] for row in rows]


# --------------------------------------------------------------------------- golden grids


def test_gpipe_grid_matches_docstring():
    assert format_grid(gpipe(3, 4), 3) == docstring_grid(gpipe)


def test_one_f_one_b_grid_matches_docstring():
    assert format_grid(one_f_one_b(3, 4), 3) == docstring_grid(one_f_one_b)


def test_interleaved_grid_matches_docstring():
    assert format_grid(interleaved_one_f_one_b(2, 4, 4), 4) == docstring_grid(interleaved_one_f_one_b)


def test_docstring_grids_are_drawn():
    assert docstring_grid(gpipe).count("\n") == 2 and docstring_grid(one_f_one_b).count("\n") == 2


def test_gpipe_actions():
    assert gpipe(2, 2) == parse(["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"])


def test_one_f_one_b_actions():
    assert one_f_one_b(2, 3) == parse(["0F0 0F1 0B0 0F2 0B1 0B2", "1F0 1B0 1F1 1B1 1F2 1B2"])


def test_one_stage_grid():
    assert format_grid(one_f_one_b(1, 2), 1) == "rank 0: 0F0 0B0 0F1 0B1"
    assert format_grid(gpipe(1, 2), 1) == "rank 0: 0F0 0F1 0B0 0B1"


def test_one_microbatch_schedules_agree():
    assert gpipe(4, 1) == one_f_one_b(4, 1)


@pytest.mark.parametrize("maker", [gpipe, one_f_one_b])
@pytest.mark.parametrize("p, m", [(0, 1), (1, 0), (-1, 3)])
def test_bad_sizes(maker, p, m):
    with pytest.raises(replica.ScheduleError, match=f"got {p} and {m}"):
        maker(p, m)


# --------------------------------------------------------------------------- actions


@pytest.mark.parametrize("text", ["0F0", "2B13", "11W3"])
def test_action_round_trip(text):
    assert str(Action.parse(text)) == text


@pytest.mark.parametrize("action", [Action(0, "F", 0), Action(3, "B", 12), Action(10, "W", 1)])
def test_action_parse_str(action):
    assert Action.parse(str(action)) == action


def test_action_parse_strips_spaces():
    assert Action.parse(" 2F0 ") == Action(2, "F", 0)


@pytest.mark.parametrize("text", ["", "F0", "0F", "0X0", "-1F0", "0 F 0", "0f0", "0F0B1", "a"])
def test_bad_action_strings(text):
    with pytest.raises(replica.ScheduleError, match="cannot parse"):
        Action.parse(text)


def test_action_fields():
    a = Action.parse("2F0")
    assert (a.stage_index, a.kind, a.microbatch_index) == (2, "F", 0)


# --------------------------------------------------------------------------- validate


def test_validate_accepts_both_schedules():
    for maker in SCHEDULES.values():
        validate(maker(3, 4), 3, 4)


def test_validate_missing_action():
    with pytest.raises(replica.ScheduleError, match="never runs 1B1"):
        validate(parse(["0F0 0F1 0B0 0B1", "1F0 1F1 1B0"]), 2, 2)


def test_validate_duplicate():
    with pytest.raises(replica.ScheduleError, match=r"more than once: \['0F1'\]"):
        validate(parse(["0F0 0F1 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"]), 2, 2)


def test_validate_stage_on_two_ranks():
    with pytest.raises(replica.ScheduleError, match="stage 1 appears on ranks 0 and 1"):
        validate(parse(["0F0 1F0 0F1 0B0 0B1", "1F1 1B0 1B1"]), 2, 2)


def test_validate_deadlock_across_ranks():
    # rank 0 waits for 1B0 before its F1; rank 1 wants 1F1 (needs 0F1) before its B0
    with pytest.raises(replica.ScheduleError, match="deadlock"):
        validate(parse(["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"]), 2, 2)


def test_validate_deadlock_within_a_rank():
    with pytest.raises(replica.ScheduleError, match=r"deadlocks.*0B0"):
        validate(parse(["0B0 0F0"]), 1, 1)


def test_validate_deadlock_names_the_stuck_actions():
    with pytest.raises(replica.ScheduleError) as info:
        validate(parse(["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"]), 2, 2)
    assert "0B0" in str(info.value) and "1F1" in str(info.value)


@pytest.mark.parametrize("bad", ["2F0", "0F2", "0B5"])
def test_validate_out_of_range(bad):
    rows = ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"]
    rows[0] += " " + bad
    with pytest.raises(replica.ScheduleError, match=f"{bad} is outside 2 stages × 2 micro-batches"):
        validate(parse(rows), 2, 2)


def test_validate_negative_index():
    with pytest.raises(replica.ScheduleError, match="outside"):
        validate([[Action(0, "F", 0), Action(0, "B", 0), Action(-1, "F", 0)]], 1, 1)


def test_validate_unknown_kind():
    with pytest.raises(replica.ScheduleError):
        validate([[Action(0, "F", 0), Action(0, "B", 0), Action(0, "X", 0)]], 1, 1)


def test_validate_weight_after_backward():
    validate(parse(["0F0 0B0 0W0"]), 1, 1)
    with pytest.raises(replica.ScheduleError, match="deadlock"):
        validate(parse(["0F0 0W0 0B0"]), 1, 1)


def test_placement():
    assert placement(gpipe(3, 2)) == {0: 0, 1: 1, 2: 2}


def test_interleaved_placement_loops_over_ranks():
    assert placement(interleaved_one_f_one_b(2, 6, 4)) == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1}


@pytest.mark.parametrize("ranks, stages, m", [(1, 2, 3), (2, 4, 2), (2, 4, 6), (3, 6, 9), (2, 6, 4)])
def test_interleaved_is_valid(ranks, stages, m):
    schedule = make_schedule("interleaved", stages, m, ranks)
    assert len(schedule) == ranks
    check_order(schedule, stages, m)


@pytest.mark.parametrize("ranks, stages, m", [(2, 2, 4), (2, 3, 4), (2, 4, 3)])
def test_interleaved_bad_sizes(ranks, stages, m):
    with pytest.raises(replica.ScheduleError, match="interleaved 1F1B needs"):
        interleaved_one_f_one_b(ranks, stages, m)


def test_make_schedule_by_name():
    assert make_schedule("GPipe", 2, 3) == gpipe(2, 3)
    assert make_schedule("1f1b", 2, 3) == one_f_one_b(2, 3)


def test_make_schedule_unknown():
    with pytest.raises(replica.ScheduleError, match=r"unknown schedule 'zb'; choose one of \[.*'1f1b', 'gpipe'"):
        make_schedule("zb", 2, 2)


# --------------------------------------------------------------------------- 1F1B memory


def in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward ran and backward did not, replaying ``actions``."""
    held = peak = 0
    for a in actions:
        held += {"F": 1, "B": -1}.get(a.kind, 0)
        peak = max(peak, held)
    return peak


def warmup(actions: list[Action]) -> int:
    """Forwards before the first backward."""
    return next(i for i, a in enumerate(actions) if a.kind == "B")


@pytest.mark.parametrize("p, m", [(3, 4), (4, 8), (4, 2), (1, 5)])
def test_one_f_one_b_warmup(p, m):
    assert [warmup(r) for r in one_f_one_b(p, m)] == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("p, m", [(3, 4), (4, 8), (4, 2), (1, 5)])
def test_one_f_one_b_in_flight_bound(p, m):
    assert [in_flight(r) for r in one_f_one_b(p, m)] == [min(p - r, m) for r in range(p)]


def test_gpipe_holds_every_microbatch():
    assert [in_flight(r) for r in gpipe(3, 5)] == [5, 5, 5]


def test_grid_length_is_two_times_m_plus_p_minus_one():
    p, m = 4, 6
    for maker in (gpipe, one_f_one_b):
        ticks = format_grid(maker(p, m), p).splitlines()[0].split()[2:]
        assert len(ticks) == 2 * (m + p - 1)


# --------------------------------------------------------------------------- execution order


def check_order(schedule: list[list[Action]], p: int, m: int) -> None:
    order = execution_order(schedule, p)
    assert sorted(order) == sorted(a for r in schedule for a in r)  # a permutation
    position = {a: i for i, a in enumerate(order)}
    for a in order:
        s, kind, i = a
        if kind == "F" and s > 0:
            assert position[Action(s - 1, "F", i)] < position[a]
        if kind == "B":
            assert position[Action(s, "F", i)] < position[a]
            if s < p - 1:
                assert position[Action(s + 1, "B", i)] < position[a]
    for rank in schedule:  # every rank's own order is kept
        assert [a for a in order if a in set(rank)] == rank


def test_execution_order_gpipe():
    check_order(gpipe(3, 4), 3, 4)


def test_execution_order_one_f_one_b():
    check_order(one_f_one_b(3, 4), 3, 4)


def test_execution_order_of_nothing():
    assert execution_order([], 0) == []


@settings(max_examples=60, deadline=None, derandomize=True)
@given(p=st.integers(1, 6), m=st.integers(1, 10), name=st.sampled_from(["gpipe", "1f1b"]))
def test_gpipe_and_one_f_one_b_are_valid(p, m, name):
    schedule = SCHEDULES[name](p, m)
    validate(schedule, p, m)
    assert placement(schedule) == {s: s for s in range(p)}
    assert all(len(r) == 2 * m for r in schedule)
    check_order(schedule, p, m)
    bound = [m] * p if name == "gpipe" else [min(p - r, m) for r in range(p)]
    assert [in_flight(r) for r in schedule] == bound
    grid = format_grid(schedule, p).splitlines()
    assert len(grid) == p and len({len(line) for line in grid}) == 1


def test_zero_bubble_h1_golden_grid():
    from replica.schedules.schedule import zero_bubble_h1

    assert format_grid(zero_bubble_h1(3, 4), 3) == docstring_grid(zero_bubble_h1)


def test_zero_bubble_v_golden_grid():
    from replica.schedules.schedule import zero_bubble_v

    assert format_grid(zero_bubble_v(4, 4), 4) == docstring_grid(zero_bubble_v)


def test_weight_actions_for_some_pairs_only_are_rejected():
    from replica.schedules.schedule import WEIGHT, zero_bubble_h1

    schedule = [[a for a in actions if not (a.kind == WEIGHT and a.microbatch_index == 0)]
                for actions in zero_bubble_h1(2, 2)]
    with pytest.raises(replica.ScheduleError, match="never runs 0W0|never runs 1W0"):
        validate(schedule, 2, 2)


def test_zero_ranks_is_an_error():
    with pytest.raises(replica.ScheduleError, match="num_ranks"):
        make_schedule("interleaved", 4, 4, 0)


def test_zero_bubble_interleaved_golden_grid():
    from replica.schedules.schedule import zero_bubble_interleaved

    assert format_grid(zero_bubble_interleaved(2, 4, 4), 4) == docstring_grid(zero_bubble_interleaved)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(p=st.integers(1, 4), v=st.integers(2, 3), m=st.integers(1, 10))
def test_zero_bubble_interleaved_is_valid_with_any_durations(p, v, m):
    for durations in ((1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (1.0, 2.0, 0.5)):
        validate(make_schedule("zb-interleaved", p * v, m, p, durations=durations), p * v, m)


# --------------------------------------------------------------------------- every generator's grid


def _registered() -> dict[str, Any]:
    return {**SCHEDULES, **INTERLEAVED, **V_SHAPED}


@pytest.mark.parametrize("name", sorted(_registered()))
def test_every_registered_schedule_draws_its_grid_and_makes_it(name):
    """Each generator's docstring grid, at the sizes it shows (ranks, stages and micro-batches
    read off the grid), is exactly what the generator makes in unit time."""
    drawn = docstring_grid(_registered()[name])
    assert drawn.count("\n") >= 1, f"{name}'s docstring draws no grid"
    rows = [line.split(":", 1)[1].split() for line in drawn.splitlines()]
    actions = [Action.parse(cell) for row in rows for cell in row if cell != "..."]
    num_stages = max(a.stage_index for a in actions) + 1
    num_microbatches = max(a.microbatch_index for a in actions) + 1
    schedule = make_schedule(name, num_stages, num_microbatches, len(rows))
    assert schedule == [[Action.parse(c) for c in row if c != "..."] for row in rows]
    assert format_grid(schedule, num_stages) == drawn


# --------------------------------------------------------------------------- the dependency rule


def test_dependencies_follow_the_chain():
    assert dependencies(Action.parse("0F1"), 3) == ()
    assert dependencies(Action.parse("2F1"), 3) == (Action.parse("1F1"),)
    assert dependencies(Action.parse("1B1"), 3) == (Action.parse("1F1"), Action.parse("2B1"))
    assert dependencies(Action.parse("2B1"), 3) == (Action.parse("2F1"),)  # the last stage starts the backward
    assert dependencies(Action.parse("1W0"), 3) == (Action.parse("1B0"),)


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_dependents_are_dependencies_read_backwards(num_stages):
    every = [Action(s, k, i) for s in range(num_stages) for k in "FBW" for i in range(2)]
    for a in every:
        assert set(dependents(a, num_stages)) == {c for c in every if a in dependencies(c, num_stages)}


def test_play_in_unit_time_is_the_grid():
    events = play(one_f_one_b(2, 2), lambda a: 1.0)
    assert sorted((e.start_s, e.rank, str(e.action)) for e in events) == [
        (0, 0, "0F0"), (1, 0, "0F1"), (1, 1, "1F0"), (2, 1, "1B0"), (3, 0, "0B0"), (3, 1, "1F1"), (4, 1, "1B1"),
        (5, 0, "0B1")]


def test_play_waits_for_arrival():
    # every dependency arrives 0.5 after it ends: the F of stage 1 starts at 1.5
    events = {str(e.action): e for e in play(gpipe(2, 1), lambda a: 1.0, arrival=lambda dep, a: dep.end_s + 0.5)}
    assert (events["1F0"].start_s, events["1B0"].start_s, events["0B0"].start_s) == (1.5, 3.0, 4.5)


def test_play_names_every_stuck_rank():
    with pytest.raises(replica.ScheduleError, match="rank 0 at 0B0 waits for 1B0, rank 1 at 1F1 waits for 0F1"):
        play(parse(["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"]), lambda a: 1.0)


def test_list_schedule_runs_each_action_after_its_dependencies():
    schedule = list_schedule([0, 1, 1, 0], 3, split_backward=True, admit=[4, 3], durations=(1.0, 1.5, 0.5))
    validate(schedule, 4, 3)
