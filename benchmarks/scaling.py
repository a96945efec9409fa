"""Predicted scaling, 1 to 1024 GPUs: the honest version of "linear scalability".

For the example GPT and GPT-3 175B (both on meta tensors, A100-80GB presets, bf16 with fp32
Adam), the tuner picks the best configuration for each world size and reports predicted
throughput: strong scaling (a fixed global batch) and weak scaling (the global batch grows
with the world). Efficiency = throughput / (world x the smallest world's throughput per GPU).
Usage: ``python benchmarks/scaling.py [--model small|175b|both] [--max-world 1024]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
from benchmarks.plan_175b import plan_175b  # noqa: E402
from examples.gpt.model import GPTConfig  # noqa: E402

MODELS = {
    "small": (GPTConfig(block_size=1024, vocab_size=50257, n_layer=24, n_head=16, n_embd=1024), 64),
    "175b": (GPTConfig(block_size=2048, vocab_size=50257, n_layer=96, n_head=96, n_embd=12288), 1536),
}


def predict(config: GPTConfig, world: int, batch: int) -> replica.Plan:
    return plan_175b(world, batch, config)  # the same meta-only planning, any GPT size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="both", choices=["small", "175b", "both"])
    parser.add_argument("--max-world", type=int, default=1024)
    args = parser.parse_args()
    names = ["small", "175b"] if args.model == "both" else [args.model]
    for name in names:
        config, base_batch = MODELS[name]
        smallest = 1 if name == "small" else 64
        worlds = [w for w in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if smallest <= w <= args.max_world]
        for mode in ("strong", "weak"):
            print(f"\n{name} GPT ({config.n_layer} layers, d={config.n_embd}), {mode} scaling, A100-80GB")
            print(f"{'GPUs':>6}{'batch':>7}{'layout':>34}{'step s':>9}{'tokens/s':>12}{'TFLOP/s/GPU':>13}"
                  f"{'efficiency':>12}")
            per_gpu0 = None
            for w in worlds:
                batch = base_batch if mode == "strong" else base_batch * w // worlds[0]
                if batch % 1:
                    continue
                start = time.perf_counter()
                try:
                    p = predict(config, w, batch)
                except replica.PartitionError as exc:
                    print(f"{w:>6}{batch:>7}  does not fit: {str(exc)[:70]}...")
                    continue
                tps = batch * config.block_size / p.predicted_step_time_s
                per_gpu0 = per_gpu0 or tps / w
                layout = (f"{p.pipeline_ranks}x{p.data_parallel_size} {p.schedule}"
                          f"{' rc' if p.recompute else ''} m={p.num_microbatches}")
                tflops = p.model_flops / p.predicted_step_time_s / w / 1e12
                print(f"{w:>6}{batch:>7}{layout:>34}{p.predicted_step_time_s:>9.2f}{tps:>12.0f}{tflops:>13.1f}"
                      f"{tps / (w * per_gpu0):>12.0%}   ({time.perf_counter() - start:.0f} s to plan)")


if __name__ == "__main__":
    main()
