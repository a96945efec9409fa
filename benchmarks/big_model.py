"""A GPT whose fp32 training state outgrows one process's share, built on meta and trained on 4 gloo ranks.

GPT 24 layers, d=1152, vocab 8192, block 128 (392,152,320 parameters: weights + gradients +
AdamW's two moments at 16 bytes a parameter = 6.27 GB) built under ``replica.deferred_init()``
(parameters on meta, nothing allocated), then ``replica.auto_parallel(..., num_stages=4,
num_microbatches=4, init=gpt_init)`` on 4 CPU ranks (gloo, 1 torch thread each): each rank
allocates and initializes only its own stages' weights, and trains 3 AdamW steps on a 4x128 batch.

Per rank: RSS just before ``auto_parallel`` (the baseline: torch imported, model on meta), peak
RSS (``ru_maxrss``, a lifetime peak), the plan's predicted memory for the rank's stages
(``StagePlan.predicted_memory_bytes``: weights + gradients + Adam's two fp32 moments, as
``auto_parallel``'s ``optimizer="adam"`` default prices them, + activations), the bytes of real
(non-meta) parameters the rank holds against the whole model's, and the step time. Targets
(#28 item 5): peak <= 1.2 x predicted + 300 MiB; predicted within 20% of the growth (peak
minus baseline).

Usage: ``python benchmarks/big_model.py [--n-layer 24] [--n-embd 1152] [--vocab 8192]
[--steps 3] [--keep-freed-memory]``.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
from examples.gpt.model import GPT, GPTConfig, loss_fn  # noqa: E402
from replica.launch import run_local  # noqa: E402

MiB = 1 << 20
BATCH, SEQ, STAGES, MICROBATCHES = 4, 128, 4, 4


def config(n_layer: int, n_embd: int, vocab: int) -> GPTConfig:
    return GPTConfig(block_size=SEQ, vocab_size=vocab, n_layer=n_layer, n_head=n_embd // 64 or 1,
                     n_embd=n_embd, dropout=0.0)


def num_parameters(cfg: GPTConfig) -> int:
    """GPT's parameter count from its shapes (tied embedding and head counted once)."""
    d, v, t = cfg.n_embd, cfg.vocab_size, cfg.block_size
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return v * d + t * d + cfg.n_layer * block + 2 * d


def rss_now() -> int:
    """Resident set size now, in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # ru_maxrss: KiB on Linux


def make_init(model: GPT):
    """GPT.__init__'s own init (``_init_weights`` and the scaled residual projections), which a
    model built on meta skipped: ``auto_parallel`` calls it on each module of a rank's stages
    after the module's ``reset_parameters()``."""
    scaled = {id(m) for name, m in model.named_modules() if name.endswith("c_proj")}
    std_proj = 0.02 / math.sqrt(2 * model.config.n_layer)

    def gpt_init(module: nn.Module) -> None:
        model._init_weights(module)
        if id(module) in scaled:
            nn.init.normal_(module.weight, mean=0.0, std=std_proj)

    return gpt_init


