"""Price Megatron-LM's published weak-scaling table with Replica's simulator: predicted TFLOP/s per GPU beside published.

Source: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC'21 (arXiv:2104.04473), Table 1: GPT models of 1.7B to 1T parameters on 32 to
3072 A100-80GB (Selene: DGX A100 nodes of 8, NVLink/NVSwitch inside, 8 x 200 Gb/s HDR
InfiniBand per node), sequence 2048, vocabulary 51,200, mixed precision, activation
recomputation. Each row's shape and layout (heads, hidden, layers, tensor- and pipeline-parallel
size, GPUs = 8 x nodes, global batch, micro-batch size, interleaving) is the paper's own script,
NVIDIA/Megatron-LM ``examples/sc21/run_table_1.sh`` (every row ``--recompute-method uniform``;
76B and 145B ``--num-layers-per-virtual-pipeline-stage 5``, 310B 3, 530B 1: the interleaved
schedule with layers / pp / that many model chunks per GPU; the others the plain 1F1B
schedule), and Eq. 2 of the paper gives each row's published parameter count from it exactly.
The achieved teraFLOP/s per GPU are the paper's Table 1 column; of those, the 1T row (163
TFLOP/s, 52% of peak, 502 PFLOP/s aggregate) is stated in the paper's abstract and text; the
other rows are as recalled from the table (they agree with its aggregate-petaFLOP/s and
percentage-of-peak columns: aggregate = per GPU x GPUs, percentage = per GPU / 312) and were
not checked against a text copy of it (the table is an image in the PDF and the README).

The paper's teraFLOP/s count Eq. 3, ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` per iteration:
the layers' matmuls four times (forward, backward, the forward again recomputed), the logits
three. Replica's predicted step is converted with the same formula (column "predicted"), so the
ratio is published step / predicted step; Replica's own ``plan.model_flops`` (three passes, no
recompute) gives the model-FLOPs utilisation column (of 312 TF/s).

Each row is planned fixed as published: ``tensor_parallel_size=tp``, ``num_stages=pp`` (x the
model chunks where interleaved), ``data_parallel_size=GPUs/(tp pp)``, ``num_microbatches=batch /
(dp x micro-batch size)``, ``schedule`` 1f1b or interleaved, ``recompute=True``, bf16 autocast,
``device="a100-80gb"``, analytic costs, no memory budget (the predicted memory of the fullest
stage is printed). Then re-priced on modified copies of the preset (``--variants``) to show
which price moves the ratios (``megatron-attn``: megatron_gpt's ``attention="megatron"``, the
s x s attention scores materialized as Megatron-LM did in 2021, before flash attention, here as
unfused torch ops: an upper bound on their memory traffic; the default SDPA prices none).
Not modelled: Megatron's fused kernels, its scatter/gather of pipeline messages (each GPU
sends 1/t of a boundary tensor, then an NVLink all-gather); ``recompute=True`` checkpoints every
layer as Megatron's uniform method does (#39: every row's fullest stage fits 80 GiB); Megatron-LM
trained in fp16 then, bf16 autocast here (the same A100 rate).

Usage: ``python benchmarks/megatron_table.py [--rows 1.7B,3.6B] [--variants preset,240tf]
[--out table.md]``: about 90 s on a 2-core machine with the default two device variants (each
row plans in 1-10 s, the 1T the longest); every variant, about 8 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
from benchmarks.megatron_gpt import MegatronGPTConfig, meta_gpt, paper_flops  # noqa: E402
from replica.partition.cost import PRESETS  # noqa: E402

A100_PEAK = 312e12
GB = 1e9


@dataclass(frozen=True)
class Row:
    """One row of Table 1, with run_table_1.sh's micro-batch size and interleaving."""

    name: str
    params_b: float  # published, billions
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    microbatch: int
    layers_per_chunk: int  # --num-layers-per-virtual-pipeline-stage; 0: not interleaved
    tflops: float  # published achieved teraFLOP/s per GPU (Eq. 3's count)

    @property
    def config(self) -> MegatronGPTConfig:
        return MegatronGPTConfig(n_layer=self.layers, n_embd=self.hidden, n_head=self.heads)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def chunks(self) -> int:
        """Model chunks (virtual stages) per GPU."""
        return self.layers // self.pp // self.layers_per_chunk if self.layers_per_chunk else 1

    @property
    def schedule(self) -> str:
        return "interleaved" if self.chunks > 1 else "1f1b"

    @property
    def num_microbatches(self) -> int:
        return self.batch // (self.dp * self.microbatch)

    @property
    def published_step_s(self) -> float:
        return paper_flops(self.config, self.batch) / (self.tflops * 1e12 * self.gpus)


