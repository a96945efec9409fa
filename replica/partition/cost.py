"""The cost model: seconds for each op, forward and backward, and for each transfer."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Mapping

import torch

from replica.errors import ConfigError
from replica.partition.graph import Node
from replica.partition.profile import OpTimes

__all__ = ["DeviceSpec", "CostModel", "device_spec", "PRESETS"]


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """What one pipeline device can do. Rates are achievable, not datasheet peaks.

    ``flops`` is for fp32 (TF32 where a GPU uses it by default), ``half_flops`` for
    bf16/fp16; ``op_overhead_s`` is the fixed cost of launching one op (Python and
    dispatch on a CPU, a kernel launch on a GPU); ``link_*`` is the point-to-point
    path to the neighbouring pipeline device inside a node of ``devices_per_node``;
    ``network_bandwidth`` the per-device bandwidth between nodes (0: same as the link).
    ``datasheet_flops`` is the vendor's dense half-precision peak, the denominator of
    model-FLOPs utilisation (0: ``half_flops``).
    """

    name: str
    flops: float
    half_flops: float
    memory_bandwidth: float
    memory_bytes: float
    link_bandwidth: float
    link_latency_s: float
    op_overhead_s: float = 0.0
    devices_per_node: int = 1
    network_bandwidth: float = 0.0
    datasheet_flops: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and not (
                isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")
            ):
                raise ConfigError(f"DeviceSpec.{f.name} must be a finite number >= 0, got {value!r}")
        for name in ("flops", "half_flops", "memory_bandwidth", "memory_bytes", "link_bandwidth"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"DeviceSpec.{name} must be > 0, got {getattr(self, name)!r}")

    def peak(self, dtype: str) -> float:
        return self.half_flops if dtype in ("float16", "bfloat16") else self.flops

    @property
    def between_nodes_bandwidth(self) -> float:
        return self.network_bandwidth or self.link_bandwidth


GB = 1e9
PRESETS: dict[str, DeviceSpec] = {
    # ~60% of the datasheet dense peaks (A100: 156 TF32 / 312 bf16 TFLOP/s, 2.0 TB/s HBM,
    # 300 GB/s NVLink per direction, 200 Gb/s InfiniBand per GPU; H100 SXM: 495 / 989,
    # 3.35 TB/s, 450 GB/s, 400 Gb/s).
    "a100-80gb": DeviceSpec(name="a100-80gb", flops=95e12, half_flops=190e12, memory_bandwidth=1.6e12,
                            memory_bytes=80 * 2**30, link_bandwidth=240 * GB, link_latency_s=10e-6,
                            op_overhead_s=6e-6, devices_per_node=8, network_bandwidth=25 * GB,
                            datasheet_flops=312e12),
    "h100-80gb": DeviceSpec(name="h100-80gb", flops=300e12, half_flops=600e12, memory_bandwidth=2.7e12,
                            memory_bytes=80 * 2**30, link_bandwidth=360 * GB, link_latency_s=8e-6,
                            op_overhead_s=5e-6, devices_per_node=8, network_bandwidth=50 * GB,
                            datasheet_flops=989e12),
}


def _cache_dir() -> Path:
    return Path(os.environ.get("REPLICA_CACHE_DIR", Path.home() / ".cache" / "replica"))


def _best_time(fn: "object", repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def _measure_cpu() -> DeviceSpec:
    """Time a matmul, a large copy and a tiny op with this process's thread count."""
    threads = torch.get_num_threads()
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    flops = 2 * 384**3 / _best_time(lambda: torch.mm(a, b), 20)
    src, dst = torch.empty(8 * 2**20), torch.empty(8 * 2**20)  # 32 MiB each
    bandwidth = 2 * src.nbytes / _best_time(lambda: dst.copy_(src), 10)
    tiny = torch.ones(4)
    overhead = _best_time(lambda: [tiny.add(1) for _ in range(200)], 5) / 200
    return DeviceSpec(name=f"cpu-{threads}t", flops=flops, half_flops=flops / 4, memory_bandwidth=bandwidth,
                      memory_bytes=_total_memory(), link_bandwidth=2 * GB, link_latency_s=60e-6,
                      op_overhead_s=overhead)


def _total_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 * 2**30


