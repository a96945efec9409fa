"""Tensor parallelism against data parallelism and a 2-stage pipeline, on 2 gloo CPU ranks.

One training step (``zero_grad`` + ``train_step``: forward, backward and the gradient
synchronization of every micro-batch; no optimizer step, as ``pipeline_vs_torch.py``) of the
benchmark GPT of ``pipeline_vs_torch.py`` (its ``build`` and ``CONFIG``; ``--layers`` /
``--embd`` shrink it) on the same global batch (default 32x128, sliced to ``--batch``), in
the same number of equal micro-batches (``graded_microbatches=False``) and 1F1B, laid out
three ways over the same 2 ranks (1 thread each):

- ``tp``: ``auto_parallel(tensor_parallel_size=2, num_stages=1)``: Megatron-style tensor
  parallelism on torch's DTensor (the blocks the planner cuts: MLPs, attention heads, token
  embedding, LM head; each rank computes the rest whole), all-reduces inside every block's
  forward and backward;
- ``dp``: ``auto_parallel(tensor_parallel_size=1, num_stages=1, data_parallel_size=2)``: two
  replicas, each half the batch, gradients all-reduced;
- ``pp``: ``auto_parallel(num_stages=2, tensor_parallel_size=1)``: a 2-stage pipeline.

All three are built in the same pair of processes (``replica.keep_freed_memory()``, through
``run_local``) and alternated round by round, each round starting one layout later (as
``sharded_dp.py`` / ``pipeline_vs_torch.py``); each step sits between two barriers. Reported:
the median step time, the median (and range) of the per-round ratio to ``dp``, the planner's
predicted step time (``pm.plan.predicted_step_time_s``), the blocks cut
(``pm.plan.tensor_parallel``, by ``ShardedBlock.kind``), and the bytes of parameters each rank
holds (local shards, ``replica.parallel.fsdp.local_tensor``) beside the same tensors whole.
The loss each layout returns on the first step is printed too (all three should agree).

Usage: ``python benchmarks/tensor_parallel_cpu.py [--rounds 5] [--steps 1] [--batch 32]
[--microbatches 4] [--layers N] [--embd D] [--out results.md]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
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
LAYOUTS = {
    "tp": dict(tensor_parallel_size=2, num_stages=1),
    "dp": dict(tensor_parallel_size=1, num_stages=1, data_parallel_size=2),
    "pp": dict(num_stages=2, tensor_parallel_size=1),
}
NAMES = {"tp": "tensor parallel (2 ranks)", "dp": "data parallel (2 replicas)", "pp": "pipeline (2 stages)"}


def param_bytes(pm) -> tuple[int, int]:
    """Bytes of parameters this rank holds (local shards), and the same tensors whole."""
    local = whole = 0
    for p in pm.parameters():
        local += local_tensor(p).numel() * p.element_size()
        whole += p.numel() * p.element_size()  # a DTensor's numel() is its global one
    return local, whole


def free_choice(batch: int, microbatches: int) -> str:
    """Which of ``LAYOUTS`` the planner takes for 2 ranks when left free (tensor parallelism, stages
    and replicas its own; replicas not sharded, as ``dp`` runs them), priced as the ranks' plans are."""
    model, x, _ = build()
    plan = replica.plan(model, (x[:batch],), world_size=2, num_microbatches=microbatches, schedule="1f1b",
                        tensor_parallel_size=None, sharded_data_parallel=False, graded_microbatches=False)
    layout = plan.layout
    return "tp" if layout.tensor_parallel_size > 1 else "pp" if layout.pipeline_ranks > 1 else "dp"


