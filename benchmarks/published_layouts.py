"""Price LLM Foundry's published A100-80GB FSDP runs with Replica's cost model: predicted MFU beside published.

LLM Foundry (mosaicml/llm-foundry, scripts/train/benchmarking/README.md, table "A100 80GB with
1600 Gbps node-node interconnect (RoCE)") publishes MPT training throughput on 8 A100-80GB with
FSDP FULL_SHARD, amp_bf16 (FSDP mixed precision DEFAULT: bf16 gathers, fp32 reduction). Each
row here is one of those runs, planned on meta tensors with its layout forced: world 8, one
stage × 8 zero3-sharded replicas, the published micro-batch size × gradient accumulation
(num_microbatches), gradients reduce-scattered every micro-batch as Composer's FSDP does
(``grad_sync="microbatch"``), activation checkpointing as published (recompute), cost="analytic".
The models are MPT's shapes in examples/gpt's GPT (learned positions, biases, tied
embedding: the published parameter counts exactly). MFU is computed with the README's formula,
``(6 N s + 12 L d s^2) × sequences/s / (GPUs × 312 TFLOP/s)``, from Replica's predicted step.
Replica's memory model holds a whole micro-batch's activations under recompute (it recomputes
a whole stage, not each block as LLM Foundry checkpoints), so these runs are priced without a
memory budget and the predicted memory is printed for what it is.

Then ``replica.plan`` picks the layout itself (``sharded_data_parallel=None``) for a Llama-2-7B
(Hugging Face LlamaForCausalLM built on meta) on 8 A100-80GB at a global batch of 8 × 4096.

The last column prices each run again at the A100 preset's old bf16 rate, 190 TF/s, before these
rows fitted it (250 TF/s; benchmarks/RESULTS.md, "A100 matmul rate").

``--source torchtitan`` prices torchtitan's published H100 rows instead
(pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md``, Llama 3.1 in bf16, Hugging
Face's LlamaForCausalLM on meta with torchtitan's shapes): 8B FSDP on 8 and 128 GPUs, 70B FSDP x
TP8 on 256, 405B FSDP8 x TP8 x PP8 on 512 (1F1B and interleaved), each with its published local
batch, 8192-token sequences and activation checkpointing, on the ``h100-80gb`` preset; predicted
tokens/s per GPU beside the published figure. The 70B and 405B rows were published only with
float8 linears (and torch.compile, AsyncTP): their bf16 reference is the figure over the gain
float8 gave the 8B (Table 1, x1.28). Then the tuner's own layout for each model and world
(``--no-free`` leaves it out: it plans each model's whole search).

Usage: ``python benchmarks/published_layouts.py [--source llm-foundry|torchtitan|all] [--no-free]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
from examples.gpt.model import GPT, GPTConfig  # noqa: E402
from replica.partition.cost import PRESETS  # noqa: E402

A100_PEAK = 312e12  # the README's GPU_AVAILABLE_FLOPS for an A100 in bf16
# the preset's matmul rates before they were fitted on this table (190 bf16 / 95 TF32 TF/s, 61%):
# the MFU the model predicted at them
BEFORE = dataclasses.replace(PRESETS["a100-80gb"], name="a100-80gb-190tf", half_flops=190e12, flops=95e12)
VOCAB = 50368


@dataclass(frozen=True)
class Published:
    """One row of LLM Foundry's A100-80GB table."""

    name: str
    d_model: int
    n_heads: int
    n_layers: int
    seq_len: int
    gpus: int
    microbatch: int
    accumulation: int
    checkpointing: bool
    mfu: float
    num_params: int

    @property
    def global_batch(self) -> int:
        return self.gpus * self.microbatch * self.accumulation

    def config(self) -> GPTConfig:
        return GPTConfig(block_size=self.seq_len, vocab_size=VOCAB, n_layer=self.n_layers, n_head=self.n_heads,
                         n_embd=self.d_model, bias=True)

    def mfu_of(self, step_s: float, num_params: int) -> float:
        """The README's MFU: 3 x (2 N s + 4 L d s^2) FLOPs a sequence over the GPUs' peak."""
        s = self.seq_len
        per_sequence = 3 * (2 * num_params * s + self.n_layers * 2 * 2 * self.d_model * s**2)
        return per_sequence * self.global_batch / step_s / (self.gpus * A100_PEAK)


