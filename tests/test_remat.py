"""Selective recompute: GELU / SiLU / LayerNorm outputs are rebuilt in backward, bit for bit,
and not kept; the planner turns it on where it is as good as free."""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import weakref

import pytest
import torch
import torch.nn.functional as F

import replica
from replica.layout import Layout
from replica.partition.partitioner import MemoryModel
from replica.partition.trace import trace
from replica.planner import PlannerOptions, refine
from replica.planner.pricing import Pricing
from replica.stage import remat
from replica.stage.weightgrad import WeightGrads, collecting, linear
from tests import models
from tests.conftest import COMPUTE_BOUND
from tests.grads import assert_same_grads

_LN_W, _LN_B = torch.randn(16), torch.randn(16)
OPS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
    "layer_norm": lambda h: remat.layer_norm(h, (16,), _LN_W, _LN_B, 1e-3),
    "layer_norm_bare": lambda h: remat.layer_norm(h, (16,)),  # no weight, no bias, default eps
}


def _mlp(x, w1, w2, op, mm):
    """x -> linear -> op -> linear; returns the output and a weak reference to op's output."""
    y = op(mm(x, w1))
    ref = weakref.ref(y)
    return mm(y, w2), ref


def _grads(op, mm, recompute: bool, sink: WeightGrads | None = None):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, requires_grad=True)  # 3-D: a linear saves a 2-D view of its input
    w1, w2 = torch.randn(16, 8, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    with remat.pointwise_recompute(recompute):
        out, kept = _mlp(x, w1, w2, op, mm)
    gc.collect()
    alive = kept() is not None
    with collecting(sink):
        out.square().sum().backward()
    if sink is not None:
        sink.apply()
    return [t.grad for t in (x, w1, w2)], alive


@pytest.mark.parametrize("mm", [F.linear, linear], ids=["F.linear", "deferrable"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_the_output_is_not_kept_and_gradients_are_bitwise_equal(name, mm):
    want, alive = _grads(OPS[name], mm, recompute=False)
    assert alive  # autograd keeps it for the second linear's weight gradient
    got, alive = _grads(OPS[name], mm, recompute=True)
    assert not alive, "the op's output is still held after the forward"
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_a_deferred_weight_gradient_rebuilds_the_output_when_it_runs():
    want, _ = _grads(F.gelu, linear, recompute=False)
    sink = WeightGrads()
    got, alive = _grads(F.gelu, linear, recompute=True, sink=sink)
    assert not alive
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "rebuilt"])
def test_weight_gradients_accumulated_in_backward_match_autograd(recompute):
    """A collector made with now=True adds each weight gradient into .grad inside backward
    (addmm_, no temporary), keeps nothing pending, and over two backwards (the second adds
    into the first's gradient) matches autograd's accumulation to fp32 round-off."""
    def grads(sink_now):
        torch.manual_seed(0)
        w1, w2 = torch.randn(16, 8, requires_grad=True), torch.randn(4, 16, requires_grad=True)
        b1 = torch.randn(16, requires_grad=True)
        for _ in range(2):
            x = torch.randn(2, 5, 8, requires_grad=True)
            with remat.pointwise_recompute(recompute):
                out = linear(F.gelu(linear(x, w1, b1)), w2)
            sink = WeightGrads(now=True) if sink_now else None
            with collecting(sink):
                out.square().sum().backward()
            if sink is not None:
                assert len(sink) == 0
        return [t.grad for t in (w1, b1, w2)]

    for got, want in zip(grads(True), grads(False)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # addmm_ rounds once, mm + add twice


def test_a_recipe_is_held_until_the_deferred_weight_gradient():
    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    w1, w2 = torch.randn(16, 8, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    with remat.pointwise_recompute():
        out = linear(F.gelu(linear(x, w1)), w2)
    sink = WeightGrads()
    with collecting(sink):
        out.sum().backward()
    assert any(isinstance(entry[2], remat._Recipe) for entry in sink.pending)


def test_an_output_written_in_place_is_kept_as_it_is():
    """A write after the op (version > 0) means running the op again would not give the
    saved values: such a tensor is kept, and the gradients still match."""
    def grads(recompute):
        torch.manual_seed(0)
        h = torch.randn(4, 8, requires_grad=True)
        w = torch.randn(3, 8, requires_grad=True)
        with remat.pointwise_recompute(recompute):
            y = F.gelu(h * 1.0)
            y.mul_(2.0)
            out = F.linear(y, w)
        out.sum().backward()
        return h.grad, w.grad

    for g, w in zip(grads(True), grads(False)):
        assert torch.equal(g, w)


def test_a_norm_run_without_its_eps_noted_is_kept():
    """F.layer_norm's autograd node does not keep eps: only remat.layer_norm's output is rebuilt."""
    _, alive = _grads(lambda h: F.layer_norm(h, (16,)), F.linear, recompute=True)
    assert alive


@pytest.mark.parametrize("kinds,rebuilt", [({"activation"}, "gelu"), ({"norm"}, "layer_norm")])
def test_only_the_kinds_asked_for_are_rebuilt(kinds, rebuilt):
    for name in ("gelu", "layer_norm"):
        want, _ = _grads(OPS[name], linear, recompute=False)
        got, alive = _grads(OPS[name], linear, recompute=kinds)
        assert alive == (name != rebuilt), name
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_an_unknown_kind_is_refused():
    with pytest.raises(replica.ReplicaError, match=r"unknown kinds of rebuilt ops \['attention'\]; choose from"):
        with remat.pointwise_recompute({"attention"}):
            pass


def test_norms_are_rewritten_to_note_their_eps():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(8, eps=1e-3)
            self.bare = torch.nn.LayerNorm(8, elementwise_affine=False)
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(F.layer_norm(self.bare(self.ln(x)), (8,), eps=1e-2))

    torch.manual_seed(0)
    net = Net()
    gm = torch.fx.symbolic_trace(net)
    x = torch.randn(3, 8)
    want = net(x)
    assert remat.rebuildable_norms(gm) == 3
    assert not any(n.op == "call_module" and "ln" in str(n.target) for n in gm.graph.nodes)
    assert torch.equal(gm(x), want)
    with remat.pointwise_recompute({"norm"}):
        out = gm(x.requires_grad_())
    assert out.grad_fn.next_functions  # still differentiable
    assert remat.rebuildable_norms(gm) == 0  # nothing left to rewrite


def test_off_outside_grad_mode_and_when_disabled():
    assert remat.rebuildable(F.gelu(torch.randn(3, requires_grad=True))) is None  # no context active
    with torch.no_grad(), remat.pointwise_recompute():
        assert remat.rebuildable(F.gelu(torch.randn(3))) is None


def test_pipelined_gradients_are_bitwise_those_without_it():
    model, inputs, target, loss_fn = models.tiny_gpt(8, num_layers=2, size_ops=True)
    grads = []
    for on in (True, False):
        pm = replica.auto_parallel(copy.deepcopy(model), inputs, num_stages=2, num_microbatches=4,
                                   schedule="zb-h1", loss_fn=loss_fn, device=COMPUTE_BOUND,
                                   recompute="pointwise" if on else None)
        # 1F1B-shaped: the first stage holds two micro-batches at once, the last one
        if on:
            assert pm.runtime.executor.rebuilt[0] == set(remat.KINDS)
        # both stages, every kind; or none at all (the planner's own rebuilds off too)
        pm.runtime.executor.rebuilt = {0: frozenset(remat.KINDS), 1: frozenset(remat.KINDS)} if on else {}
        pm.train_step(inputs, target)
        grads.append({n: p.grad for n, p in pm.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


def test_a_retained_graph_backpropagates_twice_alike():
    def grads(on):
        torch.manual_seed(0)
        x = torch.randn(6, 8, requires_grad=True)
        w1, w2 = torch.randn(16, 8, requires_grad=True), torch.randn(4, 16, requires_grad=True)
        with remat.pointwise_recompute(on):
            out = linear(F.gelu(linear(x, w1)), w2).sum()
        out.backward(retain_graph=True)
        out.backward()
        return [t.grad for t in (x, w1, w2)]

    for g, w in zip(grads(True), grads(False)):
        assert torch.equal(g, w)


@pytest.mark.parametrize("schedule,num_stages", [("1f1b", 3), ("zb-v", 4), ("interleaved", 4)])
def test_pipelined_gradients_equal_the_plain_model(schedule, num_stages):
    model, inputs, target, loss_fn = models.tiny_gpt(8, size_ops=True)
    ref = copy.deepcopy(model)
    ref_loss = loss_fn(ref(*inputs), target)
    ref_loss.backward()
    pm = replica.auto_parallel(model, inputs, num_stages=num_stages, num_microbatches=4, schedule=schedule,
                               loss_fn=loss_fn, device=COMPUTE_BOUND, recompute="pointwise")
    assert pm.plan.pointwise_recompute and pm.runtime.executor.rebuilt
    torch.testing.assert_close(pm.train_step(inputs, target), ref_loss.detach())
    assert_same_grads(pm, ref)


def test_off_unless_asked_and_kept_in_the_plan():
    model, inputs, _, loss_fn = models.tiny_gpt(8, num_layers=2)
    plain = replica.plan(model, inputs, num_stages=2, num_microbatches=4, device=COMPUTE_BOUND)
    assert not plain.pointwise_recompute
    asked = replica.plan(model, inputs, num_stages=2, num_microbatches=4, device=COMPUTE_BOUND,
                         recompute="pointwise")
    assert asked.pointwise_recompute and not asked.recompute
    assert replica.Plan.from_json(asked.to_json()).pointwise_recompute
    assert "rebuilding GELU outputs" in asked.summary()
    full = replica.plan(model, inputs, num_stages=2, num_microbatches=4, device=COMPUTE_BOUND, recompute=True)
    assert full.recompute and not full.pointwise_recompute


@pytest.mark.parametrize("bad", ["yes", -1, "full"])  # 1 and "selective" are modes now (test_activation_checkpoint)
def test_a_bad_recompute_names_the_choices(bad):
    model, inputs, _, loss_fn = models.tiny_gpt(8, num_layers=2)
    with pytest.raises(replica.ReplicaError, match=r"recompute must be True .*'pointwise'.* got"):
        replica.auto_parallel(model, inputs, num_stages=2, loss_fn=loss_fn, device=COMPUTE_BOUND, recompute=bad)


def _pricing(model, inputs, device=COMPUTE_BOUND):
    traced = trace(model, inputs)
    return Pricing(traced, model, device=device, cost="analytic", memory_budget=None, memory_model=MemoryModel(),
                   num_microbatches=4, num_stages_hint=2)


def test_the_planner_rebuilds_where_a_stage_waits():
    """On a compute-bound device a GELU or a norm costs next to nothing: the stage that waits
    for the slower one rebuilds both kinds, its activations lose them, and the predicted
    step stays within the tie. The slowest stage rebuilds nothing."""
    model, inputs, _, _ = models.tiny_gpt(8, num_layers=2)
    pricing = _pricing(model, inputs)
    raw = pricing.partition_for(Layout.for_stages("1f1b", 2), 4)
    plan = refine.finish(pricing, raw)
    slowest = max(raw.stages, key=lambda s: s.predicted_time_s).stage_index
    assert set(plan.rebuilds) == {(1 - slowest, "activation"), (1 - slowest, "norm")}
    assert plan.rebuilt(slowest) == frozenset()
    assert plan.predicted_step_time_s <= raw.predicted_step_time_s * (1 + PlannerOptions().tie)
    before, after = raw.stages[1 - slowest], plan.stages[1 - slowest]
    assert after.memory.activations < before.memory.activations
    assert before.backward_time_s < after.backward_time_s and after.predicted_time_s <= raw.bottleneck_s
    assert plan.stages[slowest] == raw.stages[slowest]
    again = replica.Plan.from_json(plan.to_json())
    assert again.rebuilds == plan.rebuilds and again.rebuilt(1 - slowest) == {"activation", "norm"}
    assert f"rebuilding GELU outputs on stages [{1 - slowest}], LayerNorm outputs on stages [{1 - slowest}]" \
        in " ".join(plan.summary().split())


def test_a_free_rebuild_must_fit_the_idle_time_at_its_risk_price(monkeypatch):
    """The model under-prices rebuilds inside a running step (measured 2-3x): a rebuild is
    taken for free only if, at PlannerOptions().rebuild_risk times its price, its stage stays within the
    slowest and the step within the tie; the plan then predicts it at its price."""
    model, inputs, _, _ = models.tiny_gpt(8, num_layers=2)
    pricing = _pricing(model, inputs)
    raw = pricing.partition_for(Layout.for_stages("1f1b", 2), 4)
    fast = min(raw.stages, key=lambda s: s.predicted_time_s)
    step_time = refine._step_time(pricing, raw)

    def free(seconds):
        trial = refine._with_rebuild(raw, fast.stage_index, seconds, 1000)
        return trial.stages[fast.stage_index].predicted_time_s <= raw.bottleneck_s \
            and step_time(trial) <= step_time(raw) * (1 + PlannerOptions().tie)

    idle = raw.bottleneck_s - fast.predicted_time_s
    for seconds, taken in ((idle * 0.2, False), (idle * 0.02, True)):
        assert free(seconds) and free(seconds * PlannerOptions().rebuild_risk) == taken
        monkeypatch.setattr(refine, "_rebuild_candidates",
                            lambda pricing, plan, fraction: {(fast.stage_index, "activation"): (seconds, 1000)})
        plan = refine.rebuilds(pricing, raw)
        assert plan.rebuilds == (((fast.stage_index, "activation"),) if taken else ())
        assert plan.stages[fast.stage_index].backward_time_s == pytest.approx(
            fast.backward_time_s + (seconds if taken else 0.0))


def test_a_free_rebuild_keeps_the_rebuilds_that_pay_for_grading(monkeypatch):
    """A plan whose stage already rebuilds one kind (to pay for graded sizes' memory) and then
    takes another for free rebuilds both: the free one is added, not put in the paid one's
    place. (It once was: the benchmark GPT's stage 0 paid for its graded sizes with GELU
    rebuilds, took LayerNorm rebuilds for free, and ran with the norms only, its peak over
    even sizes' by the GELU outputs the plan counted as freed.)"""
    model, inputs, _, _ = models.tiny_gpt(8, num_layers=2)
    pricing = _pricing(model, inputs)
    raw = pricing.partition_for(Layout.for_stages("1f1b", 2), 4)
    fast = min(raw.stages, key=lambda s: s.predicted_time_s).stage_index
    paid = dataclasses.replace(refine._with_rebuild(raw, fast, 1e-9, 1000), rebuilds=((fast, "activation"),))
    monkeypatch.setattr(refine, "_rebuild_candidates", lambda pricing, plan, fraction: {(fast, "norm"): (1e-9, 500)})
    plan = refine.rebuilds(pricing, paid)
    assert plan.rebuilds == ((fast, "activation"), (fast, "norm"))
    assert plan.stages[fast].activation_bytes == raw.stages[fast].activation_bytes - 1500
    monkeypatch.setattr(refine, "_rebuild_candidates", lambda pricing, plan, fraction: {})
    assert refine.rebuilds(pricing, paid).rebuilds == ((fast, "activation"),)  # nothing more to take: as it was


@pytest.mark.parametrize("memory_bandwidth", [1e9, 1e6, 1e3], ids=["fast", "slow", "slowest"])
def test_a_rebuild_never_makes_a_stage_the_slowest(memory_bandwidth):
    """However dear the rebuilds, every one taken for free leaves its stage within the plan's
    slowest stage and the step within the tie. Nor any under full recompute (nothing is kept to
    rebuild), nor on one stage (nobody waits)."""
    model, inputs, _, _ = models.tiny_gpt(8, num_layers=4)
    device = dataclasses.replace(COMPUTE_BOUND, name="memory-test", memory_bandwidth=memory_bandwidth)
    pricing = _pricing(model, inputs, device=device)
    for stages in (2, 3):
        raw = pricing.partition_for(Layout.for_stages("1f1b", stages), 4)
        plan = refine.finish(pricing, raw, graded=False)  # graded sizes may pay for memory with time: below
        assert plan.predicted_step_time_s <= raw.predicted_step_time_s * (1 + PlannerOptions().tie)
        for k, _ in plan.rebuilds:
            assert plan.stages[k].predicted_time_s <= raw.bottleneck_s
        assert plan.rebuilt(max(raw.stages, key=lambda s: s.predicted_time_s).stage_index) == frozenset()
    recomputing = pricing.partition_for(Layout.for_stages("1f1b", 2), 4, recompute=True)
    assert refine.finish(pricing, recomputing).rebuilds == ()
    assert refine.finish(pricing, pricing.partition_for(Layout.for_stages("1f1b", 1), 4)).rebuilds == ()


def _peaks_and_step(pricing, plan):
    from replica.planner.costs import stage_costs_from_plan
    from replica.schedules.schedule import plan_schedule
    from replica.schedules.simulate import simulate

    schedule = plan_schedule(plan)
    timeline = simulate(schedule, stage_costs_from_plan(plan, schedule, device=pricing.spec),
                        sizes=plan.relative_microbatch_sizes)
    return timeline.peak_memory_bytes, timeline.step_time_s


@pytest.mark.parametrize("memory_bandwidth", [1e9, 3e5, 1e5, 1e4], ids=["fast", "slow", "slower", "slowest"])
def test_graded_microbatches_pay_for_their_memory_out_of_their_gain(memory_bandwidth):
    """Graded sizes make a rank that holds several micro-batches hold more samples at its
    peak. Rebuilds on its stages pay that back first, even where they are not free, as far
    as the grading's gain allows: the step stays at least MIN_GAIN shorter than even sizes',
    no peak rises, and the slowest stage still rebuilds nothing. Free rebuilds come after,
    within the tie of the paid plan's step."""
    from replica.schedules.grading import MIN_GAIN

    model, inputs, _, _ = models.tiny_gpt(32, num_layers=4)
    device = dataclasses.replace(COMPUTE_BOUND, name="memory-test", memory_bandwidth=memory_bandwidth)
    pricing = _pricing(model, inputs, device=device)
    paybacks = 0
    for stages in (2, 3):
        raw = pricing.partition_for(Layout.for_stages("1f1b", stages), 8)
        graded = refine.graded_plan(pricing, raw)
        paid = refine.pay_for_grading(pricing, graded, raw)
        plan = refine.finish(pricing, raw)
        assert plan.microbatch_shares and plan.microbatch_shares == paid.microbatch_shares == graded.microbatch_shares
        assert set(paid.rebuilds) <= set(plan.rebuilds)
        (even_peaks, even_step), (graded_peaks, _), (paid_peaks, paid_step), (peaks, step) = (
            _peaks_and_step(pricing, p) for p in (raw, graded, paid, plan))
        assert paid_step <= even_step * (1 - MIN_GAIN) + 1e-12
        assert step <= paid_step * (1 + PlannerOptions().tie) + 1e-12
        assert all(a <= b <= c for a, b, c in zip(peaks, paid_peaks, graded_peaks))
        assert plan.rebuilt(max(raw.stages, key=lambda s: s.predicted_time_s).stage_index) == frozenset()
        paybacks += bool(paid.rebuilds)
        for k, _ in paid.rebuilds:  # only where the graded sizes raised the peak over even sizes'
            assert graded_peaks[k] > even_peaks[k]  # 1F1B: stage k on rank k
    if memory_bandwidth < 1e6:  # rebuilds cost something: the grading's memory is paid back
        assert paybacks


def test_an_old_plan_without_rebuilds_loads():
    model, inputs, _, _ = models.tiny_gpt(8, num_layers=2)
    plan = replica.plan(model, inputs, num_stages=2, num_microbatches=4, device=COMPUTE_BOUND)
    data = json.loads(plan.to_json())
    del data["rebuilds"]
    assert replica.Plan.from_json(json.dumps(data)).rebuilds == ()