def job(rank: int, world: int, rounds: int, steps: int, batch: int, microbatches: int, config: dict) -> dict:
    CONFIG.update(config)  # spawned ranks start from the module's defaults
    pms, built_s = {}, {}
    for name, hints in LAYOUTS.items():
        model, x, y = build()
        x, y = x[:batch], y[:batch]
        start = time.perf_counter()
        pms[name] = replica.auto_parallel(model, (x,), loss_fn=loss_fn, num_microbatches=microbatches,
                                          schedule="1f1b", graded_microbatches=False, **hints)
        built_s[name] = time.perf_counter() - start
        if rank == 0:  # before any step: a layout that fails its first step still shows its plan
            plan = pms[name].plan
            print(f"{name}: {plan.layout.describe()}; blocks cut: "
                  f"{dict(Counter(b.kind for b in plan.tensor_parallel)) or '-'}; "
                  f"predicted step {plan.predicted_step_time_s:.3f} s", flush=True)

    def step_fn(pm):
        def step() -> torch.Tensor:
            pm.zero_grad()
            return pm.train_step(x, y)
        return step

    chosen = free_choice(batch, microbatches) if rank == 0 else None
    fns = {name: step_fn(pm) for name, pm in pms.items()}
    losses, warm = {}, {}
    for name, fn in fns.items():  # warm up (the first step allocates the gradients), keep its loss
        start = time.perf_counter()
        losses[name] = float(fn())
        warm[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    order = list(LAYOUTS)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            times[name].append(timed(fns[name], steps)[0])
    return dict(
        rank=rank, times=times, losses=losses, warm=warm, built=built_s, chosen=chosen,
        params={n: param_bytes(pm) for n, pm in pms.items()},
        predicted={n: pm.plan.predicted_step_time_s for n, pm in pms.items()},
        layout={n: pm.plan.layout.describe() for n, pm in pms.items()},
        cut={n: dict(Counter(b.kind for b in pm.plan.tensor_parallel)) for n, pm in pms.items()},
        cut_params={n: sorted({p for b in pm.plan.tensor_parallel for p, _ in b.parameters}) for n, pm in pms.items()},
        note={n: pm.plan.tensor_parallel_note for n, pm in pms.items()},
        stages={n: [s.stage_index for s in pm.stages] for n, pm in pms.items()},
    )


def report(results: list[dict], args: argparse.Namespace, config: dict, wall_s: float, load: tuple) -> list[str]:
    r0 = results[0]
    dp = r0["times"]["dp"]
    lines = [f"GPT {config['n_layer']} layers, d={config['n_embd']}, {config['n_head']} heads, vocab "
             f"{config['vocab_size']}, seq {config['block_size']}; global batch {args.batch}x{config['block_size']}, "
             f"{args.microbatches} equal micro-batches, 1F1B; 2 gloo ranks x 1 thread on {os.cpu_count()} cores; "
             f"{args.rounds} rounds x {args.steps} step(s), layouts alternated (keep_freed_memory); step = "
             "zero_grad + train_step (no optimizer); times from rank 0, between barriers.", ""]
    lines.append("| layout | plan | median step s | vs dp (per-round median, min-max) | predicted step s "
                 "(measured / predicted) | blocks cut | params held MiB, rank 0 / rank 1 (of whole) | loss |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for name in LAYOUTS:
        ts = r0["times"][name]
        ratios = [t / d for t, d in zip(ts, dp)]
        med = statistics.median(ts)
        ratio = "1" if name == "dp" else f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"
        pred = r0["predicted"][name]
        cut = ", ".join(f"{n} {k}" for k, n in r0["cut"][name].items()) or "-"
        held = " / ".join(f"{r['params'][name][0] / MiB:.2f} ({r['params'][name][0] / r['params'][name][1]:.0%} "
                          f"of {r['params'][name][1] / MiB:.2f})" for r in results)
        lines.append(f"| {NAMES[name]} | {r0['layout'][name]} | {med:.3f} | {ratio} | {pred:.3f} "
                     f"({med / pred:.2f}) | {cut} | {held} | {r0['losses'][name]:.4f} |")
    lines += ["", "Chosen vs rejected, measured (the planner left free: `tensor_parallel_size=None`, stages and "
              "replicas its own; on a CPU it offers tensor parallelism only where asked, so the tp row is the "
              "price it would pay):", ""]
    lines += chosen_vs_rejected(r0["chosen"], r0["predicted"], r0["times"])
    if r0["chosen"] != "dp":
        lines += chosen_vs_rejected("dp", r0["predicted"], {"dp": dp, "tp": r0["times"]["tp"]})[2:]
    lines.append("")
    for name in LAYOUTS:
        note = r0["note"][name]
        if note:
            lines.append(f"- {name}: {note}")
        if r0["cut_params"][name]:
            lines.append(f"- {name}: parameters cut: {', '.join(r0['cut_params'][name])}")
    lines.append("- per-rank step times (s, per round): " + "; ".join(
        f"rank {r['rank']} {n}: {[round(t, 3) for t in r['times'][n]]}" for r in results for n in LAYOUTS))
    lines.append("- losses on the first step, per rank: " + "; ".join(
        f"rank {r['rank']} " + ", ".join(f"{n} {v:.5f}" for n, v in r["losses"].items()) for r in results))
    lines.append("- auto_parallel set-up s / first (warm-up) step s, rank 0: " + ", ".join(
        f"{n} {r0['built'][n]:.1f} / {r0['warm'][n]:.2f}" for n in LAYOUTS))
    lines.append(f"- wall time {wall_s:.0f} s; load average (1, 5, 15 min) at the start "
                 f"{', '.join(f'{v:.1f}' for v in load)}, at the end "
                 f"{', '.join(f'{v:.1f}' for v in os.getloadavg())}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1, help="steps timed per layout per round")
    parser.add_argument("--batch", type=int, default=32, help="global batch (data parallelism: half per replica)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--layers", type=int, default=None, help="n_layer (default: CONFIG's)")
    parser.add_argument("--embd", type=int, default=None, help="n_embd (default: CONFIG's)")
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = parser.parse_args()
    if not 0 < args.batch <= build()[1].size(0):
        parser.error(f"--batch must be 1 to {build()[1].size(0)} (the benchmark's batch, sliced)")
    config = dict(CONFIG)
    if args.layers:
        config["n_layer"] = args.layers
    if args.embd:
        config["n_embd"] = args.embd
    start, load = time.perf_counter(), os.getloadavg()
    results = run_local(job, 2, args.rounds, args.steps, args.batch, args.microbatches, config,
                        timeout_s=1800, keep_freed_memory=True)
    lines = report(sorted(results, key=lambda r: r["rank"]), args, config, time.perf_counter() - start, load)
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        root = Path(__file__).resolve().parents[1]
        try:
            head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                  text=True, check=True).stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True,
                                   text=True, check=True).stdout.strip()
            rev = head + (" + uncommitted changes" if dirty else "")
        except (OSError, subprocess.CalledProcessError):
            rev = "unknown"
        command = "python " + " ".join([str(Path(sys.argv[0])), *sys.argv[1:]])
        Path(args.out).write_text(f"# Tensor vs data parallelism vs pipeline, 2 CPU ranks\n\n"
                                  f"`{command}` at {rev}\n\n{text}\n")


if __name__ == "__main__":
    main()