TABLE_1 = (
    Row("1.7B", 1.7, 24, 2304, 24, 1, 1, 32, 512, 16, 0, 137),
    Row("3.6B", 3.6, 32, 3072, 30, 2, 1, 64, 512, 16, 0, 138),
    Row("7.5B", 7.5, 32, 4096, 36, 4, 1, 128, 512, 16, 0, 142),
    Row("18B", 18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, 0, 135),
    Row("39B", 39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, 0, 138),
    Row("76B", 76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 5, 140),
    Row("145B", 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 5, 148),
    Row("310B", 310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 3, 155),
    Row("530B", 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 1, 163),
    Row("1T", 1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, 0, 163),
)
ROWS = {r.name: r for r in TABLE_1}
# rows planned by default: all (each plans in 1-10 s on a 2-core machine, the 1T the longest)
DEFAULT_ROWS = tuple(r.name for r in TABLE_1)

_A100 = PRESETS["a100-80gb"]
_240 = dataclasses.replace(_A100, name="a100-80gb-240tf", half_flops=240e12)
# re-pricings: (the model's attention, the device), one thing changed from the preset each
# (the preset itself is left as it is)
VARIANTS: dict[str, tuple[str, replica.DeviceSpec]] = {
    "preset": ("sdpa", _A100),
    # the bf16 GEMM rate LLM Foundry's hardware-FLOPs utilisation shows sustained (published_layouts.py)
    "240tf": ("sdpa", _240),
    "260tf": ("sdpa", dataclasses.replace(_A100, name="a100-80gb-260tf", half_flops=260e12)),
    # NVLink at half the preset's 240 GB/s bus bandwidth: what the tensor-parallel all-reduces cost
    "nvlink-120": ("sdpa", dataclasses.replace(_A100, name="a100-80gb-nvlink120", link_bandwidth=120 * GB)),
    # InfiniBand at twice the preset's 25 GB/s per GPU: what the inter-node p2p and data-parallel traffic cost
    "ib-50": ("sdpa", dataclasses.replace(_A100, name="a100-80gb-ib50", network_bandwidth=50 * GB)),
    # Megatron's 2021 attention (scores materialized, dropout): megatron_gpt.py's attention="megatron"
    "megatron-attn": ("megatron", _A100),
    "megatron-attn+240tf": ("megatron", _240),
}


def price(row: Row, device: replica.DeviceSpec | str = "a100-80gb", chunks: int | None = None,
          attention: str = "sdpa", options: replica.PlannerOptions | None = None) -> tuple[replica.Plan, float]:
    """``row``'s published layout planned on ``device`` (``chunks``: model chunks per GPU other
    than the published; ``attention``: megatron_gpt's), and the seconds planning took."""
    chunks = chunks or row.chunks
    model, inputs = meta_gpt(dataclasses.replace(row.config, attention=attention), row.batch)
    start = time.perf_counter()
    plan = replica.plan(model, inputs, world_size=row.gpus, device=device, mixed_precision="bf16",
                        tensor_parallel_size=row.tp, num_stages=row.pp * chunks, data_parallel_size=row.dp,
                        num_microbatches=row.num_microbatches, schedule="interleaved" if chunks > 1 else "1f1b",
                        recompute=True, sharded_data_parallel=False, cost="analytic", memory_budget=float("inf"),
                        sequence_parallel=False, options=options,  # SC'21's runs: no sequence parallelism
                        compile=False)  # nor torch.compile
    return plan, time.perf_counter() - start


def price_nearest(row: Row, variant: str = "preset") -> tuple[replica.Plan, float, int]:
    """``price`` of the published layout, or where the planner refuses its interleaving
    (530B: 105 stages, 3 per GPU, trip the partitioner's provisional layout, which assumes
    2 stages per rank: see RESULTS.md), of 2 model chunks per GPU. Returns the chunks used too."""
    attention, device = VARIANTS[variant]
    try:
        return (*price(row, device, attention=attention), row.chunks)
    except replica.ConfigError:
        if row.chunks <= 2:
            raise
        return (*price(row, device, chunks=2, attention=attention), 2)


