"""Where a pipelined step's time goes: Replica's measured timeline beside its plan's prediction.

The benchmark GPT of ``pipeline_vs_torch.py`` on 2 gloo ranks x 1 thread, 8 micro-batches,
timed with ``PipelineModel.measure_step`` (every action on every rank; an action starts when
its inputs have arrived, so a wait for a peer is idle time). After ``--warmup`` steps it
measures ``--steps`` steps and prints, for the step of median length, each rank's busy share
and every action's start and length, with the plan's simulated start beside it; then the
median over steps of each rank's busy time, its waits, and the step. Writes that step's
Chrome trace and the plan's HTML report with it drawn under the simulated schedule.
Usage: ``python benchmarks/step_timeline.py [--steps 12] [--schedule 1f1b] [--keep] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
from benchmarks.pipeline_vs_torch import MICROBATCHES, build  # noqa: E402
from examples.gpt.model import loss_fn  # noqa: E402
from replica.launch import run_local  # noqa: E402
from replica.planner.costs import stage_costs_from_plan  # noqa: E402
from replica.schedules.simulate import Timeline, simulate  # noqa: E402
from replica.viz.chrome import write_chrome_trace  # noqa: E402


def job(rank: int, world: int, schedule: str, keep: bool, warmup: int, steps: int, out: str) -> list[Timeline]:
    model, x, y = build()
    pm = replica.auto_parallel(model, (x,), num_stages=replica.Layout.for_world(schedule, 2).num_stages,
                               num_microbatches=MICROBATCHES, schedule=schedule, loss_fn=loss_fn,
                               **({"recompute": False} if keep else {}))
    for _ in range(warmup):
        pm.zero_grad()
        pm.train_step(x, y)
    timelines = []
    for _ in range(steps):
        pm.zero_grad()
        timelines.append(pm.measure_step(x, y)[1])
    if rank == 0:
        median = sorted(timelines, key=lambda t: t.step_time_s)[len(timelines) // 2]
        write_chrome_trace(median, Path(out) / "step.json", name=f"replica {schedule}")
        replica.visualize(pm, Path(out) / "plan.html", measured=median)
        sizes = [share * pm.plan.num_microbatches for share in pm.plan.microbatch_shares]  # graded, as planned
        predicted = simulate(pm.schedule, stage_costs_from_plan(pm.plan, pm.schedule), sizes=sizes)
        print(pm.plan.summary())
        _print_step(median, predicted)
    return timelines


def _print_step(measured: Timeline, predicted: Timeline) -> None:
    planned = {e.action: e for e in predicted.events}
    print(f"\nthe step of median length: {measured.step_time_s:.3f} s (the plan predicts {predicted.step_time_s:.3f} s)")
    for rank in range(measured.num_ranks):
        print(f"rank {rank}: busy {measured.busy_s[rank]:.3f} s ({measured.busy_s[rank] / measured.step_time_s:.0%})")
        print(f"  {'action':>7} {'start ms':>9} {'ms':>7} {'waited ms':>10} {'planned start':>14} {'planned ms':>11}")
        free = 0.0
        for e in (e for e in measured.events if e.rank == rank):
            p = planned.get(e.action)
            plan_cols = f"{p.start_s * 1e3:>14.1f} {(p.end_s - p.start_s) * 1e3:>11.1f}" if p else f"{'':>14} {'':>11}"
            print(f"  {str(e.action):>7} {e.start_s * 1e3:>9.1f} {(e.end_s - e.start_s) * 1e3:>7.1f} "
                  f"{(e.start_s - free) * 1e3:>10.1f} {plan_cols}")
            free = e.end_s
        print(f"  {'end':>7} {measured.step_time_s * 1e3:>9.1f} {'':>7} {(measured.step_time_s - free) * 1e3:>10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", help="1f1b, gpipe, zb-h1, interleaved, zb-v")
    parser.add_argument("--keep", action="store_true", help="keep every activation (recompute=False)")
    parser.add_argument("--out", default="out/step-timeline", help="directory for step.json and plan.html")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    timelines = run_local(job, 2, args.schedule, args.keep, args.warmup, args.steps, args.out, timeout_s=1800,
                          keep_freed_memory=True)[0]  # glibc keeps freed memory, as measured before
    med = statistics.median
    print(f"\nmedian over {args.steps} measured steps: step {med(t.step_time_s for t in timelines):.3f} s")
    for rank in range(2):
        busy = med(t.busy_s[rank] for t in timelines)
        idle = med(t.step_time_s - t.busy_s[rank] for t in timelines)
        print(f"  rank {rank}: busy {busy:.3f} s, idle {idle:.3f} s "
              f"({med((t.step_time_s - t.busy_s[rank]) / t.step_time_s for t in timelines):.1%} of the step)")
    print(f"wrote {Path(args.out) / 'step.json'} (chrome://tracing, Perfetto) and {Path(args.out) / 'plan.html'}")


if __name__ == "__main__":
    main()
