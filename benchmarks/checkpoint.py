"""Checkpoints through torch.distributed.checkpoint (format 2, #38) against the format before it, on gloo CPU ranks.

A ~49M-parameter GPT (examples/gpt/model.py: 6 layers, d=768, vocab 8192, block 64) built by the
Trainer with AdamW, one step trained (so the moments exist), in three 4-rank layouts: ``zero3x4``
(1 stage x 4 zero3 replicas), ``pp2xzero3x2`` (2 stages x 2 zero3 replicas), ``tp2xdp2`` (2
tensor-parallel ranks x 2 replicated replicas). Each layout runs in its own ``run_local`` job;
each rank then saves (and loads back) its share both ways, in the same process, ``--repeats``
times, the order alternating:

- ``dcp``: ``replica.train.state.save_pipeline`` / ``load_into_pipeline`` (what the Trainer does
  now: every rank writes its own shards, checksums, rank 0 publishes).
- ``old``: format 1 as ``train/state.py::shard_of`` wrote it before (reimplemented here, as the
  code is gone): the replicas of a sharded stage and the tensor-parallel ranks of replica 0 gather
  every weight and AdamW moment whole (``full_tensor()``), then one rank per pipeline stage
  ``torch.save``s them (fsync + sha256, as before); loaded by ``state._load_legacy`` (format 1 is
  still read).

Per rank: the bytes it holds (weights + AdamW state, local shards: its "own state"); the peak
growth of live tensor bytes during the save (torch's profiler, ``profile_memory``: every CPU
allocation and free summed in order — tensors only, not RSS, as ``sharded_dp.py`` does), as a
multiple of its own state; the bytes it wrote (its files) and their share of the step's; save and
load seconds (between barriers, the median over repeats); and for ``checkpoint_async`` the
seconds training waits (the CPU copy and DCP's planning) and those until the step is published.
Target (#38): growth <= 1.2x own state, no rank writing more than 40% of the bytes.

Usage: ``python benchmarks/checkpoint.py [--layouts zero3x4,pp2xzero3x2,tp2xdp2] [--repeats 2]
[--layers 6] [--width 768] [--vocab 8192]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sharded_dp import allocation_peak  # noqa: E402
from examples.gpt.model import GPT, GPTConfig, loss_fn  # noqa: E402
from replica.launch import run_local  # noqa: E402

LAYOUTS = {
    "zero3x4": dict(num_stages=1, data_parallel_size=4, tensor_parallel_size=1, sharded_data_parallel="zero3"),
    "pp2xzero3x2": dict(num_stages=2, data_parallel_size=2, tensor_parallel_size=1, sharded_data_parallel="zero3"),
    "tp2xdp2": dict(num_stages=1, data_parallel_size=2, tensor_parallel_size=2, sharded_data_parallel=False),
}
MIB = 2**20


def _own_bytes(pm: Any, optimizer: torch.optim.Optimizer | None) -> int:
    """Weights + optimizer state this rank holds (local shards)."""
    from replica.parallel.fsdp import local_tensor

    total = 0
    for p in pm.parameters():
        for t in (p, *(optimizer.state.get(p, {}).values() if optimizer is not None else ())):
            if isinstance(t, torch.Tensor):
                total += local_tensor(t).numel() * t.element_size()
    return total


def _growth(fn: Any) -> tuple[Any, int]:
    """``fn()`` under torch's profiler: its result and the most tensor bytes alive at once above
    the start (every allocation and free in order)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return out, allocation_peak(prof)


def _old_save(directory: Path, pm: Any, optimizer: Any, names: dict, plain_keys: frozenset, world: int) -> list[str]:
    """Format 1, as ``shard_of`` + ``store.save`` wrote it: gathered whole, one writer per stage."""
    from replica.checkpoint.store import _write
    from replica.train.optim import state_by_name
    from replica.train.rng import rng_state

    if (pm.plan.layout.sharded and pm.data_parallel_size > 1) or pm.data_parallel_rank == 0:
        model = {k: v for k, v in pm.state_dict().items() if k in plain_keys}  # all-gathers
        optim = state_by_name(optimizer, names)  # all-gathers the moments
    if pm.data_parallel_rank != 0 or pm.tensor_parallel_rank != 0:
        return []
    count = world // (pm.data_parallel_size * pm.plan.layout.tensor_parallel_size)
    files = []
    for kind, obj in (("model", model), ("optim", optim), ("rng", rng_state())):
        name = f"{kind}-{pm.pipeline_rank:05d}-of-{count:05d}.pt"
        _write(directory / name, obj)
        files.append(name)
    if pm.pipeline_rank == 0:
        manifest = {"format": 1, "step": 1, "num_shards": count, "trainer": {}, "files": {}}
        (directory / "manifest.json").write_text(json.dumps(manifest))
        files.append("manifest.json")
    return files


def _timed(fn: Any) -> tuple[Any, float]:
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    dist.barrier()
    return out, time.perf_counter() - start