def rank_job(rank: int, world: int, n_layer: int, n_embd: int, vocab: int, steps: int) -> dict:
    cfg = config(n_layer, n_embd, vocab)
    with replica.deferred_init():
        model = GPT(cfg)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())  # tied once
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    y = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    torch.manual_seed(0)
    baseline = rss_now()
    peak_before = peak_rss()
    start = time.perf_counter()
    pm = replica.auto_parallel(model, (x,), num_stages=STAGES, num_microbatches=MICROBATCHES, schedule="1f1b",
                               loss_fn=loss_fn, init=make_init(model))
    setup_s = time.perf_counter() - start
    after_setup = rss_now()
    mine = sorted(s.stage_index for s in pm.stages)
    real = {id(p): p.numel() * p.element_size() for p in pm.parameters() if not p.is_meta}
    held = sum(real.values())
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4, weight_decay=0.1)
    times, losses, phases = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        pm.zero_grad()
        loss = pm.train_step(x, y)
        after_backward = (rss_now(), peak_rss())
        optimizer.step()
        times.append(time.perf_counter() - start)
        phases.append((*after_backward, rss_now(), peak_rss()))  # RSS, peak: after backward, after AdamW
        losses.append(float(loss) if loss is not None else None)
    # what the rank's tensors hold after training (weights, gradients, AdamW's moments, each
    # storage once) against RSS, before and after glibc hands free heap pages back (malloc_trim)
    storages = {}
    for p in pm.parameters():
        for t in (p, p.grad, *optimizer.state.get(p, {}).values()):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    live, rss_end = sum(storages.values()), rss_now()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed = rss_now()
    stages = [pm.plan.stages[k] for k in mine]
    memory = {f: sum(getattr(s.memory, f) for s in stages) for f in ("parameters", "gradients", "optimizer",
                                                                      "activations")}
    return dict(rank=rank, stages=mine, baseline=baseline, peak_before=peak_before, after_setup=after_setup,
                peak=peak_rss(), predicted=sum(s.predicted_memory_bytes for s in stages), memory=memory,
                held=held, whole=whole, times=times, phases=phases, live=live, rss_end=rss_end, trimmed=trimmed,
                losses=losses, setup_s=setup_s,
                summary=pm.plan.summary() if rank == 0 else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=24)
    parser.add_argument("--n-embd", type=int, default=1152)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="each rank calls replica.keep_freed_memory() first (glibc keeps freed memory)")
    args = parser.parse_args()
    cfg = config(args.n_layer, args.n_embd, args.vocab)
    n = num_parameters(cfg)
    print(f"GPT {cfg.n_layer} layers d={cfg.n_embd} heads {cfg.n_head} vocab {cfg.vocab_size} "
          f"block {cfg.block_size}: "
          f"{n:,} parameters; fp32 weights {4 * n / 1e9:.2f} GB, training state (x16) {16 * n / 1e9:.2f} GB "
          f"({16 * n / 2**30:.2f} GiB)")
    results = run_local(rank_job, STAGES, args.n_layer, args.n_embd, args.vocab, args.steps, timeout_s=3000,
                        keep_freed_memory=args.keep_freed_memory)
    print(results[0]["summary"])
    assert results[0]["whole"] == 4 * n, (results[0]["whole"], 4 * n)
    print(f"\n{STAGES} gloo ranks x 1 thread, batch {BATCH}x{SEQ}, {MICROBATCHES} micro-batches, 1F1B, AdamW, "
          f"{args.steps} steps, keep_freed_memory={args.keep_freed_memory}; MiB")
    print("losses:", [r["losses"] for r in results if r["losses"] and r["losses"][0] is not None][:1])
    head = (f"{'rank':>4} {'stages':>6} {'baseline':>9} {'peak':>7} {'growth':>7} {'pred.':>7} "
            f"{'of which W+G+Adam':>18} {'act.':>6} {'pred./growth':>12} {'peak limit':>10} {'peak/limit':>10} "
            f"{'real params':>11} "
            f"{'of whole':>8} {'setup s':>8} {'step s':>7}")
    print(head)
    for r in results:
        growth = r["peak"] - r["baseline"]
        limit = 1.2 * r["predicted"] + 300 * MiB
        state = r["memory"]["parameters"] + r["memory"]["gradients"] + r["memory"]["optimizer"]
        step = statistics.median(r["times"][1:] or r["times"])
        print(f"{r['rank']:>4} {','.join(map(str, r['stages'])):>6} {r['baseline'] / MiB:>9.0f} "
              f"{r['peak'] / MiB:>7.0f} {growth / MiB:>7.0f} {r['predicted'] / MiB:>7.0f} {state / MiB:>18.0f} "
              f"{r['memory']['activations'] / MiB:>6.0f} {r['predicted'] / growth:>12.2f} {limit / MiB:>10.0f} "
              f"{r['peak'] / limit:>10.2f} {r['held'] / MiB:>11.0f} {r['held'] / r['whole']:>8.1%} "
              f"{r['setup_s']:>8.1f} {step:>7.2f}")
    print("step times (s) per rank:", [[round(t, 2) for t in r["times"]] for r in results])
    print("RSS after auto_parallel (MiB):", [round(r["after_setup"] / MiB) for r in results],
          "; peak before it:", [round(r["peak_before"] / MiB) for r in results])
    print("per step, MiB above baseline: RSS after backward / peak so far | after AdamW / peak so far:")
    for r in results:
        above = [[f"{(v - r['baseline']) / MiB:.0f}" for v in ph] for ph in r["phases"]]
        print(f"  rank {r['rank']}: " + "; ".join(" / ".join(a[:2]) + " | " + " / ".join(a[2:]) for a in above))
    print("after the last step, MiB above baseline: tensors held (weights, grads, AdamW) / RSS / "
          "RSS after malloc_trim: "
          + "; ".join(f"rank {r['rank']} {r['live'] / MiB:.0f} / {(r['rss_end'] - r['baseline']) / MiB:.0f} / "
                      f"{(r['trimmed'] - r['baseline']) / MiB:.0f}" for r in results))
    total_peak = sum(r["peak"] for r in results)
    print(f"sum of peaks {total_peak / MiB:.0f} MiB; whole model's training state {16 * n / MiB:.0f} MiB")
    for r in results:
        growth = r["peak"] - r["baseline"]
        limit = 1.2 * r["predicted"] + 300 * MiB
        print(f"rank {r['rank']}: peak <= 1.2 x predicted + 300 MiB: {'met' if r['peak'] <= limit else 'MISSED'} "
              f"({(r['peak'] - limit) / MiB:+.0f} MiB); prediction within 20% of growth: "
              f"{'met' if abs(r['predicted'] / growth - 1) <= 0.2 else 'MISSED'} ({r['predicted'] / growth - 1:+.1%})")


if __name__ == "__main__":
    main()
