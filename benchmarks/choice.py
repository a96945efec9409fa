"""The planner's choice beside the layouts it rejected, measured: one table for the CPU benchmarks.

A benchmark that times several layouts side by side (round by round, in the same processes)
hands :func:`chosen_vs_rejected` each layout's predicted step, its measured steps (one per
round, the rounds aligned) and the layout the planner chose when left free among them; each
rejected layout gets a row: the predicted and the measured ratio chosen / rejected (measured:
the median of the per-round ratios, their range) and whether the choice held (measured no
slower: the median ratio at most 1, or within ``tie`` of it, the planner's own tie).
"""

from __future__ import annotations

import statistics
from typing import Mapping, Sequence

HEADER = ("| planner's choice | rejected | predicted chosen / rejected | measured chosen / rejected (median, min-max) "
          "| choice held |")


def chosen_vs_rejected(chosen: str, predicted: Mapping[str, float], times: Mapping[str, Sequence[float]],
                       tie: float = 0.01) -> list[str]:
    """Markdown rows (with the header) of ``chosen`` against every other layout of ``times``."""
    lines = [HEADER, "|---|---|---|---|---|"]
    for other in times:
        if other == chosen or not times[other] or not times[chosen]:
            continue
        ratios = [a / b for a, b in zip(times[chosen], times[other])]
        median = statistics.median(ratios)
        held = "yes" if median <= 1 + tie else "**no**"
        lines.append(f"| {chosen} | {other} | {predicted[chosen] / predicted[other]:.3f} | {median:.3f} "
                     f"({min(ratios):.2f}-{max(ratios):.2f}) | {held} |")
    return lines
