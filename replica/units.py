"""Bytes, seconds and FLOP rates as people read them: one formatter for the summary, the report and the Trainer."""

from __future__ import annotations

__all__ = ["format_bytes", "format_seconds", "format_flop_rate"]


def format_bytes(n: float, spec: str = ".3g") -> str:
    """``n`` bytes in the largest binary unit under 1024 of it (``"12.5 MiB"``): whole bytes,
    else ``spec`` (``".3g"``: three significant digits; ``".1f"``: one decimal)."""
    if n == 0:
        return "0"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:{spec}} {unit}"
        n /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def format_seconds(s: float, spec: str = ".3g") -> str:
    """``s`` seconds in s, ms or µs, with ``spec`` (µs as whole numbers under ``".1f"``-style specs)."""
    if s == 0:
        return "0"
    if s >= 1:
        return f"{s:{spec}} s"
    if s >= 1e-3:
        return f"{s * 1e3:{spec}} ms"
    return f"{s * 1e6:.0f} µs" if spec.endswith("f") else f"{s * 1e6:{spec}} µs"


def format_flop_rate(flops_per_s: float, spec: str = ".3g") -> str:
    """``flops_per_s`` in the largest of FLOP/s, kFLOP/s, MFLOP/s, GFLOP/s, TFLOP/s, PFLOP/s that keeps it
    at 1 or more (``"31.4 GFLOP/s"``, never ``"0.0 TFLOP/s"``)."""
    if flops_per_s == 0:
        return "0 FLOP/s"
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6),
                        ("kFLOP/s", 1e3)):
        if abs(flops_per_s) >= scale:
            return f"{flops_per_s / scale:{spec}} {unit}"
    return f"{flops_per_s:{spec}} FLOP/s"
