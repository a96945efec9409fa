"""The plan report: one self-contained HTML file (inline CSS, SVG and a little JS) that works offline."""

from __future__ import annotations

import base64
import json
import os
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, Union

from replica.partition.plan import BoundaryTensor, Plan, StagePlan
from replica.viz import svg
from replica.viz.figures import Figures, figures, format_bytes, format_seconds, format_share, pipeline_of
from replica.viz.modules import ModuleBox, OpInfo, ops_of, stage_boxes

if TYPE_CHECKING:
    from replica.partition.graph import Graph

__all__ = ["visualize", "render_html"]


def visualize(
    plan_or_pipeline: Any,
    path: str | os.PathLike[str],
    *,
    graph: "Graph | None" = None,
    measured: Any = None,
    memory_budget: float | Sequence[float] | None = None,
    device: Any = None,
) -> Path:
    """Write the report of a :class:`~replica.Plan` (or a ``PipelineModel`` or a Trainer: its plan,
    schedule and traced graph) to ``path`` as one HTML file that needs no network; returns the path.

    It shows the model collapsed to modules, coloured by stage and opening down to ops (exact
    with ``graph``, the traced graph the plan was made from, which a pipeline brings itself;
    inferred from names for a bare plan without it);
    every cut's tensors; per-stage predicted (and ``measured``) times and memory against
    ``memory_budget``; and the schedule simulated as a timeline. ``measured``, ``memory_budget``
    and ``device`` are as for :func:`replica.viz.figures.figures`.
    """
    text = render_html(plan_or_pipeline, graph=graph, measured=measured, memory_budget=memory_budget,
                       device=device)
    out = Path(path)
    out.write_text(text, encoding="utf-8")
    return out


def render_html(
    plan_or_pipeline: Any,
    *,
    graph: "Graph | None" = None,
    measured: Any = None,
    memory_budget: float | Sequence[float] | None = None,
    device: Any = None,
) -> str:
    """The report as a string (what :func:`visualize` writes)."""
    fig = figures(plan_or_pipeline, measured=measured, memory_budget=memory_budget, device=device)
    plan = fig.plan
    if graph is None:  # a pipeline (or a Trainer's) keeps the graph it was traced into: ops placed exactly
        graph = getattr(pipeline_of(plan_or_pipeline), "graph", None)
    depth, boxes = stage_boxes(ops_of(plan, graph), plan.num_stages)
    spans = [_span(b) for b in boxes]
    parts = [_header(fig), '<div class="card wide">', svg.cut_strip(fig, spans), "</div>",
             '<div class="charts"><div class="card">', svg.time_bars(fig), '</div><div class="card">',
             svg.memory_bars(fig), "</div></div>", '<div class="card wide">', svg.timeline(fig), _trace_link(fig)]
    if fig.measured_timeline is not None:
        parts.append(svg.timeline(fig, fig.measured_timeline, title=(
            f"Measured · step {format_seconds(fig.measured_timeline.step_time_s)}, "
            f"bubble {fig.measured_timeline.bubble_fraction:.0%}")))
    parts.append("</div>")
    parts.append(
        f'<h2>Stages and cuts</h2><p class="note">The model collapsed to modules at depth {depth} '
        f'({sum(map(len, boxes))} boxes); open a box to see its modules and ops'
        f'{"" if graph is not None else " (modules inferred from op names: pass graph= for exact ones)"}. '
        '<button type="button" onclick="openAll(true)">open all</button> '
        '<button type="button" onclick="openAll(false)">close all</button></p>')
    for stage in plan.stages:
        parts.append(_stage(fig, stage, boxes, graph))
        if stage.stage_index < plan.num_stages - 1:
            parts.append(_cut(plan, stage.stage_index))
    return _page(f"{plan.model_name or 'model'} · pipeline plan", "".join(parts))


def _span(boxes: list[ModuleBox]) -> str:
    named = [b.title for b in boxes if b.path] or [b.title for b in boxes]
    if not named:
        return "(no ops)"
    first, last = named[0], named[-1]
    if len(named) == 1 or first == last:
        return first
    head, _, _ = first.rpartition(".")
    if head and last.startswith(head + ".") and "." not in last[len(head) + 1:]:
        return f"{first} … {last[len(head) + 1:]}"  # transformer.h.11 … 23
    return f"{first} … {last}"


