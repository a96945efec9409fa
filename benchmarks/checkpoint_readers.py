"""The one-process readers of a DCP checkpoint (#38): memory held beyond what they fill, against the largest tensor.

A GPT (examples/gpt/model.py; default 6 layers, d=384, vocab 2048, tied head: 11.4M parameters) is
trained one AdamW step by the Trainer on 4 gloo ranks in 1 stage x 4 zero3 replicas, so every
tensor is stored as 4 ranks' chunks. Then, in this process, each reader runs on that checkpoint:

- ``load_into_plain_model(step, model)``: into a plain model built beforehand;
- ``load_into_plain_model(step, model, optimizer=AdamW)``: weights and AdamW state (the moments it
  fills, 2x the model, are the optimizer's own: counted apart);
- ``export_safetensors(step, out)`` and ``replica export step out`` (the command, in process);
- ``stored_weights(step)``: the index alone (names, shapes, dtypes).

Each runs once in a fresh process (``--reader``), after a warm-up that imports what the readers use
and reads the index and the smallest tensor (so first-call imports are not counted), and is
measured above its start in two such processes: (1) the resident set's high-water mark alone
(``VmHWM``, reset through ``/proc/self/clear_refs``: what the machine gave the process, allocator
caching included); (2) the most tensor bytes alive at once (torch's profiler with
``profile_memory``: every CPU allocation and free in order, as benchmarks/sharded_dp.py does) and the
Python heap's peak (``tracemalloc``: the byte buffers DCP reads a chunk into before ``torch.load``ing
it). "Beyond what it fills": the high-water growth less the tensors the reader fills that did not
exist before (the AdamW moments). The export's live tensors include the memory map of the file it
wrote, opened by ``safetensors.safe_open`` to check it (file-sized, never read: not resident).
The claim (README, Checkpoints): memory holds about one tensor, not the model.

Usage: ``python benchmarks/checkpoint_readers.py [--layers 6] [--width 384] [--vocab 2048]``
(``--reader I --step DIR`` runs one reader; the script runs itself so).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import subprocess
import sys
import tempfile
import tracemalloc
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sharded_dp import allocation_peak  # noqa: E402
from examples.gpt.model import GPT, GPTConfig, loss_fn  # noqa: E402
from replica.launch import run_local  # noqa: E402

MIB = 2**20
LAYOUT = dict(num_stages=1, data_parallel_size=4, tensor_parallel_size=1, sharded_data_parallel="zero3")


def write(rank: int, world: int, directory: str, config: dict) -> str:
    """One AdamW step in 1 stage x 4 zero3 replicas, checkpointed by every rank: the step directory."""
    from replica.defaults import default_config
    from replica.train.trainer import get_trainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**config))
    x = torch.randint(0, config["vocab_size"], (8, config["block_size"]))
    trainer = get_trainer(default_config(batch_size=8, num_microbatches=2, shuffle=False, progress=False,
                                         checkpoint_dir=directory, timeout_s=600, **LAYOUT),
                          model, loss_fn, lambda params: torch.optim.AdamW(params, lr=1e-3))
    trainer.train_dataset(x, x, epochs=1)
    return str(trainer.resumed_from or Path(directory) / f"step-{trainer.step:08d}")


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def resident(fn: Callable[[], Any]) -> int:
    """``fn()``'s growth of the resident high-water mark."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    rss = _rss("VmRSS")
    fn()
    return _rss("VmHWM") - rss


def traced(fn: Callable[[], Any]) -> tuple[int, int]:
    """``fn()``'s peak live tensor bytes and peak Python heap bytes."""
    tracemalloc.start()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    heap = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return allocation_peak(prof), heap


READERS = ["load_into_plain_model(step, model)", "load_into_plain_model(step, model, optimizer=AdamW)",
           "export_safetensors(step, out)", "replica export step out", "stored_weights(step) (the index)"]


def one_reader(index: int, step: Path, config: dict, how: str) -> None:
    """Run reader ``index`` on ``step`` in this (fresh) process, measured ``how`` (``resident`` or
    ``traced``); print the numbers as JSON."""
    import safetensors.torch  # noqa: F401  (the export's)

    import replica
    from replica import cli
    from replica.checkpoint.tensors import stored_weights

    warm = stored_weights(step)
    specs = warm.specs
    warm.read(min(specs, key=lambda n: math.prod(specs[n][0])))
    del warm

    model = GPT(GPTConfig(**config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    out = step.parent.parent / f"hf-{index}-{how}"
    fills = 0
    if index == 0:
        fn: Callable[[], Any] = lambda: replica.load_into_plain_model(step, model)  # noqa: E731
    elif index == 1:
        fn = lambda: replica.load_into_plain_model(step, model, optimizer=optimizer)  # noqa: E731
        fills = 2 * weights  # exp_avg and exp_avg_sq (fp32) come to exist
    elif index == 2:
        fn = lambda: replica.export_safetensors(step, out)  # noqa: E731
    elif index == 3:
        def fn() -> None:
            with contextlib.redirect_stdout(io.StringIO()):
                cli.main(["export", str(step), str(out)])
    else:
        fn = lambda: stored_weights(step)  # noqa: E731
    if how == "resident":
        print(json.dumps({"hwm": resident(fn), "fills": fills}))
    else:
        tensors, heap = traced(fn)
        print(json.dumps({"tensors": tensors, "heap": heap}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--reader", type=int)
    parser.add_argument("--step")
    parser.add_argument("--how", default="resident")
    args = parser.parse_args()
    config = dict(block_size=64, vocab_size=args.vocab, n_layer=args.layers, n_head=6, n_embd=args.width,
                  dropout=0.0)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if args.reader is not None:
        one_reader(args.reader, Path(args.step), config, args.how)
        return
    fresh = GPT(GPTConfig(**config))
    largest = max(t.numel() * t.element_size() for t in fresh.state_dict().values())
    weights = sum(p.numel() * p.element_size() for p in fresh.parameters())
    with tempfile.TemporaryDirectory() as root:
        step = Path(run_local(write, 4, f"{root}/checkpoints", config, timeout_s=1800)[0])
        stored = sum(f.stat().st_size for f in step.iterdir())
        files = len([f for f in step.iterdir() if f.suffix == ".distcp"])
        print(f"GPT {args.layers} layers, d={args.width}, vocab {args.vocab}: {weights / 4 / 1e6:.1f}M parameters, "
              f"weights {weights / MIB:.1f} MiB, largest tensor {largest / MIB:.2f} MiB; checkpoint "
              f"{stored / MIB:.1f} MiB in {files} DCP files (4 zero3 ranks)\n")
        print("| reader | live tensors MiB | Python heap MiB | RSS high-water MiB | beyond what it fills MiB "
              "| x largest tensor | x model weights |")
        print("|---|---|---|---|---|---|---|")
        for index, name in enumerate(READERS):
            row = {}
            for how in ("resident", "traced"):
                done = subprocess.run([sys.executable, __file__, "--reader", str(index), "--step", str(step),
                                       "--how", how, "--layers", str(args.layers), "--width", str(args.width),
                                       "--vocab", str(args.vocab)], capture_output=True, text=True, check=True)
                row.update(json.loads(done.stdout.strip().splitlines()[-1]))
            beyond = row["hwm"] - row["fills"]
            print(f"| {name} | {row['tensors'] / MIB:.2f} | {row['heap'] / MIB:.2f} | {row['hwm'] / MIB:.2f} "
                  f"| {beyond / MIB:.2f} | {beyond / largest:.2f}x | {beyond / weights:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
