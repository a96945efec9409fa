"""The figures a plan report draws: per-stage times and memory, budgets, the simulated timeline, colours."""

from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from replica.errors import ConfigError
from replica.partition.plan import Plan
from replica.planner.costs import stage_costs_from_plan
from replica.schedules.actions import FORWARD, Action, placement
from replica.schedules.schedule import plan_schedule
from replica.schedules.simulate import Timeline, simulate
from replica.units import format_bytes, format_seconds

__all__ = ["StageTimes", "Figures", "figures", "pipeline_of", "stage_colour", "KIND_COLOURS", "MEMORY_COLOURS",
           "format_bytes", "format_seconds", "format_share", "nice_ticks", "shade"]

# Tableau 10: distinct on screen and in print; beyond ten stages, hues evenly spaced.
_STAGE_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
                  "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")
KIND_COLOURS = {"forward": "#3b75af", "backward": "#e4803a", "weight": "#8e6bbf", "communication": "#a3a9b3",
                "measured": "#2b2d42"}
MEMORY_COLOURS = {"parameters": "#1d4e89", "gradients": "#4f86c6", "optimizer": "#9cc3e6",
                  "activations": "#f2a541"}


def stage_colour(stage_index: int, num_stages: int) -> str:
    if num_stages <= len(_STAGE_COLOURS):
        return _STAGE_COLOURS[stage_index]
    r, g, b = colorsys.hls_to_rgb((stage_index * 0.618034) % 1.0, 0.55, 0.55)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one stage for one step; a component is ``None`` where it was not measured."""

    forward_s: float | None = None
    backward_s: float | None = None
    communication_s: float | None = None
    total_s: float = 0.0

    @property
    def split(self) -> bool:
        return self.forward_s is not None or self.backward_s is not None


@dataclass(frozen=True)
class Figures:
    """Everything the HTML report and the PNG export draw for one plan."""

    plan: Plan
    schedule: list[list[Action]]
    timeline: Timeline
    measured: tuple[StageTimes, ...] | None
    measured_timeline: Timeline | None
    budgets: tuple[float | None, ...]
    colours: tuple[str, ...]

    @property
    def rank_of_stage(self) -> dict[int, int]:
        return placement(self.schedule)

    @property
    def stages_of_rank(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.schedule]
        for s, r in sorted(self.rank_of_stage.items()):
            out[r].append(s)
        return out


def pipeline_of(plan_or_pipeline: Any) -> Any:
    """A Trainer's pipeline (it must have been built: train first), else what was given."""
    if hasattr(plan_or_pipeline, "pipeline") and not isinstance(plan_or_pipeline, Plan):
        if plan_or_pipeline.pipeline is None:
            raise ConfigError("this Trainer has no pipeline yet: it is built on the first batch; call "
                              "train_dataset (or evaluate / predict) first, then visualize it")
        return plan_or_pipeline.pipeline
    return plan_or_pipeline


def _unwrap(plan_or_pipeline: Any) -> tuple[Plan, list[list[Action]] | None]:
    plan_or_pipeline = pipeline_of(plan_or_pipeline)
    if isinstance(plan_or_pipeline, Plan):
        return plan_or_pipeline, None
    plan = getattr(plan_or_pipeline, "plan", None)
    if isinstance(plan, Plan):
        return plan, [list(actions) for actions in plan_or_pipeline.schedule]
    raise ConfigError(
        f"expected a replica.Plan, the PipelineModel of replica.auto_parallel or a Trainer, got "
        f"{type(plan_or_pipeline).__name__}"
    )


def figures(
    plan_or_pipeline: Any,
    *,
    measured: Any = None,
    memory_budget: float | Sequence[float] | None = None,
    device: Any = None,
) -> Figures:
    """Gather the figures of a :class:`Plan` or a ``PipelineModel`` (whose ``.schedule`` is drawn).

    ``measured`` is per-stage seconds for one step: one number per stage, or one mapping per stage
    with ``forward`` / ``backward`` / ``communication`` keys, or a measured :class:`Timeline`
    (``replica.viz.chrome.measured_timeline``), which is drawn too. ``memory_budget`` is bytes per
    device, or one per stage (default: each stage's device preset, where it has a finite memory).
    ``device`` (a preset name or ``DeviceSpec``) prices the transfers of the simulated timeline:
    give it when the plan was made for a device that is not a preset.
    """
    plan, schedule = _unwrap(plan_or_pipeline)
    if schedule is None:
        schedule = plan_schedule(plan)
    spec = _spec(device) if device is not None else None
    if spec is None:
        from replica.partition.cost import PRESETS

        unknown = sorted({n for n in (s.device or plan.device for s in plan.stages)
                          if n not in PRESETS and not n.startswith("cpu")})
        if unknown:
            raise ConfigError(
                f"the plan was made for device {unknown[0]!r}, which is not a preset, so its transfers cannot be "
                "priced for the timeline; pass the DeviceSpec it was planned with: "
                "visualize(plan, path, device=spec) or save_png(plan, path, device=spec)"
            )
    costs = stage_costs_from_plan(plan, schedule, device=spec)
    sizes = plan.relative_microbatch_sizes  # graded micro-batches, as they run
    measured_times, measured_timeline = _measured(plan, measured)
    return Figures(
        plan=plan, schedule=schedule, timeline=simulate(schedule, costs, sizes=sizes), measured=measured_times,
        measured_timeline=measured_timeline, budgets=_budgets(plan, memory_budget, spec),
        colours=tuple(stage_colour(k, plan.num_stages) for k in range(plan.num_stages)),
    )


