"""Compiled stages on 2 CPU ranks: Replica eager vs compiled, and vs torch's pipelining compiled by hand.

The example GPT (examples/gpt/model.py, its default config: 4 layers, d=128, vocab 256) on 2 gloo
ranks (1 thread each), a batch of 16x128 tokens, 1F1B over 2 stages, 4 micro-batches. Modes,
alternated round by round in one pair of processes (each round starts one mode later), every
step the same batch:

- ``replica-eager`` / ``replica-compiled``: ``replica.auto_parallel(..., num_stages=2,
  schedule="1f1b", compile=False / True)`` (inductor);
- ``torch-eager`` / ``torch-compiled``: ``torch.distributed.pipelining``'s ``Schedule1F1B`` on
  the two halves a user writes by hand (benchmarks/pipeline_vs_torch.py: embeddings + blocks 0-1
  | blocks 2-3 + norm + head), compiled by hand with ``module.compile()`` (inductor);
- ``replica-auto-compiled`` (``--auto``): no hint but ``compile=True``, the tuner's layout;
- ``replica-tp-eager`` / ``replica-tp-compiled`` (``--tp``): one stage cut over both ranks
  (``tensor_parallel_size=2``), 4 micro-batches, eager and compiled (DTensor traced, static
  shapes); beside them the planner's predicted compiled/eager step ratio for this machine.

Compile seconds: torch's own account (dynamo + AOTAutograd + inductor, forward and backward) over
each mode's warm-up step, the slower rank's. Inductor caches its compiled graphs on disk
(``/tmp/torchinductor_$USER``): a second run of this script starts from that cache. Recompiles:
graphs dynamo compiled after the warm-up (0: none). Usage: ``python benchmarks/compile.py
[--rounds 5] [--steps 3] [--auto] [--tp]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
from benchmarks.pipeline_vs_torch import FirstHalf, SecondHalf, median_interval, timed, torch_step  # noqa: E402
from examples.gpt.model import GPT, GPTConfig, loss_fn  # noqa: E402
from replica.launch import run_local  # noqa: E402
from replica.parallel.compile import compile_seconds, recompiles  # noqa: E402
from replica.units import format_seconds  # noqa: E402

BATCH, SEQ, MICROBATCHES = 16, 128, 4


def torch_pipeline(rank: int, model: GPT, compiled: bool):
    """torch's 1F1B on the halves a user writes by hand, each compiled whole where asked."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    half = model.config.n_layer // 2
    module = FirstHalf(model, half) if rank == 0 else SecondHalf(model, half)
    if compiled:
        module.compile()  # in place: the module keeps its names
    stage = PipelineStage(module, stage_index=rank, num_stages=2, device=torch.device("cpu"))
    return module, Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)


def compare(rank: int, world: int, rounds: int, steps: int, auto: bool, tp: bool = False) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    x = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
    y = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
    modes = {}
    summaries = {}
    for compiled in (False, True):
        module, sched = torch_pipeline(rank, copy.deepcopy(model), compiled)
        modes[f"torch-{'compiled' if compiled else 'eager'}"] = \
            lambda m=module, s=sched: torch_step(rank, m, s, x, y)
    cut = dict(num_stages=1, tensor_parallel_size=2, num_microbatches=MICROBATCHES, schedule="1f1b")
    predicted = {}
    for name, hints in (("replica-eager", dict(compile=False)), ("replica-compiled", dict(compile=True)),
                        *((("replica-auto-compiled", {"compile": True}),) if auto else ()),
                        *((("replica-tp-eager", dict(cut, compile=False)),
                           ("replica-tp-compiled", dict(cut, compile=True))) if tp else ())):
        if "auto" not in name and "tp" not in name:
            hints = dict(hints, num_stages=2, num_microbatches=MICROBATCHES, schedule="1f1b")
        pm = replica.auto_parallel(copy.deepcopy(model), (x,), loss_fn=loss_fn, **hints)
        summaries[name] = pm.plan.summary()
        predicted[name] = pm.plan.predicted_step_time_s
        modes[name] = lambda pm=pm: (pm.zero_grad(), pm.train_step(x, y))
    compile_s, graphs = {}, {}
    for name, fn in modes.items():  # warm up every path: its compile happens here
        before_s, before_graphs = compile_seconds(), recompiles()
        timed(fn, 1)
        compile_s[name], graphs[name] = compile_seconds() - before_s, recompiles() - before_graphs
    warm = recompiles()
    times: dict[str, list[float]] = {k: [] for k in modes}
    order = list(modes)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            times[name].append(timed(modes[name], steps)[0])
    return {"times": times, "compile_s": compile_s, "graphs": graphs, "recompiles": recompiles() - warm,
            "summaries": summaries, "predicted": predicted}


