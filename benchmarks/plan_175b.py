"""Plan GPT-3 175B for 1024 A100-80GB on this laptop-class machine: meta tensors only.

96 layers, d=12288, 96 heads, vocab 50257, sequence 2048, global batch 1536 sequences,
trained as torch's mixed precision runs it: fp32 weights, gradients and Adam state, every
stage's forward under bf16 autocast (bf16 matmuls and weight copies). The tuner picks
tensor-parallel shards x pipeline ranks x data-parallel replicas x micro-batches x schedule x
recompute; every stage must fit 80 GB. Prints the plan, the wall time and this process's peak
RSS; with --world-size 8 shows the error naming how many GPUs are needed. That default run plans
examples/gpt's GPT (fused q/k/v, as tests/test_tuner.py and scaling.py do).

``--compare-megatron`` plans GPT-3 175B as Megatron-LM's GPT (benchmarks/megatron_gpt.py:
separate q, k, v projections, which the tensor-parallel pattern finder cuts; vocabulary 51,200,
Megatron's padded GPT-2 vocabulary, which 8 tensor-parallel ranks divide, where 50257 is prime
to 8) on 1024 A100-80GB twice, side by side: the tuner's free choice (``tensor_parallel_size=None``,
schedule, recompute and sharding its own) and Megatron-LM's layout priced by the same simulator
(tensor 8 x pipeline 16 x data 8, micro-batches of one sequence, activation recomputation; 1F1B
and the interleaved schedule with 2 layers per model chunk, as NVIDIA/Megatron-LM
examples/sc21/run_figure_12.sh runs 175B). The issue's bar: the tuner's predicted MFU at least the
best Megatron layout's. Narayanan et al. (SC'21, arXiv:2104.04473) report for 175B, batch 1536:
153 / 141 TFLOP/s per GPU on 384 / 1536 GPUs with (t, p) = (8, 12) (Table 2), and take 140 for
their 1024-GPU training-time estimate (34 days for 300B tokens, Sec. 5.1); their count includes the
recomputed forward (Eq. 3), x ~0.75 in model FLOPs (~105 TFLOP/s, 34% MFU at 1024 GPUs).

``--worlds 8,64,1024`` prints the tuner's choice for each world size, each with a model its world
fits (GPT-3's shapes and batch sizes, Megatron's GPT): 8 GPUs GPT-3 XL 1.3B (24 layers, d=2048,
batch 512), 64 GPUs GPT-3 13B (40 layers, d=5120, batch 1024), 1024 GPUs GPT-3 175B (batch 1536).

Usage: ``python benchmarks/plan_175b.py [--world-size 1024] [--compare-megatron] [--worlds 8,64,1024]
[--out tables.md]``.
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
from benchmarks.megatron_gpt import MegatronGPTConfig, meta_gpt  # noqa: E402
from examples.gpt.model import GPT, GPTConfig  # noqa: E402

GPT3_175B = GPTConfig(block_size=2048, vocab_size=50257, n_layer=96, n_head=96, n_embd=12288)
A100_PEAK = 312e12
# Megatron's GPT in GPT-3's shapes, with each world size's model for --worlds: (name, config, batch)
MEGATRON_175B = MegatronGPTConfig(n_layer=96, n_embd=12288, n_head=96)
WORLD_MODELS = {
    8: ("GPT-3 XL 1.3B", MegatronGPTConfig(n_layer=24, n_embd=2048, n_head=16), 512),
    64: ("GPT-3 13B", MegatronGPTConfig(n_layer=40, n_embd=5120, n_head=40), 1024),
    1024: ("GPT-3 175B", MEGATRON_175B, 1536),
}
# Megatron-LM's layouts for 175B on 1024 GPUs: (label, tp, pp, dp, model chunks per GPU)
MEGATRON_LAYOUTS = (("Megatron 8x16x8 1F1B", 8, 16, 8, 1), ("Megatron 8x16x8 interleaved", 8, 16, 8, 3))


def plan_175b(world_size: int, global_batch: int = 1536, config: GPTConfig = GPT3_175B,
              schedule: str = "auto", **fixed: object) -> replica.Plan:
    """GPT-3 175B on ``world_size`` A100-80GB, bf16; ``fixed``: planning keywords the plan must keep."""
    with torch.device("meta"):
        model = GPT(config)
    tokens = torch.empty(global_batch, config.block_size, dtype=torch.long, device="meta")
    return replica.plan(model, (tokens,), world_size=world_size, device="a100-80gb", mixed_precision="bf16",
                        schedule=schedule, **fixed)


def plan_megatron_gpt(config: MegatronGPTConfig, world_size: int, global_batch: int,
                      **fixed: object) -> tuple[replica.Plan, float]:
    """Megatron's GPT of ``config`` planned on ``world_size`` A100-80GB (bf16 autocast, analytic
    costs); ``fixed``: what the plan must keep (none: the tuner's free choice, tensor
    parallelism included). Returns the plan and the seconds planning took."""
    model, inputs = meta_gpt(config, global_batch)
    kwargs: dict = dict(schedule="auto", tensor_parallel_size=None)
    kwargs.update(fixed)
    start = time.perf_counter()
    plan = replica.plan(model, inputs, world_size=world_size, device="a100-80gb", mixed_precision="bf16",
                        cost="analytic", **kwargs)
    return plan, time.perf_counter() - start


def megatron_layout(tp: int, pp: int, dp: int, chunks: int, global_batch: int = 1536) -> dict:
    """``replica.plan``'s arguments for one of Megatron's layouts: micro-batches of one
    sequence, activation recomputation, replicas not sharded, no sequence parallelism, no memory
    budget (its memory is printed)."""
    return dict(tensor_parallel_size=tp, num_stages=pp * chunks, data_parallel_size=dp,
                num_microbatches=global_batch // dp, schedule="interleaved" if chunks > 1 else "1f1b",
                recompute=True, sharded_data_parallel=False, memory_budget=float("inf"),
                sequence_parallel=False)  # SC'21's runs: no sequence parallelism (2022's paper added it)


ROW_HEADER = ("| plan | tp x pp x dp | stages, schedule | micro-batches (sequences each) | recompute | predicted step "
              "| TFLOP/s per GPU | MFU | fullest stage | planned in |")


def row(label: str, plan: replica.Plan, seconds: float, global_batch: int) -> str:
    """One markdown row: the layout, the predicted step, model-FLOPs TFLOP/s per GPU and MFU (of 312)."""
    layout = plan.layout
    world = layout.world_size
    per_gpu = plan.model_flops / plan.predicted_step_time_s / world
    memory = max(s.predicted_memory_bytes for s in plan.stages) / 2**30
    size = global_batch / (layout.data_parallel_size * plan.num_microbatches)
    sharding = f" ({layout.sharding})" if layout.sharded else ""
    graded = ", graded" if plan.microbatch_shares else ""
    return (f"| {label} | {layout.tensor_parallel_size} x {layout.pipeline_ranks} x {layout.data_parallel_size}"
            f"{sharding} | {layout.num_stages}, {layout.schedule} | {plan.num_microbatches} ({size:g}{graded}) "
            f"| {'yes' if plan.recompute else 'no'} | {plan.predicted_step_time_s:.2f} s | {per_gpu / 1e12:.1f} "
            f"| {per_gpu / A100_PEAK:.1%} | {memory:.1f} GiB{'' if memory <= 80 else ' (over 80)'} | {seconds:.0f} s |")


def compare_megatron(world_size: int = 1024, global_batch: int = 1536) -> list[str]:
    """The tuner's 175B plan beside Megatron's layouts, priced alike; the bar's verdict last."""
    lines = [ROW_HEADER, "|" + "---|" * (ROW_HEADER.count(" | ") + 1)]
    print(lines[0], lines[1], sep="\n")
    tuner, seconds = plan_megatron_gpt(MEGATRON_175B, world_size, global_batch)
    lines.append(row("tuner", tuner, seconds, global_batch))
    print(lines[-1], flush=True)
    best = 0.0
    for label, tp, pp, dp, chunks in MEGATRON_LAYOUTS:
        try:
            plan, seconds = plan_megatron_gpt(MEGATRON_175B, world_size, global_batch,
                                              **megatron_layout(tp, pp, dp, chunks, global_batch))
        except (replica.PartitionError, replica.ConfigError) as exc:
            lines.append(f"| {label} | {tp} x {pp} x {dp} | {pp * chunks} | not planned: {exc} |")
            print(lines[-1], flush=True)
            continue
        best = max(best, plan.model_flops / plan.predicted_step_time_s)
        lines.append(row(label, plan, seconds, global_batch))
        print(lines[-1], flush=True)
    ours = tuner.model_flops / tuner.predicted_step_time_s
    verdict = (f"tuner / best Megatron layout: {ours / best:.3f} of its MFU: bar "
               f"{'met' if ours >= best else 'NOT met'}" if best else "no Megatron layout planned")
    lines += ["", verdict, "", "tuner's next best: " + "; ".join(f"{d} ({t:.2f} s)" for d, t in tuner.alternatives[:3])]
    print("\n".join(lines[-4:]))
    return lines