# (7b: MPT-7B's shapes; 13b, 30b: LLM Foundry's yamls) x the A100-80GB table's rows
PUBLISHED = (
    Published("7b", 4096, 32, 32, 4096, 8, 16, 2, True, 0.5484, 6667247616),
    Published("7b", 4096, 32, 32, 2048, 8, 6, 2, False, 0.6423, 6658859008),
    Published("13b", 5120, 40, 40, 4096, 8, 10, 3, True, 0.5762, 12864440320),
    Published("30b", 7168, 56, 48, 4096, 8, 1, 21, True, 0.5137, 29989894144),
)


def price(run: Published, device: replica.DeviceSpec | str = "a100-80gb") -> tuple[replica.Plan, int]:
    """The plan of ``run``'s published layout on ``device``, and the model's parameter count."""
    with torch.device("meta"):
        model = GPT(run.config())
    tokens = torch.empty(run.global_batch, run.seq_len, dtype=torch.long, device="meta")
    plan = replica.plan(model, (tokens,), world_size=run.gpus, num_stages=1, num_microbatches=run.accumulation,
                        schedule="1f1b", device=device, mixed_precision="bf16", sharded_data_parallel="zero3",
                        grad_sync="microbatch",  # Composer's FSDP reduce-scatters every micro-batch
                        recompute=run.checkpointing, cost="analytic", memory_budget=float("inf"),
                        compile=False)  # Composer's published runs: eager
    return plan, model.num_parameters()


def llama2_7b(global_batch: int = 8, seq_len: int = 4096) -> replica.Plan:
    """``replica.plan``'s own layout for Llama-2-7B on 8 A100-80GB."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                      max_position_embeddings=seq_len, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    tokens = torch.empty(global_batch, seq_len, dtype=torch.long, device="meta")
    return replica.plan(model, (tokens,), world_size=8, device="a100-80gb", mixed_precision="bf16",
                        sharded_data_parallel=None, cost="analytic")


# torchtitan (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Dec 2024): Llama 3.1 on
# H100 (96 GB HBM2e, 500 W), 8 a host on NVLink, 400 Gb/s RDMA per GPU; sequences of 8192 tokens
# (torchtitan's llama3 train configs); TPS/GPU read at step 90. Flavours: (dim, layers, heads,
# FFN hidden) of torchtitan's llama3_configs, 8 KV heads, vocabulary 128,256, untied head.
LLAMA3 = {"8B": (4096, 32, 32, 14336), "70B": (8192, 80, 64, 28672), "405B": (16384, 126, 128, 53248)}
TITAN_SEQ = 8192
# FSDP + compile + Float8 over FSDP + compile on the 8B (Table 1): what float8 linears bought there
FLOAT8_GAIN = 8532 / 6667


@dataclass(frozen=True)
class Titan:
    """One row of torchtitan's H100 tables: a Llama 3.1 flavour, its layout and the published
    tokens/s per GPU. ``local_batch``: sequences per data-parallel rank (its TP x PP ranks share
    them); ``microbatches``: the pipeline's (torchtitan's default, one per stage)."""

    label: str
    flavour: str
    gpus: int
    tp: int
    pp: int
    local_batch: int
    checkpointing: str
    tps: float
    float8: bool
    schedule: str = "1f1b"
    stages: int = 1
    microbatches: int = 1

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def global_batch(self) -> int:
        return self.dp * self.local_batch


TITAN = (
    Titan("T1 FSDP", "8B", 8, 1, 1, 2, "selective", 5762, False),
    Titan("T3 FSDP", "8B", 128, 1, 1, 2, "selective", 5605, False),
    Titan("T4 FSDP x TP", "70B", 256, 8, 1, 16, "full", 829, True),
    Titan("T5 FSDP x TP x PP, 1F1B", "405B", 512, 8, 8, 32, "full", 100, True, "1f1b", 8, 8),
    Titan("T5 FSDP x TP x PP, interleaved", "405B", 512, 8, 8, 32, "full", 128, True, "interleaved", 16, 16),
)


def llama3(flavour: str) -> torch.nn.Module:
    """A Hugging Face LlamaForCausalLM of torchtitan's Llama 3.1 ``flavour``, on meta."""
    import transformers

    dim, layers, heads, hidden = LLAMA3[flavour]
    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=dim, intermediate_size=hidden,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
                                      max_position_embeddings=TITAN_SEQ, use_cache=False, tie_word_embeddings=False)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def price_titan(run: Titan, model: torch.nn.Module, device: replica.DeviceSpec | str = "h100-80gb",
                free: bool = False, same_terms: bool = False, **options: object) -> replica.Plan:
    """``run``'s published layout on ``device`` (FSDP2 zero3 over its data-parallel ranks, its TP
    with sequence parallelism as torchtitan runs it, and PP, full recompute, no memory budget),
    or with ``free`` the tuner's own choice for the same world and global batch within the
    preset's memory (``same_terms``: as the forced rows are priced, recompute and no memory budget).
    ``options``: more planning keywords for the forced layout (``compile=``, ``float8=``). The
    forced layout compiles as the row ran: the float8 rows (70B, 405B) ran under torch.compile, and
    their bf16 reference keeps compile's gain; the 8B rows ran eagerly."""
    tokens = torch.empty(run.global_batch, TITAN_SEQ, dtype=torch.long, device="meta")
    if free:
        terms: dict = dict(recompute=True, memory_budget=float("inf")) if same_terms else {}
        return replica.plan(model, (tokens,), world_size=run.gpus, device=device, mixed_precision="bf16",
                            cost="analytic", schedule="auto", tensor_parallel_size=None, sharded_data_parallel=None,
                            **terms)
    return replica.plan(model, (tokens,), world_size=run.gpus, num_stages=run.stages,
                        num_microbatches=run.microbatches, schedule=run.schedule, tensor_parallel_size=run.tp,
                        data_parallel_size=run.dp, device=device, mixed_precision="bf16",
                        sharded_data_parallel="zero3", recompute=True, cost="analytic", memory_budget=float("inf"),
                        sequence_parallel=run.tp > 1, **{"compile": run.float8, **options})