def _header(fig: Figures) -> str:
    plan, tl = fig.plan, fig.timeline
    params = sum(s.memory.parameters for s in plan.stages)
    cards = [
        ("simulated step", format_seconds(tl.step_time_s), f"{plan.num_microbatches} micro-batches, {plan.schedule}"
         + ("" if abs(plan.predicted_step_time_s - tl.step_time_s) <= 0.005 * tl.step_time_s
            else f"; the plan's estimate {format_seconds(plan.predicted_step_time_s)}")),
        ("bottleneck stage", format_seconds(plan.bottleneck_s), "per step, forward + backward + transfers"),
        ("balance", f"{plan.balance:.2f}", "slowest / mean stage (1.00 = perfect)"),
        ("bubble", f"{tl.bubble_fraction:.0%}", "idle share of the simulated step"),
        ("stages", f"{plan.num_stages} × {plan.data_parallel_size}"
         + (f" × {plan.tensor_parallel_size}" if plan.tensor_parallel_size > 1 else ""),
         "pipeline stages × data-parallel replicas"
         + (" × tensor-parallel ranks" if plan.tensor_parallel_size > 1 else "")
         + (" (sequence parallel)" if plan.layout.sequence_parallel else "")
         + (f", {plan.layout.sharding} sharded" if plan.layout.sharded else "")
         + (f"; collectives {format_seconds(plan.collective_s)} a step, "
            f"{format_seconds(plan.exposed_collective_s)} not hidden" if plan.data_parallel_size > 1 else "")),
        ("parameters", format_bytes(params), f"held by all stages, on {plan.device}"
         + (" (tied ones on each holder)" if plan.tied_parameters else "")),
    ]
    out = [f"<header><h1>{escape(plan.model_name or 'model')} <span>pipeline plan</span></h1>",
           '<div class="cards">']
    for name, value, note in cards:
        out.append(f'<div class="stat"><div class="k">{escape(name)}</div><div class="v">{escape(value)}</div>'
                   f'<div class="n">{escape(note)}</div></div>')
    notes = [plan.precision_note, plan.tensor_parallel_note, plan.data_parallel_note, plan.expert_parallel_note,
             plan.compile_said]
    out.append("</div>" + "".join(f'<p class="note">{escape(n)}</p>' for n in notes if n) + "</header>")
    if not plan.exact:
        out.append('<p class="note">Large graph: cut at its cheapest candidate points, bottleneck within '
                   f'{plan.bottleneck_s / plan.lower_bound_s - 1:.1%} of the lower bound.</p>'
                   if plan.lower_bound_s > 0 else "")
    return "".join(out)


def _trace_link(fig: Figures) -> str:
    data = base64.b64encode(json.dumps(fig.timeline.to_chrome_trace(name=fig.plan.model_name)).encode())
    return ('<p class="note">Times are simulated from the plan\'s predictions. '
            f'<a download="{escape(fig.plan.model_name or "plan")}.trace.json" '
            f'href="data:application/json;base64,{data.decode()}">Download the timeline as a Chrome trace</a> '
            "(chrome://tracing, Perfetto).</p>")


