"""The cost model: seconds for each op, forward and backward, and for each transfer."""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from replica.errors import ConfigError
from replica.partition.graph import Node
from replica.partition.profile import OpTimes, cache_dir

__all__ = ["DeviceSpec", "CostModel", "TensorParallelCosts", "device_spec", "torch_device_of", "preset_for_cuda_device",
           "ring_collective_time", "PRESETS", "fused_ops", "POINTWISE",
           "float8_linears"]


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """What one pipeline device can do. Rates are achievable, not datasheet peaks.

    ``flops`` is for fp32 where matmuls may use TF32 (``torch.set_float32_matmul_precision
    ("high")``), ``fp32_flops`` for fp32 kept whole (torch's default, precision "highest"; 0:
    ``flops``, as on a CPU, which has no TF32), ``half_flops`` for bf16/fp16;
    ``op_overhead_s`` is the fixed cost of launching one op (Python and
    dispatch on a CPU, a kernel launch on a GPU); ``link_*`` is the point-to-point
    path to the neighbouring pipeline device inside a node of ``devices_per_node``, and
    each device's bus bandwidth in a collective among devices of one node (NVLink);
    ``network_bandwidth`` the per-device bandwidth between nodes (0: same as the link),
    which a collective spanning nodes runs at (:meth:`collective_bandwidth`).
    ``dispatch_overhead_s`` is what DTensor's dispatch adds to each op computing on DTensors (a
    tensor-parallel block's, sequence parallelism's token-wise ops), per call, forward and again
    in backward; ``unit_overhead_s`` what FSDP2 adds per unit to each forward and backward of a
    sharded stage (its hooks and state changes, the copies around its collectives): host time,
    measured on gloo CPU ranks by ``benchmarks/fixed_costs_cpu.py``; 0 on the GPU presets, whose
    host runs ahead of the kernels it launches (not measured there).
    ``datasheet_flops`` is the vendor's dense half-precision peak, the denominator of
    model-FLOPs utilisation (0: ``half_flops``). ``cache_bytes`` is the last-level cache one
    device's work can count on (a CPU process: its share of the cache when every core sharing
    it is busy) and ``cache_bandwidth`` the rate of an op whose tensors fit in it (0: no cache
    modelled; every byte moves at ``memory_bandwidth``).
    """

    name: str
    flops: float
    half_flops: float
    fp32_flops: float = 0.0
    memory_bandwidth: float
    memory_bytes: float
    link_bandwidth: float
    link_latency_s: float
    op_overhead_s: float = 0.0
    dispatch_overhead_s: float = 0.0
    unit_overhead_s: float = 0.0
    devices_per_node: int = 1
    network_bandwidth: float = 0.0
    datasheet_flops: float = 0.0
    cache_bytes: float = 0.0
    cache_bandwidth: float = 0.0

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
        """The rate of an op computing in ``dtype``: fp32 at the TF32 rate only where this process
        lets torch's matmuls use TF32 (``torch.get_float32_matmul_precision()``: "high" or "medium")."""
        if dtype in ("float16", "bfloat16"):
            return self.half_flops
        if self.fp32_flops > 0 and torch.get_float32_matmul_precision() == "highest":
            return self.fp32_flops
        return self.flops

    def bandwidth(self, nbytes: float) -> float:
        """Bytes per second of an op that reads and writes ``nbytes`` in one call: the cache's
        rate when they fit in it (and a cache is modelled), else the memory's."""
        if self.cache_bandwidth > 0 and nbytes <= self.cache_bytes:
            return self.cache_bandwidth
        return self.memory_bandwidth

    @property
    def between_nodes_bandwidth(self) -> float:
        return self.network_bandwidth or self.link_bandwidth

    def collective_bandwidth(self, span: int) -> float:
        """Each device's bus bandwidth in a ring collective among groups laid over ``span``
        consecutive ranks: the node's links (NVLink) while those fit in one node, else its
        share of the network (a ring that leaves the node runs at its slowest hop)."""
        return self.link_bandwidth if span <= self.devices_per_node else self.between_nodes_bandwidth


