"""Bytes and seconds as people read them: the one formatter the summary, the report and the Trainer share."""

from __future__ import annotations

__all__ = ["format_bytes", "format_seconds"]


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
