"""How long the partitioner takes to cut a 96-layer GPT (on meta tensors) into 64 stages.

The graph has over 2,000 ops; the cut is priced on the ``a100-80gb`` preset, 8 micro-batches,
1F1B. Prints the best of ``--repeats`` runs of ``partition`` alone (the trace is made once).
Usage: ``python benchmarks/partition_time.py [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.gpt.model import GPT, GPTConfig  # noqa: E402
from replica.partition.cost import CostModel, device_spec  # noqa: E402
from replica.partition.partitioner import partition  # noqa: E402
from replica.partition.trace import trace  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with torch.device("meta"):
        model = GPT(GPTConfig(block_size=128, vocab_size=512, n_layer=96, n_head=4, n_embd=64))
    graph = trace(model, (torch.empty(8, 128, dtype=torch.long, device="meta"),)).graph
    cost = CostModel(device_spec("a100-80gb"))
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        p = partition(graph, cost, num_stages=64, num_microbatches=8, schedule="1f1b")
        best = min(best, time.perf_counter() - start)
    print(f"{len(graph)} ops into {p.num_stages} stages: best of {args.repeats} runs {best:.3f} s "
          f"({'exact' if p.exact else 'not proven exact'}; bottleneck stage at least {p.lower_bound_s:.4g} s)")


if __name__ == "__main__":
    main()
