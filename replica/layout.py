"""The layout of a run: its schedules by name, and how its processes split into pipeline
ranks, data-parallel replicas and tensor-parallel shards.

Every check of a schedule name, every stages-per-rank and every rank formula reads this
module: the planner, the tuner, the runtimes, the Trainer and the examples. Nothing here
imports torch.

A rank's coordinates: ``rank = (data_parallel_rank × pipeline ranks + pipeline_rank) ×
tensor_parallel_size + tensor_parallel_rank``: the shards of one stage are neighbours
(one node), the stages of one replica follow each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from replica.errors import ConfigError

__all__ = ["ScheduleKind", "SCHEDULE_KINDS", "schedule_kind", "schedule_names", "TUNED_SCHEDULES", "SHARDINGS",
           "GRAD_SYNCS", "MESH_DIMS", "Layout", "Coordinates", "v_sharding_error"]


@dataclass(frozen=True)
class ScheduleKind:
    """What a schedule asks of the layout. ``placement``: ``"one"`` (stage r on rank r),
    ``"looped"`` (rank r holds stages r, r + P, r + 2P, ...; several per rank) or ``"v"``
    (rank r holds stages r and 2P - 1 - r); ``stages_per_rank`` is the default number of
    stages on each pipeline rank; ``splits_backward`` says whether weight gradients run as
    actions of their own (W) apart from input gradients (B); ``microbatch_multiple`` asks
    for a micro-batch count that is a multiple of the pipeline ranks."""

    name: str
    placement: str
    stages_per_rank: int
    splits_backward: bool
    microbatch_multiple: bool = False

    def pipeline_ranks(self, num_stages: int) -> int:
        """The pipeline ranks that ``num_stages`` stages of this schedule take by default."""
        return max(1, num_stages // self.stages_per_rank)

    def check_stages(self, num_stages: int, pipeline_ranks: int) -> None:
        """Raise a ``ConfigError`` unless ``num_stages`` stages fit ``pipeline_ranks`` ranks."""
        p = pipeline_ranks
        if self.placement == "one" and num_stages != p:
            raise ConfigError(
                f"schedule {self.name!r} puts one stage on each pipeline rank: {num_stages} stages need "
                f"{num_stages} pipeline ranks, got {p}; use num_stages={p}"
            )
        if self.placement == "looped" and (num_stages % p or num_stages == p):
            raise ConfigError(
                f"schedule {self.name!r} with {p} pipeline ranks needs num_stages a multiple of {p} larger "
                f"than {p} (several stages per rank), got {num_stages}; use num_stages={self.stages_per_rank * p}"
            )
        if self.placement == "v" and num_stages != 2 * p:
            raise ConfigError(
                f"schedule {self.name!r} puts two stages on each of the {p} pipeline ranks in a V: "
                f"num_stages must be {2 * p}, got {num_stages}"
            )


# The tuner tries these, in this order of preference on a tie.
SCHEDULE_KINDS: dict[str, ScheduleKind] = {k.name: k for k in (
    ScheduleKind("1f1b", "one", 1, False),
    ScheduleKind("zb-h1", "one", 1, True),
    ScheduleKind("zb-v", "v", 2, True),
    ScheduleKind("zb-interleaved", "looped", 2, True),
    ScheduleKind("interleaved", "looped", 2, False, microbatch_multiple=True),
    ScheduleKind("gpipe", "one", 1, False),
)}
TUNED_SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_KINDS)
SHARDINGS = ("none", "zero3", "zero2")  # Layout.sharding
GRAD_SYNCS = ("step", "microbatch")  # when sharded replicas reduce-scatter a stage's gradients (StagePlan.grad_sync)
MESH_DIMS = ("dp_replicate", "dp_shard", "pp", "tp")  # Layout.mesh_shape's names, outermost first


def v_sharding_error(asked: str, schedule: str, fix: str = "") -> ConfigError:
    """The error for sharded replicas (``asked``: the argument that asked for them) under a
    schedule whose V puts the first and the last stage on one rank; ``fix``: more to suggest. A weight
    both stages read (a tied embedding and head) would sit in two FSDP roots there: measured wrong
    gradients on gloo ranks (#39)."""
    return ConfigError(f"sharded data parallelism ({asked}) cannot run the schedule {schedule!r} yet: its V puts "
                       "the first and the last stage on one rank, where a weight both read (a tied embedding and "
                       "head) would sit in two FSDP roots. Use zb-h1, zb-interleaved, 1f1b, interleaved or gpipe "
                       f"with sharding{fix}")


def schedule_names(auto: bool = False) -> list[str]:
    """The schedule names a user may give, sorted (with ``"auto"``: the tuner's choice)."""
    return sorted([*SCHEDULE_KINDS, *(["auto"] if auto else [])])


def schedule_kind(name: object) -> ScheduleKind:
    """The registered schedule called ``name`` (any case); a ``ConfigError`` names the choices."""
    if not isinstance(name, str):
        raise ConfigError(f"schedule must be a string, got {type(name).__name__}")
    kind = SCHEDULE_KINDS.get(name.lower())
    if kind is None:
        raise ConfigError(f"unknown schedule {name!r}; choose one of {schedule_names(auto=True)}")
    return kind


@dataclass(frozen=True)
class Coordinates:
    """Where one process sits in a layout."""

    pipeline_rank: int
    data_parallel_rank: int
    tensor_parallel_rank: int = 0


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How a run's processes split: ``world_size = data_parallel_size × pipeline_ranks ×
    tensor_parallel_size``; ``num_stages`` stages over the pipeline ranks as ``schedule``
    places them. Validated once, here; in one process the pipeline ranks are simulated
    by the one process (``world_size`` is then the layout's, not the process group's)."""

    schedule: str
    num_stages: int
    pipeline_ranks: int
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    # how the data-parallel replicas hold their stages' state (torch's FSDP2 over each
    # stage's data-parallel group): "none" (each a whole copy), "zero3" (weights, gradients
    # and optimizer state sharded, weights gathered for each forward and backward) or
    # "zero2" (the same, the gathered weights kept from forward to backward)
    sharding: str = "none"
    # HSDP: the ranks of each FSDP shard group; the data-parallel replicas beyond it hold whole
    # copies of their group's shards (FSDP2's 2-D (replicate, shard) mesh). None: every replica
    # is in one shard group (plain FSDP). Only with sharding.
    shard_group_size: int | None = None
    # Megatron's sequence parallelism: between the blocks tensor parallelism cuts, the norms,
    # dropouts and residual adds hold 1 / tensor_parallel_size of the tokens (a block's entry
    # all-gathers them, its exit reduce-scatters). Only with tensor_parallel_size > 1.
    sequence_parallel: bool = False
    # expert parallelism: each MoE layer's experts spread over groups of this many data-parallel
    # replicas of a stage (carved out of them, as torchtitan does), tokens sent to their experts'
    # ranks and back by all-to-all (replica.parallel.experts). Divides data_parallel_size.
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        kind = schedule_kind(self.schedule)
        object.__setattr__(self, "schedule", kind.name)
        for name in ("num_stages", "pipeline_ranks", "data_parallel_size", "tensor_parallel_size"):
            _positive(name, getattr(self, name))
        if self.sharding not in SHARDINGS:
            raise ConfigError(f"sharding must be one of {list(SHARDINGS)}, got {self.sharding!r}")
        if self.sharding != "none" and self.data_parallel_size == 1:
            raise ConfigError(f"sharding={self.sharding!r} shards over data-parallel replicas, but this layout has "
                              f"one ({self.pipeline_ranks} pipeline ranks); use sharding='none' or more replicas")
        if self.sharding != "none" and kind.placement == "v":
            raise v_sharding_error(f"sharding={self.sharding!r}", kind.name)
        if self.shard_group_size is not None:
            _positive("shard_group_size", self.shard_group_size)
            d, g = self.data_parallel_size, self.shard_group_size
            if not self.sharded:
                raise ConfigError(
                    f"shard_group_size={g} groups the replicas that shard their stages (HSDP), but this layout does "
                    "not shard (sharding='none'); use sharded_data_parallel=True (or 'zero3' / 'zero2'), or drop "
                    "shard_group_size")
            if d % g:
                raise ConfigError(
                    f"shard_group_size={g} does not divide the {d} data-parallel replicas: each shard group holds "
                    f"{g} of them and the groups replicate each other. Use shard_group_size in "
                    f"{[k for k in range(1, d + 1) if d % k == 0]}")
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"sequence_parallel must be True or False, got {self.sequence_parallel!r}")
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ConfigError(
                "sequence_parallel=True shards the tokens between tensor-parallel blocks across each stage's "
                "tensor-parallel ranks, but this layout has tensor_parallel_size=1; use tensor_parallel_size > 1 "
                "(a divisor of the world size), or sequence_parallel=False")
        _positive("expert_parallel_size", self.expert_parallel_size)
        e, d = self.expert_parallel_size, self.data_parallel_size
        if d % e:
            raise ConfigError(
                f"expert_parallel_size={e} does not divide the {d} data-parallel replicas: the experts are spread "
                f"over groups of {e} replicas of each stage. Use expert_parallel_size in "
                f"{[k for k in range(1, d + 1) if d % k == 0]}, or a layout with a multiple of {e} replicas")
        kind.check_stages(self.num_stages, self.pipeline_ranks)

    @property
    def kind(self) -> ScheduleKind:
        return SCHEDULE_KINDS[self.schedule]

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.pipeline_ranks * self.tensor_parallel_size

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pipeline_ranks

    @property
    def sharded(self) -> bool:
        return self.sharding != "none"

    @property
    def dp_shard(self) -> int:
        """Replicas per FSDP shard group (1 without sharding)."""
        if not self.sharded:
            return 1
        return self.shard_group_size or self.data_parallel_size

    @property
    def dp_replicate(self) -> int:
        """Shard groups that replicate each other (the replicas themselves without sharding)."""
        return self.data_parallel_size // self.dp_shard

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        """The world as one mesh, ``MESH_DIMS`` named: row-major, so a rank's coordinates are
        :meth:`coordinates`'s (tensor-parallel ranks innermost, neighbours on one node)."""
        return (self.dp_replicate, self.dp_shard, self.pipeline_ranks, self.tensor_parallel_size)

    def describe(self) -> str:
        hsdp = f", HSDP {self.dp_replicate} x {self.dp_shard}" if self.sharded and self.dp_replicate > 1 else ""
        return (f"{self.pipeline_ranks} pipeline x {self.data_parallel_size} data"
                + (f" ({self.sharding} sharded{hsdp})" if self.sharded else "")
                + (f" x {self.tensor_parallel_size} tensor" if self.tensor_parallel_size > 1 else "")
                + (" (sequence parallel)" if self.sequence_parallel else "")
                + (f", experts over {self.expert_parallel_size} replicas" if self.expert_parallel_size > 1 else "")
                + f", {self.num_stages} stage{'s' if self.num_stages != 1 else ''}, {self.schedule}")

    # --- ranks -------------------------------------------------------------------------
    def coordinates(self, rank: int) -> Coordinates:
        """Where global ``rank`` sits."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside this layout's world of {self.world_size} ({self.describe()})")
        t = self.tensor_parallel_size
        stage_group, tp = divmod(rank, t)
        dp, pp = divmod(stage_group, self.pipeline_ranks)
        return Coordinates(pp, dp, tp)

    def global_rank(self, pipeline_rank: int, data_parallel_rank: int, tensor_parallel_rank: int = 0) -> int:
        return ((data_parallel_rank * self.pipeline_ranks + pipeline_rank) * self.tensor_parallel_size
                + tensor_parallel_rank)

    # --- making one --------------------------------------------------------------------
    @classmethod
    def for_stages(cls, schedule: str, num_stages: int | None = None, *, data_parallel_size: int = 1,
                   tensor_parallel_size: int = 1) -> "Layout":
        """``num_stages`` stages (default: the schedule's stages on one rank each, or two)
        on the pipeline ranks the schedule gives them, each rank ``tensor_parallel_size`` shards."""
        kind = schedule_kind(schedule)
        stages = num_stages if num_stages is not None else kind.stages_per_rank
        return cls(schedule=kind.name, num_stages=stages, pipeline_ranks=kind.pipeline_ranks(stages),
                   data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size)

    @classmethod
    def for_world(cls, schedule: str, world_size: int, *, num_stages: int | None = None,
                  data_parallel_size: int | None = None, tensor_parallel_size: int = 1) -> "Layout":
        """The layout of ``world_size`` processes: ``tensor_parallel_size`` (default 1) ranks
        per stage, then ``num_stages`` (default: the schedule's stages per rank on every rank
        left after ``data_parallel_size``, default 1) decides the pipeline ranks, the rest of
        the world are replicas. Errors name what fits."""
        _positive("world_size", world_size)
        _positive("tensor_parallel_size", tensor_parallel_size)
        kind = schedule_kind(schedule)
        t = tensor_parallel_size
        if world_size % t:
            raise ConfigError(
                f"tensor_parallel_size={t} does not divide the world size {world_size}; use one of "
                f"{[k for k in range(1, world_size + 1) if world_size % k == 0]}"
            )
        groups = world_size // t  # the stage groups: pipeline ranks x replicas
        per = f" (world_size {world_size} / tensor_parallel_size {t})" if t > 1 else ""
        if num_stages is None or kind.placement != "one":
            d = data_parallel_size or 1
            if groups % d:
                raise ConfigError(
                    f"data_parallel_size={d} does not divide the {groups} ranks of each tensor-parallel shard{per}; "
                    f"use one of {[k for k in range(1, groups + 1) if groups % k == 0]}" if t > 1 else
                    f"data_parallel_size={d} does not divide the world size {world_size}; use one of "
                    f"{[k for k in range(1, world_size + 1) if world_size % k == 0]}"
                )
            p = groups // d
            stages = num_stages if num_stages is not None else kind.stages_per_rank * p
            return cls(schedule=kind.name, num_stages=stages, pipeline_ranks=p, data_parallel_size=d,
                       tensor_parallel_size=t)
        if groups % num_stages:
            where = f"the {groups} ranks{per}" if t > 1 else f"the world size {world_size}"
            raise ConfigError(
                f"num_stages={num_stages} does not divide {where}: with one stage per rank, "
                f"world_size = num_stages × data-parallel replicas"
                + (" × tensor_parallel_size" if t > 1 else "")
                + f". Use num_stages in {[k for k in range(1, groups + 1) if groups % k == 0]}"
            )
        d = groups // num_stages
        if data_parallel_size not in (None, d):
            fix = ""
            if t == 1 and world_size % (num_stages * data_parallel_size) == 0:
                fix = f" (tensor_parallel_size={world_size // (num_stages * data_parallel_size)} would leave them)"
            raise ConfigError(
                f"num_stages={num_stages} on {world_size} ranks"
                + (f" with tensor_parallel_size={t}" if t > 1 else "")
                + f" leaves {d} data-parallel replicas, not data_parallel_size={data_parallel_size}{fix}"
            )
        return cls(schedule=kind.name, num_stages=num_stages, pipeline_ranks=num_stages, data_parallel_size=d,
                   tensor_parallel_size=t)
