"""The GPT of Megatron-LM's papers, for planning on meta tensors: separate q, k, v projections.

nanoGPT-style (token + learned position embeddings, pre-LN blocks, causal attention by
``F.scaled_dot_product_attention``, a 4h GELU MLP, final LayerNorm, LM head tied to the token
embedding), with biases everywhere as Megatron's GPT has them, so its parameter count is
Narayanan et al.'s Eq. 2, ``12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))``, plus the final
LayerNorm's 2h. The q / k / v / out projections are separate ``nn.Linear`` layers (what
Replica's tensor-parallel pattern finder cuts column- then row-wise).

``attention="sdpa"`` (default): one ``scaled_dot_product_attention`` call, no dropout, as a torch
run would use flash attention today. ``attention="megatron"``: attention as Megatron-LM ran it in
2021, before flash attention: the s x s scores materialized (``q @ k^T``, scaled, the causal
mask filled in, softmax, dropout 0.1, ``@ v``), and dropout 0.1 on the embeddings and each
sub-block's output (Megatron's default ``--attention-dropout`` / ``--hidden-dropout``), so the
memory traffic of the scores, which the FLOP count ignores, is priced.

Used by benchmarks/megatron_table.py and benchmarks/plan_175b.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MegatronGPTConfig", "MegatronGPT", "meta_gpt", "paper_flops", "model_flops"]


@dataclass(frozen=True)
class MegatronGPTConfig:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int = 51200
    seq_len: int = 2048
    attention: str = "sdpa"  # or "megatron": scores materialized, dropout (see the module's docstring)

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.attention not in ("sdpa", "megatron"):
            raise ValueError(f"attention must be 'sdpa' or 'megatron', got {self.attention!r}")

    @property
    def dropout(self) -> float:
        return 0.1 if self.attention == "megatron" else 0.0

    def num_parameters(self) -> int:
        """Eq. 2 of Narayanan et al. (biases and LayerNorms included) + the final LayerNorm."""
        h, l = self.n_embd, self.n_layer
        return l * (12 * h * h + 13 * h) + (self.vocab_size + self.seq_len) * h + 2 * h


class Attention(nn.Module):
    def __init__(self, c: MegatronGPTConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.megatron = c.attention == "megatron"
        self.q_proj = nn.Linear(c.n_embd, c.n_embd)
        self.k_proj = nn.Linear(c.n_embd, c.n_embd)
        self.v_proj = nn.Linear(c.n_embd, c.n_embd)
        self.out_proj = nn.Linear(c.n_embd, c.n_embd)
        self.attn_dropout = nn.Dropout(c.dropout)
        self.resid_dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        hs = C // self.n_head
        q = self.q_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)
        if self.megatron:  # the scores materialized, as before flash attention
            scores = (q @ k.transpose(-2, -1)) * (hs ** -0.5)  # (B, nh, T, T)
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            probs = self.attn_dropout(torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1))
            y = probs @ v  # (B, nh, T, hs)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.resid_dropout(self.out_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, c: MegatronGPTConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.gelu = nn.GELU()
        self.fc_out = nn.Linear(4 * c.n_embd, c.n_embd)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(self.gelu(self.fc_in(x))))


class Block(nn.Module):
    def __init__(self, c: MegatronGPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd)
        self.attn = Attention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MegatronGPT(nn.Module):
    def __init__(self, c: MegatronGPTConfig) -> None:
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.seq_len, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.h = nn.ModuleList([Block(c) for _ in range(c.n_layer)])
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, T = idx.size()
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def meta_gpt(config: MegatronGPTConfig, global_batch: int) -> tuple[MegatronGPT, tuple[torch.Tensor]]:
    """The model and a batch of token ids, both on meta (nothing allocated)."""
    with torch.device("meta"):
        model = MegatronGPT(config)
    return model, (torch.empty(global_batch, config.seq_len, dtype=torch.long, device="meta"),)


def paper_flops(config: MegatronGPTConfig, batch: int) -> float:
    """Narayanan et al.'s Eq. 3, the FLOPs of one iteration as Megatron counts them for its
    teraFLOP/s: ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``: the transformer layers' matmuls
    (attention's s^2 products in full, not halved for causality) four times (forward,
    backward = 2x, and the forward again under activation recomputation), the logits three."""
    s, h, l, v = config.seq_len, config.n_embd, config.n_layer, config.vocab_size
    return 96 * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def model_flops(config: MegatronGPTConfig, batch: int) -> float:
    """The same count without the recomputed forward (model FLOPs: three passes)."""
    s, h, l, v = config.seq_len, config.n_embd, config.n_layer, config.vocab_size
    return 72 * batch * s * l * h * h * (1 + s / (6 * h)) + 6 * batch * s * h * v
