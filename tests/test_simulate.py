"""Tests of the schedule simulator (``replica.schedules.simulate``) and its chrome-trace export
(``replica.viz.chrome``): bubble formulas, communication, memory, traces, deadlocks, plans."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

import replica
from replica.planner.costs import stage_costs_from_plan
from replica.schedules.schedule import Action, format_grid, gpipe, make_schedule, one_f_one_b, placement
from replica.schedules.simulate import Event, StageCosts, Timeline, peak_memory, simulate
from replica.viz.chrome import measured_timeline, write_chrome_trace
from tests import models
from tests.conftest import COMPUTE_BOUND

GRID = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8)]


def uniform(num_stages: int, forward_s: float = 1.0, backward_s: float = 2.0, weight_s: float = 0.0,
            **kw: Any) -> list[StageCosts]:
    return [StageCosts(forward_s, backward_s, weight_s, **kw)] * num_stages


def bubble(name: str, num_stages: int, m: int, **kw: Any) -> float:
    return simulate(make_schedule(name, num_stages, m), uniform(num_stages, **kw)).bubble_fraction


# --------------------------------------------------------------------------- bubble formulas


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", GRID)
def test_bubble_formula(name, p, m):
    assert bubble(name, p, m) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", GRID)
def test_step_time_formula(name, p, m):
    assert simulate(make_schedule(name, p, m), uniform(p)).step_time_s == pytest.approx((m + p - 1) * 3)


@pytest.mark.parametrize("p, v, k", [(p, v, k) for p in (2, 3, 4) for v in (2, 3) for k in (1, 2, 3)])
def test_interleaved_bubble_formula(p, v, k):
    m = k * p  # the schedule requires num_microbatches a multiple of the ranks; the formula then holds
    t = simulate(make_schedule("interleaved", v * p, m, p), uniform(v * p))
    assert t.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p, m", [(p, m) for p in (2, 3, 4) for m in (1, 2, p, 2 * p, 4 * p)])
def test_zero_bubble_h1_beats_1f1b(p, m):
    h1 = bubble("zb-h1", p, m, forward_s=1, backward_s=1, weight_s=1)
    assert h1 < bubble("1f1b", p, m, forward_s=1, backward_s=2)
    assert h1 == pytest.approx(2 * (p - 1) / (3 * m + 2 * (p - 1)))  # the bubble shrinks from (F+B) to (F+B-W)


@pytest.mark.parametrize("p, m", [(p, m) for p in (2, 3) for m in (2 * p, 3 * p, 4 * p)])
def test_zero_bubble_v_beats_h1(p, m):
    assert bubble("zb-v", 2 * p, m, forward_s=1, backward_s=1, weight_s=1) < bubble(
        "zb-h1", p, m, forward_s=1, backward_s=1, weight_s=1)


@pytest.mark.parametrize("m", [8, 12, 16])
def test_zero_bubble_v_beats_h1_on_four_ranks(m):
    assert bubble("zb-v", 8, m, forward_s=1, backward_s=1, weight_s=1) < bubble(
        "zb-h1", 4, m, forward_s=1, backward_s=1, weight_s=1)


@pytest.mark.parametrize("name, n, m", [("gpipe", 3, 4), ("1f1b", 4, 6), ("interleaved", 4, 4), ("zb-h1", 3, 5),
                                        ("zb-v", 6, 6), ("zb-v", 8, 8)])
def test_unit_costs_replay_the_schedule_grid(name, n, m):
    schedule = make_schedule(name, n, m)
    width = len(format_grid(schedule, n).splitlines()[0].split()) - 2  # "rank 0:" is two words
    assert simulate(schedule, uniform(n, 1, 1, 1)).step_time_s == width


@pytest.mark.parametrize("name, n, m", [("1f1b", 3, 4), ("interleaved", 4, 4), ("zb-interleaved", 4, 4),
                                        ("zb-v", 4, 4)])
def test_unit_costs_start_each_action_at_its_grid_tick(name, n, m):
    """The simulator and the drawn grids read the same dependency rule."""
    schedule = make_schedule(name, n, m)
    grid = [line.split()[2:] for line in format_grid(schedule, n).splitlines()]
    drawn = {(rank, cell): tick for rank, row in enumerate(grid) for tick, cell in enumerate(row) if cell != "..."}
    assert {(e.rank, str(e.action)): e.start_s for e in simulate(schedule, uniform(n, 1, 1, 1)).events} == drawn


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 3, 7])
def test_one_stage_step_time(name, m):
    assert simulate(make_schedule(name, 1, m), uniform(1, 1.5, 2.5)).step_time_s == pytest.approx(m * 4.0)


def test_one_stage_has_no_bubble():
    assert simulate(gpipe(1, 4), uniform(1)).bubble_fraction == 0.0


def test_busy_is_the_work_of_each_rank():
    assert simulate(one_f_one_b(3, 4), uniform(3)).busy_s == (12.0, 12.0, 12.0)


def test_events_are_sorted_and_complete():
    t = simulate(one_f_one_b(3, 4), uniform(3))
    assert len(t.events) == 24 and [e.start_s for e in t.events] == sorted(e.start_s for e in t.events)


def test_ranks_never_overlap():
    t = simulate(make_schedule("zb-v", 6, 6), uniform(6, 1, 1, 1))
    for r in range(t.num_ranks):
        mine = [e for e in t.events if e.rank == r]
        assert all(a.end_s <= b.start_s for a, b in zip(mine, mine[1:]))


def test_one_f_one_b_first_events():
    t = simulate(one_f_one_b(2, 2), uniform(2))
    assert [(str(e.action), e.start_s, e.end_s) for e in t.events if e.rank == 1] == [
        ("1F0", 1, 2), ("1B0", 2, 4), ("1F1", 4, 5), ("1B1", 5, 7)]


# --------------------------------------------------------------------------- communication


@pytest.mark.parametrize("p, m", [(p, m) for p in (2, 3, 4) for m in (1, 2, 5)])
def test_gpipe_communication_delay(p, m):
    t = simulate(gpipe(p, m), uniform(p, send_s=0.25))
    assert t.step_time_s == pytest.approx((m + p - 1) * 3 + 2 * (p - 1) * 0.25)  # each hop, there and back


def test_one_f_one_b_communication_by_hand():
    assert simulate(one_f_one_b(2, 2), uniform(2, send_s=0.25)).step_time_s == pytest.approx(9.5)


def test_send_of_the_last_stage_is_unused():
    costs = uniform(2) + [StageCosts(1, 2, send_s=100.0)]
    assert simulate(one_f_one_b(3, 4), costs).step_time_s == pytest.approx(18.0)


def test_send_within_a_rank_is_free():
    schedule = make_schedule("zb-v", 4, 4)  # stages 1 and 2 share rank 1
    same = simulate(schedule, uniform(4, 1, 1, 1))
    costs = uniform(4, 1, 1, 1)
    costs[1] = StageCosts(1, 1, 1, send_s=100.0)
    assert simulate(schedule, costs).events == same.events


def test_allreduce_added_at_the_end():
    t = simulate(gpipe(2, 2), uniform(2), allreduce_s=(5.0, 0.0))
    assert t.step_time_s == pytest.approx(9.0 + 5.0) and t.busy_s == (6.0, 6.0)


def test_allreduce_needs_one_per_rank():
    with pytest.raises(replica.ConfigError, match="2 entries for 3 ranks"):
        simulate(gpipe(3, 2), uniform(3), allreduce_s=(1.0, 1.0))


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("p, m", GRID)
def test_gpipe_holds_every_microbatch(p, m):
    t = simulate(gpipe(p, m), uniform(p, activation_bytes=10, static_bytes=7))
    assert t.peak_memory_bytes == (7 + 10 * m,) * p


@pytest.mark.parametrize("p, m", GRID)
def test_one_f_one_b_holds_stages_left(p, m):
    t = simulate(one_f_one_b(p, m), uniform(p, activation_bytes=10))
    assert t.peak_memory_bytes == tuple(10 * min(m, p - r) for r in range(p))


def test_split_backward_frees_at_w():
    schedule = [[Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "W", 0),
                 Action(0, "B", 1), Action(0, "W", 1)]]
    # B frees all but the deferred weight gradients' share, W the rest
    assert simulate(schedule, uniform(1, 1, 1, 1, activation_bytes=10, weight_bytes=10)).peak_memory_bytes == (20,)
    assert simulate(schedule, uniform(1, 1, 1, 1, activation_bytes=10, weight_bytes=3)).peak_memory_bytes == (13,)
    assert simulate(schedule, uniform(1, 1, 1, 1, activation_bytes=10)).peak_memory_bytes == (10,)
    assert peak_memory(schedule, uniform(1, 1, 1, 1, activation_bytes=10, weight_bytes=3)) == [13]


def test_backward_bytes_only_while_b_runs_and_gradients_from_the_first_b():
    schedule = [[Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 0), Action(0, "B", 1)]]
    costs = uniform(1, activation_bytes=10, backward_bytes=5, static_bytes=100, gradient_bytes=40)
    # static 60 before any backward; at the first B: 20 held + 5 rebuilt + 40 gradients
    assert peak_memory(schedule, costs) == [60 + 20 + 5 + 40]
    assert simulate(schedule, costs).peak_memory_bytes == (125,)
    costs = uniform(1, activation_bytes=10, backward_bytes=50, static_bytes=100, gradient_bytes=40)
    assert peak_memory(schedule, costs) == [60 + 20 + 50 + 40]  # B0's transient tops the forwards


def test_static_bytes_sum_over_the_stages_of_a_rank():
    t = simulate(make_schedule("interleaved", 4, 2), [StageCosts(1, 2, static_bytes=b) for b in (1, 2, 4, 8)])
    assert t.peak_memory_bytes == (1 + 4, 2 + 8)


# --------------------------------------------------------------------------- errors


def test_deadlock_is_detected():
    schedule = [[Action(0, "F", 0), Action(0, "B", 0)], [Action(1, "B", 0), Action(1, "F", 0)]]
    with pytest.raises(replica.ScheduleError, match="rank 1 at 1B0 waits for 1F0"):
        simulate(schedule, uniform(2))


def test_missing_action_deadlocks():
    with pytest.raises(replica.ScheduleError, match="waits for 1F0"):
        simulate([[Action(0, "F", 0), Action(0, "B", 0)], [Action(1, "B", 0)]], uniform(2))


def test_costs_must_cover_every_stage():
    with pytest.raises(replica.ConfigError, match="3 stages but costs cover 2"):
        simulate(gpipe(3, 2), uniform(2))


def test_negative_cost_is_refused():
    with pytest.raises(replica.ConfigError, match="forward_s must be >= 0"):
        StageCosts(-1.0, 1.0)


def test_empty_schedule():
    t = simulate([], [])
    assert (t.step_time_s, t.bubble_fraction, t.events) == (0.0, 0.0, ())


# --------------------------------------------------------------------------- chrome trace


def test_chrome_trace_is_valid():
    trace = simulate(make_schedule("zb-v", 4, 4), uniform(4, 1, 1, 1)).to_chrome_trace(name="zb-v")
    json.dumps(trace)
    assert all({"ph", "ts", "dur", "pid", "tid"} <= set(e) for e in trace["traceEvents"])
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 4 * 4 * 3 and all(e["dur"] > 0 for e in complete)


def test_chrome_trace_places_actions():
    trace = simulate(one_f_one_b(2, 1), uniform(2)).to_chrome_trace()
    first = next(e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "1B0")
    assert (first["ts"], first["dur"], first["pid"], first["tid"]) == (2e6, 2e6, 1, 1)
    assert first["args"] == {"stage_index": 1, "microbatch_index": 0, "kind": "B"}


def test_chrome_trace_names_ranks_and_stages():
    trace = simulate(make_schedule("interleaved", 4, 2), uniform(4)).to_chrome_trace()
    names = {(e["name"], e["pid"], e["tid"], e["args"]["name"]) for e in trace["traceEvents"] if e["ph"] == "M"}
    assert ("process_name", 1, 0, "rank 1") in names and ("thread_name", 1, 3, "stage 3") in names


def test_write_chrome_trace(tmp_path):
    t = simulate(one_f_one_b(3, 4), uniform(3))
    path = write_chrome_trace(t, tmp_path / "trace.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(t.to_chrome_trace()))


def test_write_chrome_trace_from_events(tmp_path):
    events = [Event(0, Action(0, "F", 0), 0.0, 1.0), Event(1, Action(1, "F", 0), 1.0, 3.0)]
    trace = json.loads(write_chrome_trace(events, tmp_path / "t.json").read_text())
    assert [e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"] == [0, 1]


# --------------------------------------------------------------------------- measured timelines


def test_measured_timeline_matches_the_simulation():
    t = simulate(one_f_one_b(3, 4), uniform(3, activation_bytes=1))
    records = [(e.rank, str(e.action), 1000.0 + e.start_s, 1000.0 + e.end_s) for e in reversed(t.events)]
    measured = measured_timeline(records, costs=uniform(3, activation_bytes=1))
    assert measured.step_time_s == pytest.approx(t.step_time_s) and measured.busy_s == t.busy_s
    assert measured.bubble_fraction == pytest.approx(t.bubble_fraction)
    assert measured.peak_memory_bytes == t.peak_memory_bytes


def test_measured_timeline_without_costs_has_no_memory():
    assert measured_timeline([(0, Action(0, "F", 0), 0.5, 1.0)]).peak_memory_bytes == (0,)


def test_measured_timeline_rejects_bad_records():
    with pytest.raises(replica.ConfigError, match="ends"):
        measured_timeline([(0, "0F0", 2.0, 1.0)])
    with pytest.raises(replica.ScheduleError, match="cannot parse"):
        measured_timeline([(0, "forward", 0.0, 1.0)])


def test_timeline_from_events_counts_ranks():
    t = Timeline.from_events([Event(2, Action(0, "F", 0), 0.0, 1.0)])
    assert t.num_ranks == 3 and t.bubble_fraction == pytest.approx(2 / 3)


# --------------------------------------------------------------------------- from a plan


@pytest.fixture(scope="module")
def gpt_plan() -> replica.Plan:
    torch.manual_seed(0)
    model, inputs, _, _ = models.tiny_gpt()
    return replica.plan(model, inputs, num_stages=3, num_microbatches=8, device=COMPUTE_BOUND)


def test_plan_step_time_agrees(gpt_plan):
    schedule = make_schedule("1f1b", 3, 8)
    t = simulate(schedule, stage_costs_from_plan(gpt_plan, schedule, device=COMPUTE_BOUND))
    assert t.step_time_s == pytest.approx(gpt_plan.predicted_step_time_s, rel=0.05)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_plan_memory_agrees(name):
    torch.manual_seed(0)
    model, inputs, _, _ = models.tiny_gpt()
    plan = replica.plan(model, inputs, num_stages=3, num_microbatches=4, schedule=name, device=COMPUTE_BOUND)
    schedule = make_schedule(name, 3, 4)
    t = simulate(schedule, stage_costs_from_plan(plan, schedule, device=COMPUTE_BOUND))
    assert t.peak_memory_bytes == pytest.approx([s.predicted_memory_bytes for s in plan.stages], abs=3)


def test_plan_costs_are_per_microbatch(gpt_plan):
    costs = stage_costs_from_plan(gpt_plan, make_schedule("1f1b", 3, 8), device=COMPUTE_BOUND)
    assert [c.forward_s * 8 for c in costs] == pytest.approx([s.forward_time_s for s in gpt_plan.stages])
    assert [c.backward_s * 8 for c in costs] == pytest.approx([s.backward_time_s for s in gpt_plan.stages])
    assert all(c.weight_s == 0 for c in costs) and costs[-1].send_s == 0 and costs[0].send_s > 0


def test_plan_costs_split_backward(gpt_plan):
    costs = stage_costs_from_plan(gpt_plan, make_schedule("zb-h1", 3, 8), device=COMPUTE_BOUND)
    assert [(c.backward_s + c.weight_s) * 8 for c in costs] == pytest.approx(
        [s.backward_time_s for s in gpt_plan.stages])
    from replica.schedules.schedule import WEIGHT_SHARE

    assert all(c.weight_s == pytest.approx(WEIGHT_SHARE * (c.backward_s + c.weight_s)) for c in costs)


def test_plan_send_time_follows_the_link(gpt_plan):
    slow = dataclasses.replace(COMPUTE_BOUND, link_bandwidth=1e3, link_latency_s=0.5)
    costs = stage_costs_from_plan(gpt_plan, make_schedule("1f1b", 3, 8), device=slow)
    sent = sum(b.nbytes for b in gpt_plan.stages[0].outputs) / 8
    assert costs[0].send_s == pytest.approx(sent / 1e3 + 0.5)


def test_plan_needs_a_matching_schedule(gpt_plan):
    with pytest.raises(replica.ConfigError, match="stages \\[0, 1\\] but the plan has 3"):
        stage_costs_from_plan(gpt_plan, make_schedule("1f1b", 2, 8), device=COMPUTE_BOUND)


def test_plan_with_unknown_device_asks_for_one(gpt_plan):
    with pytest.raises(replica.ConfigError, match="pass stage_costs_from_plan"):
        stage_costs_from_plan(gpt_plan, make_schedule("1f1b", 3, 8))


@pytest.mark.parametrize("name", ["zb-v", "interleaved"])
def test_plan_memory_bounds_two_stages_per_rank(name):
    torch.manual_seed(0)
    model, inputs, _, _ = models.tiny_gpt()
    plan = replica.plan(model, inputs, num_stages=4, num_microbatches=4, schedule=name, device=COMPUTE_BOUND)
    schedule = make_schedule(name, 4, 4)
    t = simulate(schedule, stage_costs_from_plan(plan, schedule, device=COMPUTE_BOUND))
    where = placement(schedule)
    for r in range(2):  # a rank never holds more than the sum of its stages' own peaks
        assert t.peak_memory_bytes[r] <= sum(s.predicted_memory_bytes for s in plan.stages if where[s.stage_index] == r)


def test_an_input_gradient_sent_before_the_weight_gradients_shortens_the_step():
    """The runtimes send a B's input gradient upstream before its weight gradients; a plan's
    costs say so (input_grad_share), and the upstream B starts that much sooner."""
    schedule = make_schedule("1f1b", 2, 4)
    textbook = simulate(schedule, uniform(2)).step_time_s
    early = simulate(schedule, [StageCosts(1.0, 2.0, input_grad_share=0.5)] * 2)
    assert early.step_time_s == pytest.approx(textbook - 1.0)  # the drain's last B on rank 0 starts 1 s sooner
    b1 = {e.action: e for e in early.events}
    assert b1[Action(0, "B", 3)].start_s == pytest.approx(b1[Action(1, "B", 3)].start_s + 1.0)
    with pytest.raises(replica.ConfigError, match="input_grad_share"):
        StageCosts(1.0, 2.0, input_grad_share=1.5)


def test_plan_costs_send_input_gradients_early_only_without_w():
    model, inputs, _, _ = models.tiny_gpt(8)
    # recompute=False: no rebuilds, whose savings the partitioner's budget check does not count
    plan = replica.plan(model, inputs, num_stages=2, num_microbatches=2, device=COMPUTE_BOUND, recompute=False)
    plain = stage_costs_from_plan(plan, make_schedule("1f1b", 2, 2), device=COMPUTE_BOUND)
    split = stage_costs_from_plan(plan, make_schedule("zb-h1", 2, 2), device=COMPUTE_BOUND)
    assert {c.input_grad_share for c in plain} == {0.6} and {c.input_grad_share for c in split} == {1.0}
    # the runtime holds a micro-batch's weight-gradient inputs meanwhile: not where that does
    # not fit the memory budget (here: exactly the plan's own estimate); the costs follow
    budget = max(s.predicted_memory_bytes for s in plan.stages)
    bound = replica.plan(model, inputs, num_stages=2, num_microbatches=2, device=COMPUTE_BOUND, memory_budget=budget,
                         recompute=False)
    assert plan.early_input_grads and not bound.early_input_grads
    again = stage_costs_from_plan(bound, make_schedule("1f1b", 2, 2), device=COMPUTE_BOUND)
    assert {c.input_grad_share for c in again} == {1.0}
    assert replica.Plan.from_json(bound.to_json()).early_input_grads is False
