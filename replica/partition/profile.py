"""Measured costs: time every op's forward and backward on this device with real shapes."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from replica.partition.mutation import mutates_first_argument
from replica.partition.pure import untouched, written_parameters
from replica.precision import autocast_for, precision_name

__all__ = ["OpTimes", "profile", "cache_dir"]


@dataclass(frozen=True)
class OpTimes:
    """Seconds for one call of an op on one micro-batch: forward, and backward (input and
    weight gradients together); ``*_fixed_s`` is the part that does not shrink with a
    smaller micro-batch (launch and dispatch), when a second, smaller size was timed."""

    forward_s: float
    backward_s: float
    forward_fixed_s: float | None = None
    backward_fixed_s: float | None = None


def _best(fn: Callable[..., Any], repeats: int, fresh: Callable[[], Any] | None = None, *,
          cuda: bool = False) -> float:
    """Best of ``repeats`` timed calls; ``fresh()`` (untimed) makes each call's argument, for
    ops that write into their input and must not see their own earlier writes.

    ``cuda``: the op runs on a GPU, whose calls return once their kernels are queued. The
    calls then run back to back between two waits for the GPU, and the time is their mean:
    what an op costs inside a stage, where launching the next kernels overlaps the GPU's
    work (a wait around every call would add a launch and a synchronisation to each)."""
    if cuda:
        args = [() if fresh is None else (fresh(),) for _ in range(repeats)]
        fn(*args[0])  # the first call of an op on a GPU picks its kernels: not timed
        torch.cuda.synchronize()
        start = time.perf_counter()
        for arg in args:
            fn(*arg)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeats
    best = float("inf")
    for _ in range(repeats):
        arg = () if fresh is None else (fresh(),)
        start = time.perf_counter()
        fn(*arg)
        best = min(best, time.perf_counter() - start)
    return best


def _leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
        return x.detach().requires_grad_(True)
    return x


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{str(value.dtype)[6:]}{'g' if value.requires_grad else ''}"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_describe(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_describe(v)}" for k, v in sorted(value.items())) + "}"
    return repr(value) if isinstance(value, (int, float, bool, str, type(None))) else type(value).__name__


class _Profiler(fx.Interpreter):
    """Times each op as it runs, under ``precision``'s autocast on ``device``: forwards (and
    the forward a backward is timed from) inside it, backwards outside, as torch's recipe
    runs them; the next op's inputs are the values autocast gives."""

    def __init__(self, gm: fx.GraphModule, repeats: int, cache: dict[str, list[float]], precision: str,
                 device: torch.device, *, checks: int = 0, refresh: bool = False) -> None:
        super().__init__(gm)
        self.repeats = repeats
        self.times: dict[str, OpTimes] = {}
        self.keys: dict[str, str] = {}  # node -> its cache key
        self.cache = cache
        self.precision, self.device = precision, device
        self.cuda = device.type == "cuda"
        self.checks = checks  # cached ops of at least SPOT_MIN_S still to time again (see _profile)
        # the checks spread over the graph: the next one at the first costly enough op from this place on
        ops = [x.name for x in gm.graph.nodes if x.op in ("call_function", "call_method", "call_module")]
        self._place = {name: i for i, name in enumerate(ops)}
        self._stride = max(1, len(ops) // checks) if checks else 0
        self._next_check = 0
        self.spot: list[tuple[str, list[float], list[float]]] = []  # (key, cached, timed now)
        self.refresh = refresh  # time every op again, keeping each one's best (a stale cache)

    def signature(self, n: fx.Node, args: Any, kwargs: Any) -> str:
        """What an op's time depends on: the op, its module's type and weights, its inputs' shapes
        and the autocast it runs under."""
        if n.op == "call_module":
            module = self.module.get_submodule(str(n.target))
            what = f"{type(module).__name__}{_describe([p for p in module.parameters()])}{module.extra_repr()}"
        else:
            what = f"{n.op}:{getattr(n.target, '__name__', str(n.target))}"
        autocast = "" if self.precision == "fp32" else f"|autocast {self.precision}"
        return f"{what}|{_describe(args)}|{_describe(kwargs)}{autocast}"

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in ("call_function", "call_method", "call_module"):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        op = getattr(self, n.op)

        def call(target: Any, a: Any, k: Any) -> Any:
            with autocast_for(self.device, self.precision):
                return op(target, a, k)

        key = self.keys[n.name] = self.signature(n, args, kwargs)
        cached = self.cache.get(key)
        if cached is not None and not self.refresh:  # timed before with these shapes on this device
            place = self._place.get(n.name, 0)
            if self.checks > 0 and place >= self._next_check and sum(max(t, 0.0) for t in cached) >= SPOT_MIN_S:
                self.checks -= 1
                self._next_check = place + self._stride
                self.spot.append((key, list(cached), self._time(n, call, args, kwargs)))
            self.times[n.name] = OpTimes(*cached)
        else:
            timed = self._time(n, call, args, kwargs)
            entry = timed if cached is None else _least(cached, timed)
            self.times[n.name] = OpTimes(*entry)
            self.cache[key] = entry
        with torch.no_grad():
            return call(n.target, args, kwargs)

    def _time(self, n: fx.Node, call: Callable[..., Any], args: Any, kwargs: Any) -> list[float]:
        """``[forward, backward]`` seconds of one call of ``n`` on ``args``, each the best of the repeats."""
        if mutates_first_argument(n, self.module) and isinstance(args[0], torch.Tensor):
            first, rest = args[0], tuple(args[1:])  # time writes into copies: the value stays as it was
            forward_s = _best(lambda x: call(n.target, (x, *rest), kwargs), self.repeats, first.clone,
                              cuda=self.cuda)
        else:
            forward_s = _best(lambda: call(n.target, args, kwargs), self.repeats, cuda=self.cuda)
        backward_s = 0.0
        if torch.is_grad_enabled():
            backward_s = self._backward(n, call, args, kwargs)
        return [forward_s, backward_s]

    def _backward(self, n: fx.Node, call: Callable[..., Any], args: Any, kwargs: Any) -> float:
        leaf_args, leaf_kwargs = tree_map(_leaf, args), tree_map(_leaf, kwargs)
        wrt = [x for x in tree_flatten((leaf_args, leaf_kwargs))[0]
               if isinstance(x, torch.Tensor) and x.requires_grad]
        if n.op == "call_module":
            wrt += [p for p in self.module.get_submodule(str(n.target)).parameters() if p.requires_grad]
        wrt += [self.fetch_attr(str(a.target)) for a in n.all_input_nodes if a.op == "get_attr"]
        wrt = [w for w in wrt if isinstance(w, torch.Tensor) and w.requires_grad]
        if not wrt:
            return 0.0
        if mutates_first_argument(n, self.module):  # in place: price its backward like its forward
            return -1.0
        try:
            out = call(n.target, leaf_args, leaf_kwargs)
        except RuntimeError:  # an in-place op on a leaf: price its backward like its forward
            return -1.0
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        if not outs:
            return 0.0
        grads = [torch.ones_like(o) for o in outs]
        return _best(lambda: torch.autograd.grad(outs, wrt, grads, retain_graph=True, allow_unused=True),
                     self.repeats, cuda=self.cuda)


def cache_dir() -> Path:
    """Where the planner keeps what it measured on this machine (the CPU's spec, op timings):
    ``$REPLICA_CACHE_DIR`` if set, else ``~/.cache/replica``. The one place it is read."""
    return Path(os.environ.get("REPLICA_CACHE_DIR", Path.home() / ".cache" / "replica"))


def _cache_file() -> Path:
    device = "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name().replace(" ", "-")
    name = f"profile-{device}-{torch.get_num_threads()}t-torch{torch.__version__}.json"
    return cache_dir() / name


def _load_cache(use: bool) -> dict[str, list[float]]:
    if not use:
        return {}
    try:
        data = json.loads(_cache_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(cache: dict[str, list[float]], use: bool) -> None:
    if not use:
        return
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(cache, f)
        os.replace(f.name, path)
    except OSError:
        pass  # a read-only home still profiles, just every time


def profile(gm: fx.GraphModule, inputs: Sequence[Any], *, repeats: int = 3, cache: bool = True,
            precision: str = "fp32") -> dict[str, OpTimes]:
    """Run ``gm`` op by op on ``inputs`` (one micro-batch, real tensors on the device the
    model lives on), timing each op's forward and backward as the best of ``repeats``;
    again on half of it, to tell the fixed cost of a call from the work per sample. Under a
    ``precision`` of "bf16" / "fp16" each forward runs in that autocast, as the stages will.

    A busy machine can slow every repeat of an op: an op whose two sizes' times disagree
    with any sane scaling (:func:`_implausible`) is timed again at both, up to ``RETRIES``
    times, keeping each size's best time so far (noise only ever adds time); if they still
    disagree, the slower side is pulled down to the nearest plausible time, so the cache
    ends consistent and a re-plan reads the same times. That holds for times read from
    the cache too: a bad entry written on a loaded machine heals. So does a cache written on a
    busier machine whose times agree with each other: a few of its costly ops are timed again
    (:data:`SPOT_CHECKS`), and where they now run clearly faster, every op is.

    Gradients are computed with ``torch.autograd.grad``: nothing accumulates into ``.grad``,
    and the model is left as it was (:func:`~replica.partition.pure.untouched`): a BatchNorm's
    statistics, the random generators a dropout draws from, the modules' modes.
    With ``cache``, times are kept per op signature (op, weights, input shapes, autocast) and device in
    ``~/.cache/replica`` (``REPLICA_CACHE_DIR``): a repeated op, or a re-plan, is not re-timed.
    """
    tensors = [*gm.parameters(), *(x for x in inputs if isinstance(x, torch.Tensor))]
    device = tensors[0].device if tensors else torch.device("cpu")
    with untouched(gm, written_parameters(gm)):
        return _profile(gm, inputs, repeats, cache, precision_name(precision, argument="precision"), device)


def _profile(gm: fx.GraphModule, inputs: Sequence[Any], repeats: int, cache: bool, precision: str,
             device: torch.device) -> dict[str, OpTimes]:
    store = _load_cache(cache)
    half = _halve(inputs)
    refresh = False

    def timed(x: Sequence[Any], checks: int = 0) -> tuple[dict[str, OpTimes], dict[str, str]]:
        profiler = _times(gm, x, repeats, store, precision=precision, device=device, checks=checks, refresh=refresh)
        spot.extend(profiler.spot)
        return {name: _op_times((t.forward_s, t.backward_s)) for name, t in profiler.times.items()}, profiler.keys

    spot: list[tuple[str, list[float], list[float]]] = []
    times, keys = timed(inputs, SPOT_CHECKS)
    if _stale(spot):  # written on a busier machine (or an older torch build): every op timed again
        refresh = True
        times, keys = timed(inputs)
    else:  # each re-timed op keeps its best time
        for key, old, new in spot:
            store[key] = _least(old, new)
        times = {name: _op_times(store[key]) for name, key in keys.items()}
    if half is None:
        _save_cache(store, cache)
        return times
    small, small_keys = timed(half)
    for attempt in range(RETRIES + 1):
        suspect = [name for name, t in times.items() if name in small and _implausible(t, small[name])]
        if not suspect:
            break
        if attempt == RETRIES:  # still contradictory: pull the slower side down to the bound
            for name in suspect:
                _settle(store.get(keys[name]), store.get(small_keys[name]))
        else:
            kept = {}
            for name in suspect:  # forget them, so the next passes time them afresh
                for key in (keys[name], small_keys[name]):
                    if key in store:
                        kept[key] = store.pop(key)
            timed(inputs)
            timed(half)
            for key, old in kept.items():
                store[key] = _least(old, store.get(key, old))
        # every time now the best seen: read back from the store, no pass over the model
        times = {name: _op_times(store[key]) for name, key in keys.items()}
        small = {name: _op_times(store[key]) for name, key in small_keys.items()}
    _save_cache(store, cache)
    # t(b) = fixed + b * slope from the two sizes b and b/2: fixed = 2 t(b/2) - t(b)
    return {
        name: OpTimes(t.forward_s, t.backward_s,
                      _fixed(t.forward_s, small[name].forward_s), _fixed(t.backward_s, small[name].backward_s))
        for name, t in times.items() if name in small
    }


RETRIES = 2
# Cached times are checked: a plan re-times up to SPOT_CHECKS of the cached ops that cost at least
# SPOT_MIN_S (forward and backward), spread over the graph; where they now take under STALE of their
# cached times (median), or one under STALE_ONE of its own, the cache was written on a busier
# machine and every op is timed again, each keeping its best time.
# Without it a time measured under load was read back forever: the benchmark GPT's cached ops priced
# a 2-stage pipeline at 2.98 s, timed afresh 1.48 s, measured 1.55 s (benchmarks/RESULTS.md).
SPOT_CHECKS = 6
SPOT_MIN_S = 1e-3
STALE = 0.8
STALE_ONE = 0.5
SCALING = (0.8, 2.5)  # t(b) / t(b/2): half the work costs at most the whole, plus noise; twice
# the work, at most twice the time plus cache effects. Outside this range one of them met noise.
NOISE_FLOOR_S = 100e-6  # ops this quick stay as timed: their share of a step is negligible


def _least(old: Sequence[float], new: Sequence[float]) -> list[float]:
    """Each of two ``[forward, backward]`` entries' best (noise only adds time); an in-place op's
    backward (-1) stays as it is."""
    return [b if a < 0 or b < 0 else min(a, b) for a, b in zip(old, new)]


def _stale(spot: Sequence[tuple[str, Sequence[float], Sequence[float]]]) -> bool:
    """Whether the re-timed cached ops (``(key, cached, now)``) show a cache taken on a busier
    machine: in median they now run in under :data:`STALE` of their cached times, or one runs in
    under :data:`STALE_ONE` of its own (noise only adds time, so a time that fast now means the
    cached one met load: a busy moment may have slowed only some of the ops)."""
    ratios = sorted(sum(max(t, 0.0) for t in new) / total for _, old, new in spot
                    if (total := sum(max(t, 0.0) for t in old)) > 0)
    return bool(ratios) and (ratios[len(ratios) // 2] < STALE or ratios[0] < STALE_ONE)


def _settle(big: list[float] | None, small: list[float] | None) -> None:
    """Make a cached pair of times plausible in place: noise only adds time, so the side that
    is too slow for the other comes down to the bound (in-place ops' -1 stays)."""
    if big is None or small is None:
        return
    low, high = SCALING
    for i, (b, s) in enumerate(zip(big, small)):
        if b < 0 or s < 0 or max(b, s) <= NOISE_FLOOR_S:
            continue
        if b > high * s:
            big[i] = high * s * (1 - 1e-9)  # just inside the bound, after rounding too
        elif b < low * s:
            small[i] = b / low * (1 - 1e-9)


def _implausible(big: OpTimes, small: OpTimes) -> bool:
    """Whether an op's times at a batch and at half of it contradict each other."""
    for b, s in ((big.forward_s, small.forward_s), (big.backward_s, small.backward_s)):
        if max(b, s) > NOISE_FLOOR_S and not SCALING[0] * s <= b <= SCALING[1] * s:
            return True
    return False


def _fixed(big: float, small: float) -> float:
    return min(max(2 * small - big, 0.0), small)


def _halve(inputs: Sequence[Any]) -> tuple[Any, ...] | None:
    sizes = {int(x.shape[0]) for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) != 1 or next(iter(sizes)) < 2:
        return None
    n = next(iter(sizes)) // 2
    return tuple(x[:n] if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in inputs)


def _times(gm: fx.GraphModule, inputs: Sequence[Any], repeats: int, cache: dict[str, list[float]], *,
           precision: str, device: torch.device, checks: int = 0, refresh: bool = False) -> _Profiler:
    """A pass timing each op on ``inputs`` under ``precision`` on ``device`` (its ``times``, each
    op's cache key in ``keys``, ``checks`` cached ops timed again in ``spot``; ``refresh``: every op
    timed again)."""
    profiler = _Profiler(gm, repeats, cache, precision, device, checks=checks, refresh=refresh)
    with torch.enable_grad():
        profiler.run(*inputs)
    return profiler


def _op_times(entry: Sequence[float]) -> OpTimes:
    """A cached ``[forward, backward]`` as times; an in-place op's backward (-1) priced
    like two forwards."""
    forward, backward = entry[0], entry[1]
    return OpTimes(forward, forward * 2 if backward < 0 else backward)
