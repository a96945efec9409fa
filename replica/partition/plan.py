"""The partition plan: which ops and parameters each stage holds, what crosses each cut,
and what each stage is predicted to cost. JSON in and out; the visualizer draws it."""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from replica.errors import ConfigError
from replica.layout import Layout
from replica.partition.experts import ExpertBlock
from replica.partition.tensor_parallel import ShardedBlock
from replica.units import format_bytes, format_flop_rate, format_seconds

__all__ = ["BoundaryTensor", "MemoryBreakdown", "StagePlan", "Plan"]

PLAN_FORMAT = 2  # 1: num_stages, schedule, data_parallel_size and pipeline_ranks (0: one per stage) at the top


@dataclass(frozen=True)
class BoundaryTensor:
    """A value made in ``source_stage`` and read by each of ``destination_stages``.

    ``shape`` and ``nbytes`` are for the traced batch; a micro-batch carries its share.
    ``shape`` is ``None`` for a Python value (a size, a device).
    """

    name: str
    source_stage: int
    destination_stages: tuple[int, ...]
    shape: tuple[int, ...] | None
    dtype: str | None
    nbytes: int


@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted bytes held by one stage at its peak."""

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations


@dataclass(frozen=True)
class StagePlan:
    """One stage: its ops (in order), its parameters by original name, its predicted cost
    for one whole step (every micro-batch, forward and backward, its transfers)."""

    stage_index: int
    node_names: tuple[str, ...]
    parameter_names: tuple[str, ...]
    forward_time_s: float
    backward_time_s: float
    communication_time_s: float
    memory: MemoryBreakdown
    inputs: tuple[BoundaryTensor, ...] = ()
    outputs: tuple[BoundaryTensor, ...] = ()
    module_paths: tuple[str, ...] = ()
    num_ops: int = 0
    device: str = ""
    # what the stage's backwards keep over the whole step: its saved activations (at the
    # traced batch) and, under autocast, each micro-batch's copies of the weights it casts
    activation_bytes: int = 0
    fixed_forward_s: float = 0.0
    fixed_backward_s: float = 0.0
    # the stage's data-parallel collectives over one step (replica.planner.dataparallel): the
    # gradients' all-reduce of a replicated stage; the ``gathers`` all-gathers of its weights and
    # the reduce-scatter of its gradients of a sharded one; and what of them its compute does not hide
    collective_s: float = 0.0
    exposed_collective_s: float = 0.0
    gathers: int = 0
    # the tensor-parallel collectives of the stage's step (all-reduces and all-gathers over
    # its tensor-parallel group, replica.planner.tensor_parallel): part of forward_time_s and
    # backward_time_s, which they are not overlapped with; 0.0 without tensor parallelism;
    # and the bytes of the whole tensors they run on (ring all-reduces and all-gathers), a step
    tensor_parallel_s: float = 0.0
    tensor_parallel_bytes: int = 0
    # activation checkpointing (replica.partition.recompute): the stage's mode (False, True: every
    # block, "selective", int k: its first k blocks), its blocks (module paths; none: the stage is
    # its one block), the bytes rebuilding its fullest block adds at once in backward (at the traced
    # batch: a micro-batch holds its share), and the micro-batches the schedule keeps in flight here
    recompute: bool | str | int = False
    blocks: tuple[str, ...] = ()
    recompute_bytes: int = 0
    in_flight: int = 1
    # under a split backward (zero-bubble), what the stage's deferred linears hold from each B to its W
    # over the whole step (their inputs and output gradients: replica.partition.recompute.weight_grad_bytes)
    weight_grad_bytes: int = 0
    # sharded replicas (FSDP2): when the stage reduce-scatters its gradients, "step" (once, after
    # its last backward: unsharded gradients accumulate over the micro-batches) or "microbatch"
    # (after every backward: they accumulate sharded, for m reduce-scatters a step)
    grad_sync: str = "step"

    @property
    def recompute_note(self) -> str:
        """The stage's checkpointing in a few words ("-", "4 blocks", "2 of 4 blocks", "selective")."""
        from replica.partition.recompute import describe_mode
        return describe_mode(self.recompute, len(self.blocks))

    @property
    def predicted_time_s(self) -> float:
        return self.forward_time_s + self.backward_time_s + self.communication_time_s

    @property
    def predicted_memory_bytes(self) -> int:
        return self.memory.total