def _stage(fig: Figures, stage: StagePlan, boxes: list[list[ModuleBox]], graph: "Graph | None" = None) -> str:
    plan, k = fig.plan, stage.stage_index
    colour = fig.colours[k]
    budget = fig.budgets[k]
    used = stage.memory.total
    memory = format_bytes(used) + (f" of {format_bytes(budget)} ({format_share(used / budget)})" if budget else "")
    slow = ' <span class="badge">bottleneck</span>' if stage.predicted_time_s == plan.bottleneck_s and \
        plan.num_stages > 1 else ""
    facts = [
        f"rank {fig.rank_of_stage[k]}", stage.device or plan.device, f"{stage.num_ops} ops",
        f"{len(stage.parameter_names)} parameters ({format_bytes(stage.memory.parameters)})",
        f"forward {format_seconds(stage.forward_time_s)}", f"backward {format_seconds(stage.backward_time_s)}",
        f"transfers {format_seconds(stage.communication_time_s)}", f"memory {memory}",
    ]
    if plan.data_parallel_size > 1:
        reduces = plan.num_microbatches if stage.grad_sync == "microbatch" else 1
        facts.append(f"data-parallel collectives {format_seconds(stage.collective_s)}"
                     + (f" ({stage.gathers} all-gathers, {reduces} reduce-scatter{'s' if reduces > 1 else ''}"
                        f"{', every micro-batch' if reduces > 1 else ''})" if plan.layout.sharded else "")
                     + f", {format_seconds(stage.exposed_collective_s)} not hidden")
    if plan.tensor_parallel_size > 1:
        facts.append(f"tensor-parallel collectives {format_bytes(stage.tensor_parallel_bytes)} in "
                     f"{format_seconds(stage.tensor_parallel_s)} (in forward and backward, not overlapped)")
    if stage.recompute is not False and stage.recompute != 0:
        facts.append(f"activation checkpointing: {stage.recompute_note} (of {len(stage.blocks)} blocks), "
                     f"one micro-batch's rebuilt block {format_bytes(stage.recompute_bytes / plan.num_microbatches)}")
    if fig.measured:
        facts.append(f"measured {format_seconds(fig.measured[k].total_s)}")
    mine, before, after = boxes[k], boxes[k - 1] if k else [], boxes[k + 1] if k + 1 < len(boxes) else []
    items = []
    for i, box in enumerate(mine):
        cont_in = i == 0 and before and before[-1].path == box.path and box.path != ""
        cont_out = i == len(mine) - 1 and after and after[0].path == box.path and box.path != ""
        items.append(_box(box, cont_in=bool(cont_in), cont_out=bool(cont_out)))
    return (f'<section class="stage" data-stage="{k}" id="stage-{k}" style="--c:{colour}">'
            f'<h3><span class="swatch"></span>Stage {k}{slow}</h3>'
            f'<p class="facts">{" · ".join(escape(f) for f in facts)}</p>'
            f'<div class="boxes">{"".join(items)}</div>{_sharded(plan, k, graph)}</section>')


def _sharded(plan: Plan, k: int, graph: "Graph | None") -> str:
    """Stage ``k``'s blocks cut across its tensor-parallel ranks: their modules and the
    collectives each adds (per micro-batch, with ``graph`` to size them)."""
    blocks = plan.blocks_of(k)
    if plan.tensor_parallel_size == 1:
        return ""
    t = plan.tensor_parallel_size
    if not blocks:
        return (f'<p class="note">Tensor parallel: nothing on this stage is cut; each of the {t} ranks computes it '
                'whole.</p>')
    share = 1 / (plan.data_parallel_size * plan.num_microbatches)  # of the traced batch, per micro-batch

    def sized(name: str) -> str:
        if graph is None:
            return ""
        try:
            return f" ({format_bytes(graph[name].output_bytes * share)})"
        except KeyError:
            return ""

    rows = []
    for b in blocks:
        if graph is not None:
            modules = list(dict.fromkeys(graph[n].module_path for n in b.nodes if graph[n].module_path))
        else:  # the modules owning the cut parameters
            modules = list(dict.fromkeys(p.rpartition(".")[0] or p for p, _ in b.parameters))
        cut = ", ".join(f"{p} (dim {d})" for p, d in b.parameters)
        held = {n for n, _ in plan.sequence_shards}  # sequence parallelism: split in two halves
        forward = "; ".join([f"all-gather of <code>{escape(e)}</code>{escape(sized(e))}"
                             for e in b.entries if e in held]
                            + [f"{'reduce-scatter' if e in held else 'all-gather' if b.gathers else 'all-reduce'} of "
                               f"<code>{escape(e)}</code>{escape(sized(e))}" for e in b.exits])
        backward = "; ".join([f"{'reduce-scatter' if e in held else 'all-reduce'} of <code>{escape(e)}</code>'s "
                              f"gradient{escape(sized(e))}" for e in b.entries]
                             + [f"all-gather of <code>{escape(e)}</code>'s gradient{escape(sized(e))}"
                                for e in b.exits if e in held])
        rows.append(f"<tr><td>{escape(b.kind)}</td><td>{escape(', '.join(modules) or '-')}</td>"
                    f"<td>{escape(cut)}</td><td>{forward or '-'}</td><td>{backward or '-'}</td></tr>")
    again = " (forward's again in backward: recompute)" if plan.recompute else ""
    return (f'<details class="tp"><summary>Tensor parallel: {len(blocks)} block{"s" if len(blocks) != 1 else ""} '
            f'cut across {t} ranks · {escape(format_bytes(plan.stages[k].tensor_parallel_bytes))} of collectives, '
            f'{escape(format_seconds(plan.stages[k].tensor_parallel_s))} a step{escape(again)}</summary>'
            '<table><thead><tr><th>block</th><th>modules</th><th>parameters cut</th>'
            '<th>forward, per micro-batch</th><th>backward, per micro-batch</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></details>')


