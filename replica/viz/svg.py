"""Inline SVG charts of a plan: the cut strip, per-stage time and memory bars, the pipeline timeline."""

from __future__ import annotations

from html import escape
from typing import Callable, Sequence

from replica.schedules.simulate import Timeline
from replica.viz.figures import (
    KIND_COLOURS,
    MEMORY_COLOURS,
    Figures,
    format_bytes,
    format_seconds,
    format_share,
    nice_ticks,
    shade,
)

__all__ = ["cut_strip", "time_bars", "memory_bars", "timeline"]

_FONT = 'font-family="system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif"'
_KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight"}


def _text(x: float, y: float, text: str, *, size: int = 12, anchor: str = "start", fill: str = "#1f2937",
          weight: str = "normal", extra: str = "") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" fill="{fill}" '
            f'font-weight="{weight}" {extra}>{escape(text)}</text>')


def _rect(x: float, y: float, w: float, h: float, fill: str, *, title: str = "", extra: str = "") -> str:
    tip = f"<title>{escape(title)}</title>" if title else ""
    return (f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0):.2f}" height="{max(h, 0):.2f}" fill="{fill}" '
            f'{extra}>{tip}</rect>')


def _svg(width: int, height: int, body: list[str], label: str) -> str:
    return (f'<svg viewBox="0 0 {width} {height}" width="100%" '
            f'role="img" aria-label="{escape(label)}" {_FONT}>' + "".join(body) + "</svg>")


def _legend(x: float, y: float, items: Sequence[tuple[str, str]], *, pattern: str = "") -> tuple[list[str], float]:
    out = []
    for name, colour in items:
        fill = f"url(#{pattern})" if colour == "pattern" else colour
        out.append(_rect(x, y - 10, 12, 12, fill, extra='rx="2" stroke="#9ca3af" stroke-width="0.5"'))
        out.append(_text(x + 17, y, name, size=12))
        x += 30 + 7 * len(name)
    return out, x


def cut_strip(fig: Figures, spans: Sequence[str], width: int = 1300) -> str:
    """The model as one bar cut into stages (widths by op count), each cut labelled with its bytes."""
    plan = fig.plan
    ops = [max(1, s.num_ops) for s in plan.stages]
    total = sum(ops)
    left, bar_y, bar_h = 10, 8, 46
    usable = width - 2 * left
    body, x, labelled = [], float(left), float("-inf")
    for s, n in zip(plan.stages, ops):
        w = usable * n / total
        k = s.stage_index
        body.append(f'<a href="#stage-{k}">')
        body.append(_rect(x, bar_y, w - 2, bar_h, fig.colours[k], extra='rx="4"',
                          title=f"stage {k}: {s.num_ops} ops, {spans[k]}"))
        if w > 44:
            ink = _ink(fig.colours[k])
            body.append(_text(x + 8, bar_y + 19, f"stage {k}", size=13, fill=ink, weight="600"))
            chars = int((w - 14) / 6.4)
            span = spans[k] if len(spans[k]) <= chars else spans[k][:max(0, chars - 1)] + "…"
            body.append(_text(x + 8, bar_y + 36, span, size=11, fill=ink))
        elif w > 14:
            body.append(_text(x + w / 2 - 1, bar_y + 27, str(k), size=10, anchor="middle", fill=_ink(fig.colours[k])))
        body.append("</a>")
        x += w
        if k < plan.num_stages - 1:
            crossing = sum(b.nbytes for t in plan.stages[: k + 1] for b in t.outputs
                           if max(b.destination_stages, default=-1) > k)
            body.append(f'<line x1="{x - 1:.1f}" x2="{x - 1:.1f}" y1="{bar_y - 4}" y2="{bar_y + bar_h + 8}" '
                        f'stroke="#111827" stroke-width="2" stroke-dasharray="3 2"><title>cut {k} → {k + 1}: '
                        f"{escape(format_bytes(crossing))} per step</title></line>")
            if x - labelled > 80:  # leave out labels that would overlap; the line's tooltip has them
                labelled = x
                body.append(_text(x - 1, bar_y + bar_h + 22, f"✂ {format_bytes(crossing)}", size=11,
                                  anchor="middle", fill="#374151"))
    return _svg(width, bar_y + bar_h + 30, body, "the model cut into stages")


