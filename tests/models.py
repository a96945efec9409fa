"""Small models for the transparency tests, each traceable by ``torch.fx``.

Every factory returns a :class:`ModelCase`, a named tuple that unpacks as
``model, example_inputs, target, loss_fn = tiny_gpt()``:

- ``model``: an fp32 ``nn.Module`` whose ``forward(*example_inputs)`` traces with
  ``torch.fx.symbolic_trace`` (no Python control flow on tensors, no dropout);
- ``example_inputs``: a tuple of tensors whose first dimension is ``batch_size``;
- ``target``: a tensor with the same batch dimension;
- ``loss_fn(output, target) -> scalar``: a module-level function taking the MEAN over
  the batch, so the mean of per-micro-batch losses over equal micro-batches is the
  whole-batch loss.

No model mixes samples of a batch (GroupNorm, never BatchNorm), so gradients do not
depend on how a batch is cut into micro-batches. Weights and data come from torch's
global generator: call ``torch.manual_seed`` first for a reproducible model, except
:func:`random_dag`, which is a pure function of its arguments.

    tiny_gpt(batch_size=8, *, num_layers=2, size_ops=False)   ids (B, 16) -> logits (B, 16, 64)
    unet(batch_size=8)                                         (B, 3, 16, 16) -> (B, 3, 16, 16)
    two_input_branchy(batch_size=8)                            a (B, 12), b (B, 10) -> (B, 4)
    mlp(batch_size=8)                                          (B, 20) -> logits (B, 10)
    random_dag(seed, num_nodes, *, batch_size=8, width=8)      (B, 6) -> (B, 4)

Parameters shared between two places: ``tiny_gpt`` ties ``lm_head.weight`` to
``transformer.wte.weight``; ``two_input_branchy`` calls ``shared`` twice, far apart;
``random_dag`` reuses some of its ``linears`` (see ``model.num_shared_uses``).
"""

from __future__ import annotations

import math
import random
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ModelCase",
    "tiny_gpt",
    "unet",
    "two_input_branchy",
    "mlp",
    "random_dag",
    "ALL_FACTORIES",
]


class ModelCase(NamedTuple):
    model: nn.Module
    example_inputs: tuple[Tensor, ...]
    target: Tensor
    loss_fn: Callable[[Tensor, Tensor], Tensor]


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Cross entropy over every token: logits (B, T, V), target (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def mse_loss(output: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(output, target)


def class_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits, target)


# --------------------------------------------------------------------------- tiny GPT


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, size_ops: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.head_size = n_embd // n_head
        self.size_ops = size_ops
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        mask = torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
        self.register_buffer("bias", mask)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.c_attn(x).split(self.n_head * self.head_size, dim=2)
        if self.size_ops:  # as nanoGPT: integer sizes flow through the graph
            B, T, C = x.size()
            q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
            k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            mask = torch.narrow(torch.narrow(self.bias, 2, 0, T), 3, 0, T)  # bias[:, :, :T, :T]
        else:  # constant shapes only: T must equal block_size
            q = q.unflatten(-1, (self.n_head, self.head_size)).transpose(1, 2)  # (B, nh, T, hs)
            k = k.unflatten(-1, (self.n_head, self.head_size)).transpose(1, 2)
            v = v.unflatten(-1, (self.n_head, self.head_size)).transpose(1, 2)
            mask = self.bias
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_size))  # (B, nh, T, T)
        att = att.masked_fill(mask == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).flatten(2)  # (B, T, C)
        return self.c_proj(y)


class MLPBlock(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, size_ops: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, size_ops)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLPBlock(n_embd)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class TinyGPT(nn.Module):
    """nanoGPT in miniature, with ``lm_head.weight`` tied to ``transformer.wte.weight``."""

    def __init__(
        self,
        *,
        vocab_size: int = 64,
        block_size: int = 16,
        num_layers: int = 2,
        n_embd: int = 32,
        n_head: int = 4,
        size_ops: bool = False,
    ) -> None:
        super().__init__()
        self.size_ops = size_ops
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                h=nn.ModuleList([Block(n_embd, n_head, block_size, size_ops) for _ in range(num_layers)]),
                ln_f=nn.LayerNorm(n_embd),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT
        self.register_buffer("pos", torch.arange(block_size), persistent=False)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        if self.size_ops:
            pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)  # (T,)
        else:
            pos = self.pos
        tok_emb = self.transformer.wte(idx)  # (B, T, n_embd)
        pos_emb = self.transformer.wpe(pos)  # (T, n_embd)
        x = tok_emb + pos_emb
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)  # (B, T, vocab_size)


