"""Cuts at block boundaries: how often the partitioner's optimum cuts inside a transformer layer, and what
ending every stage on whole layers costs, at the tie-break's tolerance (``BLOCK_TIE``) and around it.

For HF Llama models built on meta and the example GPT, priced analytically on an A100 preset, each stage
count is partitioned with the tie-break at 0 (the exact optimum, then the most even), ``BLOCK_TIE`` (the
default) and 5%. Reported: the cuts that fall inside a block (a ``<container>.<index>`` module, as FSDP
groups them) and the bottleneck stage over the exact optimum's (1.000 = no cost).

Usage: ``python benchmarks/block_cuts.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import replica  # noqa: E402
import replica.partition.partitioner as partitioner  # noqa: E402
from examples.gpt.model import GPT, GPTConfig  # noqa: E402
from replica.partition.trace import trace  # noqa: E402

TIES = (0.0, partitioner.BLOCK_TIE, 0.05)


def llama(hidden: int, layers: int, vocab: int, tokens: int) -> tuple[str, torch.nn.Module, torch.Tensor]:
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                                   num_attention_heads=max(4, hidden // 64), num_key_value_heads=2, vocab_size=vocab,
                                   max_position_embeddings=max(tokens, 64), use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    return f"Llama {hidden}x{layers}, vocab {vocab}", model, torch.zeros(8, tokens, dtype=torch.long, device="meta")


def gpt(n_embd: int, n_layer: int) -> tuple[str, torch.nn.Module, torch.Tensor]:
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=8, block_size=256, vocab_size=256))
    return f"example GPT {n_embd}x{n_layer}", model, torch.zeros(8, 256, dtype=torch.long, device="meta")


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    models = [llama(32, 4, 128, 16), llama(512, 12, 256, 512), llama(1024, 8, 256, 512),
              llama(1024, 8, 32000, 512), gpt(512, 12)]
    print("| model | stages | " + " | ".join(f"tie {t:.0%}: inside, bottleneck" for t in TIES) + " |")
    print("|---|---|" + "---|" * len(TIES))
    for name, model, ids in models:
        path = {n.name: n.module_path or "" for n in trace(model, (ids,)).graph.nodes}
        for stages in (2, 3, 4, 6):
            cells, optimum = [], None
            for tie in TIES:
                partitioner.BLOCK_TIE = tie
                plan = replica.plan(model, (ids,), num_stages=stages, device="a100-80gb", cost="analytic")
                inside = sum(partitioner.fsdp_unit(path[a.node_names[-1]]) == partitioner.fsdp_unit(
                    path[b.node_names[0]]) for a, b in zip(plan.stages, plan.stages[1:]))
                optimum = optimum or plan.bottleneck_s
                cells.append(f"{inside}, {plan.bottleneck_s / optimum:.3f}")
            print(f"| {name} | {stages} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
