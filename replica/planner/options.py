"""The planner's tuned constants, in one documented object a user may override."""

from __future__ import annotations

from dataclasses import dataclass, fields

from replica.errors import ConfigError
from replica.schedules.grading import MIN_GAIN

__all__ = ["PlannerOptions"]


@dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """Thresholds the planner decides with; pass your own to ``replica.plan(...,
    options=PlannerOptions(tie=0.02))`` or ``auto_parallel``. ``benchmarks/RESULTS.md``,
    "Decisions", says under each field's name what measurement set it, or that none did.

    - ``tie``: two predicted step times within this fraction of each other are a tie, which
      the one holding least memory wins (the tuner, the free rebuilds): the cost model does
      not resolve 1% on a CPU (its predictions ran 6-31% low, machine to machine).
    - ``rebuild_risk``: a rebuild taken "for free" must fit its stage's idle time at this
      many times its profiled price (on 2 CPU ranks rebuilds cost 2.5% of the step where
      1.3% was predicted, a GELU 2.1x its profile).
    - ``min_gain``: graded micro-batch sizes are used only where they shorten the simulated
      step by this fraction; rebuilds that pay for their memory keep that much of the gain.
    - ``max_simulated_actions``: the tuner prices micro-batch counts up to about this many
      actions per simulated step (time to plan grows with it).
    - ``max_pipeline_ranks``: deeper pipelines are not tried unless ``num_stages`` asks.
    """

    tie: float = 0.01
    rebuild_risk: float = 3.0
    min_gain: float = MIN_GAIN
    max_simulated_actions: int = 60_000
    max_pipeline_ranks: int = 128

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"PlannerOptions.{f.name} must be a number >= 0, got {value!r}")
        if self.max_pipeline_ranks < 1 or self.max_simulated_actions < 1:
            raise ConfigError(
                f"PlannerOptions.max_pipeline_ranks ({self.max_pipeline_ranks}) and max_simulated_actions "
                f"({self.max_simulated_actions}) must be at least 1"
            )