def ratio_cell(num: list[float], den: list[float]) -> str:
    """Per-round ratio ``num / den``: its median [95% bootstrap interval] (min-max)."""
    ratios = [a / b for a, b in zip(num, den)]
    low, high = median_interval(ratios)
    return f"{statistics.median(ratios):.3f} [{low:.3f}-{high:.3f}] ({min(ratios):.3f}-{max(ratios):.3f})"


def predicted_gains() -> None:
    """What the planner's price set (replica.partition.cost.fused_ops) predicts compile gains on an
    H100 (fp32, 1F1B over 2 stages, 4 micro-batches): planned on meta, nothing runs."""
    for config in (GPTConfig(), GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=8192, block_size=1024)):
        with torch.device("meta"):
            model = GPT(config)
        x = torch.randint(0, config.vocab_size, (8, config.block_size), device="meta")
        steps = {c: replica.plan(model, (x,), num_stages=2, num_microbatches=4, schedule="1f1b", device="h100-80gb",
                                 compile=c).predicted_step_time_s for c in (False, True)}
        print(f"predicted on h100-80gb, GPT {config.n_layer} layers d={config.n_embd} x 8x{config.block_size} tokens: "
              f"eager {format_seconds(steps[False])}, compiled {format_seconds(steps[True])}: "
              f"{steps[False] / steps[True]:.3f}x")


def titan_gains() -> None:
    """torchtitan's Llama-3 8B row on 8 H100s (FSDP, benchmarks/published_layouts.py) priced eager,
    compiled and compiled with float8 linears, beside its published Table 1 (5,762 -> 6,667 ->
    8,532 tokens/s per GPU: x1.157 from compile, x1.28 more from float8)."""
    from benchmarks.published_layouts import TITAN, llama3, price_titan, tokens_per_gpu

    run = TITAN[0]
    model = llama3(run.flavour)
    tps = {name: tokens_per_gpu(run, price_titan(run, model, **options)) for name, options in
           (("eager", dict(compile=False)), ("compiled", dict(compile=True)),
            ("float8", dict(compile=True, float8=True)))}
    print(f"predicted {run.label} {run.flavour} on {run.gpus} h100-80gb, tokens/s per GPU: eager {tps['eager']:,.0f}, "
          f"compiled {tps['compiled']:,.0f} (x{tps['compiled'] / tps['eager']:.3f}; published x{6667 / 5762:.3f}), "
          f"float8 {tps['float8']:,.0f} (x{tps['float8'] / tps['compiled']:.3f} over compiled; published "
          f"x{8532 / 6667:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--auto", action="store_true", help="also the tuner's layout, compiled")
    parser.add_argument("--tp", action="store_true", help="also one stage cut over both ranks, eager and compiled")
    args = parser.parse_args()
    results = run_local(compare, 2, args.rounds, args.steps, args.auto, args.tp, timeout_s=3000,
                        keep_freed_memory=True)
    times = results[0]["times"]
    for name, summary in results[0]["summaries"].items():
        print(f"--- {name}\n{summary}")
    print(f"\nexample GPT (4 layers, d=128, vocab 256), batch {BATCH}x{SEQ}, {MICROBATCHES} micro-batches, 1F1B over 2 "
          f"gloo ranks x 1 thread; {args.rounds} rounds x {args.steps} steps; ratios per round: median [95% interval] "
          "(min-max); compile s: the warm-up step's, slower rank; graphs: compiled in it [rank 0, rank 1]")
    w = max(len(k) for k in times) + 2
    print(f"{'mode':<{w}}{'step s':>9}{'compile s':>11}{'graphs':>9}  {'step vs replica-eager':<36}"
          f"{'speed vs torch-compiled':<36}")
    for name, ts in times.items():
        graphs = [r["graphs"][name] for r in results]
        compile_s = max(r["compile_s"][name] for r in results)
        print(f"{name:<{w}}{statistics.median(ts):>9.3f}{format_seconds(compile_s):>11}{str(graphs):>9}  "
              f"{ratio_cell(ts, times['replica-eager']):<36}{ratio_cell(times['torch-compiled'], ts):<36}")
    print(f"recompiles after the warm-up [rank 0, rank 1]: {[r['recompiles'] for r in results]}")
    if args.tp:
        p = results[0]["predicted"]
        measured = ratio_cell(times["replica-tp-compiled"], times["replica-tp-eager"])
        print(f"tensor parallel: compiled / eager step, measured {measured}, "
              f"predicted {p['replica-tp-compiled'] / p['replica-tp-eager']:.3f}")
    predicted_gains()
    titan_gains()


if __name__ == "__main__":
    main()