def _spec(device: Any) -> Any:
    from replica.partition.cost import device_spec  # imports torch

    return device_spec(device)


def _measured(plan: Plan, measured: Any) -> tuple[tuple[StageTimes, ...] | None, Timeline | None]:
    if measured is None:
        return None, None
    if isinstance(measured, Timeline):
        forward = [0.0] * plan.num_stages
        backward = [0.0] * plan.num_stages
        for e in measured.events:
            if e.action.stage_index >= plan.num_stages:
                raise ConfigError(f"the measured timeline runs stage {e.action.stage_index}; "
                                  f"the plan has {plan.num_stages} stages")
            times = forward if e.action.kind == FORWARD else backward
            times[e.action.stage_index] += e.end_s - e.start_s
        return tuple(StageTimes(f, b, None, f + b) for f, b in zip(forward, backward)), measured
    if isinstance(measured, (str, bytes)) or not isinstance(measured, Sequence) or len(measured) != plan.num_stages:
        raise ConfigError(
            f"measured must give one entry per stage ({plan.num_stages}): seconds, or a mapping with "
            f"forward/backward/communication seconds, or a measured Timeline; got {measured!r:.80}"
        )
    out = []
    for k, entry in enumerate(measured):
        if isinstance(entry, Mapping):
            unknown = set(entry) - {"forward", "backward", "communication"}
            if unknown:
                raise ConfigError(f"measured[{k}] has keys {sorted(unknown)}; use forward, backward, communication")
            parts = [entry.get(name) for name in ("forward", "backward", "communication")]
            values = [float(p) for p in parts if p is not None]
            if any(not (v >= 0 and math.isfinite(v)) for v in values):
                raise ConfigError(f"measured[{k}] must hold finite seconds >= 0, got {dict(entry)}")
            f, b, c = (None if p is None else float(p) for p in parts)
            out.append(StageTimes(f, b, c, sum(values)))
        else:
            try:
                seconds = float(entry)
            except (TypeError, ValueError):
                seconds = float("nan")
            if not (seconds >= 0 and math.isfinite(seconds)):
                raise ConfigError(f"measured[{k}] must be finite seconds >= 0, got {entry!r}")
            out.append(StageTimes(total_s=seconds))
    return tuple(out), None


def _budgets(plan: Plan, memory_budget: float | Sequence[float] | None, spec: Any) -> tuple[float | None, ...]:
    if memory_budget is not None:
        values = list(memory_budget) if isinstance(memory_budget, Sequence) else [memory_budget] * plan.num_stages
        if len(values) != plan.num_stages or any(not float(v) > 0 for v in values):
            raise ConfigError(f"memory_budget must be bytes > 0, or one per stage ({plan.num_stages}); "
                              f"got {memory_budget!r}")
        return tuple(float(v) for v in values)
    out: list[float | None] = []
    for stage in plan.stages:
        name = stage.device or plan.device
        if spec is not None:
            bytes_ = spec.memory_bytes
        else:
            from replica.partition.cost import PRESETS  # a CPU's "memory" is the host's: no budget line

            bytes_ = PRESETS[name].memory_bytes if name in PRESETS else None
        out.append(float(bytes_) if bytes_ is not None and math.isfinite(bytes_) else None)
    return tuple(out)


def shade(hex_colour: str, amount: float) -> str:
    """``amount`` > 0 lightens towards white, < 0 darkens towards black."""
    r, g, b = (int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    target = 255 if amount > 0 else 0
    a = abs(amount)
    return "#" + "".join(f"{round(c + (target - c) * a):02x}" for c in (r, g, b))


def format_share(fraction: float) -> str:
    """A share as a percentage, ``<0.1%`` rather than a misleading ``0.0%``."""
    return "<0.1%" if 0 < fraction < 0.001 else f"{fraction:.1%}"


def nice_ticks(maximum: float, count: int = 5, *, binary: bool = False) -> list[float]:
    """Round tick values from 0 to at least ``maximum``: 1, 2, 2.5 or 5 times a power of ten apart
    (of the largest power of 1024 below ``maximum`` first, with ``binary``: 256 KiB, 512 KiB...)."""
    if not maximum > 0:
        return [0.0, 1.0]
    if binary and maximum >= 1024:
        unit = 1024 ** min(4, int(math.log(maximum, 1024)))
        return [t * unit for t in nice_ticks(maximum / unit, count)]
    raw = maximum / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(math.ceil(maximum / step - 1e-9)) + 1)]
