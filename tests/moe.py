"""A plain-PyTorch mixture-of-experts block in torchtitan's style, and a small transformer built on it.

A router (a bias-free ``Linear`` scoring every token against every expert, softmax in fp32,
top-k) sends each token to ``top_k`` experts; the experts are SwiGLU MLPs whose weights are
stacked, ``w1`` and ``w3`` ``[num_experts, dim, hidden_dim]``, ``w2`` ``[num_experts,
hidden_dim, dim]``; each token's output is the sum of its experts' outputs weighed by their
scores. ``MoEConfig.experts`` picks how the experts run:

- ``"loop"``: one expert at a time, its tokens found with ``torch.where(mask)`` (a ``nonzero``:
  how many rows each expert gets depends on the data, and ``nonzero`` has no meta kernel);
- ``"grouped_mm"``: token slots sorted by expert and every expert in one
  ``torch.nn.functional.grouped_mm`` per weight, the groups' ends in ``offs`` (every shape
  fixed by the batch; its meta kernel takes only bf16, so shape inference on meta fails in fp32).
  Check :data:`HAS_GROUPED_MM` first (a torch build without it, or whose CPU kernel refuses
  fp32, cannot run it).

    MoE(config)                         (B, S, dim) -> (B, S, dim)
    MoETransformer(config, vocab_size=, seq_len=, num_layers=)   ids (B, S) -> logits (B, S, vocab)
    moe_transformer(batch_size, *, experts=..., num_experts=..., top_k=..., dim=...)  a ModelCase
    routing(model, ids)                 per MoE layer, the number of token slots each expert got
    starve(model, expert, layer=0)      that expert gets no token from then on

No part mixes samples of a batch, so the gradients of a batch are the mean of its micro-batches'.
Expert counts and dims are parameters: the expert-parallel tests will reuse this block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.models import ModelCase, lm_loss

__all__ = ["EXPERTS", "HAS_GROUPED_MM", "MoEConfig", "Router", "Experts", "MoE", "MoETransformer",
           "moe_transformer", "routing", "starve"]

EXPERTS = ("loop", "grouped_mm")


def _grouped_mm_runs() -> bool:
    """Whether ``F.grouped_mm`` exists here and runs forward and backward on CPU in fp32."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        a = torch.ones(8, 4, requires_grad=True)
        b = torch.ones(2, 4, 4, requires_grad=True)
        out = F.grouped_mm(a, b, offs=torch.tensor([3, 8], dtype=torch.int32))
        out.backward(torch.ones_like(out).contiguous())  # a materialized gradient, as the block gives it
        return bool(torch.allclose(out, torch.full((8, 4), 4.0)))
    except (RuntimeError, NotImplementedError):
        return False


HAS_GROUPED_MM = _grouped_mm_runs()


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """One MoE block. ``dim`` and ``hidden_dim`` multiples of 4 (``grouped_mm`` wants 16-byte rows)."""

    dim: int = 16
    hidden_dim: int = 32
    num_experts: int = 4
    top_k: int = 2
    experts: str = "loop"

    def __post_init__(self) -> None:
        for name in ("dim", "hidden_dim", "num_experts", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})")
        if self.experts not in EXPERTS:
            raise ValueError(f"MoEConfig.experts must be one of {EXPERTS}, got {self.experts!r}")
        if self.dim % 4 or self.hidden_dim % 4:
            raise ValueError(f"MoEConfig.dim ({self.dim}) and hidden_dim ({self.hidden_dim}) must be multiples of 4")