def _cpu_spec() -> DeviceSpec:
    """The measured CPU spec, cached per thread count in ``~/.cache/replica`` so that every
    process on the machine (every rank) prices ops identically."""
    threads = torch.get_num_threads()
    if threads in _CPU_SPECS:
        return _CPU_SPECS[threads]
    path = _cache_dir() / f"cpu-{threads}t.json"
    spec = None
    try:
        spec = DeviceSpec(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, ConfigError):
        spec = _measure_cpu()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
                json.dump(asdict(spec), f)
            os.replace(f.name, path)
        except OSError:
            pass  # a read-only home still gets a measured spec, just not a cached one
    _CPU_SPECS[threads] = spec
    return spec


_CPU_SPECS: dict[int, DeviceSpec] = {}


def device_spec(device: "str | DeviceSpec | torch.device | None") -> DeviceSpec:
    """A preset by name (``"cpu"``, ``"a100-80gb"``, ``"h100-80gb"``), or a spec as given."""
    if isinstance(device, DeviceSpec):
        return device
    name = "cpu" if device is None else str(device)
    if name == "cpu" or name.startswith("cpu"):
        return _cpu_spec()
    if name in PRESETS:
        return PRESETS[name]
    raise ConfigError(
        f"unknown device {name!r}. Use one of {['cpu', *PRESETS]} or pass "
        "replica.DeviceSpec(name=..., flops=..., half_flops=..., memory_bandwidth=..., "
        "memory_bytes=..., link_bandwidth=..., link_latency_s=...)."
    )


@dataclass(frozen=True)
class CostModel:
    """Prices for ops and transfers.

    Analytic: time = FLOPs / FLOP/s + bytes / bandwidth + launch overhead per call, and
    backward = ``backward_factor`` × forward (2: one matmul for the input, one for the
    weight). Ops found in ``measured`` (per micro-batch call, from :func:`profile`) use
    their measured times instead (timed on ``measured_fraction`` of the traced batch).
    ``batch_fraction`` prices a share of the traced batch (one data-parallel replica's,
    when the graph was traced at the global batch).
    """

    device: DeviceSpec
    dtype: str = "float32"
    backward_factor: float = 2.0
    measured: Mapping[str, OpTimes] = field(default_factory=dict)
    batch_fraction: float = 1.0
    measured_fraction: float = 1.0

    def scaled(self, nbytes: float) -> float:
        """Bytes of a tensor traced at the full batch, for the share of it this model prices."""
        return nbytes * self.batch_fraction

    def _analytic(self, node: Node, num_calls: int) -> float:
        d = self.device
        work = node.flops / d.peak(self.dtype) + node.bytes_accessed / d.memory_bandwidth
        return work * self.batch_fraction + num_calls * d.op_overhead_s

    def forward_time(self, node: Node, num_calls: int = 1) -> float:
        """Seconds to run ``node`` over the traced batch (times ``batch_fraction``), split
        into ``num_calls`` micro-batches."""
        if node.kind != "op":
            return 0.0
        if node.name in self.measured:
            t = self.measured[node.name]
            return self._from_measured(t.forward_s, t.forward_fixed_s, num_calls)
        return self._analytic(node, num_calls)

    def _from_measured(self, seconds: float, fixed: float | None, num_calls: int) -> float:
        """A call timed on ``measured_fraction`` of the traced batch: a fixed cost per call
        (measured, else the device's launch overhead) plus work in proportion to the samples."""
        fixed = min(seconds, self.device.op_overhead_s if fixed is None else fixed)
        return num_calls * fixed + (seconds - fixed) / self.measured_fraction * self.batch_fraction

    def backward_time(self, node: Node, num_calls: int = 1) -> float:
        if node.kind != "op":
            return 0.0
        if node.name in self.measured:
            t = self.measured[node.name]
            return self._from_measured(t.backward_s, t.backward_fixed_s, num_calls)
        return self.backward_factor * self._analytic(node, num_calls)

    def transfer_time(self, nbytes: float, num_messages: int = 1) -> float:
        """Seconds to move ``nbytes`` to the next device in ``num_messages`` messages."""
        return nbytes / self.device.link_bandwidth + num_messages * self.device.link_latency_s
