"""Measured costs: every op timed, nothing left in .grad, plans built from the timings."""

from __future__ import annotations

import pytest
import torch

import replica
from replica.partition.cost import CostModel, device_spec
from replica.partition.profile import OpTimes, profile
from replica.partition.trace import trace
from tests import models


def test_every_op_is_timed_and_no_grad_accumulates():
    model, inputs, _, _ = models.tiny_gpt(4)
    traced = trace(model, inputs)
    times = profile(traced.module, inputs, repeats=1)
    ops = {n.name for n in traced.graph.op_nodes}
    assert set(times) == ops
    assert all(t.forward_s > 0 and t.backward_s >= 0 for t in times.values())
    assert all(p.grad is None for p in model.parameters())


def test_weighted_ops_have_a_backward():
    model, inputs, _, _ = models.mlp(4)
    traced = trace(model, inputs)
    times = profile(traced.module, inputs, repeats=1)
    linears = [n.name for n in traced.graph.op_nodes if n.target == "linear"]
    assert linears and all(times[name].backward_s > 0 for name in linears)


def test_measured_times_replace_the_analytic_ones():
    model, inputs, _, _ = models.mlp(4)
    traced = trace(model, inputs)
    node = traced.graph.op_nodes[0]
    # timed on a quarter of the batch: four calls cost four times the work (plus nothing fixed)
    spec = replica.DeviceSpec(name="t", flops=1e12, half_flops=1e12, memory_bandwidth=1e12, memory_bytes=1e12,
                              link_bandwidth=1e9, link_latency_s=0.0, op_overhead_s=0.0)
    cost = CostModel(spec, measured={node.name: OpTimes(0.5, 1.25)}, measured_fraction=0.25)
    assert cost.forward_time(node, num_calls=4) == pytest.approx(2.0)
    assert cost.backward_time(node, num_calls=4) == pytest.approx(5.0)
    # a launch cost is paid per call; the work splits over however many calls
    launch = CostModel(device_spec("a100-80gb"), measured={node.name: OpTimes(0.5, 1.25)}, measured_fraction=0.25)
    overhead = device_spec("a100-80gb").op_overhead_s
    assert launch.forward_time(node, num_calls=8) == pytest.approx(8 * overhead + (0.5 - overhead) * 4)


def test_auto_profiles_real_models_on_their_own_device():
    model, inputs, _, _ = models.mlp(8)
    plan = replica.plan(model, inputs, num_stages=2, num_microbatches=2, cost="profile")
    assert plan.num_stages == 2 and plan.device.startswith("cpu")
    assert all(s.forward_time_s > 0 for s in plan.stages)


def test_profile_on_meta_tensors_is_an_error_naming_the_fix():
    model, inputs, _, _ = models.mlp(8)
    with pytest.raises(replica.ConfigError, match="cost='analytic'"):
        replica.plan(model, tuple(x.to("meta") for x in inputs), num_stages=2, cost="profile")


def test_unknown_cost_mode():
    model, inputs, _, _ = models.mlp(8)
    with pytest.raises(replica.ConfigError, match="'auto', 'analytic' or 'profile'"):
        replica.plan(model, inputs, num_stages=2, cost="guess")


