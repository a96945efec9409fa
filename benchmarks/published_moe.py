"""Price a published mixture-of-experts training run with Replica's planner: predicted tokens/s per GPU vs published.

The run: NeMo AutoModel's pre-training table (NVIDIA-NeMo/Automodel ``docs/performance-summary.md``,
"System: DGX-H100, Precision: BF16", last updated 2025-10-02; its config
``examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml``): Qwen3 MoE 30B (Qwen3-30B-A3B: 48
layers, hidden 2048, 32 query / 4 key-value heads of 128, 128 experts of hidden 768 a layer, top-8,
vocab 151936) on 8 H100, global batch 512 × 4096 tokens, local batch 4 × 16 accumulation steps,
TP 1, PP 1, CP 1, EP 8, FSDP2 over the 8 GPUs, activation checkpointing, Adam, TE + DeepEP kernels
and a "fake balanced gate" (every expert the same number of tokens): 21.773 s a step, 277 model
TFLOP/s per GPU, 12,040 tokens/s per GPU.

Priced as that layout: Hugging Face's ``Qwen3MoeForCausalLM`` built on meta with those shapes
(``grouped_mm`` experts, bf16 weights: planning bf16 autocast on meta fails in the exported
graph's dtype asserts, so the weights are bf16 and no autocast), ``replica.plan`` with world 8,
one stage × 8 zero3-sharded replicas, ``expert_parallel_size=8``, 16 micro-batches, every block
checkpointed, ``cost="analytic"`` on the ``h100-80gb`` preset, no memory budget. On meta the
routing is not run: the all-to-all is priced balanced, as the published run's gate makes it.
``--free`` also plans the tuner's own layout for the same world and batch (it searches the
expert-parallel size with the rest; within the preset's memory).

Usage: ``python benchmarks/published_moe.py [--layers N] [--free]`` (``--layers`` plans a shallower
model of the same shapes and scales nothing: for a quick look only).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402

GPUS, GLOBAL_BATCH, SEQ, MICROBATCHES, EP = 8, 512, 4096, 16, 8
PUBLISHED_TPS, PUBLISHED_STEP_S, PUBLISHED_TFLOPS = 12_040, 21.773, 277


def qwen3_30b_a3b(layers: int = 48) -> torch.nn.Module:
    """Hugging Face's Qwen3MoeForCausalLM with Qwen3-30B-A3B's shapes, bf16, on meta."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=SEQ, use_cache=False,
        tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
    config._experts_implementation = "grouped_mm"  # every shape fixed by the batch: traceable on meta
    with torch.device("meta"):
        return transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)


def price(model: torch.nn.Module, free: bool = False) -> replica.Plan:
    tokens = torch.empty(GLOBAL_BATCH, SEQ, dtype=torch.long, device="meta")
    if free:
        return replica.plan(model, (tokens,), world_size=GPUS, device="h100-80gb", cost="analytic")
    return replica.plan(model, (tokens,), world_size=GPUS, num_stages=1, num_microbatches=MICROBATCHES,
                        schedule="1f1b", data_parallel_size=GPUS, device="h100-80gb", sharded_data_parallel="zero3",
                        recompute=True, cost="analytic", memory_budget=float("inf"), expert_parallel_size=EP)


def row(label: str, plan: replica.Plan, seconds: float) -> str:
    tps = GLOBAL_BATCH * SEQ / plan.predicted_step_time_s / GPUS
    memory = max(s.predicted_memory_bytes for s in plan.stages) / 2**30
    return (f"| {label} | {plan.layout.describe()}, {plan.num_microbatches} micro-batches | {PUBLISHED_TPS:,} "
            f"| {tps:,.0f} | {tps / PUBLISHED_TPS:.2f} | {plan.predicted_step_time_s:.2f} s ({PUBLISHED_STEP_S} s) "
            f"| {plan.expert_parallel_s:.2f} s | {plan.collective_s:.2f} s ({plan.exposed_collective_s:.2f} s) "
            f"| {memory:.0f} GiB | {seconds:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--free", action="store_true")
    args = parser.parse_args()
    model = qwen3_30b_a3b(args.layers)
    print(f"Qwen3-30B-A3B shapes, {args.layers} layers: {sum(p.numel() for p in model.parameters()) / 1e9:.1f} B "
          "parameters")
    print("| layout | priced | published TPS/GPU | predicted TPS/GPU | predicted / published | step (published) "
          "| all-to-all a step | FSDP collectives (exposed) | predicted memory | planned in |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    start = time.perf_counter()
    plan = price(model)
    print(row("published (EP8 x FSDP8)", plan, time.perf_counter() - start), flush=True)
    print(plan.summary(), file=sys.stderr)
    if args.free:
        start = time.perf_counter()
        plan = price(model, free=True)
        print(row("the tuner's own", plan, time.perf_counter() - start), flush=True)
        print(plan.summary(), file=sys.stderr)


if __name__ == "__main__":
    main()