@dataclass(frozen=True)
class Plan:
    """A whole pipeline: its :class:`~replica.layout.Layout` (schedule, stages, pipeline
    ranks, replicas), each stage's ops, parameters and predicted costs, and what the
    planner decided about micro-batches and memory."""

    model_name: str
    layout: Layout
    num_microbatches: int
    device: str
    stages: tuple[StagePlan, ...]
    predicted_step_time_s: float
    tied_parameters: dict[str, tuple[str, ...]] = field(default_factory=dict)
    graph_fingerprint: str = ""
    exact: bool = True
    lower_bound_s: float = 0.0
    alternatives: tuple[tuple[str, float], ...] = ()
    model_flops: float = 0.0
    device_peak_flops: float = 0.0
    # the recompute mode asked of every stage (False, True, "selective", int k; each stage's own
    # in ``stages[i].recompute``): truthy where activations are checkpointed
    recompute: bool | str | int = False
    simulated_bubble: float = -1.0
    microbatch_shares: tuple[float, ...] = ()  # relative micro-batch sizes; () is even
    # a backward sends its input gradient to another rank before computing its weight
    # gradients (faster; meanwhile it holds that micro-batch's layer inputs and output
    # gradients: on only where one micro-batch's activations more fit the memory budget)
    early_input_grads: bool = True
    # stages that hold several micro-batches rebuild GELU / SiLU outputs in backward instead
    # of keeping them (stage/remat.py): less memory, about 1-2% more time; opt-in
    pointwise_recompute: bool = False
    # (stage, kind) pairs: the kinds of ops ("activation": GELU / SiLU, "norm": LayerNorm)
    # whose outputs a stage rebuilds anyway: to pay for graded micro-batches' memory, or
    # where the planner found it as good as free (replica.planner.refine.finish)
    rebuilds: tuple[tuple[int, str], ...] = ()
    # per graph input, the dims a call may change (torch.export fixes the others); () when
    # not recorded. An fx graph takes any shape its code allows: every dim of every input.
    dynamic_dims: tuple[tuple[int, ...], ...] = ()
    # each pipeline rank's actions in order ("2F0": stage 2's forward of micro-batch 0),
    # worked out once by the planner from the final plan: the runtimes, the simulator and
    # the report all read these (replica.schedules.schedule.plan_schedule); () to derive them
    actions: tuple[tuple[str, ...], ...] = ()
    # each action's predicted start (seconds into the step), aligned with ``actions``: the
    # order in which ranks post their messages breaks ties by it (replica.runtime.p2p); ()
    # in plans saved before it (any consistent order is then used)
    action_starts: tuple[tuple[float, ...], ...] = ()
    # what the stages compute in (replica.precision): "fp32", the weights' own dtype, or
    # "bf16" / "fp16" autocast, priced at the device's half-precision rate and in autocast's
    # dtypes (plans saved before this field read as "fp32")
    precision: str = "fp32"
    # the data-parallel collectives of the rank that waits longest for them, over one step:
    # all of them, and what its compute does not hide (in predicted_step_time_s)
    collective_s: float = 0.0
    exposed_collective_s: float = 0.0
    # the structures cut across the layout's tensor-parallel ranks (replica.partition.
    # tensor_parallel): () with tensor_parallel_size 1, or where nothing in the graph shards
    tensor_parallel: tuple[ShardedBlock, ...] = ()
    # with layout.sequence_parallel: (node, dim) of each value between those blocks held as a
    # sequence shard (replica.partition.sequence_parallel); () without, or where none has such a dim
    sequence_shards: tuple[tuple[str, int], ...] = ()
    # every stage runs through torch.compile (replica.parallel.compile), priced with its fused
    # pointwise ops (replica.partition.cost.fused_ops); ``compile_note``: why, in a few words
    compile: bool = False
    compile_note: str = ""
    # the linears train in float8 (torchao, replica.parallel.float8), priced at the float8 rate
    float8: bool = False
    # each MoE layer's experts (replica.partition.experts), spread over
    # layout.expert_parallel_size replicas where that is > 1; () in a model without them
    experts: tuple[ExpertBlock, ...] = ()
    # with layout.expert_parallel_size > 1 (replica.planner.experts): the busiest pipeline rank's
    # all-to-all seconds and bytes sent a step (in predicted_step_time_s), and the example batch's
    # routing imbalance (the busiest expert rank's token slots over the mean)
    expert_parallel_s: float = 0.0
    expert_parallel_bytes: int = 0
    expert_imbalance: float = 1.0
    # sharded replicas: why some stages reduce-scatter their gradients every micro-batch
    # (StagePlan.grad_sync, chosen per pipeline rank by replica.planner.pricing.Pricing.sync_grads)
    grad_sync_note: str = ""

    def __post_init__(self) -> None:
        if len(self.stages) != self.num_stages:
            raise ConfigError(f"plan has {len(self.stages)} stages but num_stages={self.num_stages}")

    # --- the layout's figures ----------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    @property
    def schedule(self) -> str:
        return self.layout.schedule

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data_parallel_size

    @property
    def pipeline_ranks(self) -> int:
        return self.layout.pipeline_ranks

    @property
    def stages_per_rank(self) -> int:
        return self.layout.stages_per_rank

    @property
    def sends_input_grads_early(self) -> bool:
        """Whether a backward that sends an input gradient to another rank sends it before
        computing its weight gradients: the plan's choice (``early_input_grads``), never where
        sharded replicas reduce gradients inside the backward (FSDP2), the schedule has W
        actions of its own, or the stages are compiled (the linears that defer their weight
        gradients would run eagerly, breaking the graph: a compiled backward runs whole). The
        one place this is decided; planner and runtimes read it."""
        return self.early_input_grads and not self.layout.sharded and not self.layout.kind.splits_backward \
            and not self.compile

    # --- derived figures -------------------------------------------------------------
    @property
    def bottleneck_s(self) -> float:
        return max(s.predicted_time_s for s in self.stages)

    @property
    def balance(self) -> float:
        """Slowest stage over the mean stage: 1.00 is perfect balance."""
        mean = sum(s.predicted_time_s for s in self.stages) / self.num_stages
        return self.bottleneck_s / mean if mean > 0 else 1.0

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the ranks' time in the simulated schedule (the 1F1B formula
        (p-1)/(m+p-1) for plans made without a simulation)."""
        if self.simulated_bubble >= 0:
            return self.simulated_bubble
        p, m = self.num_stages, self.num_microbatches
        return (p - 1) / (m + p - 1)

    @property
    def relative_microbatch_sizes(self) -> list[float]:
        """Each micro-batch's size over the even one (``[]`` when even): what
        ``simulate(..., sizes=)`` scales each micro-batch's costs by."""
        return [x * self.num_microbatches for x in self.microbatch_shares]

    @property
    def recompute_title(self) -> str:
        """The plan's checkpointing for the summary's title ("" without any)."""
        modes = {repr(s.recompute) for s in self.stages if s.recompute is not False and s.recompute != 0}
        if not modes:
            return ", recomputing activations" if self.recompute else ""
        if len(modes) == 1 and any(s.recompute is False or s.recompute == 0 for s in self.stages):
            return ", activation checkpointing per stage"  # a mix: some stages keep everything
        if modes == {"True"}:
            return ", checkpointing every block"
        if modes == {"'selective'"}:
            return ", selective checkpointing (matmul and attention outputs kept)"
        if len(modes) == 1:
            return f", checkpointing the first {modes.pop()} blocks of each stage"
        return ", activation checkpointing per stage"

    def rebuilt(self, stage_index: int) -> frozenset[str]:
        """The kinds of ops whose outputs ``stage_index`` rebuilds in backward, unasked."""
        return frozenset(kind for k, kind in self.rebuilds if k == stage_index)

    @property
    def precision_note(self) -> str:
        """One line on what the stages compute in, for the summary and the report."""
        if self.precision == "fp32":
            return "precision: the weights' own dtype (no autocast)"
        return f"precision: {self.precision} autocast (weights, gradients and optimizer state in the weights' dtype)"

    @property
    def data_parallel_note(self) -> str:
        """One line on the data-parallel replicas and their collectives ("" with one replica)."""
        d = self.data_parallel_size
        if d == 1:
            return ""
        times = (f"{_seconds(self.collective_s)} of collectives a step on the busiest rank, "
                 f"{_seconds(self.exposed_collective_s)} of it not hidden behind compute")
        if not self.layout.sharded:
            return f"data parallel: {d} replicas, gradients all-reduced once a step: {times}"
        gathers = sorted({s.gathers for s in self.stages})
        count = str(gathers[0]) if len(gathers) == 1 else f"{gathers[0]}-{gathers[-1]}"
        dtype = " in bf16" if self.precision == "bf16" else " in fp16" if self.precision == "fp16" else ""
        every = [s.stage_index for s in self.stages if s.grad_sync == "microbatch"]
        if not every or self.num_microbatches == 1:
            reduced = "its gradients reduce-scattered once"
        elif len(every) == self.num_stages:
            reduced = (f"its gradients reduce-scattered every micro-batch ({self.num_microbatches} times a step, "
                       "accumulated sharded)")
        else:
            reduced = (f"its gradients reduce-scattered once (accumulated unsharded), but stages {every}'s every "
                       f"micro-batch ({self.num_microbatches} times a step, accumulated sharded)")
        why = f" ({self.grad_sync_note})" if self.grad_sync_note else ""
        return (f"data parallel: {d} {self.layout.sharding}-sharded replicas (FSDP2): each stage's weights "
                f"all-gathered{dtype} {count} time{'s' if count != '1' else ''} a step, {reduced}: {times}{why}")

    @property
    def static_shape_stages(self) -> tuple[int, ...]:
        """The stages that compile with static shapes, one graph per micro-batch size: those holding
        tensor-parallel blocks (DTensor takes no symbolic batch through head-sharded attention;
        replica.parallel.compile)."""
        if self.tensor_parallel_size <= 1:
            return ()
        return tuple(s.stage_index for s in self.stages if self.blocks_of(s.stage_index))

    @property
    def expert_parallel_stages(self) -> tuple[int, ...]:
        """The stages holding an MoE layer whose experts are spread over an expert group (ep > 1)."""
        if self.layout.expert_parallel_size <= 1 or not self.experts:
            return ()
        return tuple(s.stage_index for s in self.stages if any(b.exit in s.node_names for b in self.experts))

    @property
    def compile_said(self) -> str:
        """:attr:`compile_line` where there is something to say (compiled, or off for a reason), else "":
        what the summary and the HTML report print."""
        return self.compile_line if self.compile or self.compile_note else ""

    @property
    def compile_line(self) -> str:
        """One line on compilation: on or off, and why."""
        if not self.compile:
            return f"compile: off ({self.compile_note})" if self.compile_note else "compile: off"
        split = " zero-bubble stages run each deferred linear eagerly between their compiled graphs (its weight " \
                "gradient is computed by a W action);" if self.layout.kind.splits_backward else ""
        static = list(self.static_shape_stages)
        tp = f" stages {static} compile each micro-batch size once (static shapes: DTensor's sharding rules take " \
             "no symbolic batch flattened with the heads in attention's matmuls);" if static else ""
        experts = f" stages {list(self.expert_parallel_stages)} run each expert-parallel layer eagerly between " \
            "compiled graphs: its all-to-all dispatch has data-dependent sizes;" if self.expert_parallel_stages else ""
        float8 = " the linears in float8 (torchao);" if self.float8 else ""
        fsdp = " FSDP2's per-block units run their hooks eagerly between compiled graphs;" \
            if self.layout.sharded and self.data_parallel_size > 1 else ""
        dims = "shapes static in every stage" if len(static) == self.num_stages else "the batch dim dynamic"
        return (f"compile: every stage through torch.compile ({self.compile_note}), {dims};{split}{tp}"
                f"{experts}"
                f"{fsdp}{float8} checkpointed blocks compiled inside their checkpoint")

    @property
    def tensor_parallel_size(self) -> int:
        return self.layout.tensor_parallel_size

    def blocks_of(self, stage_index: int) -> tuple[ShardedBlock, ...]:
        """The tensor-parallel blocks stage ``stage_index`` holds (a block is never cut by the pipeline)."""
        names = set(self.stages[stage_index].node_names)
        return tuple(b for b in self.tensor_parallel if b.nodes[0] in names)

    @property
    def tensor_parallel_note(self) -> str:
        """One line on the tensor-parallel ranks and their collectives ("" with one rank per stage)."""
        t = self.tensor_parallel_size
        if t == 1:
            return ""
        if not self.tensor_parallel:
            return (f"tensor parallel: {t} ranks per stage, but no block of the graph can be cut {t} ways: "
                    "every rank computes its whole stage")
        kinds: dict[str, int] = {}
        for b in self.tensor_parallel:
            kinds[b.kind] = kinds.get(b.kind, 0) + 1
        cut = ", ".join(f"{n} {kind}{'s' if n != 1 and kind != 'attention' else ''}" for kind, n in kinds.items())
        busiest = max(self.stages, key=lambda s: s.tensor_parallel_s)
        if self.layout.sequence_parallel:
            sequence = (f"; sequence parallel: {len(self.sequence_shards)} values between blocks hold 1/{t} of the "
                        "tokens (exits reduce-scatter, entries all-gather)" if self.sequence_shards else
                        "; sequence parallel, but no value between blocks is a (batch, tokens, features) tensor: "
                        "the exits all-reduce as without it")
        else:
            sequence = ""
        return (f"tensor parallel: {t} ranks per stage, {cut} cut across them; their collectives (all-reduces, "
                f"all-gathers, not overlapped) on the busiest stage ({busiest.stage_index}): "
                f"{_bytes(busiest.tensor_parallel_bytes)} in {_seconds(busiest.tensor_parallel_s)} a step{sequence}")

    @property
    def expert_parallel_note(self) -> str:
        """One line on the experts: how many MoE layers, over how many replicas, at what price ("" without)."""
        if not self.experts:
            return ""
        e = self.layout.expert_parallel_size
        counts = sorted({b.num_experts for b in self.experts})
        plural = "s" if len(self.experts) > 1 else ""
        layers = f"{len(self.experts)} MoE layer{plural} of {'/'.join(map(str, counts))} experts"
        if e == 1:
            return f"experts: {layers}, every replica holds all of them"
        return (f"expert parallel: {layers} spread over {e} replicas ({counts[0] // e} experts each); all-to-all "
                f"{_bytes(self.expert_parallel_bytes)} sent in {_seconds(self.expert_parallel_s)} a step by the "
                f"busiest rank; routing imbalance {self.expert_imbalance:.2f} on the example batch")

    def stage_of(self, node_name: str) -> int:
        for s in self.stages:
            if node_name in s.node_names:
                return s.stage_index
        raise KeyError(node_name)

    # --- JSON ------------------------------------------------------------------------
    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps({"format": PLAN_FORMAT, **asdict(self)}, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data: dict[str, Any] = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"not a Replica plan: invalid JSON ({exc})") from exc
        version = data.pop("format", None) if isinstance(data, dict) else None
        if version not in (1, PLAN_FORMAT):
            raise ConfigError(f"not a Replica plan of format {PLAN_FORMAT}; re-create it with replica.plan(...)")

        def boundary(d: dict[str, Any]) -> BoundaryTensor:
            return BoundaryTensor(
                d["name"], d["source_stage"], tuple(d["destination_stages"]),
                None if d["shape"] is None else tuple(d["shape"]), d["dtype"], d["nbytes"],
            )

        try:
            stages = tuple(
                StagePlan(
                    stage_index=s["stage_index"], node_names=tuple(s["node_names"]),
                    parameter_names=tuple(s["parameter_names"]), forward_time_s=s["forward_time_s"],
                    backward_time_s=s["backward_time_s"], communication_time_s=s["communication_time_s"],
                    memory=MemoryBreakdown(**s["memory"]), inputs=tuple(boundary(b) for b in s["inputs"]),
                    outputs=tuple(boundary(b) for b in s["outputs"]), module_paths=tuple(s["module_paths"]),
                    num_ops=s.get("num_ops", 0), device=s.get("device", ""),
                    activation_bytes=s.get("activation_bytes", 0),
                    fixed_forward_s=s.get("fixed_forward_s", 0.0), fixed_backward_s=s.get("fixed_backward_s", 0.0),
                    collective_s=s.get("collective_s", 0.0), exposed_collective_s=s.get("exposed_collective_s", 0.0),
                    gathers=s.get("gathers", 0), tensor_parallel_s=s.get("tensor_parallel_s", 0.0),
                    tensor_parallel_bytes=s.get("tensor_parallel_bytes", 0),
                    recompute=s.get("recompute", False), blocks=tuple(s.get("blocks", ())),
                    recompute_bytes=s.get("recompute_bytes", 0), in_flight=s.get("in_flight", 1),
                    weight_grad_bytes=s.get("weight_grad_bytes", 0), grad_sync=s.get("grad_sync", "step"),
                )
                for s in data.pop("stages")
            )
            data["tied_parameters"] = {k: tuple(v) for k, v in data["tied_parameters"].items()}
            data["alternatives"] = tuple((str(a), float(t)) for a, t in data.get("alternatives", ()))
            data["microbatch_shares"] = tuple(float(x) for x in data.get("microbatch_shares", ()))
            data["rebuilds"] = tuple((int(k), str(kind)) for k, kind in data.get("rebuilds", ()))
            data["dynamic_dims"] = tuple(tuple(int(d) for d in dims) for dims in data.get("dynamic_dims", ()))
            data["actions"] = tuple(tuple(str(a) for a in actions) for actions in data.get("actions", ()))
            data["action_starts"] = tuple(tuple(float(t) for t in starts) for starts in data.get("action_starts", ()))
            data["tensor_parallel"] = tuple(ShardedBlock.from_dict(b) for b in data.get("tensor_parallel", ()))
            data["sequence_shards"] = tuple((str(n), int(d)) for n, d in data.get("sequence_shards", ()))
            data["experts"] = tuple(ExpertBlock.from_dict(b) for b in data.get("experts", ()))
            if version == 1:  # the layout's figures stood at the top
                ranks = data.pop("pipeline_ranks", 0) or data["num_stages"]
                data["layout"] = {"schedule": data.pop("schedule"), "num_stages": data.pop("num_stages"),
                                  "pipeline_ranks": ranks, "data_parallel_size": data.pop("data_parallel_size", 1)}
            data["layout"] = Layout(**data["layout"])
            return cls(stages=stages, **data)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"not a complete Replica plan ({type(exc).__name__}: {exc}); re-create it with replica.plan(...)"
            ) from exc

    # --- text ------------------------------------------------------------------------
    def summary(self) -> str:
        """A compact table: stages, ops, parameters, time, memory, balance."""
        from rich.console import Console
        from rich.table import Table

        names = {"activation": "GELU", "norm": "LayerNorm"}
        rebuild = ", rebuilding GELU outputs" if self.pointwise_recompute else ""
        if self.rebuilds and not self.pointwise_recompute:
            order = list(names)
            kinds = sorted({c for _, c in self.rebuilds}, key=lambda c: (order.index(c) if c in order else 9, c))
            rebuild = ", rebuilding " + ", ".join(
                f"{names.get(kind, kind)} outputs on stages {[k for k, c in self.rebuilds if c == kind]}"
                for kind in kinds)
        tensor = f" × {self.tensor_parallel_size} tensor-parallel ranks" if self.tensor_parallel_size > 1 else ""
        table = Table(title=(
            f"{self.model_name}: {self.num_stages} stages{tensor} × {self.data_parallel_size} "
            f"{self.layout.sharding + '-sharded ' if self.layout.sharded else ''}"
            f"replica{'s' if self.data_parallel_size != 1 else ''}, "
            f"{self.num_microbatches} micro-batches, {self.schedule}"
            f"{self.recompute_title}{rebuild}, on {self.device}"
        ), title_justify="left")
        checkpointing = any(s.recompute is not False and s.recompute != 0 for s in self.stages)
        columns = ("stage", "ops", "params", "modules", "fwd+bwd", "comm", "memory",
                   *(("recompute",) if checkpointing else ()), "sends")
        for col in columns:
            table.add_column(col, justify="left" if col in ("modules", "sends") else "right")
        for s in self.stages:
            table.add_row(
                str(s.stage_index), str(s.num_ops), _bytes(s.memory.parameters),
                _span(s.module_paths), _seconds(s.forward_time_s + s.backward_time_s),
                _seconds(s.communication_time_s), _bytes(s.predicted_memory_bytes),
                *((s.recompute_note,) if checkpointing else ()),
                ", ".join(f"{_sent(b)}→{'/'.join(map(str, b.destination_stages))}" for b in s.outputs[:3])
                + (" …" if len(s.outputs) > 3 else ""),
            )
        out = io.StringIO()
        Console(file=out, width=120, force_terminal=False, color_system=None).print(table)
        lines = ["\n".join(line.rstrip() for line in out.getvalue().rstrip().splitlines())]
        lines.append(
            f"predicted step {_seconds(self.predicted_step_time_s)}, bottleneck stage "
            f"{_seconds(self.bottleneck_s)}, balance {self.balance:.2f} (1.00 = perfect), "
            f"bubble {self.bubble_fraction:.0%}"
        )
        lines.append(self.precision_note)
        if self.compile_said:
            lines.append(self.compile_said)
        if self.tensor_parallel_note:
            lines.append(self.tensor_parallel_note)
        if self.data_parallel_note:
            lines.append(self.data_parallel_note)
        if self.expert_parallel_note:
            lines.append(self.expert_parallel_note)
        if self.microbatch_shares:
            share = " / ".join(f"{x:.0%}" for x in self.microbatch_shares)
            lines.append(f"graded micro-batches (shares of the batch, in order): {share}")
        if not self.exact:
            gap = self.bottleneck_s / self.lower_bound_s - 1 if self.lower_bound_s > 0 else float("nan")
            lines.append(f"large graph: cut at its cheapest candidate points; bottleneck within {gap:.1%} "
                         "of the lower bound (total / stages, or the costliest op)")
        if self.model_flops and self.predicted_step_time_s > 0:
            devices = self.layout.world_size
            per_device = self.model_flops / self.predicted_step_time_s / max(1, devices)
            mfu = (f", {per_device / self.device_peak_flops:.0%} model-FLOPs utilisation"
                   if self.device_peak_flops else "")
            lines.append(f"predicted {format_flop_rate(per_device)} per device{mfu}")
        if self.dynamic_dims:
            lines.append("dynamic dims per input (others fixed by torch.export): " + "; ".join(
                f"input {i}: {', '.join(map(str, dims)) or 'none'}" for i, dims in enumerate(self.dynamic_dims)))
        if self.alternatives:
            lines.append("next best: " + "; ".join(f"{d} ({_seconds(t)})" for d, t in self.alternatives[:3]))
        for name, aliases in self.tied_parameters.items():
            holders = [s.stage_index for s in self.stages if name in s.parameter_names]
            if len(holders) > 1:
                lines.append(f"tied: {name} = {', '.join(aliases)} held by stages {holders}, gradients summed")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _span(paths: tuple[str, ...]) -> str:
    if not paths:
        return "-"
    return paths[0] if len(paths) == 1 else f"{paths[0]} … {paths[-1]}"


def _sent(b: BoundaryTensor) -> str:
    """A send's size; a Python number (a size from the batch's shape, a flag) has none in bytes."""
    return _bytes(b.nbytes) if b.shape is not None else "a number"


def _bytes(n: float) -> str:
    return format_bytes(n, ".1f")


def _seconds(s: float) -> str:
    return format_seconds(s)