GB = 1e9
PRESETS: dict[str, DeviceSpec] = {
    # ~60% of the datasheet dense peaks (A100: 156 TF32 / 312 bf16 TFLOP/s, 2.0 TB/s HBM,
    # 300 GB/s NVLink per direction, 200 Gb/s InfiniBand per GPU; H100 SXM: 495 / 989,
    # 3.35 TB/s, 450 GB/s, 400 Gb/s). fp32 without TF32 (torch's default): ~70% of 19.5 / 67
    # TFLOP/s; benchmarks/gpu_check.py measured a GPT's eager fp32 step at 47 TFLOP/s on an H200.
    # The A100's matmul rates are 80% of its peaks (250 bf16, 125 TF32): fitted on LLM Foundry's
    # published FSDP runs, held out on Megatron-LM's (benchmarks/RESULTS.md, "A100 matmul rate").
    "a100-80gb": DeviceSpec(name="a100-80gb", flops=125e12, half_flops=250e12, fp32_flops=14e12,
                            memory_bandwidth=1.6e12,
                            memory_bytes=80 * 2**30, link_bandwidth=240 * GB, link_latency_s=10e-6,
                            op_overhead_s=6e-6, devices_per_node=8, network_bandwidth=25 * GB,
                            datasheet_flops=312e12),
    # the A100 40GB: the same compute and links, 1.56 TB/s of HBM and half the memory
    "a100-40gb": DeviceSpec(name="a100-40gb", flops=125e12, half_flops=250e12, fp32_flops=14e12,
                            memory_bandwidth=1.25e12, memory_bytes=40 * 2**30, link_bandwidth=240 * GB,
                            link_latency_s=10e-6,
                            op_overhead_s=6e-6, devices_per_node=8, network_bandwidth=25 * GB,
                            datasheet_flops=312e12),
    "h100-80gb": DeviceSpec(name="h100-80gb", flops=300e12, half_flops=600e12, fp32_flops=45e12,
                            memory_bandwidth=2.7e12, memory_bytes=80 * 2**30, link_bandwidth=360 * GB,
                            link_latency_s=8e-6,
                            op_overhead_s=5e-6, devices_per_node=8, network_bandwidth=50 * GB,
                            datasheet_flops=989e12),
}

def ring_collective_time(spec: DeviceSpec, nbytes: float, group: int, span: int, *, passes: int = 1,
                         calls: int = 1) -> float:
    """Seconds of ring collectives over ``group`` ranks (laid over ``span`` consecutive ranks) on
    a tensor of ``nbytes`` whole (as gathered, or before it is reduced): in each pass every rank
    sends and receives ``(group - 1) / group`` of it, and each of the ``calls`` collectives
    pays ``group - 1`` link latencies. An all-gather or a reduce-scatter is one pass, an
    all-reduce two (NCCL's ring: a reduce-scatter then an all-gather)."""
    if group <= 1:
        return 0.0
    hop = (group - 1) / group * nbytes / spec.collective_bandwidth(span)
    return passes * (hop + calls * (group - 1) * spec.link_latency_s)


# torch.cuda.get_device_name() -> preset: "NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3", ...
# An H200 (141 GB, 4.8 TB/s) or GH200 is priced as an H100: its plans fit, a little pessimistic.
_CUDA_NAMES = ((r"\ba100\b.*\b40gb\b", "a100-40gb"), (r"\ba100\b.*\b80gb\b", "a100-80gb"),
               (r"\ba100\b", "a100-40gb"),  # size not named: the smaller, whose plans fit either
               (r"\bh100\b", "h100-80gb"), (r"\bg?h200\b", "h100-80gb"))


def preset_for_cuda_device(name: str) -> str:
    """The preset that prices the GPU ``torch.cuda.get_device_name()`` calls ``name``.
    An A100 or H100/H200 only: any other GPU raises ``ConfigError`` rather than being
    planned with another GPU's rates and memory."""
    for pattern, preset in _CUDA_NAMES:
        if re.search(pattern, str(name).lower()):
            return preset
    raise ConfigError(
        f"no cost preset for the GPU {name!r}: Replica knows the A100 and the H100/H200 (presets "
        f"{sorted(PRESETS)}). Pass device='<preset>' to replica.auto_parallel / replica.plan when the GPU is "
        "close to one of them, or device=replica.DeviceSpec(name=..., flops=..., half_flops=..., "
        "memory_bandwidth=..., memory_bytes=..., link_bandwidth=..., link_latency_s=...) with its own rates."
    )


