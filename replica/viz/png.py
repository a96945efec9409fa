"""PNG export of a plan's charts (stage times, memory, timeline) with matplotlib, for READMEs and papers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from replica.errors import ConfigError, ReplicaError
from replica.viz.figures import KIND_COLOURS, MEMORY_COLOURS, Figures, figures, format_bytes, format_seconds, shade

__all__ = ["save_png", "CHARTS"]

CHARTS = ("time", "memory", "timeline")
_KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight"}


def _matplotlib() -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ReplicaError(
            'PNG export needs matplotlib, which is not installed: pip install "replica[viz]" '
            "(or pip install matplotlib); visualize() writes the HTML report without it"
        ) from exc
    return Figure, FigureCanvasAgg


def save_png(
    plan_or_pipeline: Any,
    path: str | os.PathLike[str],
    *,
    charts: Sequence[str] = CHARTS,
    measured: Any = None,
    memory_budget: float | Sequence[float] | None = None,
    device: Any = None,
    dpi: int = 150,
) -> Path:
    """Draw ``charts`` (any of ``"time"``, ``"memory"``, ``"timeline"``) of a plan or a
    ``PipelineModel`` into one PNG at ``path``; returns the path. ``measured``,
    ``memory_budget`` and ``device`` are as for :func:`replica.visualize`. Needs matplotlib
    (``pip install "replica[viz]"``); the figure is made without pyplot, so no window opens."""
    wanted = list(dict.fromkeys(charts))
    if not wanted or any(c not in CHARTS for c in wanted):
        raise ConfigError(f"charts must be a non-empty selection of {list(CHARTS)}, got {list(charts)}")
    Figure, FigureCanvasAgg = _matplotlib()
    fig = figures(plan_or_pipeline, measured=measured, memory_budget=memory_budget, device=device)
    bars = [c for c in wanted if c != "timeline"]
    rows = (1 if bars else 0) + (1 if "timeline" in wanted else 0)
    ranks = fig.timeline.num_ranks
    heights = ([4.2] if bars else []) + ([1.3 + 0.45 * ranks] if "timeline" in wanted else [])
    figure = Figure(figsize=(13, sum(heights) + 0.3 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(rows, max(1, len(bars)), height_ratios=heights)
    for i, chart in enumerate(bars):
        ax = figure.add_subplot(grid[0, i])
        (_time if chart == "time" else _memory)(ax, fig)
    if "timeline" in wanted:
        _timeline(figure.add_subplot(grid[rows - 1, :]), fig)
    out = Path(path)
    figure.savefig(out, dpi=dpi, facecolor="white")
    return out


def _stage_axis(ax: Any, fig: Figures) -> None:
    n = fig.plan.num_stages
    ax.set_xticks(range(n), [f"stage {k}" for k in range(n)], fontsize=9, rotation=0 if n <= 12 else 90)
    for k, label in enumerate(ax.get_xticklabels()):
        label.set_color(fig.colours[k])
        label.set_fontweight("bold")
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="y", color="#e5e7eb")
    ax.set_axisbelow(True)


def _time(ax: Any, fig: Figures) -> None:
    plan, measured = fig.plan, fig.measured
    width = 0.38 if measured else 0.6
    xs = [k - (width / 2 + 0.01 if measured else 0) for k in range(plan.num_stages)]
    bottom = [0.0] * plan.num_stages
    for name in ("forward", "backward", "communication"):
        values = [getattr(s, f"{name}_time_s") * 1e3 for s in plan.stages]
        ax.bar(xs, values, width, bottom=bottom, color=KIND_COLOURS[name], label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    if measured:
        mx = [k + width / 2 + 0.01 for k in range(plan.num_stages)]
        ax.bar(mx, [m.total_s * 1e3 for m in measured], width, color=KIND_COLOURS["measured"], label="measured")
    mean = sum(s.predicted_time_s for s in plan.stages) / plan.num_stages * 1e3
    ax.axhline(mean, color="#111827", linestyle="--", linewidth=1, label=f"mean {format_seconds(mean / 1e3)}")
    slowest = max(range(plan.num_stages), key=lambda k: plan.stages[k].predicted_time_s)
    ax.annotate("bottleneck", (xs[slowest], bottom[slowest]), xytext=(0, 6), textcoords="offset points",
                ha="center", fontsize=8, color="#b91c1c", fontweight="bold")
    ax.set_ylabel("ms per step")
    ax.set_title(f"Time per step by stage · balance {plan.balance:.2f} (bottleneck / mean)", loc="left",
                 fontsize=11, fontweight="bold", pad=22)
    ax.legend(fontsize=8, ncols=5, loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False)
    _stage_axis(ax, fig)


def _memory(ax: Any, fig: Figures) -> None:
    plan = fig.plan
    unit, unit_name = _unit(max(s.memory.total for s in plan.stages))
    bottom = [0.0] * plan.num_stages
    for name, colour in MEMORY_COLOURS.items():
        values = [getattr(s.memory, name) / unit for s in plan.stages]
        ax.bar(range(plan.num_stages), values, 0.6, bottom=bottom, color=colour, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    used = max(bottom) * unit
    budgets = [b for b in fig.budgets if b is not None]
    title = "Memory per device at peak"
    if budgets and max(budgets) <= 4 * used:
        for k, b in enumerate(fig.budgets):
            if b is not None:
                ax.hlines(b / unit, k - 0.45, k + 0.45, color="#dc2626", linestyle="--", linewidth=2,
                          label="budget" if k == 0 else None)
    elif budgets:
        title += f" · budget {format_bytes(min(budgets))} off the scale"
    ax.set_ylabel(unit_name)
    ax.set_title(title, loc="left", fontsize=11, fontweight="bold", pad=22)
    ax.legend(fontsize=8, ncols=5, loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False)
    _stage_axis(ax, fig)


def _unit(n: float) -> tuple[float, str]:
    for power, name in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if n >= 1024 ** power:
            return 1024.0 ** power, name
    return 1.0, "bytes"


def _timeline(ax: Any, fig: Figures) -> None:
    from matplotlib.patches import Patch

    tl, plan = fig.timeline, fig.plan
    ms = 1e3
    for r in range(tl.num_ranks):
        ax.barh(r, tl.step_time_s * ms, 0.8, left=0, color="#f3f4f6", hatch="///", edgecolor="#d1d5db",
                linewidth=0)
    pixels = ax.get_window_extent().width or 1000.0
    boxes: dict[tuple[int, str], list[tuple[float, float]]] = {}  # one broken_barh per rank and colour
    feet: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in tl.events:
        s, kind, i = e.action
        colour = KIND_COLOURS[_KIND_NAMES[kind]]
        w = (e.end_s - e.start_s) * ms
        boxes.setdefault((e.rank, colour if i % 2 == 0 else shade(colour, 0.28)), []).append((e.start_s * ms, w))
        feet.setdefault((e.rank, fig.colours[s]), []).append((e.start_s * ms, w))
        if w / (tl.step_time_s * ms) * pixels > 26:
            ax.text(e.start_s * ms + w / 2, e.rank - 0.04, str(e.action), ha="center", va="center", fontsize=7,
                    color="white", fontweight="bold")
    thin = len(tl.events) > 2000  # white edges would grey out a dense timeline
    for (rank, colour), spans in boxes.items():
        ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=colour, edgecolor="white", linewidth=0 if thin else 0.5)
    for (rank, colour), spans in feet.items():
        ax.broken_barh(spans, (rank + 0.28, 0.12), facecolors=colour, edgecolor="white",
                       linewidth=0 if thin else 0.5)
    ax.set_yticks(range(tl.num_ranks), [f"rank {r}" for r in range(tl.num_ranks)])
    ax.set_ylim(tl.num_ranks - 0.5, -0.5)
    ax.set_xlim(0, tl.step_time_s * ms)
    ax.set_xlabel("ms")
    ax.spines[["top", "right", "left"]].set_visible(False)
    kinds = sorted({e.action.kind for e in tl.events}, key="FBW".index)
    handles = [Patch(color=KIND_COLOURS[_KIND_NAMES[k]], label=_KIND_NAMES[k]) for k in kinds]
    handles.append(Patch(facecolor="#f3f4f6", hatch="///", edgecolor="#d1d5db", label="idle (bubble)"))
    ax.legend(handles=handles, fontsize=8, ncols=len(handles), loc="lower left", bbox_to_anchor=(0, 1.0),
              frameon=False)
    ax.set_title(f"Pipeline schedule · {plan.schedule}, {plan.num_microbatches} micro-batches · step "
                 f"{format_seconds(tl.step_time_s)}, bubble {tl.bubble_fraction:.0%}", loc="left", fontsize=11,
                 fontweight="bold", pad=22)
