"""Float8 training of a stage's linears through torchao, on an SM90 GPU (``float8=True``)."""

from __future__ import annotations

import torch

from replica.errors import ConfigError

__all__ = ["float8_stage"]


def float8_stage(module: torch.nn.Module) -> int:
    """Swap ``module``'s ``nn.Linear`` layers for torchao's float8 training linears (their weights
    keep their names: the parameter is the same), as torchtitan's float8 converter does before
    compile. Needs torchao and a CUDA device of compute capability 9.0 or more (H100, H200): else a
    ``ConfigError`` naming what is missing. Returns how many linears now train in float8."""
    weights = [p for p in module.parameters()]
    device = weights[0].device if weights else torch.device("cpu")
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        what = "the CPU" if device.type != "cuda" else f"{torch.cuda.get_device_name(device)} (capability " \
            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
        raise ConfigError(
            f"float8=True trains the linears in float8, which needs an SM90 GPU (H100, H200), but this stage's weights "
            f"are on {what}. Run it on an H100, or plan with float8=False")
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        raise ConfigError("float8=True runs on torchao's float8 training: pip install torchao, or plan with "
                          "float8=False") from None
    before = sum(type(m) is torch.nn.Linear for m in module.modules())
    # float8 matmuls need both dims of the weight divisible by 16
    convert_to_float8_training(module, module_filter_fn=lambda m, _: all(d % 16 == 0 for d in m.weight.shape))
    return before - sum(type(m) is torch.nn.Linear for m in module.modules())
