"""The planning vocabulary: one definition of the keywords ``plan``, ``auto_parallel`` and ``TrainerConfig`` share.

:class:`PlanningOptions` names and checks every planning keyword once; ``replica.plan`` and
``replica.auto_parallel`` take them as ``**planning`` (their signatures are made from these
fields) and :class:`~replica.defaults.TrainerConfig` inherits them, so the three take the same
names with the same meaning and the same errors. :class:`PlanRequest` adds the world the plan
is for and answers what the planner may choose.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from replica.errors import ConfigError
from replica.layout import GRAD_SYNCS, SCHEDULE_KINDS, SHARDINGS, Layout, schedule_kind
from replica.partition.cost import device_spec, torch_device_of
from replica.planner.options import PlannerOptions
from replica.planner.tensor_parallel import tensor_parallel_choices
from replica.precision import precision_name

__all__ = ["PlanningOptions", "PlanRequest", "check_count", "planning_keywords", "split_planning",
           "with_planning_signature", "BATCH_MEANINGS"]

BATCH_MEANINGS = ("global", "per_rank")


def check_count(name: str, value: object) -> None:
    """A positive int or None, else a ``ConfigError`` naming ``name``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{name} must be a positive int or None, got {value!r}")


@dataclass(kw_only=True)
class PlanningOptions:
    """The planning keywords; None leaves a choice to the planner.

    ``num_stages``, ``num_microbatches`` (per replica), ``schedule`` (a name of
    :data:`replica.layout.SCHEDULE_KINDS`, or None / ``"auto"``: the tuner's choice. In one
    process, where nothing runs in parallel and a schedule only changes memory, None is
    ``"1f1b"``; ``"auto"`` there still simulates the ranks as if they ran in parallel),
    ``data_parallel_size``, ``tensor_parallel_size`` (the ranks each stage's layers are cut
    across, Megatron-style, on DTensor; None: the tuner, within a node), ``sharded_data_parallel``
    (True: the replicas shard weights, gradients and optimizer state with FSDP2, ``"zero3"`` or
    ``"zero2"`` as priced, or the one named; False: whole copies; None: the planner decides),
    ``shard_group_size`` (HSDP: the replicas of each FSDP shard group, the groups replicating each
    other; None: the planner weighs one group of every replica against groups that fit a node),
    ``grad_sync`` (sharded replicas: ``"step"`` reduce-scatters each stage's gradients once a step,
    accumulating them unsharded over its micro-batches; ``"microbatch"`` after every backward, so
    they accumulate sharded, 1/d of the bytes, for m reduce-scatters a step; None: the planner
    keeps "step" on every pipeline rank that fits it and reduces every micro-batch on the others),
    ``sequence_parallel`` (Megatron's sequence parallelism, with ``tensor_parallel_size`` > 1: the
    norms, dropouts and residuals between tensor-parallel blocks hold a shard of the tokens, a
    block's entry all-gathers them and its exit reduce-scatters; True, False, or None: the
    planner prices both), ``expert_parallel_size`` (each MoE layer's experts spread over this many
    data-parallel replicas of its stage, tokens sent to them and back by all-to-all; a divisor of the
    replicas and of every MoE layer's expert count; None: the planner's choice),
    ``recompute`` (activation checkpointing per stage, :mod:`replica.partition.recompute`: True
    checkpoints every block, a stage without blocks whole; ``"selective"`` keeps the blocks'
    matmul and attention outputs and recomputes the rest; an int ``k`` the first k blocks of each
    stage; ``"pointwise"``: rebuild GELU / SiLU outputs in backward on stages that hold several
    micro-batches; False: none of these; None: the tuner decides), ``compile`` (True: every stage runs
    through ``torch.compile``, inductor, after activation checkpointing and before FSDP2, priced with
    its fused pointwise ops; False: eager; None: off on a CPU; for a GPU (weights not on a CPU) the
    chosen layout compiled where it is priced faster than the same layout eager; said in the summary),
    ``float8`` (True: the linears train in float8 through torchao, on top of ``compile``, priced at an SM90 GPU's float8
    rate; refused where the plan is not for an H100; default False), ``mixed_precision`` (None: fp32, or
    rather the weights' own dtype; ``"bf16"`` / ``"fp16"``: autocast, priced at the device's
    half-precision rate), ``device`` (what the plan is priced for and, for the Trainer, where the
    model runs: None, where the model's weights are; a torch device, ``"cpu"`` / ``"cuda:1"``,
    priced as that device's preset; a preset name such as ``"h100-80gb"`` or a
    ``replica.DeviceSpec``: priced as that machine, wherever this runs; or one per stage),
    ``cost`` (``"profile"`` times every op here, ``"analytic"`` prices FLOPs and bytes on
    ``device``'s spec, ``"auto"`` profiles a real model on a CPU when no other device is named,
    and prices a GPU on its preset: op-by-op timing on a GPU measured 1.3-2.3x its real step),
    ``memory_budget`` (bytes per device, or one per stage; default: the device's memory when
    planning analytically), ``optimizer`` (what the memory model counts per parameter),
    ``tracer`` (``"fx"``, ``"export"`` or ``"auto"``), ``dynamic_dims`` (``"auto"``,
    ``"batch"`` or ``"all"``), ``leaf_modules`` (module types or names the tracer keeps whole),
    ``graded_microbatches`` (smaller micro-batches where the pipeline fills and drains, where the
    simulator says it pays), ``options`` (:class:`replica.PlannerOptions`, the thresholds) and
    ``batch`` (``"global"``: every step takes the plain model's whole batch on every rank, each
    replica trains its slice; ``"per_rank"``: each replica is fed its own batch, so the replicas
    must be fixed by ``data_parallel_size`` or ``num_stages``).
    """

    num_stages: int | None = None
    num_microbatches: int | None = None
    schedule: str | None = None
    data_parallel_size: int | None = None
    tensor_parallel_size: int | None = None
    sharded_data_parallel: bool | str | None = None
    shard_group_size: int | None = None
    grad_sync: str | None = None
    sequence_parallel: bool | None = None
    expert_parallel_size: int | None = None
    recompute: bool | str | int | None = None
    compile: bool | None = None
    float8: bool = False
    mixed_precision: Any = None
    device: Any = None
    cost: str = "auto"
    memory_budget: float | Sequence[float] | None = None
    optimizer: str = "adam"
    tracer: str = "auto"
    dynamic_dims: str = "auto"
    leaf_modules: Iterable[Any] = ()
    graded_microbatches: bool = True
    options: PlannerOptions | None = None
    batch: str = "global"

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_microbatches", "data_parallel_size", "tensor_parallel_size",
                     "shard_group_size", "expert_parallel_size"):
            check_count(name, getattr(self, name))
        if self.schedule is not None and not (isinstance(self.schedule, str) and self.schedule.lower() == "auto"):
            try:
                self.schedule = schedule_kind(self.schedule).name
            except ConfigError as exc:
                raise ConfigError(f"{exc} (or None: the tuner's choice)") from None
        elif self.schedule is not None:
            self.schedule = "auto"
        precision_name(self.mixed_precision)  # a ConfigError names the choices
        if not (self.sharded_data_parallel in (None, True, False) or self.sharded_data_parallel in SHARDINGS):
            raise ConfigError(f"sharded_data_parallel must be True, False, None (the planner decides) or one of "
                              f"{list(SHARDINGS)}, got {self.sharded_data_parallel!r}")
        if self.shard_group_size is not None and self.sharded_data_parallel in (False, "none"):
            raise ConfigError(
                f"shard_group_size={self.shard_group_size} groups the replicas that shard their stages (HSDP), but "
                f"sharded_data_parallel={self.sharded_data_parallel!r}; use sharded_data_parallel=True (or None), or "
                "drop shard_group_size")
        if self.shard_group_size is not None and self.data_parallel_size is not None \
                and self.data_parallel_size % self.shard_group_size:
            d, g = self.data_parallel_size, self.shard_group_size
            raise ConfigError(
                f"shard_group_size={g} does not divide data_parallel_size={d}: each shard group holds {g} replicas "
                f"and the groups replicate each other. Use shard_group_size in "
                f"{[k for k in range(1, d + 1) if d % k == 0]}")
        if self.grad_sync is not None and self.grad_sync not in GRAD_SYNCS:
            raise ConfigError(
                f"grad_sync must be 'step' (sharded replicas reduce-scatter each gradient once a step), 'microbatch' "
                f"(after every micro-batch's backward: gradients accumulate sharded) or None (the planner decides), "
                f"got {self.grad_sync!r}")
        if self.grad_sync is not None and self.sharded_data_parallel in (False, "none"):
            raise ConfigError(
                f"grad_sync={self.grad_sync!r} says when sharded replicas reduce-scatter their gradients, but "
                f"sharded_data_parallel={self.sharded_data_parallel!r}; use sharded_data_parallel=True (or None), or "
                "drop grad_sync")
        if self.sequence_parallel not in (None, True, False):
            raise ConfigError(f"sequence_parallel must be True, False or None (the planner decides), got "
                              f"{self.sequence_parallel!r}")
        if self.sequence_parallel is True and self.tensor_parallel_size == 1:
            raise ConfigError(
                "sequence_parallel=True shards the tokens between tensor-parallel blocks across each stage's "
                "tensor-parallel ranks, but tensor_parallel_size=1; use tensor_parallel_size=2 or more (a divisor of "
                "the world size), or sequence_parallel=False / None")
        k = self.recompute
        if not (k is None or isinstance(k, bool) or k in ("pointwise", "selective") or isinstance(k, int) and k >= 0):
            raise ConfigError(
                f"recompute must be True (checkpoint every block: keep only its inputs, run its forward again in "
                f"backward), 'selective' (keep matmul and attention outputs, recompute the rest), an int k >= 0 "
                f"(the first k blocks of each stage), 'pointwise' (rebuild GELU / SiLU outputs in backward), "
                f"False or None (let the tuner decide), got {self.recompute!r}"
            )
        if not (self.compile is None or isinstance(self.compile, bool)):
            raise ConfigError(
                f"compile must be True (every stage through torch.compile), False (eager) or None (the planner "
                f"decides: off on a CPU, on for a GPU where it is priced faster), got {self.compile!r}")
        if not isinstance(self.float8, bool):
            raise ConfigError(f"float8 must be True (the linears in float8, torchao, on an H100) or False, got "
                              f"{self.float8!r}")
        if self.float8 and self.compile is False:
            raise ConfigError(
                "float8=True casts every linear's inputs and weights to float8 around its matmul; without compile "
                "those casts are separate kernels that cost more than the float8 matmul saves (torchao's float8 "
                "training is meant to run under torch.compile). Use compile=True or None with float8=True")
        if self.cost not in ("auto", "analytic", "profile"):
            raise ConfigError(f"cost must be 'auto', 'analytic' or 'profile', got {self.cost!r}")
        if self.tracer not in ("auto", "fx", "export"):
            raise ConfigError(f"tracer must be 'auto', 'fx' or 'export', got {self.tracer!r}")
        if self.batch not in BATCH_MEANINGS:
            raise ConfigError(
                f"batch={self.batch!r}; use 'global' (example inputs and train_step take the whole batch, every "
                "replica trains its slice) or 'per_rank' (each replica is fed its own batch)"
            )
        if self.options is not None and not isinstance(self.options, PlannerOptions):
            raise ConfigError(f"options must be a replica.PlannerOptions, got {type(self.options).__name__}")
        for one in self.device if isinstance(self.device, (list, tuple)) else [self.device]:
            if isinstance(one, str) and one.split(":")[0] in ("cpu", "cuda", "mps", "xpu"):
                try:
                    torch.device(one)
                except (RuntimeError, TypeError) as exc:
                    raise ConfigError(
                        f"device={one!r} is not a torch device ({exc}); use e.g. 'cpu', 'cuda' or 'cuda:1', a cost "
                        "preset such as 'a100-80gb', or None for where the model's parameters are") from None
            elif one is not None and torch_device_of(one) is None:
                device_spec(one)  # a ConfigError names the presets
        if not isinstance(self.graded_microbatches, bool):
            raise ConfigError(f"graded_microbatches must be True or False, got {self.graded_microbatches!r}")

    @property
    def precision(self) -> str:
        """``mixed_precision`` by its one name: ``"fp32"``, ``"bf16"`` or ``"fp16"``."""
        return precision_name(self.mixed_precision)

    def planning(self) -> dict[str, Any]:
        """The planning keywords as ``auto_parallel`` takes them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(PlanningOptions)}


def planning_keywords() -> tuple[str, ...]:
    """The names of the planning keywords, in order."""
    return tuple(f.name for f in dataclasses.fields(PlanningOptions))


def split_planning(kwargs: dict[str, Any], call: str) -> dict[str, Any]:
    """``kwargs`` checked to be planning keywords; an unknown one is a ``ConfigError``
    naming the closest keyword ``call`` takes."""
    known = planning_keywords()
    for name in kwargs:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]}=?" if close else f"; its planning keywords are {list(known)}"
            raise ConfigError(f"{call}() got an unexpected keyword {name}={kwargs[name]!r}{hint}")
    return kwargs


def with_planning_signature(func: Callable[..., Any]) -> Callable[..., Any]:
    """Give ``func`` (which takes ``**planning``) a signature that lists the planning keywords,
    for ``help()`` and editors."""
    sig = inspect.signature(func)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    taken = {p.name for p in params}
    for f in dataclasses.fields(PlanningOptions):
        if f.name not in taken:
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default))
    func.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return func


@dataclass(kw_only=True)
class PlanRequest(PlanningOptions):
    """The planning keywords and the world they are for; what the planner may choose.

    ``world_size`` None plans for one process that runs every pipeline rank itself (no
    replicas). The tuner searches when the schedule is left to it in a world (or named
    ``"auto"``), or when a world's stage or micro-batch count is left open.
    ``tensor_parallel_size`` None lets the tuner choose among the divisors of the device's
    ``devices_per_node`` that divide the world, where it tunes; a fixed layout and one
    process keep 1; with sharded replicas FSDP2 shards the tensor-parallel shards (2-D).
    """

    world_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count("world_size", self.world_size)
        if self.schedule is None:  # the tuner's choice; in one process nothing overlaps: 1F1B
            self.schedule = "auto" if self.world_size is not None else "1f1b"
        if self.options is None:
            self.options = PlannerOptions()
        if self.world_size is None and self.data_parallel_size not in (None, 1):
            raise ConfigError(
                f"data_parallel_size={self.data_parallel_size} needs a world of processes: give world_size= to "
                "replica.plan, or start auto_parallel or the Trainer under torchrun (torchrun --nproc_per_node N, N "
                f"a multiple of {self.data_parallel_size}); this runs in one process, which has no replicas: leave "
                "data_parallel_size None here"
            )
        self._check_world()
        self._check_tensor_parallel()
        e = self.expert_parallel_size
        if e is not None and e > 1 and self.world_size is None:
            raise ConfigError(
                f"expert_parallel_size={e} needs a world of processes (the experts spread over {e} data-parallel "
                "replicas): give world_size= to replica.plan, or run auto_parallel under torchrun")
        if e is not None and self.data_parallel_size is not None and self.data_parallel_size % e:
            d = self.data_parallel_size
            raise ConfigError(
                f"expert_parallel_size={e} does not divide data_parallel_size={d}: the experts spread over groups of "
                f"{e} replicas. Use expert_parallel_size in {[k for k in range(1, d + 1) if d % k == 0]}")
        if self.sequence_parallel is True and self.tensor_parallel_fixed() == 1:
            raise ConfigError(
                "sequence_parallel=True shards the tokens between tensor-parallel blocks, but this plan has one "
                "tensor-parallel rank per stage (" + ("one process" if self.world_size is None else
                                                      "a layout fixed without tensor_parallel_size") +
                "); give world_size= and tensor_parallel_size=2 or more, or sequence_parallel=False / None")
        if self.world_size is not None and self.num_stages is not None:
            self._check_stages_fit()

    def _check_stages_fit(self) -> None:
        """``num_stages`` must fit the world with some schedule the planner may use and some
        tensor-parallel size it may pick: else the first one's error, naming what fits."""
        assert self.world_size is not None and self.num_stages is not None
        schedules = list(SCHEDULE_KINDS) if self.schedule == "auto" else [self.schedule]
        fixed = self.tensor_parallel_fixed()
        sizes = [fixed] if fixed is not None else [k for k in range(1, self.world_size + 1) if self.world_size % k == 0]
        errors = []
        for name in schedules:
            for t in sizes:
                try:
                    Layout.for_world(name, self.world_size, num_stages=self.num_stages,
                                     data_parallel_size=self.data_parallel_size, tensor_parallel_size=t)
                    return
                except ConfigError as exc:
                    errors.append(exc)
        raise errors[0]

    def _check_world(self) -> None:
        """Degrees that cannot multiply to the world: named before anything is priced."""
        w = self.world_size
        if w is None:
            return
        d = self.data_parallel_size
        if d is not None and w % d:
            raise ConfigError(
                f"data_parallel_size={d} does not divide world_size={w}: world_size = data_parallel_size × "
                f"pipeline ranks × tensor_parallel_size. Use data_parallel_size in "
                f"{[k for k in range(1, w + 1) if w % k == 0]}, or a world_size that is a multiple of {d}")
        t = self.tensor_parallel_size
        if d is not None and t is not None and w % (d * t):
            raise ConfigError(
                f"data_parallel_size={d} × tensor_parallel_size={t} = {d * t} does not divide world_size={w}: "
                f"world_size = data_parallel_size × pipeline ranks × tensor_parallel_size")

    def _check_tensor_parallel(self) -> None:
        t = self.tensor_parallel_size
        if t is None or t == 1:
            return
        if self.world_size is None:
            raise ConfigError(
                f"tensor_parallel_size={t} needs a world of processes (each stage's blocks sharded over {t} "
                f"ranks): give world_size= to replica.plan, or run auto_parallel under torchrun")
        if self.world_size % t:
            raise ConfigError(
                f"tensor_parallel_size={t} does not divide world_size={self.world_size}: world_size = "
                f"data_parallel_size × pipeline ranks × tensor_parallel_size. Use tensor_parallel_size in "
                f"{[k for k in range(1, self.world_size + 1) if self.world_size % k == 0]}, or a world_size "
                f"that is a multiple of {t}")

    def tensor_parallel_fixed(self) -> int | None:
        """The tensor-parallel size the request fixes, or None where the tuner picks it:
        one process, a layout the request fixes (see :attr:`tuning`) and a per-rank batch
        whose replicas the request does not fix keep 1."""
        if self.tensor_parallel_size is not None:
            return self.tensor_parallel_size
        if self.world_size is None or not self.tuning:
            return 1
        if self.batch == "per_rank" and self.data_parallel_size is None:
            return 1
        return None

    def tensor_parallel_choices(self, devices_per_node: int) -> tuple[int, ...]:
        """The tensor-parallel sizes the planner may use on a device of ``devices_per_node``."""
        t = self.tensor_parallel_fixed()
        if t is not None:
            return (t,)
        assert self.world_size is not None
        return tuple(tensor_parallel_choices(self.world_size, devices_per_node))

    @property
    def tuning(self) -> bool:
        """Whether the tuner searches: the schedule is left to it, or in a world the stage or
        micro-batch count is left open."""
        if self.schedule == "auto":
            return True
        return self.world_size is not None and (self.num_stages is None or self.num_microbatches is None)

    @property
    def shardings(self) -> tuple[str, ...]:
        """The shardings of the replicas the planner may choose from."""
        asked = self.sharded_data_parallel
        if asked is None:
            return SHARDINGS[1:] if self.shard_group_size is not None else SHARDINGS
        if isinstance(asked, str):
            return (asked,)
        return ("zero3", "zero2") if asked else ("none",)

    def sequence_parallel_choices(self, tensor_parallel_size: int) -> tuple[bool, ...]:
        """The sequence-parallel settings to price at ``tensor_parallel_size``: the one asked
        (True only where it cuts: none at one rank), else both where it cuts."""
        if tensor_parallel_size <= 1:
            return () if self.sequence_parallel else (False,)
        if self.sequence_parallel is None:
            return (False, True)
        return (self.sequence_parallel,)

    def shard_groups(self, replicas: int, ranks_per_replica: int, devices_per_node: int) -> tuple[int, ...]:
        """The shard-group sizes to price for ``replicas`` sharded replicas of
        ``ranks_per_replica`` ranks each: the one asked (where it divides them), else one group of
        them all and, where it differs, the largest group that fits a node (HSDP)."""
        if self.shard_group_size is not None:
            return (self.shard_group_size,) if replicas % self.shard_group_size == 0 else ()
        fits = [g for g in range(1, replicas + 1) if replicas % g == 0 and g * ranks_per_replica <= devices_per_node]
        return tuple(dict.fromkeys([replicas, *(fits[-1:] if fits and fits[-1] > 1 else [])]))

    def replicas_fixed(self) -> int | None:
        """The data-parallel replicas the request fixes, or None where the tuner picks them."""
        if self.world_size is None:
            return 1
        if self.data_parallel_size is not None:
            return self.data_parallel_size
        t = self.tensor_parallel_fixed()
        if self.schedule != "auto" and self.num_stages is not None and t is not None:
            return Layout.for_world(self.schedule, self.world_size, num_stages=self.num_stages,
                                    tensor_parallel_size=t).data_parallel_size
        return None

