"""The CIFAR-10 example reads the standard python batches, refuses to run without them (pointing at
--synthetic), and trains end to end through the trainer."""

from __future__ import annotations

import argparse
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.cifar10 import train
from examples.cifar10.data import TEST_FILE, TRAIN_FILES, load_cifar10, synthetic_cifar
from examples.cifar10.model import CifarCNN

REPO = Path(__file__).resolve().parents[1]


def fake_cifar(directory: Path, per_file: int = 20) -> None:
    """Files in CIFAR-10's own format: pickled dicts of bytes keys, uint8 rows of 3072."""
    directory.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for name in (*TRAIN_FILES, TEST_FILE):
        data = torch.randint(0, 256, (per_file, 3072), dtype=torch.uint8, generator=g).numpy()
        labels = torch.randint(0, 10, (per_file,), generator=g).tolist()
        with open(directory / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": labels, b"batch_label": name.encode()}, f)


def test_the_python_batches_load_normalised(tmp_path: Path) -> None:
    fake_cifar(tmp_path / "cifar-10-batches-py")
    x_train, y_train, x_test, y_test = load_cifar10(tmp_path)  # the parent directory works too
    assert x_train.shape == (100, 3, 32, 32) and y_train.shape == (100,) and x_test.shape == (20, 3, 32, 32)
    assert x_train.dtype == torch.float32 and y_train.dtype == torch.long
    assert abs(float(x_train.mean())) < 0.5


def test_without_data_it_says_so_and_offers_synthetic(tmp_path: Path, capsys) -> None:
    args = argparse.Namespace(synthetic=False, data_dir=str(tmp_path))
    with pytest.raises(SystemExit) as info:
        train.load_data(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "CIFAR-10 not found" in err and "--synthetic" in err and "never downloads" in err


def test_the_model_traces_and_the_synthetic_set_is_deterministic() -> None:
    x, y = synthetic_cifar(8, seed=3)
    assert torch.equal(x, synthetic_cifar(8, seed=3)[0]) and y.max() < 10
    assert CifarCNN()(x).shape == (8, 10)
    torch.fx.symbolic_trace(CifarCNN())


def test_the_script_trains_on_the_real_format(tmp_path: Path) -> None:
    fake_cifar(tmp_path / "data")
    done = subprocess.run([sys.executable, str(REPO / "examples" / "cifar10" / "train.py"), "--data-dir",
                           str(tmp_path / "data"), "--epochs", "1", "--batch-size", "50", "--threads", "1",
                           "--checkpoint-dir", str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "100 training and 20 test images" in done.stdout and "test accuracy" in done.stdout
    assert (tmp_path / "ckpt" / "step-00000002" / "manifest.json").is_file()