def tiny_gpt(batch_size: int = 8, *, num_layers: int = 2, size_ops: bool = False) -> ModelCase:
    """Token ids (B, 16) in [0, 64) -> logits (B, 16, 64); loss: next-token cross entropy.

    ``size_ops=True`` reshapes with ``B, T, C = x.size()`` and builds positions with
    ``torch.arange(idx.size(1))`` as nanoGPT does, so integers (not only tensors) cross
    between ops; the default uses constant shapes only.
    """
    model = TinyGPT(num_layers=num_layers, size_ops=size_ops)
    data = torch.randint(0, 64, (batch_size, 17))
    return ModelCase(model, (data[:, :-1].contiguous(),), data[:, 1:].contiguous(), lm_loss)


# --------------------------------------------------------------------------- ResNet (BatchNorm)


class ResidualBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class TinyResNet(nn.Module):
    """A ResNet in small: a stem, residual blocks of BatchNorm2d, a BatchNorm1d head."""

    def __init__(self, c: int = 8, num_blocks: int = 3, *, cumulative: bool = True) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.blocks = nn.Sequential(*(ResidualBlock(c) for _ in range(num_blocks)))
        self.fc, self.bn_fc = nn.Linear(c, 16), nn.BatchNorm1d(16, momentum=None if cumulative else 0.2)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, 8, 8) -> (B, 10)
        h = self.blocks(F.relu(self.bn(self.stem(x)))).mean((2, 3))  # (B, c)
        return self.head(F.relu(self.bn_fc(self.fc(h))))


# --------------------------------------------------------------------------- U-Net


def conv_block(c_in: int, c_out: int, *, inplace: bool = False) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1),
        nn.GroupNorm(4, c_out),
        nn.ReLU(inplace=True) if inplace else nn.GELU(),
    )


