"""The precision a run computes in: one name for the planner, the runtimes and the report.

``"fp32"`` computes in the weights' own dtype (fp32 for an fp32 model, bf16 for a model
cast to bf16); ``"bf16"`` and ``"fp16"`` are torch's automatic mixed precision: fp32
weights and optimizer state, each stage's forward (and the loss) under
``torch.autocast(device_type, dtype)``, the backward in whatever dtype autocast chose for
each op. A user's own ``torch.autocast`` around ``train_step`` means the same thing and is
read from torch's autocast state at each step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from replica.errors import ConfigError

__all__ = ["PRECISIONS", "precision_name", "autocast_dtype", "ambient_autocast", "autocast_for"]

# name -> the dtype autocast computes in (None: no autocast)
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

_ALIASES: dict[Any, str] = {
    None: "fp32", False: "fp32", "fp32": "fp32", "float32": "fp32", torch.float32: "fp32",
    "bf16": "bf16", "bfloat16": "bf16", torch.bfloat16: "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", torch.float16: "fp16",
}


def precision_name(value: Any, *, argument: str = "mixed_precision") -> str:
    """``None``/``"fp32"`` -> ``"fp32"``; ``"bf16"``/``torch.bfloat16`` -> ``"bf16"``;
    ``"fp16"``/``torch.float16`` -> ``"fp16"``; anything else is a :class:`ConfigError`."""
    if value is True:
        raise ConfigError(f"{argument}=True does not say which half precision: pass {argument}='bf16' "
                          f"(bfloat16 autocast, no loss scaling) or {argument}='fp16' (float16 autocast with "
                          "replica.GradScaler)")
    try:
        return _ALIASES[value.lower() if isinstance(value, str) else value]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown {argument}={value!r}; choose None (fp32), 'bf16' or 'fp16'") from None


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype autocast computes in under ``precision`` (None for fp32)."""
    return PRECISIONS[precision_name(precision)]


def ambient_autocast(device_type: str) -> torch.dtype | None:
    """The dtype of the ``torch.autocast`` the caller is inside for ``device_type``, or None."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 takes no device type
        enabled = torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()
    if not enabled:
        return None
    try:
        return torch.get_autocast_dtype(device_type)
    except AttributeError:  # torch < 2.4
        return torch.get_autocast_cpu_dtype() if device_type == "cpu" else torch.get_autocast_gpu_dtype()


@contextlib.contextmanager
def autocast_for(device: torch.device, precision: str) -> Iterator[None]:
    """``torch.autocast`` on ``device``'s type in ``precision``'s dtype; nothing for fp32 (a
    caller's own autocast stays in force either way)."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield
