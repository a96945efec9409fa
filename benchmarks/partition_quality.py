"""Partition quality: Replica's plan against the hand splits people use, measured stage by stage.

For each model and stage count, every plan's stages are built with Replica's split and
timed one by one (forward + backward of one micro-batch, best of ``--repeats``, one
thread) in this process. Reported per plan: measured time per stage, the measured
bottleneck over the mean (1.00 = perfect balance), and for Replica the error of its
predicted stage times. Baselines, all cut at layer boundaries:

- ``equal-layers``: the same number of layers per stage (how people split by hand for
  torch.distributed.pipelining / Megatron); embeddings ride with the first stage, the
  final norm and head with the last;
- ``equal-params``: layers grouped so each stage holds about the same parameters
  (DeepSpeed's PipelineModule default, ``partition_method="parameters"``);
- ``greedy-time``: layers grouped greedily by their profiled time (torchgpipe's
  ``balance_by_time``).

Usage: ``python benchmarks/partition_quality.py [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.gpt.model import GPT, GPTConfig  # noqa: E402
from replica.partition.cost import CostModel, device_spec  # noqa: E402
from replica.partition.partitioner import partition  # noqa: E402
from replica.partition.profile import profile  # noqa: E402
from replica.partition.split import split  # noqa: E402
from replica.partition.trace import trace  # noqa: E402
from replica.runtime import microbatch  # noqa: E402


class UNet(nn.Module):
    """Encoder-decoder with long skips (concatenations across the whole net)."""

    def __init__(self, c: int = 32) -> None:
        super().__init__()
        def block(i: int, o: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.GroupNorm(4, o), nn.GELU(),
                                 nn.Conv2d(o, o, 3, padding=1), nn.GELU())
        self.enc1, self.enc2, self.enc3 = block(3, c), block(c, 2 * c), block(2 * c, 4 * c)
        self.mid = block(4 * c, 4 * c)
        self.dec3, self.dec2, self.dec1 = block(8 * c, 2 * c), block(4 * c, c), block(2 * c, c)
        self.head = nn.Conv2d(c, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)  # (B, c, H, W)
        e2 = self.enc2(F.max_pool2d(e1, 2))  # (B, 2c, H/2, W/2)
        e3 = self.enc3(F.max_pool2d(e2, 2))  # (B, 4c, H/4, W/4)
        m = self.mid(e3)
        d3 = self.dec3(torch.cat([m, e3], 1))
        d2 = self.dec2(torch.cat([F.interpolate(d3, scale_factor=2.0), e2], 1))
        d1 = self.dec1(torch.cat([F.interpolate(d2, scale_factor=2.0), e1], 1))
        return self.head(d1)


class ResNet(nn.Module):
    """A ResNet-like stack: a wide stem, residual blocks that shrink the image, a linear head."""

    def __init__(self, c: int = 32, blocks: int = 8, classes: int = 100) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.GroupNorm(4, c), nn.ReLU())
        self.layers = nn.ModuleList()
        for i in range(blocks):
            self.layers.append(nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(4, c), nn.ReLU(),
                                             nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(4, c)))
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for i, layer in enumerate(self.layers):
            x = F.relu(x + layer(x))
            if i % 3 == 2:
                x = F.avg_pool2d(x, 2)
        return self.head(x.mean((2, 3)))


def cases() -> dict[str, tuple[nn.Module, tuple[torch.Tensor, ...], Callable[[str], str]]]:
    """model, example inputs, and how a module path maps to its layer (the unit hand splits use)."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=128, vocab_size=8192, n_layer=8, n_head=8, n_embd=256))
    gpt_x = torch.randint(0, 8192, (8, 128))

    def gpt_layer(path: str) -> str:
        parts = path.split(".")
        if path.startswith("transformer.h."):
            return ".".join(parts[:3])
        return "first" if path.startswith(("transformer.wte", "transformer.wpe", "transformer.drop")) or not path \
            else "last"

    def top(path: str) -> str:
        parts = path.split(".")
        return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]

    return {
        "gpt-vocab8192": (gpt, (gpt_x,), gpt_layer),
        "unet": (UNet(), (torch.randn(8, 3, 64, 64),), top),
        "resnet": (ResNet(), (torch.randn(8, 3, 64, 64),), top),
    }


def layer_units(graph: Any, layer_of: Callable[[str], str]) -> list[tuple[str, int, int]]:
    """Consecutive runs of ops by layer: (layer, first node, end node)."""
    units: list[tuple[str, int, int]] = []
    for i, n in enumerate(graph.nodes):
        if n.kind != "op":
            continue
        name = layer_of(n.module_path)
        if units and units[-1][0] == name:
            units[-1] = (name, units[-1][1], i + 1)
        else:
            units.append((name, i, i + 1))
    return units


def bounds_by_weight(graph: Any, units: list[tuple[str, int, int]], weights: list[float], k: int) -> list[int]:
    """Cut between units so that every stage gets about total/k of the weight (greedy)."""
    total = sum(weights)
    cuts, acc = [], 0.0
    for u, w in zip(units[:-1], weights[:-1]):
        acc += w
        if len(cuts) < k - 1 and acc >= total * (len(cuts) + 1) / k:
            cuts.append(u[2])
    while len(cuts) < k - 1:  # too few units: split the last ones
        cuts.append(units[-(k - len(cuts))][2])
    return [0, *sorted(set(cuts)), len(graph.nodes)]


