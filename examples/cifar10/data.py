"""CIFAR-10 from its python batches on disk (never downloaded), or a learnable synthetic stand-in."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.nn.functional as F

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"


def find_cifar10(data_dir: str | Path) -> Path | None:
    """The directory holding ``data_batch_1..5`` and ``test_batch`` (``data_dir`` or its ``cifar-10-batches-py``)."""
    for d in (Path(data_dir), Path(data_dir) / "cifar-10-batches-py"):
        if all((d / f).is_file() for f in (*TRAIN_FILES, TEST_FILE)):
            return d
    return None


def _read(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="bytes")  # the dataset's own format: a dict of bytes keys
    x = torch.tensor(batch[b"data"], dtype=torch.uint8).view(-1, 3, 32, 32)  # (N, 3, 32, 32)
    y = torch.tensor(batch[b"labels"], dtype=torch.long)  # (N,)
    return x, y


def normalize(x: torch.Tensor) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> float, each channel standardised with CIFAR-10's statistics."""
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    return (x.float() / 255.0 - mean) / std


def load_cifar10(data_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x_train (50000, 3, 32, 32), y_train, x_test (10000, 3, 32, 32), y_test``, normalised."""
    d = find_cifar10(data_dir)
    if d is None:
        raise FileNotFoundError(
            f"no CIFAR-10 python batches in {data_dir} (expected {', '.join(TRAIN_FILES)} and {TEST_FILE}, "
            "as extracted from cifar-10-python.tar.gz)"
        )
    train = [_read(d / f) for f in TRAIN_FILES]
    x_test, y_test = _read(d / TEST_FILE)
    x_train = torch.cat([x for x, _ in train])
    y_train = torch.cat([y for _, y in train])
    return normalize(x_train), y_train, normalize(x_test), y_test


def synthetic_cifar(num_samples: int, *, image_size: int = 32, num_classes: int = 10, noise: float = 1.0,
                    seed: int = 0, template_seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable stand-in: each class is a smooth random colour pattern (fixed by
    ``template_seed``), each sample its class's pattern, randomly shifted, plus Gaussian noise.
    Train and test sets share templates and differ in ``seed``. Returns ``x (N, 3, S, S), y (N,)``."""
    g = torch.Generator().manual_seed(template_seed)
    coarse = torch.randn(num_classes, 3, 4, 4, generator=g)  # (C, 3, 4, 4)
    templates = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear", align_corners=False)
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, num_classes, (num_samples,), generator=g)  # (N,)
    x = templates[y]  # (N, 3, S, S)
    shifts = torch.randint(-2, 3, (num_samples,), generator=g)  # (N,): a horizontal shift per sample
    for s in range(-2, 3):
        x[shifts == s] = torch.roll(x[shifts == s], shifts=s, dims=3)
    x = x + noise * torch.randn(x.shape, generator=g)
    return x, y
