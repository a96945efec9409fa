"""Sequence parallelism against tensor parallelism alone, on 2 gloo CPU ranks: step time and saved activations.

One training step (``zero_grad`` + ``train_step``, no optimizer) of the benchmark GPT of
``pipeline_vs_torch.py`` (its ``build`` and ``CONFIG``; ``--layers`` / ``--embd`` shrink it) at
``tensor_parallel_size=2``, one stage, in equal micro-batches, 1F1B, laid out two ways in the same
pair of processes (1 thread each) and alternated round by round:

- ``tp``: ``sequence_parallel=False``: the blocks' exits all-reduced, everything between the
  blocks (norms, residual adds, dropout) whole on both ranks;
- ``sp``: ``sequence_parallel=True``: those values hold half the tokens each, exits
  reduce-scattered and entries all-gathered.

Reported: the median step, the median (and range) of the per-round ratio sp / tp, the planner's
predicted step and stage activation bytes, and, measured by a tensor-level tracker, the bytes of
the tensors autograd saves for backward in one step on each rank, all micro-batches together
(``saved_tensors_hooks``: each storage counted once, a DTensor by its local shard), and the first step's loss of each.

Usage: ``python benchmarks/sequence_parallel_cpu.py [--rounds 5] [--batch 16] [--microbatches 2]
[--layers N] [--embd D] [--out results.md]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
from benchmarks.choice import chosen_vs_rejected  # noqa: E402
from benchmarks.pipeline_vs_torch import CONFIG, build, timed  # noqa: E402
from examples.gpt.model import loss_fn  # noqa: E402
from replica.launch import run_local  # noqa: E402
from replica.parallel.fsdp import local_tensor  # noqa: E402

MiB = 1 << 20
LAYOUTS = {"tp": False, "sp": True}


def saved_bytes(step) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``step`` runs, over
    all its micro-batches (each kept referenced until the step ends, so none is reused)."""
    seen: dict[int, int] = {}
    held: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = local_tensor(t)
        try:
            storage = local.untyped_storage()
            seen.setdefault(storage.data_ptr(), storage.nbytes())
            held.append(local)
        except (RuntimeError, NotImplementedError):  # a tensor without storage (a wrapper)
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def job(rank: int, world: int, rounds: int, steps: int, batch: int, microbatches: int, config: dict) -> dict:
    CONFIG.update(config)
    torch.set_num_threads(1)
    pms = {}
    for name, sp in LAYOUTS.items():
        model, x, y = build()
        x, y = x[:batch], y[:batch]
        pms[name] = replica.auto_parallel(model, (x,), loss_fn=loss_fn, num_microbatches=microbatches,
                                          schedule="1f1b", graded_microbatches=False, tensor_parallel_size=2,
                                          num_stages=1, sequence_parallel=sp)

    def step_fn(pm):
        def step() -> torch.Tensor:
            pm.zero_grad()
            return pm.train_step(x, y)
        return step

    chosen = None
    if rank == 0:  # the planner left free to take sequence parallelism or not, at the same layout
        fresh, _, _ = build()  # the layouts above hold the last model's weights as DTensors
        free = replica.plan(fresh, (x,), world_size=world, num_microbatches=microbatches, schedule="1f1b",
                            graded_microbatches=False, tensor_parallel_size=2, num_stages=1, sequence_parallel=None)
        chosen = "sp" if free.layout.sequence_parallel else "tp"
    fns = {name: step_fn(pm) for name, pm in pms.items()}
    losses = {name: float(fn()) for name, fn in fns.items()}  # warm-up
    saved = {name: saved_bytes(fn) for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    order = list(LAYOUTS)
    for r in range(rounds):
        for name in order[r % 2:] + order[:r % 2]:
            times[name].append(timed(fns[name], steps)[0])
    return dict(rank=rank, times=times, losses=losses, saved=saved, chosen=chosen,
                predicted={n: pm.plan.predicted_step_time_s for n, pm in pms.items()},
                activations={n: pm.plan.stages[0].activation_bytes for n, pm in pms.items()},
                layout={n: pm.plan.layout.describe() for n, pm in pms.items()},
                region={n: len(pm.plan.sequence_shards) for n, pm in pms.items()})


def report(results: list[dict], args: argparse.Namespace, config: dict, wall_s: float) -> list[str]:
    r0 = results[0]
    tp = r0["times"]["tp"]
    lines = [f"GPT {config['n_layer']} layers, d={config['n_embd']}, {config['n_head']} heads, vocab "
             f"{config['vocab_size']}, seq {config['block_size']}; batch {args.batch}x{config['block_size']}, "
             f"{args.microbatches} equal micro-batches, 1F1B, tp=2 on 2 gloo ranks x 1 thread; {args.rounds} rounds "
             f"x {args.steps} step(s), alternated; times from rank 0.", "",
             "| layout | median step s | vs tp (median, min-max) | predicted step s | predicted activations MiB "
             "| saved for backward MiB, rank 0 / 1 | loss |", "|---|---|---|---|---|---|---|"]
    for name in LAYOUTS:
        ts = r0["times"][name]
        ratios = [t / b for t, b in zip(ts, tp)]
        ratio = "1" if name == "tp" else f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"
        held = " / ".join(f"{r['saved'][name] / MiB:.2f}" for r in results)
        lines.append(f"| {r0['layout'][name]} ({r0['region'][name]} values on token shards) | "
                     f"{statistics.median(ts):.3f} | {ratio} | {r0['predicted'][name]:.3f} | "
                     f"{r0['activations'][name] / MiB:.2f} | {held} | {r0['losses'][name]:.5f} |")
    lines += ["", "Chosen vs rejected, measured (`sequence_parallel=None` at the same layout):", ""]
    lines += chosen_vs_rejected(r0["chosen"], r0["predicted"], r0["times"])
    lines += ["", f"- wall time {wall_s:.0f} s; load average at the end "
              f"{', '.join(f'{v:.1f}' for v in os.getloadavg())}"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--embd", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = dict(CONFIG)
    if args.layers:
        config["n_layer"] = args.layers
    if args.embd:
        config["n_embd"] = args.embd
    start = time.perf_counter()
    results = run_local(job, 2, args.rounds, args.steps, args.batch, args.microbatches, config, timeout_s=1800,
                        keep_freed_memory=True)
    text = "\n".join(report(sorted(results, key=lambda r: r["rank"]), args, config, time.perf_counter() - start))
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
