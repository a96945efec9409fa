"""Tiny mixture-of-experts models for the routing and expert-parallel tests, and ways to force their routing.

    MODELS                      the names: "plain" (tests/moe.py's stacked-weight MoE), then Hugging
                                Face "mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"
    build(name)                 (model, vocab_size): seeded, fp32, no cache; None where transformers
                                lacks the class (``missing(name)`` says why)
    experts_modules(model)      {path: module}: every stacked-expert module (HF ``*Experts`` or ``moe.Experts``)
    routing(model, ids)         per expert module, the token slots each expert got on batch ``ids``
    force(model, name, mode)    "starve": an expert of every MoE layer gets no token; "hog": expert 0
                                of every MoE layer takes every token; set on router weights or biases

Every model routes with token-choice top-k and calls its experts as ``experts(x (N, D), index
(N, k), weights (N, k)) -> (N, D)``, each slot's output weighed by its weight (HF's interface, the
plain model's too).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from tests import moe

__all__ = ["MODELS", "HF_CLASSES", "build", "missing", "experts_modules", "routing", "force"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODELS = ("plain", "mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
HF_CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
              "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}
VOCAB = 64
NUM_EXPERTS = 4


def missing(name: str) -> str | None:
    """Why ``name`` cannot be built here (None: it can)."""
    if name == "plain":
        return None
    try:
        import transformers
    except ImportError:
        return "transformers is not installed"
    if not hasattr(transformers, HF_CLASSES[name]):
        return f"transformers {transformers.__version__} has no {HF_CLASSES[name]}"
    return None


def _hf(name: str) -> nn.Module:
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, use_cache=False, num_experts_per_tok=2)
    if name == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=48, num_local_experts=NUM_EXPERTS, **common)
    elif name == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=NUM_EXPERTS,
                                             norm_topk_prob=True, **common)
    elif name == "deepseek_v3":  # the first layer dense, one shared expert beside the routed ones
        config = transformers.DeepseekV3Config(
            intermediate_size=48, moe_intermediate_size=24, n_routed_experts=NUM_EXPERTS, n_shared_experts=1,
            n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **{**common, "num_key_value_heads": 4})
    else:
        config = transformers.GptOssConfig(intermediate_size=24, num_local_experts=NUM_EXPERTS, head_dim=8,
                                           sliding_window=8, **common)
    model = getattr(transformers, HF_CLASSES[name])(config)
    if name in ("deepseek_v3", "gpt_oss"):  # routers start at zero there: give them a routing that varies
        with torch.no_grad():
            for path, p in model.named_parameters():
                if path.endswith(("gate.weight", "router.weight")):
                    p.normal_(0, 0.5)
    return model


def build(name: str) -> tuple[nn.Module, int] | None:
    """The model ``name`` (seeded, in training mode) and its vocabulary size; None if it cannot be built."""
    if missing(name) is not None:
        return None
    torch.manual_seed(0)
    if name == "plain":
        model = moe.moe_transformer(1, num_experts=NUM_EXPERTS, vocab_size=VOCAB).model
    else:
        model = _hf(name)
    return model.train(), VOCAB


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every module holding a layer's stacked experts, by path."""
    return {path: m for path, m in model.named_modules()
            if isinstance(m, moe.Experts) or (type(m).__name__.endswith("Experts") and hasattr(m, "down_proj"))}


def routing(model: nn.Module, ids: torch.Tensor) -> list[list[int]]:
    """Per expert module of ``model``, how many token slots each expert receives for batch ``ids``."""
    counts: list[list[int]] = []
    modules = experts_modules(model)

    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        counts.append(torch.bincount(args[1].reshape(-1), minlength=module.num_experts).tolist())

    handles = [m.register_forward_pre_hook(hook) for m in modules.values()]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return counts


def _routers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, moe.Router) or type(m).__name__.endswith("Router")]


def force(model: nn.Module, name: str, mode: str) -> None:
    """Force every MoE layer's routing of ``model`` (built by :func:`build` as ``name``): "starve"
    leaves expert 1 without a token, "hog" sends every token to expert 0 (and with top-k = 2, to
    one other). In place, on the router's bias where it has one; a router without one gets a zero
    weight, which does both (ties: experts 0..k-1 take every token, the others none)."""
    assert mode in ("starve", "hog"), mode
    expert, sign = (1, -1.0) if mode == "starve" else (0, 1.0)
    with torch.no_grad():
        for router in _routers(model):
            bias = {"plain": "expert_bias", "deepseek_v3": "e_score_correction_bias", "gpt_oss": "bias"}.get(name)
            if bias is not None:  # the other mode's push undone first
                getattr(router, bias).zero_()
                getattr(router, bias)[expert] = sign * 1e4
            else:  # no bias: the scores tie, top-k takes experts 0..k-1 for every token, the rest get none
                router.weight.zero_()
