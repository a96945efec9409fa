"""One-GPU check: the example GPT through Replica on one device, predicted against measured.

For each GPT size, precision (fp32, bf16 autocast), schedule (1F1B on one stage, ZB-V's two
chunks on one rank) and recompute mode, in one process: the plan's predicted step time and
memory (profiled on this device, and priced analytically on the matching preset), the
measured step time (``train_step`` + AdamW ``step``, median of ``--steps`` after a warm-up),
tokens/s and peak memory (``torch.cuda.max_memory_allocated``: live tensor bytes, not the
allocator's reserve), beside the plain model's eager step (and ``torch.compile``'s, the
reference for the compile issue) on the same batch. A configuration that fails is a row with
its error, not the end of the run; the whole run stops starting configurations after
``--budget-s`` seconds. On a CPU it runs tiny sizes (CI keeps it alive); memory is measured
on CUDA only.

    python benchmarks/gpu_check.py                       # CUDA when present, else CPU tiny sizes
    python benchmarks/gpu_check.py --device cpu --sizes tiny --out /tmp/gpu_check.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
from examples.gpt.model import GPT, GPTConfig, loss_fn  # noqa: E402
from replica.units import format_bytes  # noqa: E402


@dataclass(frozen=True)
class Size:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    vocab_size: int
    batch: int


SIZES = {
    "tiny": Size("tiny", 2, 64, 4, 32, 256, 4),
    "small": Size("small", 4, 128, 4, 64, 256, 8),
    "gpt2-125m": Size("gpt2-125m", 12, 768, 12, 1024, 50304, 8),
    "gpt2-350m": Size("gpt2-350m", 24, 1024, 16, 1024, 50304, 8),
    "gpt2-760m": Size("gpt2-760m", 24, 1536, 16, 1024, 50304, 8),
}
DEFAULT_SIZES = {"cuda": ("gpt2-125m", "gpt2-350m", "gpt2-760m"), "cpu": ("tiny",)}
# (schedule, stages): both on one rank; 1F1B's one stage is micro-batched gradient accumulation,
# ZB-V runs its two chunks (the V) on the one rank with the split backward
SCHEDULES = (("1f1b", 1), ("zb-v", 2))
RECOMPUTE = (False, True, "selective", 1, "pointwise")
PRECISIONS = ("fp32", "bf16")
MICROBATCHES = 4


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def _allocated(device: torch.device) -> int:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def _timed(step, device: torch.device, steps: int, base: int) -> tuple[float, int | None]:
    """Median seconds of ``steps`` calls of ``step`` after one warm-up (which also makes the
    optimizer's state), and the peak memory over the timed ones above ``base`` (the bytes
    allocated before the model was copied to the device: the batch)."""
    step()
    _reset_peak(device)
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = _peak(device)
    return statistics.median(times), None if peak is None else peak - base


def _plain_row(size: Size, precision: str, model: torch.nn.Module, x, y, device, steps: int,
               compiled: bool = False, microbatches: int = 1) -> dict:
    """The plain model's step on the whole batch, or accumulated over ``microbatches`` slices of
    it (the work Replica's step does, without its runtime), eager or under ``torch.compile``."""
    base = _allocated(device)
    plain = copy.deepcopy(model).to(device)
    run = torch.compile(plain) if compiled else plain
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    pieces = list(zip(x.tensor_split(microbatches), y.tensor_split(microbatches)))

    def step() -> None:
        for xs, ys in pieces:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = loss_fn(run(xs), ys) * (len(xs) / len(x))
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds, peak = _timed(step, device, steps, base)
    what = "torch.compile" if compiled else "plain eager" if microbatches == 1 else f"plain eager x{microbatches}"
    return {"size": size.name, "precision": precision, "what": what,
            "measured_s": seconds, "tokens_per_s": x.numel() / seconds, "measured_peak_bytes": peak}


def _grad_error(pm, model: torch.nn.Module, x, y, device: torch.device, precision: str) -> float:
    """The largest relative error, over parameters, of Replica's gradient on one batch against
    the plain model's on it (``|g - g_plain| / |g_plain|``, Frobenius norms): ~1e-6 in fp32,
    ~1e-2 under bf16 autocast (the two sum micro-batches in another order)."""
    plain = copy.deepcopy(model).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = loss_fn(plain(x), y)
    loss.backward()
    pm.zero_grad()
    pm.train_step(x, y)
    want = dict(plain.named_parameters())
    worst = 0.0
    for name, p in pm.named_parameters():
        ref = want[name].grad
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        worst = max(worst, float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)))
    pm.zero_grad()
    del plain, want
    return worst


