"""The 8-layer benchmark GPT under bf16 on 2 gloo ranks: step time and per-rank peak RSS
beside fp32 and beside the plan's predictions.

GPT 8 layers, d=256, vocab 512, batch 32x128, 8 micro-batches (pipeline_vs_torch.py's model
and batch), ``replica.auto_parallel(num_stages=2, schedule="1f1b", mixed_precision=...)`` on
2 CPU ranks (gloo, 1 torch thread each), once with ``mixed_precision=None`` (fp32) and once
with ``"bf16"`` (each stage's forward and the loss under ``torch.autocast("cpu",
torch.bfloat16)``; weights, gradients and AdamW's moments stay fp32).

Step time: both pipelines are built in one pair of processes from the same weights and
timed in alternation, round by round (even rounds fp32 first, odd rounds bf16 first), a
step being ``zero_grad`` + ``train_step`` on the same batch (no optimizer: the weights stay
put, so both precisions' losses are of one model and one batch). Reported: the median over
the rounds, the per-round bf16/fp32 ratio (median, 95% bootstrap interval, range), and the
plan's ``predicted_step_time_s`` (each plan profiles its ops in its own precision).

Peak RSS: ``ru_maxrss`` is a lifetime peak, so each precision gets a fresh pair of processes
(fp32's, then bf16's) that builds the model, pipelines it and trains ``--rss-steps`` AdamW
steps. Per rank: RSS before the model is built (baseline: torch imported, gloo up), the
lifetime peak, the growth (peak - baseline), the peak of the training steps alone (VmHWM
reset after ``auto_parallel``), and the plan's ``predicted_memory_bytes`` over the rank's
stage (weights + gradients + AdamW's two moments + activations). Every rank calls
``replica.keep_freed_memory()`` as in the other benchmarks.

Beside them, the plain model in one process (no pipeline): what 3 forward+backward passes
add to RSS (VmHWM over the RSS before them, gradients already allocated) at ``--plain-batches``
sequences, in fp32 and under the same bf16 autocast: a micro-batch's worth and the whole batch.

Each run plans from op times profiled afresh in that run (a temporary ``REPLICA_CACHE_DIR``)
so both precisions are timed under the same conditions; ``--profile-cache`` reuses
``~/.cache/replica`` instead.

Usage: ``python benchmarks/mixed_precision.py [--rounds 8] [--steps 2] [--rss-steps 3]
[--recompute auto|keep|pointwise] [--plain-batches 4,32] [--markdown] [--summaries]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
from benchmarks.big_model import peak_rss, rss_now  # noqa: E402
from benchmarks.pipeline_vs_torch import BATCH, CONFIG, MICROBATCHES, SEQ, build, median_interval, timed  # noqa: E402
from examples.gpt.model import loss_fn  # noqa: E402
from replica.launch import run_local  # noqa: E402

MiB = 1 << 20
PRECISIONS = ("fp32", "bf16")
STAGES = 2
RECOMPUTE = {"auto": None, "keep": False, "pointwise": "pointwise"}  # --recompute -> auto_parallel(recompute=)


def pipeline(model: torch.nn.Module, x: torch.Tensor, precision: str, recompute: str) -> replica.PipelineModel:
    return replica.auto_parallel(model, (x,), num_stages=STAGES, num_microbatches=MICROBATCHES, schedule="1f1b",
                                 loss_fn=loss_fn, mixed_precision=precision, recompute=RECOMPUTE[recompute])


def predicted(pm: replica.PipelineModel) -> dict:
    """The plan's figures for this rank's stages (memory by part, what they rebuild) and its step time."""
    stages = [pm.plan.stages[s.stage_index] for s in pm.stages]
    memory = {f: sum(getattr(s.memory, f) for s in stages) for f in ("parameters", "gradients", "optimizer",
                                                                      "activations")}
    return dict(stages=[s.stage_index for s in stages], memory=memory,
                total=sum(s.predicted_memory_bytes for s in stages),
                step_s=pm.plan.predicted_step_time_s,
                precision=pm.plan.precision, rebuilds=sorted(pm.plan.rebuilt(stages[0].stage_index)))


def time_job(rank: int, world: int, rounds: int, steps: int, recompute: str) -> dict:
    """Both precisions' pipelines in these two processes, timed alternately."""
    model, x, y = build()
    pms = {p: pipeline(copy.deepcopy(model), x, p, recompute) for p in PRECISIONS}
    load = [os.getloadavg()[0]]
    losses = {}

    def step(p: str) -> None:
        pms[p].zero_grad()
        losses[p] = pms[p].train_step(x, y)

    for p in PRECISIONS:  # warm up each once
        timed(lambda p=p: step(p), 1)
    times: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    for r in range(rounds):
        for p in (PRECISIONS if r % 2 == 0 else PRECISIONS[::-1]):
            times[p].append(timed(lambda p=p: step(p), steps)[0])
    load.append(os.getloadavg()[0])
    return dict(times=times, load=load, plans={p: predicted(pm) for p, pm in pms.items()},
                losses={p: None if v is None else float(v) for p, v in losses.items()},
                summaries={p: pm.plan.summary() for p, pm in pms.items()} if rank == 0 else {})