def tokens_per_gpu(run: Titan, plan: replica.Plan) -> float:
    return run.global_batch * TITAN_SEQ / plan.predicted_step_time_s / run.gpus


def torchtitan(device: replica.DeviceSpec | str = "h100-80gb", free: bool = True,
               same_terms: bool = False) -> list[str]:
    """torchtitan's rows priced on ``device`` beside the published tokens/s per GPU; with ``free``,
    the tuner's own layout for each flavour and world, within the preset's memory or, with
    ``same_terms``, on the forced rows' terms (recompute, no memory budget)."""
    lines = ["| row | model | GPUs | fsdp x tp x pp | local batch | AC (priced: full) | published TPS/GPU "
             "| bf16 reference | predicted TPS/GPU | predicted / reference | step | collectives (exposed) "
             "| predicted memory |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print(*lines, sep="\n", flush=True)
    models: dict[str, torch.nn.Module] = {}
    best: dict[tuple[str, int], float] = {}
    for run in TITAN:
        model = models.setdefault(run.flavour, llama3(run.flavour))
        plan = price_titan(run, model, device)
        tps = tokens_per_gpu(run, plan)
        best[(run.flavour, run.gpus)] = max(best.get((run.flavour, run.gpus), 0.0), tps)
        reference = run.tps / FLOAT8_GAIN if run.float8 else run.tps
        ratio = tps / reference
        memory = max(s.predicted_memory_bytes for s in plan.stages) / 2**30
        lines.append(
            f"| {run.label} | {run.flavour} | {run.gpus} | {run.dp} x {run.tp} x {run.pp} | {run.local_batch} "
            f"| {run.checkpointing} | {run.tps:,.0f}{' (float8)' if run.float8 else ''} | {reference:,.0f} "
            f"| {tps:,.0f} | {ratio:.2f}{'' if abs(ratio - 1) <= 0.2 else ' (outside ±20%)'} "
            f"| {plan.predicted_step_time_s:.2f} s | {plan.collective_s:.2f} s ({plan.exposed_collective_s:.2f} s) "
            f"| {memory:.0f} GiB{'' if memory <= 80 else ' (over 80)'} |")
        print(lines[-1], flush=True)
    if free:
        lines += ["", "| model | GPUs | the tuner's choice | predicted TPS/GPU | best forced | free / best forced "
                  "| fullest stage | planned in |", "|---|---|---|---|---|---|---|---|"]
        print(*lines[-3:], sep="\n", flush=True)
        for (flavour, gpus), forced in best.items():
            run = next(r for r in TITAN if (r.flavour, r.gpus) == (flavour, gpus))
            start = time.perf_counter()
            plan = price_titan(run, models[flavour], device, free=True, same_terms=same_terms)
            tps = tokens_per_gpu(run, plan)
            memory = max(s.predicted_memory_bytes for s in plan.stages) / 2**30
            lines.append(f"| {flavour} | {gpus} | {plan.layout.describe()}, {plan.num_microbatches} micro-batches"
                         f"{', recompute' if plan.recompute else ''} | {tps:,.0f} | {forced:,.0f} "
                         f"| {tps / forced:.2f} | {memory:.0f} GiB | {time.perf_counter() - start:.0f} s |")
            print(lines[-1], flush=True)
    return lines


def llm_foundry() -> None:
    """LLM Foundry's A100 rows, and the tuner's layout for Llama-2-7B."""
    print("| model | seq | GPUs | micro-batch x accum. | checkpointing | published MFU | predicted MFU "
          "| predicted / published | step | collectives (exposed) | predicted memory | MFU at 190 TF/s (ratio) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run in PUBLISHED:
        plan, num_params = price(run)
        if num_params != run.num_params:
            raise SystemExit(f"{run.name}: {num_params} parameters, LLM Foundry's has {run.num_params}")
        mfu = run.mfu_of(plan.predicted_step_time_s, num_params)
        memory = max(s.predicted_memory_bytes for s in plan.stages) / 2**30
        ratio = mfu / run.mfu
        before = run.mfu_of(price(run, BEFORE)[0].predicted_step_time_s, num_params)
        print(f"| {run.name} | {run.seq_len} | {run.gpus} | {run.microbatch} x {run.accumulation} "
              f"| {'yes' if run.checkpointing else 'no'} | {run.mfu:.1%} | {mfu:.1%} | {ratio:.2f}"
              f"{'' if abs(ratio - 1) <= 0.2 else ' (outside ±20%)'} | {plan.predicted_step_time_s:.2f} s "
              f"| {plan.collective_s:.2f} s ({plan.exposed_collective_s * 1e3:.0f} ms) "
              f"| {memory:.0f} GiB{'' if memory <= 80 else ' (over 80)'} "
              f"| {before:.1%} ({before / run.mfu:.2f}) |")
    plan = llama2_7b()
    per_device = plan.model_flops / plan.predicted_step_time_s / plan.layout.world_size
    print(f"\nLlama-2-7B, 8 x A100-80GB, global batch 8 x 4096, sharded_data_parallel=None: "
          f"{plan.layout.describe()}, {plan.num_microbatches} micro-batch(es)"
          f"{', recompute' if plan.recompute else ''}; predicted step {plan.predicted_step_time_s:.2f} s, "
          f"{per_device / A100_PEAK:.1%} MFU, fullest stage "
          f"{max(s.predicted_memory_bytes for s in plan.stages) / 2**30:.1f} GiB")
    print("next best: " + "; ".join(f"{d} ({t:.2f} s)" for d, t in plan.alternatives[:3]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=("llm-foundry", "torchtitan", "all"), default="all")
    parser.add_argument("--no-free", action="store_true", help="torchtitan: only the published layouts")
    parser.add_argument("--same-terms", action="store_true",
                        help="torchtitan: the tuner's choice priced as the forced rows are (recompute, no budget)")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.source in ("llm-foundry", "all"):
        llm_foundry()
    if args.source in ("torchtitan", "all"):
        print()
        torchtitan(free=not args.no_free, same_terms=args.same_terms)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
