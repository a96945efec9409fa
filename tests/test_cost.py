"""Tests of the cost model (``replica.partition.cost``): device specs, presets, the CPU cache, prices."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

import replica
from replica.partition import cost
from replica.partition.cost import PRESETS, CostModel, DeviceSpec, device_spec
from replica.partition.graph import Node

RATES = dict(flops=1e12, half_flops=4e12, memory_bandwidth=1e11, memory_bytes=1e10, link_bandwidth=1e9,
             link_latency_s=1e-5, op_overhead_s=1e-6)


def spec(**changes) -> DeviceSpec:
    return DeviceSpec(**{"name": "test", **RATES, **changes})


def op(flops: float = 0.0, nbytes: float = 0.0, kind: str = "op") -> Node:
    return Node(name="n", kind=kind, target="linear", module_path="", inputs=(), flops=flops, bytes_accessed=nbytes)


# --------------------------------------------------------------------------- DeviceSpec


def test_spec_is_kw_only():
    with pytest.raises(TypeError):
        DeviceSpec("x", 1.0, 1.0, 1.0, 1.0, 1.0, 0.0)  # type: ignore[misc]


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec().flops = 2.0  # type: ignore[misc]


@pytest.mark.parametrize("field", ["flops", "half_flops", "memory_bandwidth", "memory_bytes", "link_bandwidth",
                                   "link_latency_s", "op_overhead_s", "dispatch_overhead_s", "unit_overhead_s",
                                   "cache_bytes", "cache_bandwidth"])
def test_negative_rate_names_the_field(field):
    with pytest.raises(replica.ConfigError, match=rf"DeviceSpec\.{field} must be a finite number >= 0, got -1"):
        spec(**{field: -1})


@pytest.mark.parametrize("field", ["flops", "half_flops", "memory_bandwidth", "memory_bytes", "link_bandwidth"])
def test_zero_rate_names_the_field(field):
    with pytest.raises(replica.ConfigError, match=rf"DeviceSpec\.{field} must be > 0, got 0"):
        spec(**{field: 0})


@pytest.mark.parametrize("field", ["link_latency_s", "op_overhead_s"])
def test_zero_latency_is_fine(field):
    assert getattr(spec(**{field: 0.0}), field) == 0.0


@pytest.mark.parametrize("value", ["fast", None, float("nan")])
def test_non_number_rate(value):
    with pytest.raises(replica.ConfigError, match=r"DeviceSpec\.flops"):
        spec(flops=value)


def test_spec_error_is_a_value_error():
    with pytest.raises(ValueError):
        spec(flops=-5)


def test_peak_by_dtype():
    s = spec()
    assert s.peak("float32") == s.peak("float64") == 1e12
    assert s.peak("bfloat16") == s.peak("float16") == 4e12


def test_device_spec_exported():
    assert replica.DeviceSpec is DeviceSpec


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", ["a100-80gb", "h100-80gb"])
def test_presets_exist(name):
    s = device_spec(name)
    assert s is PRESETS[name] and s.name == name
    assert s.memory_bytes == 80 * 2**30
    assert s.half_flops > s.flops > 0 and s.link_bandwidth > 0


def test_h100_faster_than_a100():
    a, h = PRESETS["a100-80gb"], PRESETS["h100-80gb"]
    assert h.flops > a.flops and h.memory_bandwidth > a.memory_bandwidth


def test_spec_passes_through():
    s = spec()
    assert device_spec(s) is s


@pytest.mark.parametrize("name", ["tpu-v9", "nonsense", "a100", "cuda:0"])
def test_unknown_device_lists_presets(name):
    with pytest.raises(replica.ConfigError) as info:
        device_spec(name)
    msg = str(info.value)
    assert f"unknown device {name!r}" in msg
    assert "'cpu'" in msg and "'a100-80gb'" in msg and "'a100-40gb'" in msg and "'h100-80gb'" in msg
    assert "replica.DeviceSpec(" in msg
    assert ("preset_for_cuda_device(" in msg) == name.startswith("cuda")


def test_a100_40gb_preset_has_half_the_memory():
    small, large = PRESETS["a100-40gb"], PRESETS["a100-80gb"]
    assert device_spec("a100-40gb") is small and small.name == "a100-40gb"
    assert small.memory_bytes == 40 * 2**30 and small.memory_bandwidth < large.memory_bandwidth
    assert (small.flops, small.half_flops, small.link_bandwidth) == (large.flops, large.half_flops,
                                                                     large.link_bandwidth)


@pytest.mark.parametrize("gpu, preset", [
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100 80GB PCIe", "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
    ("NVIDIA A100", "a100-40gb"),  # size not named: the smaller, whose plans fit either
    ("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA H100 PCIe", "h100-80gb"), ("NVIDIA H100 NVL", "h100-80gb"),
    ("NVIDIA H200", "h100-80gb"), ("NVIDIA GH200 480GB", "h100-80gb"),
])
def test_known_gpus_get_their_preset(gpu, preset):
    assert cost.preset_for_cuda_device(gpu) == preset
    assert device_spec(cost.preset_for_cuda_device(gpu)) is PRESETS[preset]


@pytest.mark.parametrize("gpu", ["NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-32GB", "NVIDIA A10G", "NVIDIA L40S",
                                 "NVIDIA A800-SXM4-80GB", "NVIDIA H800", "NVIDIA B200", "AMD Instinct MI300X", ""])
def test_an_unknown_gpu_is_refused_not_priced_as_an_a100(gpu):
    with pytest.raises(replica.ConfigError) as info:
        cost.preset_for_cuda_device(gpu)
    msg = str(info.value)
    assert f"no cost preset for the GPU {gpu!r}" in msg
    assert "['a100-40gb', 'a100-80gb', 'h100-80gb']" in msg
    assert "device='<preset>'" in msg and "replica.auto_parallel" in msg and "replica.plan" in msg
    assert "replica.DeviceSpec(name=..., flops=..." in msg


# --------------------------------------------------------------------------- measured CPU


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty on-disk and in-process CPU spec cache, and a count of measurements."""
    monkeypatch.setenv("REPLICA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost, "_CPU_SPECS", {})
    calls = []

    def counted():  # what _measure_cpu returns, without the half second of timing
        calls.append(1)
        return spec(name=f"cpu-{torch.get_num_threads()}t")

    monkeypatch.setattr(cost, "_measure_cpu", counted)
    return tmp_path, calls


def cache_file(tmp_path):
    return tmp_path / f"cpu-{torch.get_num_threads()}t.json"


def test_cpu_is_measured_once_for_real(tmp_path, monkeypatch):
    monkeypatch.setenv("REPLICA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost, "_CPU_SPECS", {})
    s = device_spec("cpu")
    assert s.name == f"cpu-{torch.get_num_threads()}t"
    assert s.flops > 1e7 and s.half_flops > 0 and s.memory_bandwidth > 1e7 and 0 < s.op_overhead_s < 1e-2
    assert s.cache_bytes == 0 or s.cache_bandwidth >= s.memory_bandwidth  # a cache is never slower
    assert DeviceSpec(**json.loads(cache_file(tmp_path).read_text())) == s
    monkeypatch.setattr(cost, "_CPU_SPECS", {})
    monkeypatch.setattr(cost, "_measure_cpu", lambda: pytest.fail("measured again despite the cache file"))
    assert device_spec("cpu") == s


def test_cpu_measured_once_and_written(cache):
    tmp_path, calls = cache
    assert not cache_file(tmp_path).exists()
    s = device_spec("cpu")
    assert calls == [1]
    assert DeviceSpec(**json.loads(cache_file(tmp_path).read_text())) == s
    assert device_spec("cpu") is s and calls == [1]


def test_cpu_cache_file_reused_by_a_new_process(cache, monkeypatch):
    tmp_path, calls = cache
    first = device_spec("cpu")
    monkeypatch.setattr(cost, "_CPU_SPECS", {})  # as if a new process started
    assert device_spec("cpu") == first and calls == [1]


def test_cpu_cache_file_is_trusted(cache):
    tmp_path, calls = cache
    written = dataclasses.replace(PRESETS["a100-80gb"], name="cpu-from-file")
    cache_file(tmp_path).write_text(json.dumps(dataclasses.asdict(written)))
    assert device_spec("cpu") == written and calls == []


@pytest.mark.parametrize("text", ["{", '{"name": "x"}', '{"name": "x", "flops": -1, "half_flops": 1, '
                                  '"memory_bandwidth": 1, "memory_bytes": 1, "link_bandwidth": 1, "link_latency_s": 0}'])
def test_bad_cache_file_is_measured_again(cache, text):
    tmp_path, calls = cache
    cache_file(tmp_path).write_text(text)
    s = device_spec("cpu")
    assert calls == [1] and DeviceSpec(**json.loads(cache_file(tmp_path).read_text())) == s


def test_unwritable_cache_still_measures(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("REPLICA_CACHE_DIR", str(tmp_path / "file" / "replica"))
    monkeypatch.setattr(cost, "_CPU_SPECS", {})
    monkeypatch.setattr(cost, "_measure_cpu", lambda: spec())
    assert device_spec("cpu") == spec()


@pytest.mark.parametrize("device", [None, "cpu", "cpu:0", torch.device("cpu")])
def test_cpu_names(cache, device):
    assert device_spec(device).name.startswith("cpu-")


# --------------------------------------------------------------------------- CostModel


def test_forward_time_formula():
    m = CostModel(spec())
    assert m.forward_time(op(flops=2e12, nbytes=3e11)) == pytest.approx(2.0 + 3.0 + 1e-6)


def test_forward_time_pays_overhead_per_call():
    m = CostModel(spec())
    assert m.forward_time(op(), num_calls=8) == pytest.approx(8e-6)
    assert m.forward_time(op(flops=1e12), num_calls=4) == pytest.approx(1.0 + 4e-6)


@pytest.mark.parametrize("kind", ["input", "output"])
def test_inputs_and_outputs_are_free(kind):
    assert CostModel(spec()).forward_time(op(flops=1e12, nbytes=1e11, kind=kind)) == 0.0


def test_backward_is_twice_forward():
    m = CostModel(spec())
    n = op(flops=3e12, nbytes=5e10)
    assert m.backward_time(n, 4) == pytest.approx(2 * m.forward_time(n, 4))


def test_backward_factor():
    m = CostModel(spec(), backward_factor=3.0)
    assert m.backward_time(op(flops=1e12)) == pytest.approx(3 * m.forward_time(op(flops=1e12)))


def test_transfer_time_formula():
    m = CostModel(spec())
    assert m.transfer_time(2e9) == pytest.approx(2.0 + 1e-5)
    assert m.transfer_time(2e9, num_messages=3) == pytest.approx(2.0 + 3e-5)
    assert m.transfer_time(0, num_messages=0) == 0.0


@pytest.mark.parametrize("dtype, rate", [("float32", 1e12), ("float64", 1e12), ("bfloat16", 4e12),
                                         ("float16", 4e12)])
def test_half_precision_uses_half_flops(dtype, rate):
    assert CostModel(spec(op_overhead_s=0.0), dtype=dtype).forward_time(op(flops=8e12)) == pytest.approx(8e12 / rate)


def test_plan_of_a_bf16_model_uses_half_flops():
    fast_memory = DeviceSpec(name="t", flops=1e9, half_flops=1e10, memory_bandwidth=1e30, memory_bytes=1e12,
                             link_bandwidth=1e12, link_latency_s=0.0, op_overhead_s=0.0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    fp32 = replica.plan(model, x, device=fast_memory).stages[0].forward_time_s
    bf16 = replica.plan(model.to(torch.bfloat16), x.to(torch.bfloat16), device=fast_memory).stages[0].forward_time_s
    assert fp32 == pytest.approx(2 * 4 * (16 * 32 + 32 * 8) / 1e9)
    assert bf16 == pytest.approx(fp32 / 10)


def test_plan_records_the_device_name():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert replica.plan(model, torch.randn(2, 4), num_stages=2, device="h100-80gb").device == "h100-80gb"


@pytest.mark.parametrize("bad", [True, float("inf"), float("nan")])
def test_booleans_and_infinities_are_not_rates(bad):
    with pytest.raises(replica.ConfigError, match="DeviceSpec.flops must be a finite number"):
        spec(flops=bad)


# --------------------------------------------------------------------------- the cache


def cached(**changes) -> DeviceSpec:
    """Memory at 1e11 B/s, a 1 MB cache at 4e11 B/s."""
    return spec(cache_bytes=1e6, cache_bandwidth=4e11, **changes)


def test_a_call_that_fits_the_cache_moves_at_its_rate():
    s = cached()
    assert s.bandwidth(1e6) == 4e11 and s.bandwidth(1e6 + 1) == 1e11
    assert spec().bandwidth(1.0) == 1e11  # no cache modelled: always the memory's rate


def test_micro_batches_that_fit_the_cache_are_priced_at_its_rate():
    big = op(nbytes=2e6)
    m = CostModel(cached())
    assert m.forward_time(big, 1) == pytest.approx(2e6 / 1e11 + 1e-6)  # 2 MB a call: from memory
    assert m.forward_time(big, 2) == pytest.approx(2e6 / 4e11 + 2e-6)  # 1 MB a call: from the cache
    assert m.backward_time(big, 2) == pytest.approx(2 * (2e6 / 4e11 + 2e-6))
    # without a cache the split only adds launches
    assert CostModel(spec()).forward_time(big, 2) == pytest.approx(2e6 / 1e11 + 2e-6)


def test_a_replica_share_is_priced_at_its_own_size():
    m = CostModel(cached(), batch_fraction=0.5)
    assert m.forward_time(op(nbytes=2e6), 1) == pytest.approx(1e6 / 4e11 + 1e-6)


def test_a_measured_op_scaled_out_of_the_cache_pays_the_memory_rate():
    from replica.partition.profile import OpTimes

    node = op(nbytes=2e6)  # 0.5 MB on the timed quarter batch: timed in the cache
    times = {"n": OpTimes(forward_s=1e-3, backward_s=2e-3, forward_fixed_s=1e-4, backward_fixed_s=2e-4)}
    m = CostModel(cached(), measured=times, measured_fraction=0.25)
    plain = CostModel(spec(), measured=times, measured_fraction=0.25)
    shift = 2e6 / 1e11 - 2e6 / 4e11  # the whole batch in one call: its bytes from memory
    assert m.forward_time(node, 1) == pytest.approx(plain.forward_time(node, 1) + shift)
    assert m.backward_time(node, 1) == pytest.approx(plain.backward_time(node, 1) + 2 * shift)
    assert m.forward_time(node, 4) == pytest.approx(plain.forward_time(node, 4))  # the timed size again


def test_call_overhead_is_what_one_more_call_costs():
    from replica.partition.profile import OpTimes

    node = op(flops=1e9, nbytes=1e3)
    for m in (CostModel(spec()), CostModel(spec(), measured={"n": OpTimes(1e-3, 2e-3, 1e-4, 3e-4)})):
        assert m.call_overhead(node) == pytest.approx(m.forward_time(node, 2) - m.forward_time(node, 1))
        one_more = m.backward_time(node, 2) - m.backward_time(node, 1)
        assert m.call_overhead(node, backward=True) == pytest.approx(one_more)
    assert CostModel(spec()).call_overhead(op(kind="input")) == 0.0


def test_an_op_on_dtensors_pays_the_dispatch_per_call_each_way():
    from replica.partition.cost import TensorParallelCosts
    from replica.partition.profile import OpTimes

    dispatch = spec(dispatch_overhead_s=3e-5)
    cut = TensorParallelCosts(size=2, sharded=frozenset({"n"}))
    node, other = op(flops=1e9, nbytes=1e3), dataclasses.replace(op(flops=1e9, nbytes=1e3), name="m")
    for measured in ({}, {"n": OpTimes(1e-3, 2e-3, 1e-4, 3e-4), "m": OpTimes(1e-3, 2e-3, 1e-4, 3e-4)}):
        with_, without = (CostModel(dispatch, tensor_parallel=cut, measured=measured),
                          CostModel(spec(), tensor_parallel=cut, measured=measured))
        for calls in (1, 4):
            assert with_.forward_time(node, calls) == pytest.approx(without.forward_time(node, calls) + calls * 3e-5)
            assert with_.backward_time(node, calls) == pytest.approx(without.backward_time(node, calls) + calls * 3e-5)
            assert with_.forward_time(other, calls) == pytest.approx(without.forward_time(other, calls))  # plain
        assert with_.call_overhead(node) == pytest.approx(with_.forward_time(node, 2) - with_.forward_time(node, 1))
    assert CostModel(dispatch).forward_time(node) == pytest.approx(CostModel(spec()).forward_time(node))  # no TP


def test_the_cpu_prices_dtensor_and_fsdp_in_its_own_launches(tmp_path, monkeypatch):
    monkeypatch.setenv("REPLICA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost, "_CPU_SPECS", {})
    s = device_spec("cpu")
    assert s.dispatch_overhead_s == pytest.approx(cost.DTENSOR_DISPATCH_OPS * s.op_overhead_s)
    assert s.unit_overhead_s == pytest.approx(cost.FSDP_UNIT_OPS * s.op_overhead_s)
    monkeypatch.setattr(cost, "_CPU_SPECS", {})
    assert all(p.dispatch_overhead_s == p.unit_overhead_s == 0 for p in PRESETS.values())  # GPUs: hidden


def fake_caches(root, levels):
    for i, (level, kind, size, shared) in enumerate(levels):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
            (d / name).write_text(f"{value}\n")
    return root


def test_last_level_cache_share(tmp_path):
    root = fake_caches(tmp_path, [(1, "Data", "32K", "0"), (1, "Instruction", "32K", "0"),
                                  (2, "Unified", "1024K", "0"), (3, "Unified", "32M", "0-3")])
    assert cost._last_level_cache(1, root) == (32 * 2**20, 8 * 2**20)  # a quarter when all 4 CPUs work
    assert cost._last_level_cache(2, root) == (32 * 2**20, 16 * 2**20)
    assert cost._last_level_cache(16, root) == (32 * 2**20, 32 * 2**20)


@pytest.mark.parametrize("levels", [[], [(3, "Unified", "lots", "0")], [(2, "Unified", "1M", "zero")]])
def test_an_unreadable_cache_is_not_modelled(tmp_path, levels):
    assert cost._last_level_cache(1, fake_caches(tmp_path / "cache", levels)) == (0.0, 0.0)
    assert cost._last_level_cache(1, tmp_path / "missing") == (0.0, 0.0)


def test_cpu_lists_are_counted():
    assert cost._count_cpus("0-3,8-11\n") == 8 and cost._count_cpus("5") == 1


def test_a_cache_file_from_before_the_cache_fields_is_measured_again(cache):
    tmp_path, calls = cache
    old = dataclasses.asdict(spec(name="old"))
    del old["cache_bytes"], old["cache_bandwidth"]
    cache_file(tmp_path).write_text(json.dumps(old))
    s = device_spec("cpu")
    assert calls == [1] and s.name != "old"
    assert json.loads(cache_file(tmp_path).read_text()).keys() >= {"cache_bytes", "cache_bandwidth"}
