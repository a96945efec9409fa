"""Plan GPT-3 175B for 1024 A100-80GB on this laptop-class machine: meta tensors only.

96 layers, d=12288, 96 heads, vocab 50257, sequence 2048, global batch 1536 sequences,
trained as torch's mixed precision runs it: fp32 weights, gradients and Adam state, every
stage's forward under bf16 autocast (bf16 matmuls and weight copies). The tuner picks
pipeline ranks x data-parallel replicas x micro-batches x schedule x recompute; every
stage must fit 80 GB. Prints the plan, the wall time and this process's peak RSS; with --world-size 8
shows the error naming how many GPUs are needed.
Usage: ``python benchmarks/plan_175b.py [--world-size 1024]``.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
from examples.gpt.model import GPT, GPTConfig  # noqa: E402

GPT3_175B = GPTConfig(block_size=2048, vocab_size=50257, n_layer=96, n_head=96, n_embd=12288)


def plan_175b(world_size: int, global_batch: int = 1536, config: GPTConfig = GPT3_175B,
              schedule: str = "auto") -> replica.Plan:
    with torch.device("meta"):
        model = GPT(config)
    tokens = torch.empty(global_batch, config.block_size, dtype=torch.long, device="meta")
    return replica.plan(model, (tokens,), world_size=world_size, device="a100-80gb", mixed_precision="bf16",
                        schedule=schedule)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=1024)
    args = parser.parse_args()
    start = time.perf_counter()
    try:
        plan = plan_175b(args.world_size)
        print(plan.summary())
        print(f"fullest stage: {max(s.predicted_memory_bytes for s in plan.stages) / 2**30:.1f} GiB")
    except replica.PartitionError as exc:
        print(f"PartitionError: {exc}")
    print(f"planned in {time.perf_counter() - start:.1f} s, peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
