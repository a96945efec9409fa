"""Whether a plan's stages run through ``torch.compile``: the user's choice, or the planner's rule."""

from __future__ import annotations

from replica.errors import ConfigError
from replica.partition.autocast import target_device_type
from replica.partition.cost import DeviceSpec

__all__ = ["compile_choice", "check_float8", "FLOAT8_SPEEDUP", "FLOAT8_DEVICES"]

# SM90 presets, whose tensor cores run float8 matmuls (the datasheet's dense FP8 peak is twice BF16's)
FLOAT8_DEVICES = ("h100", "h200")
# fitted, not held out: torchtitan's Llama-3 8B on 8 H100s gained 1.28x from float8 linears on top
# of compile (Table 1), which 1.55x on the linears' FLOPs reproduces (2.0 predicted 1.44x: dynamic
# scaling's casts and amax reductions take the rest)
FLOAT8_SPEEDUP = 1.55  # a float8 linear's FLOPs at this many times the half-precision rate (RESULTS.md, Decisions)


def check_float8(asked: bool, spec: DeviceSpec) -> None:
    """``float8=True`` on a plan for anything but an SM90 GPU preset is a ``ConfigError``."""
    if asked and not spec.name.startswith(FLOAT8_DEVICES):
        where = "a CPU" if target_device_type(spec) == "cpu" else spec.name
        raise ConfigError(
            f"float8=True trains the linears in float8 (torchao), which needs an SM90 GPU (H100, H200): this plan is "
            f"for {where}. Plan for device='h100-80gb' on an H100, or leave float8=False (compile=True alone "
            "compiles the stages)")


def compile_choice(asked: bool | None, spec: DeviceSpec, weights_on: str, float8: bool = False) -> tuple[bool, str]:
    """``(compiled, why)`` for a request's ``compile`` on ``spec``, the model's weights being on
    device type ``weights_on`` ("cpu", "cuda", or "meta" for a model planned without them).

    True and False are the user's (``why`` "compile=True", or "" for False). None is one rule,
    the same for every model: on where the plan is for a GPU and the weights are not on a CPU
    (torchtitan's published H100 table gains 1.16x from compile alone on Llama-3 8B, and a GPU
    step repays the compile seconds within a few hundred steps); off where the stages run on a
    CPU, where inductor's C++ build costs 10-20 s a graph from a cold cache on a small machine
    (benchmarks/compile.py measures both): ``compile=True`` still compiles there. ``float8``
    turns None on: its casts are fused by the compiler."""
    if asked is None and float8:
        return True, "compile=None with float8=True: on, float8's casts need the compiler"
    if asked is not None:
        return asked, "compile=True" if asked else ""
    if target_device_type(spec) == "cpu" or weights_on == "cpu":
        where = spec.name if target_device_type(spec) == "cpu" else f"a model on the CPU (priced as {spec.name})"
        return False, (f"compile=None for {where}: off by the planner's rule, inductor's CPU build costs 10-20 s a "
                       "graph from a cold cache (benchmarks/compile.py); compile=True turns it on")
    # on for now: make_plan prices the chosen layout eager too and keeps the faster (_compile_if_it_pays)
    return True, f"compile=None on {spec.name}: on by the planner's rule, a GPU repays the compile within the run"
