"""Evaluation metrics over pipelined outputs: summed loss and correct counts, reduced across ranks."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from replica.errors import ConfigError

__all__ = ["METRICS", "is_classification", "metric_names", "batch_sums"]

METRICS = ("loss", "accuracy")
_CLASSIFICATION_FUNCTIONS = (F.cross_entropy, F.nll_loss)


def is_classification(loss: Callable[..., Any]) -> bool:
    """Whether ``loss`` scores class predictions (so ``evaluate`` reports accuracy)."""
    return isinstance(loss, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)) or loss in _CLASSIFICATION_FUNCTIONS


def metric_names(metrics: str | Sequence[str] | None, loss: Callable[..., Any]) -> tuple[tuple[str, ...], bool]:
    """``(names, as_dict)``: what to compute and whether ``evaluate`` returns a dict."""
    if metrics is None:
        return ("accuracy" if is_classification(loss) else "loss",), False
    names = (metrics,) if isinstance(metrics, str) else tuple(metrics)
    unknown = [m for m in names if m not in METRICS]
    if unknown or not names:
        raise ConfigError(f"unknown metrics {unknown or names!r}; choose from {list(METRICS)}, e.g. "
                          "metrics=('loss', 'accuracy')")
    return names, not isinstance(metrics, str)


def _loss_sum(loss: Callable[..., Any], out: Any, target: Any, n: int) -> float:
    value = loss(out, target)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ConfigError(f"the loss must return a scalar tensor, got {type(value).__name__}")
    reduction = getattr(loss, "reduction", "mean")
    return float(value) * (n if reduction == "mean" else 1)


def _correct(loss: Callable[..., Any], out: Any, target: Any) -> tuple[int, int]:
    if not isinstance(out, torch.Tensor) or out.dim() < 2:
        raise ConfigError(
            f"accuracy needs class scores of shape (batch, classes, ...), but the model returns "
            f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}; use metrics=('loss',)"
        )
    pred = out.argmax(dim=1)
    if target.is_floating_point() and target.shape == out.shape:  # class probabilities
        target = target.argmax(dim=1)
    if target.is_floating_point() or target.shape != pred.shape:
        raise ConfigError(
            f"accuracy compares argmax over dim 1 of the output {tuple(out.shape)} with integer class indices "
            f"of shape {tuple(pred.shape)} (or probabilities shaped like the output), but the target is "
            f"{target.dtype} of shape {tuple(target.shape)}"
        )
    valid = target != getattr(loss, "ignore_index", -100)
    return int(((pred == target) & valid).sum()), int(valid.sum())


def batch_sums(loss: Callable[..., Any], names: Sequence[str], out: Any, target: Any, n: int) -> list[float]:
    """``[loss × samples, samples, correct, counted]`` of one batch (zeros for metrics not asked)."""
    sums = [0.0, float(n), 0.0, 0.0]
    if "loss" in names:
        sums[0] = _loss_sum(loss, out, target, n)
    if "accuracy" in names:
        correct, counted = _correct(loss, out, target)
        sums[2], sums[3] = float(correct), float(counted)
    return sums
