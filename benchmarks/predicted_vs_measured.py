"""Predicted vs measured step time on this machine: does the simulator know the runtime?

GPT 8 layers, d=256, vocab 512, batch 32x128, on 2 gloo ranks x 1 thread, 2 stages, for
GPipe and 1F1B (and the zero-bubble schedules) at several micro-batch counts. Every
configuration is planned with profiled costs and its simulated step time is compared with
the median measured step, alternated round by round. The tuner's pick is the configuration
with the lowest prediction; it is good when its measured time is close to the best measured.
Usage: ``python benchmarks/predicted_vs_measured.py [--rounds 3] [--steps 2]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
from benchmarks.pipeline_vs_torch import build  # noqa: E402
from examples.gpt.model import loss_fn  # noqa: E402
from replica.launch import run_local  # noqa: E402

CONFIGS = [(s, m) for s in ("gpipe", "1f1b") for m in (2, 4, 8, 16)] + [("zb-h1", 8), ("zb-v", 8)]


def job(rank: int, world: int, rounds: int, steps: int) -> dict:
    model, x, y = build()
    pms = {}
    for schedule, m in CONFIGS:
        import copy

        stages = 4 if schedule == "zb-v" else 2
        pms[(schedule, m)] = replica.auto_parallel(copy.deepcopy(model), (x,), num_stages=stages,
                                                   num_microbatches=m, schedule=schedule, loss_fn=loss_fn)
    times: dict[tuple[str, int], list[float]] = {k: [] for k in pms}
    for pm in pms.values():  # warm-up
        pm.train_step(x, y)
    for _ in range(rounds):
        for key, pm in pms.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                pm.zero_grad()
                pm.train_step(x, y)
            dist.barrier()
            times[key].append((time.perf_counter() - start) / steps)
    return {f"{s} m={m}": (pm.plan.predicted_step_time_s, statistics.median(times[(s, m)]))
            for (s, m), pm in pms.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    result = run_local(job, 2, args.rounds, args.steps, timeout_s=3000, keep_freed_memory=True)[0]
    print(f"{'configuration':<16}{'predicted s':>13}{'measured s':>12}{'error':>9}")
    for name, (pred, meas) in result.items():
        print(f"{name:<16}{pred:>13.3f}{meas:>12.3f}{pred / meas - 1:>+9.1%}")
    pick = min(result, key=lambda k: result[k][0])
    best = min(result, key=lambda k: result[k][1])
    print(f"tuner's pick (lowest prediction): {pick}, measured {result[pick][1]:.3f} s; best measured: {best}, "
          f"{result[best][1]:.3f} s; the pick is {result[pick][1] / result[best][1] - 1:+.1%} from the best")


if __name__ == "__main__":
    main()