def reset_peak() -> bool:
    """Reset this process's VmHWM (Linux: ``echo 5 > /proc/self/clear_refs``); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def high_water() -> int:
    """VmHWM: peak RSS since the last :func:`reset_peak` (bytes)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_job(rank: int, world: int, precision: str, steps: int, recompute: str) -> dict:
    """One precision in fresh processes: baseline, lifetime peak and the training steps' own peak."""
    baseline = rss_now()
    model, x, y = build()
    pm = pipeline(model, x, precision, recompute)
    del model
    after_setup = rss_now()
    setup_peak = peak_rss()
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4, weight_decay=0.1)
    reset = reset_peak()
    for _ in range(steps):
        pm.zero_grad()
        pm.train_step(x, y)
        optimizer.step()
    return dict(rank=rank, baseline=baseline, after_setup=after_setup, setup_peak=setup_peak, peak=peak_rss(),
                train_peak=high_water() if reset else None, plan=predicted(pm))


def plain_job(rank: int, world: int, precision: str, batch: int, steps: int = 3) -> int:
    """The plain model, one process: bytes its forward+backward passes add to RSS at ``batch``
    sequences (the gradients allocated beforehand, so: activations and transients)."""
    model, x, y = build()
    x, y = x[:batch], y[:batch]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    baseline = rss_now()
    if not reset_peak():
        return -1
    for _ in range(steps):
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_fn(model(x), y)
        loss.backward()
    return high_water() - baseline


