"""Measured peak of live tensor bytes per pipeline rank beside the plan's prediction, for every recompute mode.

Two gloo ranks on this CPU run the example GPT (``examples/gpt/model.py``) through a pipeline:
1F1B over 2 stages (one a rank), ZB-V over 4 (two a rank, in a V) and interleaved 1F1B over 4 (two
a rank, looped), fp32 and bf16 autocast,
under each recompute mode (``False``, ``1``: the first block of each stage, ``"selective"``,
``True``: every block). Each rank measures one ``train_step`` + ``optimizer.step()`` (after a
warm-up step that makes Adam's state) with a tensor-level tracker, :class:`LiveBytes`: a
``TorchDispatchMode`` that counts each new storage an op makes until it is freed, on top of the
storages alive when the step starts (weights, Adam's moments, buffers) -- tensor bytes, not RSS,
which glibc's freed-but-kept memory blurs. The prediction is the planner's for that rank
(:func:`replica.planner.costs.rank_memory`: weights, gradients, optimizer state and what the
rank's actions hold at once, walked in its order, as the tuner reads it).

Usage: ``python benchmarks/activation_memory.py [--layers 8] [--embd 64] [--seq 64] [--batch 16]
[--microbatches 4] [--out table.md]`` (about 40 s on 2 cores).
"""

from __future__ import annotations

import argparse
import pickle
import sys
import weakref
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import replica  # noqa: E402
from replica.launch import run_local  # noqa: E402
from replica.planner.costs import rank_memory, stage_costs_from_plan  # noqa: E402
from replica.schedules.schedule import plan_schedule  # noqa: E402

MODES: tuple[Any, ...] = (False, 1, "selective", True)
RUNS = (("1f1b", 2), ("zb-v", 4), ("interleaved", 4))
PRECISIONS = (None, "bf16")


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages alive: those of ``start`` (tensors alive when tracking starts) and
    each one an op makes while the mode is active, until it is freed; ``peak`` is the most."""

    def __init__(self, start: list[torch.Tensor]) -> None:
        super().__init__()
        self.seen: set[int] = set()
        self.current = 0
        for t in start:
            self._add(t)
        self.peak = self.current

    def _add(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.seen:
            return
        self.seen.add(key)
        self.current += storage.nbytes()
        weakref.finalize(storage, self._free, key, storage.nbytes())

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = max(self.peak, self.current)
        return out


def _model(args: argparse.Namespace) -> tuple[torch.nn.Module, tuple[torch.Tensor], torch.Tensor, Any]:
    from examples.gpt.model import GPT, GPTConfig, loss_fn

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=args.seq, vocab_size=128, n_layer=args.layers, n_head=4, n_embd=args.embd))
    data = torch.randint(0, 128, (args.batch, args.seq + 1))
    return model, (data[:, :-1].contiguous(),), data[:, 1:].contiguous(), loss_fn


def job(rank: int, world: int, args: argparse.Namespace) -> bytes:
    torch.set_num_threads(1)
    rows = []
    for precision in PRECISIONS:
        for schedule, stages in RUNS:
            for mode in MODES:
                model, inputs, target, loss_fn = _model(args)
                pm = replica.auto_parallel(model, inputs, num_stages=stages, schedule=schedule, loss_fn=loss_fn,
                                           num_microbatches=args.microbatches, recompute=mode,
                                           mixed_precision=precision, device="a100-80gb", timeout_s=120)
                opt = torch.optim.Adam(pm.parameters(), lr=1e-4)
                pm.train_step(inputs, target)  # warm-up: Adam's state exists from here on
                opt.step()
                opt.zero_grad(set_to_none=True)
                start = [*pm.parameters(), *(b for s in pm.stages for b in s.module.buffers()),
                         *(v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))]
                with LiveBytes(start) as tracker:
                    pm.train_step(inputs, target)
                    opt.step()
                opt.zero_grad(set_to_none=True)
                plan = pm.plan
                predicted = rank_memory(stage_costs_from_plan(plan, plan_schedule(plan)), plan_schedule(plan))
                rows.append(dict(precision=precision or "fp32", schedule=schedule, mode=mode, rank=rank,
                                 measured=tracker.peak, predicted=predicted[pm.pipeline_rank],
                                 stages=[s.stage_index for s in pm.stages]))
    return pickle.dumps(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--out", help="also write the markdown table to this file")
    args = parser.parse_args()
    results = [pickle.loads(r) for r in run_local(job, 2, args, timeout_s=1800)]
    lines = ["| precision | schedule | recompute | rank (stages) | measured peak | predicted | predicted / measured |",
             "|---|---|---|---|---|---|---|"]
    worst = 0.0
    for rows in zip(*results):
        for r in rows:
            ratio = r["predicted"] / r["measured"]
            worst = max(worst, abs(ratio - 1))
            lines.append(f"| {r['precision']} | {r['schedule']} | {r['mode']!r} | {r['rank']} {r['stages']} | "
                         f"{r['measured'] / 2**20:.2f} MiB | {r['predicted'] / 2**20:.2f} MiB | {ratio:.3f} |")
    lines.append(f"\nlargest |predicted / measured - 1|: {worst:.1%}")
    order = {}
    for rows in zip(*results):
        for r in rows:
            order.setdefault((r["precision"], r["schedule"], r["rank"]), {})[repr(r["mode"])] = r["measured"]
    for key, by_mode in order.items():
        ok = by_mode["False"] > by_mode["1"] > by_mode["True"] and by_mode["False"] > by_mode["'selective'"] > \
            by_mode["True"]
        lines.append(f"{key}: False > 1 > True, False > 'selective' > True: {'yes' if ok else 'NO'}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