def _replica_row(size: Size, precision: str, schedule: str, stages: int, recompute, model, x, y, device,
                 steps: int, preset: str | None) -> dict:
    row = {"size": size.name, "precision": precision, "what": f"replica {schedule}", "schedule": schedule,
           "stages": stages, "recompute": recompute}
    mp = "bf16" if precision == "bf16" else None
    keywords = dict(num_stages=stages, num_microbatches=MICROBATCHES, schedule=schedule, recompute=recompute,
                    mixed_precision=mp)
    base = _allocated(device)
    mine = copy.deepcopy(model).to(device)
    if preset is not None:  # the same layout priced on the preset's rates, as a plan for a cluster would be
        analytic = replica.plan(mine, (x,), device=preset, cost="analytic", **keywords)
        row["preset"] = preset
        row["analytic_s"] = analytic.predicted_step_time_s
        row["analytic_bytes"] = sum(s.predicted_memory_bytes for s in analytic.stages)
    start = time.perf_counter()
    pm = replica.auto_parallel(mine, (x,), loss_fn=loss_fn, **keywords)
    row["plan_s"] = time.perf_counter() - start
    plan = pm.plan
    row["predicted_s"] = plan.predicted_step_time_s
    row["predicted_bytes"] = sum(s.predicted_memory_bytes for s in plan.stages)
    row["grad_error"] = _grad_error(pm, model, x, y, device, precision)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)

    def step() -> None:
        pm.train_step(x, y)
        opt.step()
        pm.zero_grad()

    row["measured_s"], row["measured_peak_bytes"] = _timed(step, device, steps, base)
    row["tokens_per_s"] = x.numel() / row["measured_s"]
    return row


def run(device: torch.device, sizes: list[str], steps: int, budget_s: float, compile_reference: bool,
        preset: str | None = None, recompute=RECOMPUTE, precisions=PRECISIONS, out: str | None = None) -> dict:
    """Every row, in order; rows past the budget are listed as skipped. ``preset``: price each
    layout on it analytically too (None: on CUDA, the GPU's own preset; on a CPU, none).
    ``out``: the JSON is rewritten there after every row, so a run cut short keeps what it measured."""
    began = time.perf_counter()
    if preset is None and device.type == "cuda":
        from replica.partition.cost import preset_for_cuda_device

        preset = preset_for_cuda_device(torch.cuda.get_device_name(device))
    rows: list[dict] = []
    for name in sizes:
        size = SIZES[name]
        torch.manual_seed(0)
        cfg = GPTConfig(block_size=size.block_size, vocab_size=size.vocab_size, n_layer=size.n_layer,
                        n_head=size.n_head, n_embd=size.n_embd)
        model = GPT(cfg)  # on the CPU: each row copies it to the device, so a row's peak is its own
        x = torch.randint(0, size.vocab_size, (size.batch, size.block_size), device=device)
        y = torch.randint(0, size.vocab_size, (size.batch, size.block_size), device=device)
        params = model.num_parameters()
        todo = []
        for precision in precisions:
            todo.append(("plain", precision, None, None, None))
            todo.append(("accumulate", precision, None, None, None))
            todo += [("replica", precision, s, n, r) for s, n in SCHEDULES for r in recompute]
        if compile_reference and name == sizes[-1]:  # last: the budget cuts it before any Replica row
            todo += [("compile", precision, None, None, None) for precision in precisions]
        for kind, precision, schedule, stages, mode in todo:
            if time.perf_counter() - began > budget_s:
                rows.append({"size": name, "precision": precision, "what": kind if schedule is None
                             else f"replica {schedule}", "recompute": mode, "skipped": "time budget"})
                continue
            try:
                if kind == "replica":
                    row = _replica_row(size, precision, schedule, stages, mode, model, x, y, device, steps, preset)
                else:
                    row = _plain_row(size, precision, model, x, y, device, steps, compiled=kind == "compile",
                                     microbatches=MICROBATCHES if kind == "accumulate" else 1)
            except Exception as exc:  # a failing configuration is a row: the rest still runs
                row = {"size": name, "precision": precision, "what": kind if schedule is None
                       else f"replica {schedule}", "recompute": mode,
                       "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300],
                       "where": traceback.format_exc().strip().splitlines()[-3][:200]}
            row["parameters"] = params
            row["tokens"] = x.numel()
            rows.append(row)
            print(_line(row), flush=True)
            if out:
                Path(out).write_text(json.dumps({"environment": _environment(device, preset, steps, began),
                                                 "rows": rows}, indent=1, default=str))
            gc.collect()  # the row's model, stages and optimizer go before the next row's peak
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del model, x, y
    return {"environment": _environment(device, preset, steps, began), "rows": rows}


def _environment(device: torch.device, preset: str | None, steps: int, began: float) -> dict:
    return {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else "cpu", "preset": preset, "microbatches": MICROBATCHES, "steps": steps,
            "seconds": time.perf_counter() - began}


def _bytes(n) -> str:
    return "-" if n is None else format_bytes(n)