def render(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        return "\n".join("| " + " | ".join(r) + " |" for r in [header, ["---"] * len(header), *rows])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per precision per round")
    parser.add_argument("--rss-steps", type=int, default=3, help="AdamW steps in each precision's RSS processes")
    parser.add_argument("--recompute", choices=tuple(RECOMPUTE), default="auto",
                        help="auto: the tuner picks what each stage rebuilds (per precision); keep: recompute=False, "
                        "every activation kept, so only the dtypes differ; pointwise: GELU outputs rebuilt")
    parser.add_argument("--profile-cache", action="store_true",
                        help="plan from ~/.cache/replica's op times (REPLICA_CACHE_DIR) instead of profiling both "
                        "precisions afresh in this run")
    parser.add_argument("--plain-batches", default="4,32", help="sequences for the plain model's one-process check "
                        "(comma-separated; '' skips it)")
    parser.add_argument("--no-rss", action="store_true")
    parser.add_argument("--markdown", action="store_true", help="tables as markdown (for RESULTS.md)")
    parser.add_argument("--summaries", action="store_true", help="also print both plans' summaries")
    args = parser.parse_args()
    fresh = None
    if not args.profile_cache:  # both precisions' op times from this run, on the machine as it is now
        fresh = os.environ["REPLICA_CACHE_DIR"] = tempfile.mkdtemp(prefix="replica-mixed-precision-")
    try:
        run(args)
    finally:
        if fresh:
            shutil.rmtree(fresh, ignore_errors=True)


def run(args: argparse.Namespace) -> None:
    results = run_local(time_job, 2, args.rounds, args.steps, args.recompute, timeout_s=1800,
                        keep_freed_memory=True)
    result = results[0]
    times, plans = result["times"], result["plans"]
    if args.summaries:
        for p, summary in result["summaries"].items():
            print(f"--- {p}\n{summary}")
    for p in PRECISIONS:
        assert plans[p]["precision"] == p, (p, plans[p]["precision"])
    tokens = BATCH * SEQ
    print(f"GPT {CONFIG['n_layer']} layers d={CONFIG['n_embd']} vocab {CONFIG['vocab_size']}, batch {BATCH}x{SEQ}, "
          f"{MICROBATCHES} micro-batches, {STAGES} stages 1F1B on 2 gloo ranks x 1 thread; "
          f"{args.rounds} rounds x {args.steps} steps, fp32 and bf16 alternating; recompute={args.recompute}; "
          f"torch {torch.__version__}; load average {result['load'][0]:.1f} before the rounds, "
          f"{result['load'][1]:.1f} after, on {os.cpu_count()} CPUs")
    med = {p: statistics.median(times[p]) for p in PRECISIONS}
    ratios = [b / f for b, f in zip(times["bf16"], times["fp32"])]
    low, high = median_interval(ratios)
    rows = []
    for p in PRECISIONS:
        pred = plans[p]["step_s"]
        lo, hi = median_interval(times[p])
        ratio = "1" if p == "fp32" else \
            f"{statistics.median(ratios):.3f} [{low:.3f}-{high:.3f}] ({min(ratios):.2f}-{max(ratios):.2f})"
        rows.append([p, f"{med[p]:.3f} [{lo:.3f}-{hi:.3f}]", f"{tokens / med[p]:,.0f}", ratio, f"{pred:.3f}",
                     f"{med[p] / pred:.2f}",
                     " / ".join(",".join(r["plans"][p]["rebuilds"]) or "-" for r in results)])
    print("\nstep time (train_step, no optimizer): median over rounds [95% interval]; bf16/fp32 per round: "
          "median [95% interval] (min-max)")
    print(render(["precision", "step s", "tokens/s", "bf16/fp32 step", "predicted s", "measured/predicted",
                  "rebuilt in backward (stage 0 / 1)"], rows, args.markdown))
    pred_ratio = plans["bf16"]["step_s"] / plans["fp32"]["step_s"]
    print(f"predicted bf16/fp32 step: {pred_ratio:.3f}")
    if None not in result["losses"].values():
        f, b = result["losses"]["fp32"], result["losses"]["bf16"]
        print(f"loss of the last timed step, same weights and batch: fp32 {f:.5f}, bf16 {b:.5f} ({b - f:+.5f})")
    if args.no_rss:
        return

    rss = {p: run_local(rss_job, 2, p, args.rss_steps, args.recompute, timeout_s=600, keep_freed_memory=True)
           for p in PRECISIONS}
    print(f"\nper-rank memory (MiB), fresh processes per precision, {args.rss_steps} AdamW steps; "
          "baseline: before the model is built; growth: peak - baseline; steps add: the steps' own peak (VmHWM "
          "reset after auto_parallel) - RSS after auto_parallel; predicted: W + G + AdamW + activations of the "
          "rank's stage")
    rows = []
    for rank in range(2):
        for p in PRECISIONS:
            r = rss[p][rank]
            m = r["plan"]["memory"]
            growth = r["peak"] - r["baseline"]
            state = m["parameters"] + m["gradients"] + m["optimizer"]
            train = r["train_peak"]
            ref = rss["fp32"][rank]
            ref_growth = ref["peak"] - ref["baseline"]
            vs = "" if p == "fp32" else f"{r['peak'] / ref['peak']:.3f} / {growth / ref_growth:.3f}"
            rows.append([str(rank), p, f"{r['baseline'] / MiB:.0f}", f"{r['peak'] / MiB:.0f}", f"{growth / MiB:.0f}",
                         vs, "-" if train is None else f"{(train - r['after_setup']) / MiB:.0f}",
                         f"{r['plan']['total'] / MiB:.0f} = {state / MiB:.0f} + {m['activations'] / MiB:.1f}",
                         f"{r['plan']['total'] / growth:.2f}"])
    print(render(["rank", "precision", "baseline", "peak", "growth", "bf16/fp32 peak / growth",
                  "steps add", "predicted = W+G+Adam + act.", "predicted/growth"], rows, args.markdown))
    for p in PRECISIONS:
        print(f"{p}: RSS after auto_parallel {[round(r['after_setup'] / MiB) for r in rss[p]]} MiB, "
              f"peak by then {[round(r['setup_peak'] / MiB) for r in rss[p]]} MiB")

    batches = [int(b) for b in args.plain_batches.split(",") if b]
    if batches:
        plain = {(p, b): run_local(plain_job, 1, p, b, timeout_s=600, keep_freed_memory=True)[0]
                 for b in batches for p in PRECISIONS}
        print("\nthe plain model in one process: what 3 forward+backward passes add to RSS (MiB), gradients "
              "allocated before")
        rows = [[str(b), *(f"{plain[(p, b)] / MiB:.0f}" for p in PRECISIONS),
                 f"{plain[('bf16', b)] / plain[('fp32', b)]:.3f}"] for b in batches]
        print(render(["sequences", *PRECISIONS, "bf16/fp32"], rows, args.markdown))


if __name__ == "__main__":
    main()
