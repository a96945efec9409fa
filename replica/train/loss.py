"""The Trainer's loss on what the model returns: a torch loss scores a ``ModelOutput``'s ``logits``.

A Hugging Face model returns a ``ModelOutput`` (``CausalLMOutputWithPast``...), which torch's
losses cannot take. :class:`ModelLoss` hands a torch loss (``torch.nn.CrossEntropyLoss()``,
``F.cross_entropy``...) the output's ``logits``; a classification loss given per-position
scores ``(batch, ..., classes)`` and targets ``(batch, ...)`` scores every position (the
classes moved to dim 1, as torch's losses take them). The target is the label of each
position as it stands: shift it yourself for next-token prediction. A loss of your own gets
the output as the model returns it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from replica.errors import ConfigError

__all__ = ["ModelLoss", "scores", "class_scores"]

_CLASSIFICATION = (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)
_CLASSIFICATION_FUNCTIONS = (F.cross_entropy, F.nll_loss)


def _is_torch_loss(loss: Callable[..., Any]) -> bool:
    return isinstance(loss, torch.nn.modules.loss._Loss) or getattr(loss, "__module__", "") == F.__name__


def scores(out: Any) -> Any:
    """``out.logits`` of a ``ModelOutput`` (or a dict's ``"logits"``), else ``out`` itself."""
    if isinstance(out, torch.Tensor):
        return out
    logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else out


def class_scores(out: torch.Tensor, target: Any) -> tuple[torch.Tensor, Any]:
    """Per-position scores ``(batch, ..., classes)`` with targets ``(batch, ...)`` as torch's
    classification losses take them: one row per position, ``(positions, classes)``."""
    if isinstance(target, torch.Tensor) and not target.is_floating_point() and out.dim() > 2 \
            and out.dim() == target.dim() + 1 and out.shape[:-1] == target.shape:
        return out.reshape(-1, out.shape[-1]), target.reshape(-1)
    return out, target


class ModelLoss:
    """``loss(output, target)`` for the pipeline: a torch loss scores ``output.logits``; any other
    loss gets the output as is, and a ``TypeError`` on a ``ModelOutput`` names ``out.logits``."""

    def __init__(self, loss: Callable[[Any, Any], torch.Tensor]) -> None:
        self.loss = loss
        self.reduction = getattr(loss, "reduction", "mean")
        self.torch_loss = _is_torch_loss(loss)
        self.classification = isinstance(loss, _CLASSIFICATION) or loss in _CLASSIFICATION_FUNCTIONS

    def prepare(self, out: Any, target: Any) -> tuple[Any, Any]:
        """What the loss is given: the logits, one row per position, for a torch loss."""
        if not self.torch_loss:
            return out, target
        out = scores(out)
        if self.classification and isinstance(out, torch.Tensor):
            out, target = class_scores(out, target)
        return out, target

    def __call__(self, out: Any, target: Any) -> torch.Tensor:
        out, target = self.prepare(out, target)
        try:
            return self.loss(out, target)
        except TypeError as exc:
            if isinstance(out, torch.Tensor):
                raise
            name = getattr(self.loss, "__name__", type(self.loss).__name__)
            raise ConfigError(
                f"the loss {name} cannot take the model's output, a {type(out).__name__} ({exc}). Score its tensor "
                "yourself, e.g. loss=lambda out, y: torch.nn.functional.cross_entropy(out.logits.flatten(0, -2), "
                "y.flatten()) for a Hugging Face model's out.logits, or pass a torch loss "
                "(torch.nn.CrossEntropyLoss()), which is given out.logits"
            ) from exc