def check(row: Row, plan: replica.Plan, chunks: int) -> None:
    """The plan is the published layout, and tensor parallelism was priced."""
    layout = plan.layout
    got = (layout.tensor_parallel_size, layout.pipeline_ranks, layout.data_parallel_size, layout.num_stages,
           layout.schedule, plan.num_microbatches)
    want = (row.tp, row.pp, row.dp, row.pp * chunks, "interleaved" if chunks > 1 else "1f1b", row.num_microbatches)
    if got != want:
        raise SystemExit(f"{row.name}: planned (tp, pp, dp, stages, schedule, m) = {got}, asked {want}")
    if row.tp > 1 and not plan.tensor_parallel:
        raise SystemExit(f"{row.name}: tensor_parallel_size={row.tp} but the plan cut no block (plan.tensor_parallel empty)")


HEADER = ("| model | tp x pp x dp (chunks) | GPUs | batch = mb x m x dp | schedule | published TF/s | predicted TF/s "
          "| predicted / published | step: published / predicted | model-FLOPs MFU | TP all-reduces (of step) | bubble "
          "| TP blocks | fullest stage | planned in |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                        help=f"comma-separated rows of {list(ROWS)} (default: {','.join(DEFAULT_ROWS)})")
    parser.add_argument("--variants", default="preset,240tf",
                        help=f"comma-separated device re-pricings of {list(VARIANTS)}; the first is the main table")
    parser.add_argument("--out", help="also write the markdown tables to this file")
    args = parser.parse_args()
    rows = [ROWS[name] for name in args.rows.split(",") if name]
    variants = [name for name in args.variants.split(",") if name]
    for name in variants:
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {list(VARIANTS)}")

    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    ratios: dict[str, dict[str, float]] = {name: {} for name in variants}
    total = time.perf_counter()
    print(lines[0])
    print(lines[1])
    for row in rows:
        plan, seconds, chunks = price_nearest(row, variants[0])
        check(row, plan, chunks)
        step = plan.predicted_step_time_s
        predicted = paper_flops(row.config, row.batch) / step / row.gpus / 1e12
        ratio = predicted / row.tflops
        ratios[variants[0]][row.name] = ratio
        mfu = plan.model_flops / step / row.gpus / A100_PEAK
        memory = max(s.predicted_memory_bytes for s in plan.stages) / 2**30
        kinds: dict[str, int] = {}
        for block in plan.tensor_parallel:
            kinds[block.kind] = kinds.get(block.kind, 0) + 1
        blocks = ", ".join(f"{n} {k}" for k, n in kinds.items()) or "-"
        ranks = plan.layout.pipeline_ranks  # each rank's stages: k, k + p, ... (1F1B and interleaved)
        tp_s = max(sum(s.tensor_parallel_s for s in plan.stages[r::ranks]) for r in range(ranks))
        chunk_note = "" if chunks == 1 else f" ({chunks})" if chunks == row.chunks else f" ({chunks}; published {row.chunks})"
        line = (f"| {row.name} | {row.tp} x {row.pp} x {row.dp}{chunk_note}"
                + f" | {row.gpus} | {row.microbatch} x {row.num_microbatches} x {row.dp} | {plan.layout.schedule} "
                f"| {row.tflops:.0f} | {predicted:.1f} | {ratio:.2f}{'' if abs(ratio - 1) <= 0.2 else ' (outside ±20%)'} "
                f"| {row.published_step_s:.2f} / {step:.2f} s | {mfu:.1%} | {tp_s:.2f} s ({tp_s / step:.0%}) "
                f"| {plan.bubble_fraction:.0%} | {blocks} "
                f"| {memory:.1f} GiB{'' if memory <= 80 else ' (over 80)'} | {seconds:.0f} s |")
        lines.append(line)
        print(line, flush=True)
        for name in variants[1:]:
            other, _, _ = price_nearest(row, name)
            ratios[name][row.name] = paper_flops(row.config, row.batch) / other.predicted_step_time_s / row.gpus / 1e12 \
                / row.tflops
    if len(variants) > 1:
        head = "| device | " + " | ".join(r.name for r in rows) + " |"
        lines += ["", "predicted / published TFLOP/s per GPU, re-priced:", "", head,
                  "|---|" + "---|" * len(rows)]
        for name in variants:
            attention, spec = VARIANTS[name]
            label = (f"{name} (attention {attention}, bf16 {spec.half_flops / 1e12:.0f} TF/s, NVLink "
                     f"{spec.link_bandwidth / GB:.0f} GB/s, IB {spec.between_nodes_bandwidth / GB:.0f} GB/s)")
            lines.append(f"| {label} | " + " | ".join(f"{ratios[name][r.name]:.2f}" for r in rows) + " |")
        print("\n".join(lines[len(rows) + 2:]))
    print(f"\n{time.perf_counter() - total:.0f} s in all")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
