"""A byte-level text corpus that exists on every machine: Python's own standard library."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

VOCAB_SIZE = 256  # one token per byte


def stdlib_sources() -> list[Path]:
    """The standard library's top-level .py files, sorted so every machine reads them in one order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if p.is_file())


def load_corpus(path: str | None, max_bytes: int) -> torch.Tensor:
    """Read `path` (or the standard library's sources when None) as a uint8 tensor of at most max_bytes."""
    if path is not None:
        with open(path, "rb") as f:
            raw = f.read(max_bytes)
    else:
        parts: list[bytes] = []
        size = 0
        for source in stdlib_sources():
            text = source.read_bytes()
            parts.append(text)
            size += len(text)
            if size >= max_bytes:
                break
        raw = b"".join(parts)[:max_bytes]
    if len(raw) == 0:
        where = path if path is not None else sysconfig.get_paths()["stdlib"]
        raise ValueError(f"no text found in {where!r}; pass a text file with --data FILE")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def train_val_split(data: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """The first (1 - val_fraction) of the bytes for training, the rest for validation."""
    n = int(len(data) * (1.0 - val_fraction))
    return data[:n], data[n:]


def get_batch(
    data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of data: x (B, T) and y (B, T), y being x shifted by one byte."""
    if len(data) <= block_size:
        raise ValueError(f"corpus of {len(data)} bytes is too short for block_size={block_size}")
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)  # (B,)
    offsets = torch.arange(block_size)  # (T,)
    x = data[ix[:, None] + offsets].long()  # (B, T)
    y = data[ix[:, None] + offsets + 1].long()  # (B, T)
    return x, y


def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)  # (T,)


def decode(tokens: torch.Tensor) -> str:
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")


if __name__ == "__main__":
    data = load_corpus(None, int(os.environ.get("MAX_BYTES", 3_000_000)))
    print(f"{len(data):,} bytes from {len(stdlib_sources())} files")
    print(decode(data[:200]))
