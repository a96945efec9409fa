"""FSDP2's and DTensor's fixed costs on gloo CPU ranks: what the planner prices per op, unit and call.

On tiny tensors (bytes negligible, so what is left is the fixed cost), 2 gloo ranks of one
thread each (``run_local``), each figure the median of ``--repeats`` timings:

- ``op``: a plain ``add`` (forward, and forward + backward through a chain of ``--ops``
  adds and multiplies): the per-op cost the CPU spec's ``op_overhead_s`` measures;
- ``dtensor``: the same chain on replicated ``DTensor`` s: per op (forward + backward) what
  DTensor's dispatch adds, and that over the plain op's (the CPU spec's
  ``dispatch_overhead_s`` is this ratio times its measured ``op_overhead_s``);
- ``collective``: one ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` / ``all_reduce`` of
  a few floats over the 2 ranks (the spec's ``link_latency_s`` is charged per call and pass);
- ``fsdp``: ``--units`` FSDP2 units (``fully_shard`` per ``Linear(16, 16)``, then the root),
  ``--microbatches`` forwards and backwards a step as Replica runs them (gradients reduced
  and weights resharded at the last backward only), zero2 (``reshard_after_forward=False``)
  and zero3, against the same plain units whose gradients are all-reduced once: per unit and
  per forward or backward action, what FSDP adds (its hooks; zero3's gathers counted apart);
- ``optimizer``: ``AdamW.step`` over the units' parameters as DTensor shards against plain
  tensors: per parameter tensor.

Usage: ``python benchmarks/fixed_costs_cpu.py [--repeats 7] [--ops 200] [--units 16] [--microbatches 4]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replica.launch import run_local  # noqa: E402


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _chain(x: torch.Tensor, ops: int) -> torch.Tensor:
    for i in range(ops // 2):
        x = x * 1.001 + 0.5
    return x


def _units(n: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(n)))


def _step(model: torch.nn.Module, microbatches: int, fsdp: bool) -> None:
    x = torch.randn(2, 16)
    for i in range(microbatches):
        last = i == microbatches - 1
        if fsdp:
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            model.set_is_last_backward(last)
        model(x).sum().backward()


def job(rank: int, world: int, repeats: int, ops: int, units: int, microbatches: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, float] = {}
    small = torch.ones(4, 8)
    out["op_forward"] = _median_time(lambda: [small.add(1.0) for _ in range(ops)], repeats) / ops
    plain = torch.ones(4, 8, requires_grad=True)
    out["op"] = _median_time(lambda: _chain(plain, ops).sum().backward(), repeats) / ops
    replicated = DTensor.from_local(torch.ones(4, 8), mesh, [Replicate()], run_check=False).requires_grad_()
    out["dtensor"] = _median_time(lambda: _chain(replicated, ops).sum().backward(), repeats) / ops
    out["dtensor_forward"] = _median_time(lambda: [replicated.add(1.0) for _ in range(ops)], repeats) / ops
    calls = 20
    local, whole = torch.ones(4), torch.empty(4 * world)
    out["all_gather"] = _median_time(lambda: [dist.all_gather_into_tensor(whole, local) for _ in range(calls)],
                                     repeats) / calls
    out["reduce_scatter"] = _median_time(lambda: [dist.reduce_scatter_tensor(local, whole) for _ in range(calls)],
                                         repeats) / calls
    out["all_reduce"] = _median_time(lambda: [dist.all_reduce(whole) for _ in range(calls)], repeats) / calls

    base = _units(units)

    def replicated_step() -> None:
        _step(base, microbatches, False)
        for p in base.parameters():
            dist.all_reduce(p.grad)
    out["replicated_step"] = _median_time(replicated_step, repeats)
    for name, again in (("zero2", False), ("zero3", True)):
        model = _units(units)
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=again)
        fully_shard(model, mesh=mesh, reshard_after_forward=again)
        out[f"{name}_step"] = _median_time(lambda: _step(model, microbatches, True), repeats)
        if name == "zero2":
            sharded = torch.optim.AdamW(model.parameters(), lr=1e-3)
            whole_opt = torch.optim.AdamW(base.parameters(), lr=1e-3)
            sharded.step(), whole_opt.step()  # their state made
            params = len(list(base.parameters()))
            out["adamw_plain"] = _median_time(whole_opt.step, repeats) / params
            out["adamw_dtensor"] = _median_time(sharded.step, repeats) / params
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--units", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    results = run_local(job, 2, args.repeats, args.ops, args.units, args.microbatches, timeout_s=600)
    us = {k: max(r[k] for r in results) * 1e6 for k in results[0]}  # the slower rank: what the step waits for
    u, m = args.units, args.microbatches
    actions = 2 * m * (u + 1)  # every forward and backward of each unit and the root
    def per_action(name: str) -> tuple[float, str]:
        extra = (us[f"{name}_step"] - us["replicated_step"]) / actions
        return extra, f"{extra / us['op_forward']:.0f}x forward"

    rows = [
        ("plain op, forward", us["op_forward"], "-"),
        ("plain op, forward + backward (per op of a chain)", us["op"], "-"),
        ("DTensor op, forward", us["dtensor_forward"], f"{us['dtensor_forward'] / us['op_forward']:.1f}x forward"),
        ("DTensor op, forward + backward", us["dtensor"], f"{us['dtensor'] / us['op']:.1f}x forward + backward"),
        ("all_gather_into_tensor, 2 ranks, 16 bytes", us["all_gather"], "-"),
        ("reduce_scatter_tensor", us["reduce_scatter"], "-"),
        ("all_reduce", us["all_reduce"], "-"),
        (f"zero2 over replicated, per unit and action ({u} units + root, {m} micro-batches)", *per_action("zero2")),
        ("zero3 over replicated, per unit and action", *per_action("zero3")),
        ("AdamW step, plain, per parameter tensor", us["adamw_plain"], "-"),
        ("AdamW step, DTensor shards, per parameter tensor", us["adamw_dtensor"],
         f"+{(us['adamw_dtensor'] - us['adamw_plain']) / us['op_forward']:.0f}x forward"),
    ]
    print("| what | µs | over a plain op |")
    print("|---|---|---|")
    for name, value, ratio in rows:
        print(f"| {name} | {value:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