def worlds(sizes: list[int]) -> list[str]:
    """The tuner's free choice for each world size, on the model WORLD_MODELS gives it."""
    lines = ["| GPUs | model, batch |" + ROW_HEADER[1:], "|---|---|" + "---|" * (ROW_HEADER.count(" | ") + 1)]
    print(lines[0], lines[1], sep="\n")
    notes = [""]
    for size in sizes:
        name, config, batch = WORLD_MODELS[size]
        plan, seconds = plan_megatron_gpt(config, size, batch)
        lines.append(f"| {size} | {name}, {batch} " + row("tuner", plan, seconds, batch))
        print(lines[-1], flush=True)
        notes.append(f"{size} GPUs, next best: " + "; ".join(f"{d} ({t:.2f} s)" for d, t in plan.alternatives[:2]))
    print("\n".join(notes))
    return lines + notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=1024)
    parser.add_argument("--compare-megatron", action="store_true",
                        help="the tuner's 175B plan beside Megatron-LM's layouts on --world-size GPUs")
    parser.add_argument("--worlds", help="comma-separated world sizes of 8, 64, 1024: the tuner's choice for each")
    parser.add_argument("--out", help="write the markdown tables of --compare-megatron / --worlds here")
    args = parser.parse_args()
    if args.compare_megatron or args.worlds:
        lines: list[str] = []
        if args.compare_megatron:
            lines += compare_megatron(args.world_size)
        if args.worlds:
            lines += [""] * bool(lines) + worlds([int(w) for w in args.worlds.split(",")])
        if args.out:
            Path(args.out).write_text("\n".join(lines) + "\n")
        print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
        return
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