def _best_time(fn: "object", repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


# DTensor's and FSDP2's fixed costs in plain ops' launches (``op_overhead_s``), measured on 2 gloo
# ranks of one thread by benchmarks/fixed_costs_cpu.py (benchmarks/RESULTS.md, the median of three
# runs on a loaded machine): a DTensor op's forward took ~17 plain ops' time (12-51), and FSDP2 added
# ~160 per unit to each forward and backward (51-210; zero2 against the same units replicated); in
# launches, so that a faster CPU prices them lower
DTENSOR_DISPATCH_OPS = 17
FSDP_UNIT_OPS = 160


def _measure_cpu() -> DeviceSpec:
    """Time a matmul, a large copy, a copy that fits this process's share of the last-level
    cache, and a tiny op, with this process's thread count."""
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)  # its own generator: measuring leaves the user's RNG alone
    a, b = torch.randn(384, 384, generator=g), torch.randn(384, 384, generator=g)
    flops = 2 * 384**3 / _best_time(lambda: torch.mm(a, b), 20)
    size, cache = _last_level_cache(threads)
    big = max(32 * 2**20, 2 * size)  # each buffer twice the cache: the copy streams from memory
    src, dst = torch.empty(int(big) // 4), torch.empty(int(big) // 4)
    bandwidth = 2 * src.nbytes / _best_time(lambda: dst.copy_(src), 10)
    del src, dst
    cache_bandwidth = 0.0
    if cache >= 2**20:  # source and destination together half the share, as an op's inputs and outputs
        src, dst = torch.empty(int(cache) // 16), torch.empty(int(cache) // 16)
        cache_bandwidth = max(bandwidth, 2 * src.nbytes / _best_time(lambda: dst.copy_(src), 20))
    tiny = torch.ones(4)
    overhead = _best_time(lambda: [tiny.add(1) for _ in range(200)], 5) / 200
    return DeviceSpec(name=f"cpu-{threads}t", flops=flops, half_flops=flops / 4, memory_bandwidth=bandwidth,
                      memory_bytes=_total_memory(), link_bandwidth=2 * GB, link_latency_s=60e-6,
                      op_overhead_s=overhead, dispatch_overhead_s=DTENSOR_DISPATCH_OPS * overhead,
                      unit_overhead_s=FSDP_UNIT_OPS * overhead, cache_bytes=cache if cache_bandwidth else 0.0,
                      cache_bandwidth=cache_bandwidth)


def _last_level_cache(threads: int, root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> tuple[float, float]:
    """The last-level cache's bytes, and its share for ``threads`` threads when every CPU
    sharing it is busy (pipeline ranks on one machine are): its size times ``threads`` over
    the CPUs that share it. ``(0, 0)`` where the system does not say (non-Linux)."""
    try:
        levels = []
        for index in root.glob("index*"):
            if (index / "type").read_text().strip() == "Instruction":
                continue
            size = (index / "size").read_text().strip()
            nbytes = int(size[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}[size[-1]] if size[-1] in "KMG" \
                else int(size)
            sharing = _count_cpus((index / "shared_cpu_list").read_text())
            levels.append((int((index / "level").read_text()), nbytes, sharing))
    except (OSError, ValueError, KeyError):
        return 0.0, 0.0
    if not levels:
        return 0.0, 0.0
    _, nbytes, sharing = max(levels)
    return float(nbytes), float(nbytes * min(threads, sharing) // max(1, sharing))


def _count_cpus(cpu_list: str) -> int:
    """How many CPUs a list such as ``0-3,8-11`` names."""
    count = 0
    for part in cpu_list.strip().split(","):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


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
    path = cache_dir() / f"cpu-{threads}t.json"
    spec = None
    try:
        saved = json.loads(path.read_text())
        if set(saved) != {f.name for f in fields(DeviceSpec)}:  # written by another version: measure again
            raise ValueError("stale device spec")
        spec = DeviceSpec(**saved)
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


def torch_device_of(device: Any) -> torch.device | None:
    """``device`` as a torch device where it names one (``"cpu"``, ``"cuda:1"``, a
    ``torch.device``), None where it names a cost preset or a ``DeviceSpec`` (or is None)."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str) and device.split(":")[0] in ("cpu", "cuda", "mps", "xpu"):
        try:
            return torch.device(device)
        except RuntimeError:
            return None
    return None


def device_spec(device: "str | DeviceSpec | torch.device | None") -> DeviceSpec:
    """A preset by name (``"cpu"``, ``"a100-80gb"``, ``"a100-40gb"``, ``"h100-80gb"``), a torch device
    (``"cuda:1"``: its GPU's preset), or a spec as given."""
    if isinstance(device, DeviceSpec):
        return device
    name = "cpu" if device is None else str(device)
    if name == "cpu" or name.startswith("cpu"):
        return _cpu_spec()
    if name in PRESETS:
        return PRESETS[name]
    if name.startswith("cuda") and torch.cuda.is_available():  # a torch device: priced as its GPU's preset
        return PRESETS[preset_for_cuda_device(torch.cuda.get_device_name(torch.device(name)))]
    gpu = (" (for a CUDA device, its preset is preset_for_cuda_device(torch.cuda.get_device_name(device)))"
           if name.startswith("cuda") else "")
    raise ConfigError(
        f"unknown device {name!r}. Use one of {['cpu', *PRESETS]}{gpu} or pass "
        "replica.DeviceSpec(name=..., flops=..., half_flops=..., memory_bandwidth=..., "
        "memory_bytes=..., link_bandwidth=..., link_latency_s=...)."
    )


@dataclass(frozen=True)
class TensorParallelCosts:
    """What cutting structures across ``size`` tensor-parallel ranks does to the ops' prices
    (:mod:`replica.planner.tensor_parallel` makes one from the plan's blocks).

    ``sharded``: the ops that compute on shards: their FLOPs and bytes moved (or, measured,
    the part of their time that grows with the batch) are divided by ``size``; their launch
    overhead is not, and each of their calls pays DTensor's dispatch
    (``DeviceSpec.dispatch_overhead_s``). ``forward`` / ``backward``: per op, the ring collectives over the
    tensor-parallel group that follow it in its forward / its backward, each ``(bytes of the
    whole tensor at the traced batch, passes)``: an exit's output all-reduced (2 passes) or
    all-gathered (1), an entry's gradient all-reduced (2). Each runs once per micro-batch call
    on the critical path (not overlapped with compute), over ``size`` ranks that are neighbours
    (a node's links while ``size <= devices_per_node``)."""

    size: int
    sharded: frozenset[str] = frozenset()
    forward: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    backward: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)


# elementwise ops (by a graph node's target): what a compiler fuses into the kernel before them
POINTWISE = frozenset({
    "add", "sub", "mul", "truediv", "div", "neg", "pow", "exp", "log", "sqrt", "rsqrt", "abs", "clamp", "where",
    "gelu", "relu", "silu", "tanh", "sigmoid", "dropout", "masked_fill", "iadd", "imul", "isub", "itruediv",
    "float", "to", "type_as", "contiguous",
})
# ops whose output a compiler can feed straight into a following elementwise op's kernel
_FUSES_INTO = POINTWISE | {"layernorm", "layer_norm", "rmsnorm", "rms_norm", "softmax", "groupnorm", "group_norm"}


def fused_ops(graph: Iterable[Node]) -> frozenset[str]:
    """The ops a compiled stage runs for free (the price set of ``compile=True``): every
    elementwise op (:data:`POINTWISE`) that reads the output of another elementwise op, or of a
    norm or softmax. A chain of them is then one memory pass and one launch, priced as its first
    op; matmuls, norms and the chain's first op keep their eager prices. Inductor fuses more
    (a norm's backward, reductions into their consumers); this is the part that holds on every
    device it targets."""
    kinds = {n.name: _op_name(n.target) for n in graph}
    return frozenset(n.name for n in graph if n.kind == "op" and kinds[n.name] in POINTWISE
                     and any(kinds.get(i) in _FUSES_INTO for i in n.inputs))


def _op_name(target: str) -> str:
    """An op's name whatever the tracer: ``mul`` for fx's ``mul`` and torch.export's ``mul.Tensor``."""
    return target.split(".", 1)[0]


def float8_linears(graph: Iterable[Node]) -> frozenset[str]:
    """The ops ``float8=True`` runs in float8: linears with a weight (torchao swaps ``nn.Linear``)."""
    return frozenset(n.name for n in graph if n.kind == "op" and _op_name(n.target) == "linear" and n.parameters)


@dataclass(frozen=True)
class CostModel:
    """Prices for ops and transfers.

    Analytic: time = FLOPs / FLOP/s + bytes / bandwidth + launch overhead per call (the
    bandwidth of the cache when one call's bytes fit in it, see ``DeviceSpec``; the FLOP/s of
    the op's ``compute_dtype`` under autocast, else of the model's ``dtype``), and
    backward = ``backward_factor`` × forward (2: one matmul for the input, one for the
    weight). Ops found in ``measured`` (per micro-batch call, from :func:`profile`) use
    their measured times instead (timed on ``measured_fraction`` of the traced batch).
    ``batch_fraction`` prices a share of the traced batch (one data-parallel replica's,
    when the graph was traced at the global batch). ``tensor_parallel`` (None: no tensor
    parallelism) divides the work of the ops computing on shards and adds the collectives of
    the tensor-parallel group to the ops they follow (:class:`TensorParallelCosts`). ``fused``
    (a compiled plan's :func:`fused_ops`) are free but for their collectives; ``compiled``: no
    DTensor dispatch is paid (the compiled graph calls the ops it dispatched to); ``float8``
    (:func:`float8_linears`) compute at ``float8_speedup`` times the half-precision rate.
    """

    device: DeviceSpec
    dtype: str = "float32"
    backward_factor: float = 2.0
    measured: Mapping[str, OpTimes] = field(default_factory=dict)
    batch_fraction: float = 1.0
    measured_fraction: float = 1.0
    tensor_parallel: TensorParallelCosts | None = None
    fused: frozenset[str] = frozenset()  # ops a compiled stage runs inside another's kernel: free (fused_ops)
    compiled: bool = False  # compiled stages: DTensor's dispatch ran once, when traced (no dispatch_overhead_s)
    float8: frozenset[str] = frozenset()  # linears computing in float8 (float8_linears), at float8_speedup x
    float8_speedup: float = 1.0
    # (id(node), num_calls, backward) -> (node, seconds): an op priced once per call count (the
    # planner's search prices the same ops for every cut; the node is held so its id stays its own)
    _times: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _share(self, node: Node) -> float:
        """The share of ``node``'s work one rank does: ``1 / size`` for an op computing on shards."""
        tp = self.tensor_parallel
        return 1.0 / tp.size if tp is not None and node.name in tp.sharded else 1.0

    def _dispatch(self, node: Node) -> float:
        """What DTensor's dispatch adds to one call of ``node`` (forward, or backward): an op
        computing on DTensors (``TensorParallelCosts.sharded``) pays ``dispatch_overhead_s``, eagerly:
        a compiled stage's graph holds the plain ops DTensor dispatched to, once, when traced."""
        tp = self.tensor_parallel
        return self.device.dispatch_overhead_s if tp is not None and node.name in tp.sharded and not self.compiled \
            else 0.0

    def collective_time(self, node: Node, num_calls: int = 1, backward: bool = False) -> float:
        """Seconds of the tensor-parallel collectives that follow ``node``'s forward (or its
        backward) over the traced batch (times ``batch_fraction``) in ``num_calls`` micro-batches."""
        tp = self.tensor_parallel
        if tp is None or node.kind != "op":
            return 0.0
        found = (tp.backward if backward else tp.forward).get(node.name, ())
        return sum(ring_collective_time(self.device, nbytes * self.batch_fraction, tp.size, tp.size,
                                        passes=passes, calls=num_calls) for nbytes, passes in found)

    def collective_bytes(self, node: Node, backward: bool = False) -> float:
        """Bytes of the whole tensors the tensor-parallel collectives after ``node``'s forward
        (or backward) run on, over the traced batch (times ``batch_fraction``)."""
        tp = self.tensor_parallel
        if tp is None or node.kind != "op":
            return 0.0
        return sum(nbytes for nbytes, _ in (tp.backward if backward else tp.forward).get(node.name, ())) \
            * self.batch_fraction

    def _collective_latency(self, node: Node, backward: bool) -> float:
        """The part of one call's tensor-parallel collectives that does not shrink with the micro-batch."""
        tp = self.tensor_parallel
        if tp is None:
            return 0.0
        found = (tp.backward if backward else tp.forward).get(node.name, ())
        return sum(passes * (tp.size - 1) * self.device.link_latency_s for _, passes in found)

    def scaled(self, nbytes: float) -> float:
        """Bytes of a tensor traced at the full batch, for the share of it this model prices."""
        return nbytes * self.batch_fraction

    def _analytic(self, node: Node, num_calls: int) -> float:
        d = self.device
        share = self._share(node)
        nbytes = node.bytes_accessed * self.batch_fraction * share
        bandwidth = d.bandwidth(nbytes / max(1, num_calls))
        rate = d.peak(node.compute_dtype or self.dtype)  # an op's own dtype where autocast chose one
        if node.name in self.float8:
            rate = d.half_flops * self.float8_speedup
        return node.flops * share / rate * self.batch_fraction + nbytes / bandwidth + num_calls * d.op_overhead_s

    def call_overhead(self, node: Node, backward: bool = False) -> float:
        """The part of one call's time that does not shrink with the micro-batch."""
        if node.kind != "op":
            return 0.0
        known = self._times.get((id(node), 0, backward))  # 0 calls: the key of the per-call part
        if known is not None and known[0] is node:
            return known[1]
        seconds = self._call_overhead(node, backward)
        self._times[(id(node), 0, backward)] = (node, seconds)
        return seconds

    def _call_overhead(self, node: Node, backward: bool) -> float:
        collective = self._collective_latency(node, backward)
        if node.name in self.fused:
            return collective
        if node.name in self.measured:
            t = self.measured[node.name]
            seconds, fixed = (t.backward_s, t.backward_fixed_s) if backward else (t.forward_s, t.forward_fixed_s)
            return min(seconds, self.device.op_overhead_s if fixed is None else fixed) + collective \
                + self._dispatch(node)
        launch = (self.backward_factor if backward else 1.0) * self.device.op_overhead_s
        return launch + collective + self._dispatch(node)

    def forward_time(self, node: Node, num_calls: int = 1) -> float:
        """Seconds to run ``node`` over the traced batch (times ``batch_fraction``), split
        into ``num_calls`` micro-batches."""
        if node.kind != "op":
            return 0.0
        known = self._times.get((id(node), num_calls, False))
        if known is not None and known[0] is node:
            return known[1]
        seconds = self._forward_time(node, num_calls)
        self._times[(id(node), num_calls, False)] = (node, seconds)
        return seconds

    def _forward_time(self, node: Node, num_calls: int) -> float:
        collective = self.collective_time(node, num_calls) if self.tensor_parallel is not None else 0.0
        if node.name in self.fused:
            return collective
        collective += num_calls * self._dispatch(node)  # a fused op runs in a compiled kernel: no dispatch
        if node.name in self.measured:
            t = self.measured[node.name]
            return self._from_measured(t.forward_s, t.forward_fixed_s, num_calls, self._share(node)) \
                + self._cache_shift(node, num_calls) + collective
        return self._analytic(node, num_calls) + collective

    def _from_measured(self, seconds: float, fixed: float | None, num_calls: int, share: float = 1.0) -> float:
        """A call timed on ``measured_fraction`` of the traced batch: a fixed cost per call
        (measured, else the device's launch overhead) plus work in proportion to the samples
        (times ``share``: one tensor-parallel rank's part of it)."""
        fixed = min(seconds, self.device.op_overhead_s if fixed is None else fixed)
        return num_calls * fixed + (seconds - fixed) / self.measured_fraction * self.batch_fraction * share

    def backward_time(self, node: Node, num_calls: int = 1) -> float:
        if node.kind != "op":
            return 0.0
        known = self._times.get((id(node), num_calls, True))
        if known is not None and known[0] is node:
            return known[1]
        seconds = self._backward_time(node, num_calls)
        self._times[(id(node), num_calls, True)] = (node, seconds)
        return seconds

    def _backward_time(self, node: Node, num_calls: int) -> float:
        collective = self.collective_time(node, num_calls, backward=True) if self.tensor_parallel is not None else 0.0
        if node.name in self.fused:
            return collective
        collective += num_calls * self._dispatch(node)
        if node.name in self.measured:
            t = self.measured[node.name]
            return self._from_measured(t.backward_s, t.backward_fixed_s, num_calls, self._share(node)) \
                + self.backward_factor * self._cache_shift(node, num_calls) + collective
        return self.backward_factor * self._analytic(node, num_calls) + collective

    def _cache_shift(self, node: Node, num_calls: int) -> float:
        """A measured op scaled to another size: what its bytes gain or lose when one call's
        tensors fit the cache at one size and not at the other (timed on a micro-batch that
        fits, a whole batch that does not moves its bytes at the memory's rate)."""
        d = self.device
        if d.cache_bandwidth <= 0:
            return 0.0
        per_call = node.bytes_accessed * self.batch_fraction * self._share(node) / max(1, num_calls)
        timed = node.bytes_accessed * self.measured_fraction
        return num_calls * per_call * (1 / d.bandwidth(per_call) - 1 / d.bandwidth(timed))

    def transfer_time(self, nbytes: float, num_messages: int = 1) -> float:
        """Seconds to move ``nbytes`` to the next device in ``num_messages`` messages."""
        return nbytes / self.device.link_bandwidth + num_messages * self.device.link_latency_s
