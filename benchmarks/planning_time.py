"""Planning time, old code against new (issue #32: nothing measured gets slower), side by side.

Two calls, 1 torch thread, each timed alone in a fresh process:

- ``gpt``: ``replica.auto_parallel`` on the benchmark GPT (examples/gpt/model.py, 8 layers,
  d=256, vocab 512, batch 32x128; pipeline_vs_torch.py's ``build()``), 2 stages, 8 micro-batches,
  the default ``cost="auto"`` (ops profiled on this CPU);
- ``gpt2``: ``replica.plan`` on a transformers ``GPT2LMHeadModel`` (4 layers, d=256, 4 heads, vocab
  1000, ids 8x128 with an attention mask, as tests/test_hf_models.py feeds GPT-2), 2 stages, 4
  micro-batches.

``cold``: a new, empty profile cache (``REPLICA_CACHE_DIR``); ``warm``: the same call again, in
a new process, on the cache the cold one filled. The driver alternates the two trees round by
round (each round starting with the other tree), each tree's ``replica`` put first on
``PYTHONPATH``, and prints per (case, cache) the median seconds of each tree, new / old of the
medians and (min-max) new / old within a round.
Usage: ``python benchmarks/planning_time.py --old /tmp/replica-old [--new .] [--rounds 5]
[--cases gpt,gpt2]`` (the old tree e.g. ``git worktree add /tmp/replica-old 7431322``);
``--one CASE --tree DIR`` times one call and prints it as JSON (``REPLICA_CACHE_DIR`` from the
environment).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = dict(block_size=128, vocab_size=512, n_layer=8, n_head=8, n_embd=256, dropout=0.0)  # pipeline_vs_torch.py's
BATCH, SEQ = 32, 128
GPT2 = dict(n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=128)
GPT2_BATCH = 8


def one(case: str, tree: Path) -> dict:
    """Time one planning call with the ``replica`` of ``tree`` (checked), 1 thread."""
    torch.set_num_threads(1)
    sys.path.insert(0, str(tree))  # examples/ from the same tree; PYTHONPATH already puts its replica first
    import replica

    where = Path(replica.__file__).resolve()
    if tree.resolve() not in where.parents:
        raise SystemExit(f"replica imported from {where}, not from {tree}")
    if case == "gpt":
        from examples.gpt.model import GPT, GPTConfig, loss_fn

        torch.manual_seed(0)
        model = GPT(GPTConfig(**CONFIG))
        x = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
        start = time.perf_counter()
        pm = replica.auto_parallel(model, (x,), num_stages=2, num_microbatches=8, loss_fn=loss_fn)
        seconds = time.perf_counter() - start
        plan = pm.plan
    else:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers

        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2, use_cache=False))
        ids = torch.randint(0, GPT2["vocab_size"], (GPT2_BATCH, SEQ))
        mask = torch.ones(GPT2_BATCH, SEQ, dtype=torch.long)
        mask[1::2, SEQ - 3:] = 0  # trailing padding on every other sample, as the tests
        start = time.perf_counter()
        plan = replica.plan(model, (ids,), example_kwargs=dict(attention_mask=mask), num_stages=2, num_microbatches=4)
        seconds = time.perf_counter() - start
    return dict(case=case, tree=str(tree), replica=str(where), seconds=seconds, schedule=str(plan.schedule),
                num_stages=plan.num_stages, num_microbatches=plan.num_microbatches)


def run_one(case: str, tree: Path, cache: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), REPLICA_CACHE_DIR=cache, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, __file__, "--one", case, "--tree", str(tree)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", choices=("gpt", "gpt2"), help="time one call here and print it as JSON")
    parser.add_argument("--tree", type=Path, help="with --one: the tree replica must come from")
    parser.add_argument("--old", type=Path, help="the old tree (e.g. a worktree of 7431322)")
    parser.add_argument("--new", type=Path, default=ROOT)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", default="gpt,gpt2")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.tree or ROOT)))
        return
    if args.old is None:
        parser.error("--old is needed (or --one)")
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    cases = args.cases.split(",")
    times: dict[tuple[str, str, str], list[float]] = {}
    plans: dict[tuple[str, str], set[str]] = {}
    for r in range(args.rounds):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        for case in cases:
            for name in order:
                with tempfile.TemporaryDirectory(prefix="replica-cache-") as cache:
                    for cache_state in ("cold", "warm"):
                        got = run_one(case, trees[name], cache)
                        times.setdefault((case, cache_state, name), []).append(got["seconds"])
                        plans.setdefault((case, name), set()).add(
                            f"{got['schedule']} {got['num_stages']} stages m={got['num_microbatches']}")
                        print(f"round {r + 1} {case} {cache_state} {name}: {got['seconds']:.2f} s", flush=True)
    print(f"\nold {trees['old']}, new {trees['new']}; medians of {args.rounds} rounds, 1 thread")
    print("| case | cache | old s | new s | new/old |")
    print("|---|---|---|---|---|")
    for case in cases:
        for cache_state in ("cold", "warm"):
            old = statistics.median(times[(case, cache_state, "old")])
            new = statistics.median(times[(case, cache_state, "new")])
            ratios = [n / o for n, o in zip(times[(case, cache_state, "new")], times[(case, cache_state, "old")])]
            print(f"| {case} | {cache_state} | {old:.2f} | {new:.2f} | {new / old:.3f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    for case in cases:
        for name in ("old", "new"):
            print(f"{case} {name} plans: {', '.join(sorted(plans[(case, name)]))}")


if __name__ == "__main__":
    main()