class Router(nn.Module):
    """Token-choice top-k: each token's ``top_k`` experts and their softmax scores. The buffer
    ``expert_bias`` (zeros) shifts which experts are chosen, not their scores (torchtitan's
    load balancing); :func:`starve` uses it to leave an expert without tokens."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.gate = nn.Linear(config.dim, config.num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(config.num_experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        scores = F.softmax(self.gate(x).float(), dim=-1)  # (N, num_experts)
        experts = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices  # (N, top_k)
        return scores.gather(-1, experts).to(x.dtype), experts


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs with stacked weights, called as Hugging Face's experts are:
    ``experts(tokens (N, dim), chosen (N, top_k), scores (N, top_k)) -> (N, dim)``, each token the
    sum of its experts' outputs weighed by their scores; ``config.experts`` says how they run."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        e, d, h = config.num_experts, config.dim, config.hidden_dim
        self.num_experts = e
        self.run = config.experts
        self.w1 = nn.Parameter(torch.randn(e, d, h) / d**0.5)  # gate projection
        self.w3 = nn.Parameter(torch.randn(e, d, h) / d**0.5)  # up projection
        self.w2 = nn.Parameter(torch.randn(e, h, d) / h**0.5)  # down projection

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e`` on its tokens ``x`` (n, dim) -> (n, dim)."""
        return (F.silu(x @ self.w1[e]) * (x @ self.w3[e])) @ self.w2[e]

    def grouped(self, x: Tensor, offsets: Tensor) -> Tensor:
        """Every expert at once on ``x`` sorted by expert, expert ``e``'s rows ending at ``offsets[e]``."""
        h = F.silu(F.grouped_mm(x, self.w1, offs=offsets)) * F.grouped_mm(x, self.w3, offs=offsets)
        return F.grouped_mm(h, self.w2, offs=offsets)

    def forward(self, tokens: Tensor, chosen: Tensor, scores: Tensor) -> Tensor:
        if self.run == "loop":
            return self._loop(tokens, chosen, scores)
        return self._grouped(tokens, chosen, scores)

    def _loop(self, tokens: Tensor, chosen: Tensor, scores: Tensor) -> Tensor:
        out = torch.zeros_like(tokens)
        for e in range(self.num_experts):
            token, slot = torch.where(chosen == e)  # (n_e,) each: data-dependent n_e, maybe 0
            y = self.expert(e, tokens[token]) * scores[token, slot].unsqueeze(-1)  # (n_e, D)
            out = out.index_add(0, token, y)
        return out

    def _grouped(self, tokens: Tensor, chosen: Tensor, scores: Tensor) -> Tensor:
        k, e = chosen.shape[-1], self.num_experts
        flat = chosen.reshape(-1)  # (N * top_k,): slot n * top_k + j is token n's j-th expert
        order = torch.argsort(flat, stable=True)  # slots sorted by expert
        counts = torch.histc(flat.float(), bins=e, min=0, max=e)  # slots per expert, fixed size
        offsets = torch.cumsum(counts, dim=0).to(torch.int32)  # where each expert's rows end
        token = order // k  # (N * top_k,)
        y = self.grouped(tokens[token], offsets) * scores.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(tokens).index_add(0, token, y)


class MoE(nn.Module):
    """Router, then the experts on their tokens, then each token's outputs summed by score."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.router = Router(config)
        self.experts = Experts(config)

    def forward(self, x: Tensor) -> Tensor:
        B, S, D = x.shape
        tokens = x.reshape(B * S, D)  # (N, D)
        scores, chosen = self.router(tokens)  # (N, top_k) each
        return self.experts(tokens, chosen, scores).reshape(B, S, D)


class Block(nn.Module):
    """Pre-norm causal self-attention, then a pre-norm MoE, each around a residual."""

    def __init__(self, config: MoEConfig, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.attn_norm = nn.LayerNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.moe_norm = nn.LayerNorm(config.dim)
        self.moe = MoE(config)

    def forward(self, x: Tensor) -> Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(D, dim=-1)  # (B, S, D) each
        heads = lambda t: t.reshape(B, S, self.num_heads, D // self.num_heads).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)  # (B, nh, S, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(B, S, D))
        return x + self.moe(self.moe_norm(x))


class MoETransformer(nn.Module):
    """Token embedding, ``num_layers`` MoE blocks, a final norm and an untied head."""

    def __init__(self, config: MoEConfig, *, vocab_size: int = 32, seq_len: int = 8, num_layers: int = 2,
                 num_heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, config.dim)
        self.pos = nn.Parameter(torch.randn(seq_len, config.dim) * 0.02)
        self.layers = nn.ModuleList(Block(config, num_heads) for _ in range(num_layers))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, vocab_size, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids) + self.pos  # (B, S, dim)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))  # (B, S, vocab)


def moe_transformer(batch_size: int = 8, *, experts: str = "loop", num_experts: int = 4, top_k: int = 2,
                    dim: int = 16, hidden_dim: int = 32, num_layers: int = 2, vocab_size: int = 32,
                    seq_len: int = 8) -> ModelCase:
    """A :class:`MoETransformer` with token ids (B, seq_len), next-token targets and ``lm_loss``."""
    config = MoEConfig(dim=dim, hidden_dim=hidden_dim, num_experts=num_experts, top_k=top_k, experts=experts)
    model = MoETransformer(config, vocab_size=vocab_size, seq_len=seq_len, num_layers=num_layers)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len))
    target = torch.randint(0, vocab_size, (batch_size, seq_len))
    return ModelCase(model, (ids,), target, lm_loss)


def starve(model: nn.Module, expert: int, layer: int = 0) -> None:
    """Leave ``expert`` of MoE layer ``layer`` without a token, whatever the batch."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    with torch.no_grad():
        routers[layer].expert_bias[expert] = -1e4


def routing(model: nn.Module, ids: Tensor) -> list[list[int]]:
    """Per MoE layer of ``model``, how many token slots each expert receives for batch ``ids``."""
    counts: list[list[int]] = []

    def hook(router: nn.Module, args: tuple[Tensor, ...], out: tuple[Tensor, Tensor]) -> None:
        counts.append(torch.bincount(out[1].reshape(-1), minlength=router.gate.out_features).tolist())

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, Router)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return counts