def test_in_place_ops_are_priced():
    class InPlace(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            y.mul_(2)
            return torch.relu_(y)

    traced = trace(InPlace(), (torch.randn(3, 4),))
    times = profile(traced.module, (torch.randn(3, 4),), repeats=1)
    assert set(times) == {n.name for n in traced.graph.op_nodes}


def test_times_are_cached_per_op_signature(tmp_path, monkeypatch):
    from replica.partition import profile as profile_module

    monkeypatch.setenv("REPLICA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(profile_module, "SPOT_CHECKS", 0)  # a busy moment could make a quick op worth re-timing
    model, inputs, _, _ = models.mlp(4)
    traced = trace(model, inputs)
    first = profile(traced.module, inputs, repeats=1)
    files = list(tmp_path.glob("profile-*.json"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    again = profile(traced.module, inputs, repeats=1)
    assert again == first  # read back, not re-timed


def test_the_cache_can_be_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("REPLICA_CACHE_DIR", str(tmp_path))
    model, inputs, _, _ = models.mlp(4)
    profile(trace(model, inputs).module, inputs, repeats=1, cache=False)
    assert not list(tmp_path.glob("profile-*.json"))


def test_times_that_contradict_their_half_size_are_implausible():
    from replica.partition.profile import NOISE_FLOOR_S, _implausible

    ms = 1e-3
    assert not _implausible(OpTimes(2 * ms, 4 * ms), OpTimes(1 * ms, 2 * ms))  # linear in the batch
    assert not _implausible(OpTimes(1 * ms, 2 * ms), OpTimes(1 * ms, 2 * ms))  # all fixed cost
    assert _implausible(OpTimes(6 * ms, 2 * ms), OpTimes(0.3 * ms, 1 * ms))  # the batch met noise
    assert _implausible(OpTimes(1 * ms, 2 * ms), OpTimes(1 * ms, 5 * ms))  # half of it, in backward
    quick = NOISE_FLOOR_S / 10
    assert not _implausible(OpTimes(quick, quick), OpTimes(quick / 9, quick / 9))  # too quick to matter


def test_a_cached_time_slowed_by_a_busy_machine_is_timed_again(tmp_path, monkeypatch):
    """A profile written while the machine was busy heals: an op whose batch took far more
    than twice its half batch is timed again, and keeps the better of the two times."""
    import json

    from replica.partition import profile as profile_module

    monkeypatch.setenv("REPLICA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(profile_module, "NOISE_FLOOR_S", 0.0)  # the MLP's ops are quick
    model, inputs, _, _ = models.mlp(4)
    traced = trace(model, inputs)
    profile(traced.module, inputs, repeats=3)
    (path,) = tmp_path.glob("profile-*.json")
    good = json.loads(path.read_text())
    slowed = {k: [t * 1000 for t in v] if "(T(4, " in k else v for k, v in good.items()}
    assert slowed != good
    path.write_text(json.dumps(slowed))
    times = profile(traced.module, inputs, repeats=3)
    healed = json.loads(path.read_text())
    for key, value in slowed.items():
        if value != good[key]:
            assert all(new < old / 10 for new, old in zip(healed[key], value)), key
    assert max(t.forward_s for t in times.values()) < max(v[0] for v in slowed.values()) / 10


def test_a_cache_written_on_a_busier_machine_is_timed_again(tmp_path, monkeypatch):
    """Times that agree with each other but were all taken on a busier machine (every entry 20x
    here) heal: a few costly cached ops are timed again, run far faster, and every op is timed
    again, keeping its best. A cache faster than the machine is now is kept as it is (noise only
    adds time) and timed again only at those few ops."""
    import json

    from replica.partition import profile as profile_module

    monkeypatch.setenv("REPLICA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(profile_module, "SPOT_MIN_S", 0.0)  # the MLP's ops are quick
    monkeypatch.setattr(profile_module, "NOISE_FLOOR_S", float("inf"))  # no batch/half-batch retries here
    model, inputs, _, _ = models.mlp(4)
    traced = trace(model, inputs)
    profile(traced.module, inputs, repeats=3)
    (path,) = tmp_path.glob("profile-*.json")
    good = json.loads(path.read_text())
    busy = {k: [t * 20 if t > 0 else t for t in v] for k, v in good.items()}
    path.write_text(json.dumps(busy))
    profile(traced.module, inputs, repeats=3)
    healed = json.loads(path.read_text())
    ratios = sorted(sum(healed[k]) / sum(v) for k, v in busy.items() if sum(v) > 0)
    assert ratios[-1] <= 1 and ratios[len(ratios) // 2] < 0.5, ratios  # every op timed again, not just 4
    quiet = {k: [t / 20 if t > 0 else t for t in v] for k, v in good.items()}
    path.write_text(json.dumps(quiet))
    calls = []
    best = profile_module._best
    monkeypatch.setattr(profile_module, "_best", lambda *a, **k: calls.append(1) or best(*a, **k))
    profile(traced.module, inputs, repeats=3)
    assert json.loads(path.read_text()) == quiet
    assert 0 < len(calls) <= 2 * profile_module.SPOT_CHECKS  # a forward and a backward per op checked


def test_a_cache_slowed_at_some_ops_is_stale():
    """Noise only adds time: one re-timed op now under half its cached time means the cache met
    load there (a busy moment may slow only some ops); a few percent either way is noise."""
    from replica.partition.profile import _stale

    def spot(*ratios):
        return [(str(i), [1e-3, 2e-3], [1e-3 * r, 2e-3 * r]) for i, r in enumerate(ratios)]

    assert _stale(spot(0.5, 0.6, 0.7, 0.75))  # in median under 0.8
    assert _stale(spot(1.0, 1.05, 0.95, 0.4))  # one op cached at 2.5x
    assert not _stale(spot(0.9, 1.1, 0.85, 1.3, 0.95))
    assert not _stale([])


def test_times_that_stay_contradictory_are_settled_once():
    """Times still contradictory after the retries are pulled into the plausible range and
    cached so: the next profile reads them back unchanged instead of timing them again."""
    from replica.partition.profile import SCALING, _implausible, _settle

    big, small = [6e-3, 1e-3], [1e-3, 2e-3]  # the batch slow forward, its half slow backward
    _settle(big, small)
    assert big[0] <= SCALING[1] * small[0] and small[1] <= big[1] / SCALING[0]
    assert not _implausible(OpTimes(*big), OpTimes(*small))
    inplace = [-1.0, -1.0]
    _settle(inplace, [1.0, 1.0])
    assert inplace == [-1.0, -1.0]