def _axis(x0: float, y0: float, x1: float, scale: float, ticks: list[float],
          fmt: Callable[[float], str]) -> list[str]:
    out = []
    for t in ticks:
        y = y0 - t * scale
        out.append(f'<line x1="{x0:.1f}" x2="{x1:.1f}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e7eb"/>')
        out.append(_text(x0 - 6, y + 4, fmt(t), size=11, anchor="end", fill="#6b7280"))
    out.append(f'<line x1="{x0:.1f}" x2="{x1:.1f}" y1="{y0:.1f}" y2="{y0:.1f}" stroke="#6b7280"/>')
    return out


def _stage_labels(fig: Figures, x0: float, slot: float, y: float) -> list[str]:
    n = fig.plan.num_stages
    every = max(1, -(-n * 56 // int(slot * n)))
    out = []
    for k in range(0, n, every):
        cx = x0 + slot * (k + 0.5)
        out.append(_rect(cx - 5, y - 9, 10, 10, fig.colours[k], extra='rx="2"'))
        out.append(_text(cx, y + 14, f"stage {k}", size=11, anchor="middle", fill="#374151"))
    return out


def time_bars(fig: Figures, width: int = 640, height: int = 330) -> str:
    """Per stage, predicted forward / backward / communication seconds per step, stacked; measured beside."""
    plan, measured = fig.plan, fig.measured
    left, right, top, bottom = 70, 64, 56, 44
    x1, y0 = width - right, float(height - bottom)
    peak = max([s.predicted_time_s for s in plan.stages] + [m.total_s for m in measured or ()])
    ticks = nice_ticks(peak * 1.08)
    scale = (y0 - top) / ticks[-1]
    slot = (x1 - left) / plan.num_stages
    items = [("forward", KIND_COLOURS["forward"]), ("backward", KIND_COLOURS["backward"]),
             ("communication", KIND_COLOURS["communication"])]
    if measured:
        items.append(("measured" if not any(m.split for m in measured) else "measured (outlined)",
                      KIND_COLOURS["measured"]))
    body, x = _legend(left, 40, items)
    slowest = max(range(plan.num_stages), key=lambda k: plan.stages[k].predicted_time_s)
    if plan.num_stages > 1:
        body.append(f'<path d="M{x:.1f},{30} l10,0 l-5,8 z" fill="#dc2626"/>')
        body.append(_text(x + 15, 40, "bottleneck", size=12))
    body.insert(0, _text(left - 62, 18, f"Time per step by stage · balance {plan.balance:.2f} (bottleneck / mean)",
                         size=14, weight="600"))
    body += _axis(left, y0, x1, scale, ticks, format_seconds)
    bar = slot * (0.36 if measured else 0.56)
    for s in plan.stages:
        k = s.stage_index
        x = left + slot * k + (slot / 2 - bar - 1 if measured else (slot - bar) / 2)
        y = y0
        predicted: tuple[tuple[str, float], ...] = (("forward", s.forward_time_s), ("backward", s.backward_time_s),
                                                    ("communication", s.communication_time_s))
        for name, value in predicted:
            h = value * scale
            body.append(_rect(x, y - h, bar, h, KIND_COLOURS[name],
                              title=f"stage {k} predicted {name}: {format_seconds(value)}"))
            y -= h
        if measured:
            m, mx = measured[k], left + slot * k + slot / 2 + 1
            if m.split:
                ym = y0
                for name, part in (("forward", m.forward_s), ("backward", m.backward_s),
                                   ("communication", m.communication_s)):
                    h = (part or 0.0) * scale
                    body.append(_rect(mx, ym - h, bar, h, KIND_COLOURS[name],
                                      title=f"stage {k} measured {name}: {format_seconds(part or 0.0)}",
                                      extra=f'stroke="{KIND_COLOURS["measured"]}" stroke-width="1.5"'))
                    ym -= h
            else:
                h = m.total_s * scale
                body.append(_rect(mx, y0 - h, bar, h, KIND_COLOURS["measured"],
                                  title=f"stage {k} measured: {format_seconds(m.total_s)}"))
            y = min(y, y0 - m.total_s * scale)
        if k == slowest and plan.num_stages > 1:
            cx = left + slot * (k + 0.5)
            body.append(f'<path d="M{cx - 5:.1f},{y - 12:.1f} l10,0 l-5,8 z" fill="#dc2626">'
                        f"<title>bottleneck: stage {k}, {escape(format_seconds(s.predicted_time_s))}</title></path>")
    mean = sum(s.predicted_time_s for s in plan.stages) / plan.num_stages
    ym = y0 - mean * scale
    body.append(f'<line x1="{left}" x2="{x1}" y1="{ym:.1f}" y2="{ym:.1f}" stroke="#111827" '
                'stroke-dasharray="5 4" stroke-width="1.2"/>')
    body.append(_text(x1 + 4, ym - 2, "mean", size=10, fill="#111827"))
    body.append(_text(x1 + 4, ym + 10, format_seconds(mean), size=10, fill="#111827"))
    body += _stage_labels(fig, left, slot, y0 + 20)
    return _svg(width, height, body, "time per stage")


def memory_bars(fig: Figures, width: int = 640, height: int = 330) -> str:
    """Per stage, parameters / gradients / optimizer / activations at peak, stacked, against the budget."""
    plan = fig.plan
    left, right, top, bottom = 70, 16, 56, 44
    x1, y0 = width - right, height - bottom
    used = max(s.memory.total for s in plan.stages)
    budgets = [b for b in fig.budgets if b is not None]
    on_scale = bool(budgets) and max(budgets) <= 4 * used
    ticks = nice_ticks(max([used] + (budgets if on_scale else [])) * 1.08, binary=True)
    scale = (y0 - top) / ticks[-1]
    slot = (x1 - left) / plan.num_stages
    title = "Memory per device at peak"
    if budgets and not on_scale:
        share = format_share(used / min(budgets))
        title += f" · budget {format_bytes(min(budgets))}, off the scale ({share} used at most)"
    body = [_text(left - 62, 18, title, size=14, weight="600")]
    items = [(name, colour) for name, colour in MEMORY_COLOURS.items()]
    if on_scale:
        items.append(("budget", "#dc2626"))
    legend, _ = _legend(left, 40, items)
    body += legend + _axis(left, y0, x1, scale, ticks, format_bytes)
    bar = slot * 0.56
    for s in plan.stages:
        k = s.stage_index
        x, y = left + slot * k + (slot - bar) / 2, y0
        for name in MEMORY_COLOURS:
            value = getattr(s.memory, name)
            h = value * scale
            body.append(_rect(x, y - h, bar, h, MEMORY_COLOURS[name],
                              title=f"stage {k} {name}: {format_bytes(value)}"))
            y -= h
        if slot > 44:
            body.append(_text(x + bar / 2, y - 5, format_bytes(s.memory.total), size=10, anchor="middle",
                              fill="#374151"))
        budget = fig.budgets[k]
        if on_scale and budget is not None:
            yb = y0 - budget * scale
            body.append(f'<line x1="{left + slot * k + 2:.1f}" x2="{left + slot * (k + 1) - 2:.1f}" '
                        f'y1="{yb:.1f}" y2="{yb:.1f}" stroke="#dc2626" stroke-width="2" stroke-dasharray="6 3">'
                        f'<title>stage {k} budget {escape(format_bytes(budget))}</title></line>')
    body += _stage_labels(fig, left, slot, y0 + 20)
    return _svg(width, height, body, "memory per stage")


def _ink(background: str) -> str:
    """Text colour readable on ``background``: white on dark colours, near-black on light ones."""
    r, g, b = (int(background[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return "#fff" if 0.299 * r + 0.587 * g + 0.114 * b < 0.66 else "#1f2937"


def timeline(fig: Figures, tl: Timeline | None = None, *, title: str = "", width: int = 1300) -> str:
    """Ranks × time: one box per action, coloured by kind (shade alternating by micro-batch, the
    stage's colour along its foot), idle time hatched so the bubbles show."""
    tl = tl or fig.timeline
    left, right, top, row, gap = 118, 16, 56, 30, 6
    num_ranks = tl.num_ranks
    height = top + num_ranks * (row + gap) + 40
    x1 = width - right
    step = tl.step_time_s or 1.0
    ticks = [t for t in nice_ticks(step, 8) if t <= step * 1.0001]
    scale = (x1 - left) / step
    kinds = sorted({e.action.kind for e in tl.events}, key="FBW".index)
    plan = fig.plan
    head = title or (f"Pipeline schedule · {plan.schedule}, {plan.num_microbatches} micro-batches · step "
                     f"{format_seconds(tl.step_time_s)}, bubble {tl.bubble_fraction:.0%}")
    body = ['<defs><pattern id="idle" width="6" height="6" patternUnits="userSpaceOnUse" '
            'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f3f4f6"/>'
            '<line x1="0" y1="0" x2="0" y2="6" stroke="#d1d5db" stroke-width="2"/></pattern></defs>',
            _text(8, 18, head, size=14, weight="600")]
    legend, _ = _legend(left, 40, [(_KIND_NAMES[k], KIND_COLOURS[_KIND_NAMES[k]]) for k in kinds]
                        + [("idle (bubble)", "pattern")], pattern="idle")
    body += legend
    for t in ticks:
        x = left + t * scale
        body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top - 4}" y2="{height - 34}" stroke="#e5e7eb"/>')
        body.append(_text(x, height - 20, format_seconds(t), size=11, anchor="middle",
                          fill="#6b7280"))
    stages_of = [sorted({e.action.stage_index for e in tl.events if e.rank == r}) for r in range(num_ranks)]
    for r in range(num_ranks):
        y = top + r * (row + gap)
        body.append(_text(8, y + 13, f"rank {r}", size=12, weight="600"))
        names = ", ".join(map(str, stages_of[r]))
        body.append(_text(8, y + 26, f"stage{'s' if len(stages_of[r]) > 1 else ''} {names}", size=10,
                          fill="#6b7280"))
        body.append(_rect(left, y, step * scale, row, "url(#idle)"))
    for e in tl.events:
        s, kind, i = e.action
        x, y = left + e.start_s * scale, top + e.rank * (row + gap)
        w = (e.end_s - e.start_s) * scale
        colour = KIND_COLOURS[_KIND_NAMES[kind]]
        fill = colour if i % 2 == 0 else shade(colour, 0.28)
        body.append(_rect(x, y, w, row, fill, extra='stroke="#fff" stroke-width="0.6"',
                          title=f"{e.action}: stage {s} {_KIND_NAMES[kind]}, micro-batch {i}, rank {e.rank}, "
                                f"{format_seconds(e.start_s)} – {format_seconds(e.end_s)}"))
        body.append(_rect(x + 0.5, y + row - 4, w - 1, 4, fig.colours[s] if s < len(fig.colours) else "#999"))
        label = str(e.action) if w > 30 else str(i) if w > 12 else ""
        if label:
            body.append(_text(x + w / 2, y + row / 2 + 3, label, size=11 if w > 30 else 9, anchor="middle",
                              fill="#fff", weight="600"))
    body.append(_text(x1, height - 4, "time →", size=11, anchor="end", fill="#6b7280"))
    return _svg(width, height, body, "pipeline timeline")