def equal_layers(graph: Any, units: list[tuple[str, int, int]], k: int) -> list[int]:
    """Repeated layers spread evenly; whatever is before them joins stage 0, after them the last."""
    body = [u for u in units if u[0] not in ("first", "last")] or units
    per = len(body) / k
    cuts = [body[round(per * s) - 1][2] for s in range(1, k)]
    return [0, *cuts, len(graph.nodes)]


def time_stages(traced: Any, plan: Any, sample: tuple[torch.Tensor, ...], repeats: int) -> list[float]:
    """Forward + backward of each stage alone on one micro-batch, best of ``repeats``."""
    stages = split(traced, plan)
    values: dict[str, Any] = {}
    inputs: list[tuple[Any, ...]] = []
    with torch.no_grad():
        out = None
        for s in stages:
            args = sample if s.is_first else tuple(values[n] for n in s.input_names)
            inputs.append(args)
            out = s.module(*args)
            if not s.is_last:
                values.update(zip(s.output_names, out))
    times = []
    for s, args in zip(stages, inputs):
        def step() -> None:
            leaves = tuple(a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                           for a in args)
            out = s.module(*leaves)
            outs = [o for o in (out if isinstance(out, tuple) else (out,))
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        step()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            best = min(best, time.perf_counter() - start)
        times.append(best)
    for p in traced.module.parameters():
        p.grad = None
    return times


def report_analytic_error(name: str, graph: Any, measured: dict, m: int) -> None:
    """How far the analytic model (FLOPs and bytes on the measured CPU spec) is from the
    profile, per op kind, forward + backward of one micro-batch."""
    analytic = CostModel(device_spec("cpu"), batch_fraction=1 / m)
    kinds: dict[str, list[tuple[float, float]]] = {}
    for n in graph.op_nodes:
        if n.name not in measured or (n.flops == 0 and n.bytes_accessed == 0):
            continue
        t = measured[n.name]
        a = analytic.forward_time(n, 1) + analytic.backward_time(n, 1)
        kinds.setdefault(n.target, []).append((a, t.forward_s + t.backward_s))
    rows = sorted(kinds.items(), key=lambda kv: -sum(x[1] for x in kv[1]))[:8]
    print(f"\n{name}: analytic / profiled time per op kind (1.00 = exact), heaviest first")
    print("  " + "  ".join(f"{k} {sum(a for a, _ in v) / sum(t for _, t in v):.2f}" for k, v in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    m = args.microbatches
    print(f"measured forward+backward per stage, one micro-batch, 1 thread, best of {args.repeats}")
    for name, (model, inputs, layer_of) in cases().items():
        traced = trace(model, inputs)
        graph = traced.graph
        sample = microbatch.split(inputs, m, "inputs")[0]
        measured_ops = profile(traced.module, sample)
        cost = CostModel(device_spec("cpu"), measured=measured_ops, measured_fraction=1 / m)
        report_analytic_error(name, graph, measured_ops, m)
        units = layer_units(graph, layer_of)
        params = [sum(graph.parameters[p].nbytes for p in dict.fromkeys(
            q for n in graph.nodes[a:b] for q in n.parameters)) for _, a, b in units]
        unit_time = [sum(cost.forward_time(n, m) + cost.backward_time(n, m) for n in graph.nodes[a:b])
                     for _, a, b in units]
        for k in (2, 4):
            plans = {
                "replica": partition(graph, cost, num_stages=k, num_microbatches=m, schedule="1f1b"),
                "equal-layers": partition(graph, cost, num_stages=k, num_microbatches=m, schedule="1f1b",
                                          bounds=equal_layers(graph, units, k)),
                "equal-params": partition(graph, cost, num_stages=k, num_microbatches=m, schedule="1f1b",
                                          bounds=bounds_by_weight(graph, units, params, k)),
                "greedy-time": partition(graph, cost, num_stages=k, num_microbatches=m, schedule="1f1b",
                                         bounds=bounds_by_weight(graph, units, unit_time, k)),
            }
            print(f"\n{name}, {k} stages")
            print(f"  {'plan':<14}{'measured ms per stage':<36}{'bottleneck/mean':>16}{'vs equal-layers':>17}"
                  f"{'pred. err':>11}")
            results = {}
            for label, plan in plans.items():
                t = time_stages(traced, plan, sample, args.repeats)
                results[label] = t
            base = max(results["equal-layers"])
            for label, t in results.items():
                pred = [(s.predicted_time_s - s.communication_time_s) / m for s in plans[label].stages]
                err = statistics.mean(abs(p - q) / q for p, q in zip(pred, t))
                print(f"  {label:<14}{' '.join(f'{x * 1e3:7.2f}' for x in t):<36}"
                      f"{max(t) / statistics.mean(t):>16.2f}{max(t) / base - 1:>+16.0%}{err:>11.1%}")


if __name__ == "__main__":
    main()