def job(rank: int, world: int, layout: str, root: str, repeats: int, config: dict) -> dict:
    from replica.defaults import default_config
    from replica.train import state
    from replica.train.trainer import get_trainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**config))
    x = torch.randint(0, config["vocab_size"], (8, config["block_size"]))
    trainer = get_trainer(default_config(batch_size=8, num_microbatches=2, schedule="1f1b", shuffle=False,
                                         progress=False, timeout_s=600, **LAYOUTS[layout]),
                          model, loss_fn, lambda params: torch.optim.AdamW(params, lr=1e-3))
    trainer.train_dataset(x, x, epochs=1)
    pm, optimizer = trainer.pipeline, trainer.optimizer
    names, plain_keys = trainer._names, trainer._plain_keys
    own = _own_bytes(pm, optimizer)
    base = Path(root) / layout
    rows: dict[str, list[dict]] = {"dcp": [], "old": [], "async": []}
    for r in range(repeats):
        for kind in (("dcp", "old") if r % 2 == 0 else ("old", "dcp")):
            directory = base / f"{kind}-{r}"
            if kind == "dcp":
                (_, growth), save_s = _timed(lambda: _growth(lambda: state.save_pipeline(
                    directory, 1, pm, optimizer, names, plain_keys, {"world_size": world}, keep=1).finish()))
                step = directory / "step-00000001"
                mine = [p.name for p in step.iterdir() if p.name.startswith(f"__{rank}_")]
                mine += [f"rank-{rank:05d}.pt"] + ([".metadata", "trainer.pt", "manifest.json"] if rank == 0 else [])
                _, load_s = _timed(lambda: state.load_into_pipeline(step, pm, optimizer, names, plain_keys))
            else:
                step = directory / "step-00000001"
                if rank == 0:
                    step.mkdir(parents=True)
                dist.barrier()
                (mine, growth), save_s = _timed(lambda: _growth(
                    lambda: _old_save(step, pm, optimizer, names, plain_keys, world)))
                _, load_s = _timed(lambda: state._load_legacy(step, pm, optimizer, names, plain_keys))
            written = sum((step / n).stat().st_size for n in mine)
            rows[kind].append({"growth": growth, "written": written, "save_s": save_s, "load_s": load_s})
            dist.barrier()
            if rank == 0:
                shutil.rmtree(directory, ignore_errors=True)
        # checkpoint_async: how long the step waits (the CPU copy, DCP's planning), then until published
        directory = base / f"async-{r}"
        pending, blocked_s = _timed(lambda: state.save_pipeline(directory, 1, pm, optimizer, names, plain_keys,
                                                                {"world_size": world}, keep=1, asynchronous=True))
        _, publish_s = _timed(pending.finish)
        rows["async"].append({"blocked_s": blocked_s, "publish_s": publish_s})
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
    return {"rank": rank, "own": own, "layout": pm.plan.layout.describe(), "rows": rows}


def report(layout: str, results: list[dict]) -> str:
    lines = [f"### {layout}: {results[0]['layout']}", "",
             "| rank | own state MiB | save growth MiB dcp (x own) | old (x own) | written MiB dcp (share) "
             "| old (share) | save s dcp / old | load s dcp / old |", "|---|---|---|---|---|---|---|---|"]
    totals = {k: sum(statistics.median(x["written"] for x in r["rows"][k]) for r in results) for k in ("dcp", "old")}
    for r in results:
        m = {k: {f: statistics.median(x[f] for x in r["rows"][k]) for f in ("growth", "written", "save_s", "load_s")}
             for k in ("dcp", "old")}
        own = r["own"]
        lines.append(
            f"| {r['rank']} | {own / MIB:.1f} | {m['dcp']['growth'] / MIB:.1f} ({m['dcp']['growth'] / own:.2f}x) "
            f"| {m['old']['growth'] / MIB:.1f} ({m['old']['growth'] / own:.2f}x) "
            f"| {m['dcp']['written'] / MIB:.1f} ({m['dcp']['written'] / max(totals['dcp'], 1):.0%}) "
            f"| {m['old']['written'] / MIB:.1f} ({m['old']['written'] / max(totals['old'], 1):.0%}) "
            f"| {m['dcp']['save_s']:.2f} / {m['old']['save_s']:.2f} "
            f"| {m['dcp']['load_s']:.2f} / {m['old']['load_s']:.2f} |")
    worst = max(statistics.median(x["growth"] for x in r["rows"]["dcp"]) / r["own"] for r in results)
    share = max(statistics.median(x["written"] for x in r["rows"]["dcp"]) for r in results) / max(totals["dcp"], 1)
    blocked = max(statistics.median(x["blocked_s"] for x in r["rows"]["async"]) for r in results)
    publish = max(statistics.median(x["publish_s"] for x in r["rows"]["async"]) for r in results)
    lines += ["", f"dcp: worst growth {worst:.2f}x own state (target <= 1.2x), largest writer {share:.0%} of "
              f"{totals['dcp'] / MIB:.0f} MiB (target <= 40%); old: {totals['old'] / MIB:.0f} MiB written; "
              f"checkpoint_async: training waits {blocked:.2f} s, published {publish:.2f} s later", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    config = dict(block_size=64, vocab_size=args.vocab, n_layer=args.layers, n_head=12, n_embd=args.width,
                  dropout=0.0)
    params = sum(p.numel() for p in GPT(GPTConfig(**config)).parameters())
    print(f"GPT {args.layers} layers, d={args.width}, vocab {args.vocab}: {params / 1e6:.1f}M parameters; "
          f"weights + AdamW {3 * 4 * params / MIB:.0f} MiB\n")
    with tempfile.TemporaryDirectory() as root:
        for layout in args.layouts.split(","):
            results = run_local(job, 4, layout, root, args.repeats, config, timeout_s=1800)
            print(report(layout, results), flush=True)


if __name__ == "__main__":
    main()
