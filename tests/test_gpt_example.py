"""The GPT example trains a couple of steps under ``--precision bf16`` (and fp16 with
replica.GradScaler), through its plain loop and through the Trainer, offline on a small
slice of the standard library."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from examples.gpt import train

REPO = Path(__file__).resolve().parents[1]
TINY = ["--steps", "2", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
        "--batch-size", "8", "--num-stages", "2", "--num-microbatches", "2", "--max-bytes", "50000",
        "--log-every", "1", "--sample-tokens", "10", "--threads", "1"]


def run_example(*flags: str) -> str:
    done = subprocess.run([sys.executable, str(REPO / "examples" / "gpt" / "train.py"), *TINY, *flags],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step +\d+ \| loss ([0-9.]+)", out, re.M)]


def test_precision_defaults_to_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py"])
    assert train.parse_args().precision == "fp32"
    monkeypatch.setattr(sys, "argv", ["train.py", "--precision", "fp8"])
    with pytest.raises(SystemExit):
        train.parse_args()


def test_compile_flag_is_auto_parallels_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    for flag, want in (([], None), (["--compile", "on"], True), (["--compile", "off"], False)):
        monkeypatch.setattr(sys, "argv", ["train.py", *flag])
        assert train.compile_choice(train.parse_args()) is want
    monkeypatch.setattr(sys, "argv", ["train.py", "--compile", "yes"])
    with pytest.raises(SystemExit):
        train.parse_args()


def test_bf16_trains_a_couple_of_steps() -> None:
    out = run_example("--precision", "bf16")
    assert "precision: bf16 autocast" in out
    got = losses(out)
    assert len(got) == 2 and all(0 < x < 10 for x in got), out[-2000:]
    assert re.search(r"^val loss [0-9.]+$", out, re.M), out[-2000:]


def test_fp16_trains_with_a_grad_scaler() -> None:
    out = run_example("--precision", "fp16")
    assert "precision: fp16 autocast" in out and "loss scale 65536" in out
    assert len(losses(out)) == 2, out[-2000:]


def test_the_trainer_path_takes_precision_too() -> None:
    out = run_example("--trainer", "--precision", "bf16")
    assert re.search(r"^val loss [0-9.]+$", out, re.M), out[-2000:]