def _box(box: ModuleBox, *, cont_in: bool, cont_out: bool) -> str:
    marks = ('<span class="cont" title="begins in the previous stage">◂</span>' if cont_in else "")
    tail = ('<span class="cont" title="continues in the next stage">▸</span>' if cont_out else "")
    return (f'<details class="box" data-level="0" data-module="{escape(box.path)}">'
            f'<summary>{marks}<span class="name">{escape(box.title)}</span>{tail}'
            f'<span class="n">{box.num_ops} op{"s" if box.num_ops != 1 else ""}</span></summary>'
            f'<ul class="tree">{_tree(box.children)}</ul></details>')


def _tree(children: list[Union[ModuleBox, OpInfo]]) -> str:
    out = []
    for c in children:
        if isinstance(c, OpInfo):
            out.append(_op(c))
        elif len(c.ops) == 1 and c.children == c.ops:  # a module called as one op: show the op
            out.append(_op(c.ops[0], module=c.path))
        else:
            out.append(f'<li><details><summary>{escape(c.title)} <span class="n">{c.num_ops} ops</span>'
                       f'</summary><ul class="tree">{_tree(c.children)}</ul></details></li>')
    return "".join(out)


def _op(op: OpInfo, module: str = "") -> str:
    detail = []
    if op.target:
        detail.append(f"<code>{escape(op.target)}</code>")
    if module:
        detail.append(f'<span class="m">{escape(module)}</span>')
    if op.shape is not None:
        detail.append(f'<span class="m">{escape(_shape(op.shape))} {escape(op.dtype or "")}</span>')
    return f'<li class="op">{escape(op.name)} {" ".join(detail)}</li>'


def _shape(shape: tuple[int, ...] | None) -> str:
    return "value" if shape is None else "(" + ", ".join(map(str, shape)) + ")"


def _bytes_of(b: BoundaryTensor, num_microbatches: int) -> str:
    """A crossing tensor's bytes (per micro-batch with ``num_microbatches``); a Python number has none."""
    return format_bytes(b.nbytes / num_microbatches) if b.shape is not None else "a number"


def _cut(plan: Plan, k: int) -> str:
    """The tensors crossing the cut after stage ``k``: made at or before it, read after it."""
    crossing: list[BoundaryTensor] = [b for s in plan.stages[: k + 1] for b in s.outputs
                                      if max(b.destination_stages, default=-1) > k]
    total = sum(b.nbytes for b in crossing)
    rows = []
    for b in crossing:
        via = ' <span class="m">(passes through)</span>' if b.source_stage < k else ""
        rows.append(
            f"<tr><td><code>{escape(b.name)}</code>{via}</td><td>{escape(_shape(b.shape))}</td>"
            f"<td>{escape(b.dtype or '-')}</td><td class='r'>{escape(_bytes_of(b, 1))}</td>"
            f"<td class='r'>{escape(_bytes_of(b, plan.num_microbatches))}</td>"
            f"<td>{b.source_stage} → {', '.join(map(str, b.destination_stages))}</td></tr>"
        )
    body = "".join(rows) or '<tr><td colspan="6">nothing crosses this cut</td></tr>'
    return (f'<section class="cut" data-cut="{k}"><h4>✂ cut {k} → {k + 1}: {len(crossing)} tensor'
            f'{"s" if len(crossing) != 1 else ""}, {escape(format_bytes(total))} per step</h4>'
            '<table><thead><tr><th>tensor</th><th>shape (traced batch)</th><th>dtype</th><th>bytes</th>'
            f'<th>per micro-batch</th><th>stage → stages</th></tr></thead><tbody>{body}</tbody></table></section>')