def _err(e) -> str:
    return "-" if e is None else f"{e:.1e}"


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def _line(row: dict) -> str:
    head = f"{row['size']:<10} {row['precision']:<5} {row['what']:<15} {str(row.get('recompute', '')):<10}"
    if "error" in row:
        return f"{head} ERROR {row['error']}"
    if "skipped" in row:
        return f"{head} skipped ({row['skipped']})"
    return (f"{head} measured {_ms(row['measured_s'])} ms, predicted {_ms(row.get('predicted_s'))} ms "
            f"(preset {_ms(row.get('analytic_s'))}), grad error {row.get('grad_error', float('nan')):.1e}, "
            f"{row['tokens_per_s']:.0f} tok/s, peak "
            f"{_bytes(row.get('measured_peak_bytes'))}, predicted {_bytes(row.get('predicted_bytes'))} ")


def markdown(result: dict) -> str:
    """A RESULTS table: one row per configuration, step times against the plain eager step on the
    whole batch and on the same micro-batches (gradient accumulation: the work without the runtime)."""
    rows = result["rows"]

    def eager(what: str) -> dict:
        return {(r["size"], r["precision"]): r["measured_s"] for r in rows if r.get("what") == what
                and "measured_s" in r}

    whole, sliced = eager("plain eager"), eager(f"plain eager x{MICROBATCHES}")
    out = [f"| size | precision | run | recompute | measured ms | vs eager | vs eager x{MICROBATCHES} "
           "| predicted ms (plan) "
           "| predicted ms (preset, analytic) | tokens/s | peak memory | predicted memory | grad error |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    skipped = sum("skipped" in r for r in rows)
    for r in rows:
        if "skipped" in r:
            continue
        if "error" in r:
            out.append(f"| {r['size']} | {r['precision']} | {r['what']} | {r.get('recompute', '')} | "
                       f"error: {r['error'][:120]} |||||||||")
            continue
        ratio = []
        for base in (whole.get((r["size"], r["precision"])), sliced.get((r["size"], r["precision"]))):
            ratio.append(f"{r['measured_s'] / base:.2f}x" if base else "-")
        out.append(f"| {r['size']} | {r['precision']} | {r['what']} | {r.get('recompute', '')} | "
                   f"{_ms(r['measured_s'])} | {ratio[0]} | {ratio[1]} | {_ms(r.get('predicted_s'))} | "
                   f"{_ms(r.get('analytic_s'))} | "
                   f"{r['tokens_per_s']:.0f} | {_bytes(r.get('measured_peak_bytes'))} | "
                   f"{_bytes(r.get('predicted_bytes'))} | {_err(r.get('grad_error'))} |")
    if skipped:
        out.append(f"\n{skipped} configurations not started: the time budget (--budget-s) ran out")
    return "\n".join(out)


def _mode(text: str):
    """A recompute mode as typed on the command line: False, True, an int k, or a name."""
    if text in ("False", "True"):
        return text == "True"
    if text.isdigit():
        return int(text)
    if text not in [m for m in RECOMPUTE if isinstance(m, str)]:
        raise SystemExit(f"unknown recompute mode {text!r}; pick from {', '.join(map(str, RECOMPUTE))}")
    return text


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", default=None, help=f"comma-separated, of {sorted(SIZES)}")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="start no configuration after this many seconds (the whole check: <= 5 minutes)")
    parser.add_argument("--no-compile-reference", action="store_true",
                        help="skip torch.compile of the plain model (default: on CUDA, for the last size, at the end)")
    parser.add_argument("--preset", default=None,
                        help="also price each layout analytically on this preset (default: the GPU's own)")
    parser.add_argument("--recompute", default=None,
                        help=f"comma-separated recompute modes (default: all of {', '.join(map(str, RECOMPUTE))})")
    parser.add_argument("--precisions", default=None,
                        help=f"comma-separated, of {', '.join(PRECISIONS)} (default: both)")
    parser.add_argument("--out", default=None, help="write the JSON here")
    parser.add_argument("--markdown", default=None, help="write the RESULTS table here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available here; pass --device cpu (tiny sizes)")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    sizes = args.sizes.split(",") if args.sizes else list(DEFAULT_SIZES["cuda" if device.type == "cuda" else "cpu"])
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"unknown sizes {unknown}; pick from {sorted(SIZES)}")
    recompute = RECOMPUTE if args.recompute is None else tuple(_mode(m) for m in args.recompute.split(","))
    precisions = PRECISIONS if args.precisions is None else tuple(args.precisions.split(","))
    if set(precisions) - set(PRECISIONS):
        raise SystemExit(f"unknown precisions {sorted(set(precisions) - set(PRECISIONS))}; pick from {PRECISIONS}")
    compiled = device.type == "cuda" and not args.no_compile_reference
    result = run(device, sizes, args.steps, args.budget_s, compiled, preset=args.preset, recompute=recompute,
                 precisions=precisions, out=args.out)
    table = markdown(result)
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return result


if __name__ == "__main__":
    main()