class UNet(nn.Module):
    """Two downsamplings, two upsamplings, skips concatenated across the whole net."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        c = channels
        self.enc1 = conv_block(3, c, inplace=True)  # (B, c, 16, 16)
        self.down1 = nn.Conv2d(c, c, 3, stride=2, padding=1)  # (B, c, 8, 8)
        self.enc2 = conv_block(c, 2 * c)  # (B, 2c, 8, 8)
        self.pool = nn.MaxPool2d(2)  # (B, 2c, 4, 4)
        self.mid = conv_block(2 * c, 4 * c)  # (B, 4c, 4, 4)
        self.up2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, stride=2)  # (B, 2c, 8, 8)
        self.dec2 = conv_block(4 * c, 2 * c)  # cat(up2, enc2)
        self.up1 = nn.Upsample(scale_factor=2, mode="nearest")  # (B, 2c, 16, 16)
        self.dec1 = conv_block(3 * c, c)  # cat(up1, enc1)
        self.head = nn.Conv2d(c + 3, 3, 1)  # cat(dec1, input)

    def forward(self, x: Tensor) -> Tensor:
        e1 = self.enc1(x)  # (B, c, 16, 16)
        e2 = self.enc2(self.down1(e1))  # (B, 2c, 8, 8)
        m = self.mid(self.pool(e2))  # (B, 4c, 4, 4)
        d2 = self.dec2(torch.cat([self.up2(m), e2], dim=1))  # (B, 2c, 8, 8)
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))  # (B, c, 16, 16)
        return self.head(torch.cat([d1, x], dim=1))  # (B, 3, 16, 16)


def unet(batch_size: int = 8) -> ModelCase:
    """Images (B, 3, 16, 16) -> images (B, 3, 16, 16); loss: MSE against a target image."""
    model = UNet()
    x = torch.randn(batch_size, 3, 16, 16)
    return ModelCase(model, (x,), torch.randn(batch_size, 3, 16, 16), mse_loss)


# --------------------------------------------------------------------------- two inputs


class TwoInputBranchy(nn.Module):
    """Separate MLPs on ``a`` and ``b`` merged by add and concat; ``shared`` runs twice."""

    def __init__(self, d_a: int = 12, d_b: int = 10, width: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.branch_a = nn.Sequential(nn.Linear(d_a, width), nn.Tanh(), nn.Linear(width, width))
        self.branch_b = nn.Sequential(nn.Linear(d_b, width), nn.GELU(), nn.Linear(width, width), nn.Tanh())
        self.shared = nn.Linear(width, width)
        self.merge = nn.Linear(2 * width, width)
        self.trunk = nn.Sequential(
            nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width)
        )
        self.head = nn.Linear(width, d_out)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        ha = self.branch_a(a)  # (B, w)
        hb = self.branch_b(b)  # (B, w)
        early = self.shared(ha)  # first use of shared
        both = torch.cat([ha, hb], dim=1)  # (B, 2w)
        x = self.merge(both) + ha + hb
        x = self.trunk(x)
        late = self.shared(x)  # second use, far from the first
        return self.head(torch.tanh(late) + early)


def two_input_branchy(batch_size: int = 8) -> ModelCase:
    """``forward(a, b)``: a (B, 12), b (B, 10) -> (B, 4); loss: MSE."""
    model = TwoInputBranchy()
    inputs = (torch.randn(batch_size, 12), torch.randn(batch_size, 10))
    return ModelCase(model, inputs, torch.randn(batch_size, 4), mse_loss)


# --------------------------------------------------------------------------- MLP


def mlp(batch_size: int = 8, *, num_layers: int = 5, width: int = 32) -> ModelCase:
    """Features (B, 20) -> logits (B, 10) through ``num_layers`` Linear layers; loss: cross entropy."""
    layers: list[nn.Module] = [nn.Linear(20, width), nn.ReLU()]
    for _ in range(num_layers - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    model = nn.Sequential(*layers)
    x = torch.randn(batch_size, 20)
    return ModelCase(model, (x,), torch.randint(0, 10, (batch_size,)), class_loss)


# --------------------------------------------------------------------------- random DAG

# One node: (op, argument node indices, index into ``linears`` or -1).
Node = tuple[str, tuple[int, ...], int]
OPS = ("linear", "add", "cat", "tanh", "gelu")


class RandomDAG(nn.Module):
    """Node 0 projects the input to ``width``; node i applies ``nodes[i-1]`` to earlier
    nodes; the output is ``head`` of the sum of every node no later node reads."""

    def __init__(
        self, nodes: list[Node], linears: list[nn.Linear], d_in: int, width: int, d_out: int
    ) -> None:
        super().__init__()
        self.nodes = nodes
        self.inp = nn.Linear(d_in, width)
        self.linears = nn.ModuleList(linears)
        self.head = nn.Linear(width, d_out)
        read = {j for _, args, _ in nodes for j in args}
        self.sinks = [i for i in range(len(nodes) + 1) if i not in read]
        uses = [li for _, _, li in nodes if li >= 0]
        self.num_shared_uses = len(uses) - len(set(uses))

    def forward(self, x: Tensor) -> Tensor:
        h = [self.inp(x)]
        for op, args, li in self.nodes:
            if op == "linear":
                h.append(self.linears[li](h[args[0]]))
            elif op == "add":
                h.append(h[args[0]] + h[args[1]])
            elif op == "cat":
                h.append(self.linears[li](torch.cat([h[args[0]], h[args[1]]], dim=-1)))
            elif op == "tanh":
                h.append(torch.tanh(h[args[0]]))
            else:
                h.append(F.gelu(h[args[0]]))
        out = h[self.sinks[0]]
        for i in self.sinks[1:]:
            out = out + h[i]
        return self.head(out)


def random_dag(seed: int, num_nodes: int, *, batch_size: int = 8, width: int = 8) -> ModelCase:
    """A random DAG of ``num_nodes`` nodes after the input projection: (B, 6) -> (B, 4); loss: MSE.

    Structure, weights and data all follow from ``seed`` (torch's global generator is
    left as it was). About a third of ``linear`` and ``cat`` nodes reuse an earlier
    node's Linear, so parameters are shared between distant ops.
    """
    rng = random.Random(seed)
    nodes: list[Node] = []
    square: list[int] = []  # indices into linears of width -> width layers
    wide: list[int] = []  # indices into linears of 2*width -> width layers
    num_linears = 0

    def pick(i: int) -> int:  # an earlier node: often the latest, else any
        return i - 1 if rng.random() < 0.5 else rng.randrange(i)

    for i in range(1, num_nodes + 1):
        op = rng.choice(OPS) if i > 1 else rng.choice(("linear", "tanh", "gelu"))
        li = -1
        if op in ("linear", "cat"):
            pool = square if op == "linear" else wide
            if pool and rng.random() < 0.35:
                li = rng.choice(pool)
            else:
                li = num_linears
                num_linears += 1
                pool.append(li)
        if op in ("add", "cat"):
            a = pick(i)
            b = rng.choice([j for j in range(i) if j != a])
            args: tuple[int, ...] = (a, b)
        else:
            args = (pick(i),)
        nodes.append((op, args, li))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        linears = [nn.Linear(width if li in square else 2 * width, width) for li in range(num_linears)]
        model = RandomDAG(nodes, linears, d_in=6, width=width, d_out=4)
        x = torch.randn(batch_size, 6)
        target = torch.randn(batch_size, 4)
    return ModelCase(model, (x,), target, mse_loss)


ALL_FACTORIES: dict[str, Callable[[], ModelCase]] = {
    "tiny_gpt": tiny_gpt,
    "tiny_gpt_size_ops": lambda: tiny_gpt(size_ops=True),
    "unet": unet,
    "two_input_branchy": two_input_branchy,
    "mlp": mlp,
    "random_dag": lambda: random_dag(0, 12),
}