_CSS = """
*{box-sizing:border-box}
body{margin:0;padding:24px 32px 48px;background:#f6f7f9;color:#1f2937;
 font:14px/1.45 system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif}
main{max-width:1340px;margin:0 auto}
h1{font-size:26px;margin:0 0 14px}h1 span{color:#6b7280;font-weight:400}
h2{font-size:19px;margin:28px 0 6px}
.cards{display:grid;grid-template-columns:repeat(6,1fr);gap:10px;margin-bottom:14px}
.stat{background:#fff;border-radius:10px;padding:10px 14px;box-shadow:0 1px 2px rgba(0,0,0,.08)}
.stat .k{color:#6b7280;font-size:12px;text-transform:uppercase;letter-spacing:.04em}
.stat .v{font-size:22px;font-weight:650;margin:2px 0}.stat .n{color:#6b7280;font-size:11.5px}
.card{background:#fff;border-radius:10px;padding:12px 14px;box-shadow:0 1px 2px rgba(0,0,0,.08)}
.card.wide{margin-bottom:14px}
.charts{display:grid;grid-template-columns:1fr 1fr;gap:14px;margin-bottom:14px}
.note{color:#4b5563;font-size:12.5px;margin:6px 2px}
button{font:inherit;font-size:12px;padding:2px 10px;border:1px solid #d1d5db;border-radius:6px;background:#fff;
 cursor:pointer}
section.stage{background:#fff;border-radius:10px;border-left:8px solid var(--c);padding:10px 16px 14px;
 margin:12px 0 0;box-shadow:0 1px 2px rgba(0,0,0,.08)}
section.stage h3{margin:0;font-size:16px;display:flex;align-items:center;gap:8px}
.swatch{display:inline-block;width:14px;height:14px;border-radius:3px;background:var(--c)}
.badge{background:#fee2e2;color:#b91c1c;font-size:11px;font-weight:600;border-radius:999px;padding:1px 8px}
.facts{margin:4px 0 10px;color:#4b5563;font-size:12.5px}
.boxes{display:flex;flex-wrap:wrap;gap:6px;align-items:flex-start}
details.box{border:1px solid color-mix(in srgb,var(--c) 55%,#fff);
 background:color-mix(in srgb,var(--c) 16%,#fff);border-radius:7px;padding:4px 9px;min-width:84px}
details.box[open]{flex-basis:100%}
details.box>summary{cursor:pointer;list-style:none;display:flex;gap:6px;align-items:baseline;white-space:nowrap}
details.box>summary::-webkit-details-marker{display:none}
details.box .name{font-weight:600;font-size:12.5px}
.n{color:#6b7280;font-size:11px}.cont{color:var(--c);font-weight:700}
.m{color:#6b7280;font-size:11.5px}
ul.tree{list-style:none;margin:4px 0 2px;padding-left:14px;border-left:2px solid color-mix(in srgb,var(--c) 40%,#fff)}
ul.tree li{margin:1px 0;font-size:12.5px}ul.tree summary{cursor:pointer}
code{font:12px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;background:#f3f4f6;border-radius:4px;
 padding:0 3px}
section.cut{margin:0 0 0 26px;padding:8px 14px 10px;border-left:2px dashed #9ca3af}
section.cut h4{margin:0 0 6px;font-size:13.5px}
table{border-collapse:collapse;font-size:12.5px;background:#fff;border-radius:6px}
th,td{padding:3px 10px;border-bottom:1px solid #eef0f3;text-align:left}th{color:#6b7280;font-weight:600}
td.r{text-align:right}
details.tp{margin-top:8px;font-size:12.5px}details.tp>summary{cursor:pointer;color:#4b5563}
@media (max-width:900px){.cards{grid-template-columns:repeat(3,1fr)}.charts{grid-template-columns:1fr}}
"""

_JS = """function openAll(v){document.querySelectorAll('details').forEach(function(d){d.open=v;});}"""


def _page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_CSS}</style>'
            f"<script>{_JS}</script></head><body><main>{body}</main>"
            '<footer class="note" style="text-align:center">made by replica · one file, no network</footer>'
            "</body></html>\n")
