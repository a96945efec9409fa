"""A study as a page: a table of its trials and Optuna's plots, in one self-contained HTML file."""

from __future__ import annotations

import html
import json
import warnings
from pathlib import Path
from typing import Any, Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

from replica.units import format_bytes, format_seconds

__all__ = ["write_report"]


def _plots(study: optuna.Study) -> list[tuple[str, Callable[[optuna.Study], Any]]]:
    import optuna.visualization as vis

    return [("Optimization history", vis.plot_optimization_history),
            ("Intermediate values (per epoch)", vis.plot_intermediate_values),
            ("Parameter importance", vis.plot_param_importances),
            ("Parallel coordinates", vis.plot_parallel_coordinate)]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value)


def _note(t: FrozenTrial) -> str:
    """Why a trial stopped, when it did not complete: the pruning reason or the error's last line."""
    attrs = t.user_attrs
    text = attrs.get("pruned_reason") or attrs.get("error") or t.system_attrs.get("fail_reason") or ""
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[0] if t.state == TrialState.PRUNED and lines else (lines[-1] if lines else "")


def _layout(layout: dict[str, Any] | None) -> str | None:
    """``2 stages × 1 replica, 1f1b, 4 micro-batches``: the layout a trial ran (or was planned)."""
    if not layout:
        return None
    replicas = layout["data_parallel_size"]
    return (f"{layout['num_stages']} stage{'s' * (layout['num_stages'] != 1)} × {replicas} "
            f"replica{'s' * (replicas != 1)}, {layout['schedule']}, {layout['num_microbatches']} micro-batches")


def _table(study: optuna.Study) -> str:
    trials = study.get_trials(deepcopy=False)
    names = sorted({k for t in trials for k in t.params})
    head = ["#", "state", "value", *names, "layout", "predicted step", "predicted memory", "seconds", "note"]
    best = study.best_trial.number if any(t.state == TrialState.COMPLETE for t in trials) else None
    rows = []
    for t in trials:
        a = t.user_attrs
        step = a.get("predicted_step_time_s")
        memory = a.get("predicted_memory_bytes")
        cells = [t.number, t.state.name, t.value, *(t.params.get(n) for n in names),
                 _layout(a.get("layout") or a.get("planned_layout")),
                 format_seconds(step) if step is not None else None,
                 format_bytes(memory) if memory is not None else None,
                 f"{a['seconds']:.1f}" if "seconds" in a else None, _note(t)]
        mark = ' class="best"' if t.number == best else ""
        rows.append(f"<tr{mark}>" + "".join(f"<td>{html.escape(_cell(c))}</td>" for c in cells) + "</tr>")
    header = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return f"<table><thead><tr>{header}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def write_report(study: optuna.Study, path: str | Path) -> Path:
    """Write ``study``'s page to ``path``: every trial (state, value, parameters, the plan's predicted
    step time and memory, why it was pruned or failed; the best one marked) and Optuna's plots
    (history, per-epoch values, parameter importance) where the study has enough trials for them.
    Plotly's script is embedded once, so the page opens offline."""
    path = Path(path)
    figures, script = [], True
    for title, plot in _plots(study):
        try:
            with warnings.catch_warnings():  # "too few trials to compute importances": the page says so itself
                warnings.simplefilter("ignore")
                figure = plot(study)
        except (ValueError, RuntimeError, ImportError) as exc:  # too few complete trials, no parameters
            figures.append(f"<h2>{html.escape(title)}</h2><p>not drawn: {html.escape(str(exc))}</p>")
            continue
        figures.append(f"<h2>{html.escape(title)}</h2>"
                       + figure.to_html(full_html=False, include_plotlyjs=script, default_height="420px"))
        script = False
    counts = {s.name: sum(t.state == s for t in study.get_trials(deepcopy=False)) for s in TrialState}
    summary = ", ".join(f"{n} {name.lower()}" for name, n in counts.items() if n)
    best = ""
    if counts["COMPLETE"]:
        best = (f"<p>best: trial {study.best_trial.number}, value {study.best_value:.6g}, "
                f"params <code>{html.escape(json.dumps(study.best_params))}</code></p>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(study.study_name)}</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:13px}"
        "td,th{border:1px solid #ccc;padding:3px 6px;text-align:left}tr.best{background:#e6f4e6}"
        "</style></head><body>"
        f"<h1>Study {html.escape(study.study_name)}</h1><p>{summary} ({study.direction.name.lower()})</p>{best}"
        + _table(study) + "".join(figures) + "</body></html>"
    )
    return path
