"""The front door: ``plan`` and ``auto_parallel`` trace the model and ask the planner, with the same arguments."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from replica.errors import ConfigError, PipelineError
from replica.materialize import check_initializable
from replica.meta import materialize_own_stages, ready_for_runtime
from replica.partition.plan import Plan
from replica.partition.trace import trace
from replica.pipeline_model import PipelineModel
from replica.planner import PlannerOptions, PlanRequest, make_plan
from replica.planner.agree import agree_on_plan, distributed, use_the_model_device
from replica.precision import precision_name
from replica.runtime.local import LossFn

__all__ = ["auto_parallel", "plan", "PipelineModel"]

_PLANNING_DOC = """
    Planning arguments (the same for ``plan`` and ``auto_parallel``; None leaves the choice to
    the planner): ``num_stages``, ``num_microbatches`` (per replica), ``schedule`` (a name, or
    ``"auto"`` to let the tuner pick; None is ``"1f1b"``), ``data_parallel_size``,
    ``tensor_parallel_size`` (the ranks each stage's layers are cut across, Megatron-style: the
    planner finds the MLPs, attention heads, token embedding and head it can cut in the traced
    graph, and DTensor computes them, exactly; everything else runs whole on each of them.
    None: the tuner decides, within a node; 1: off. It runs only across processes),
    ``device`` (a preset name, a ``DeviceSpec``, or one per stage), ``cost`` (``"profile"``
    times every op here on real tensors, ``"analytic"`` prices FLOPs and bytes on
    ``device``'s spec, ``"auto"`` profiles when the model and inputs are real and no other
    ``device`` is named), ``memory_budget`` (bytes per device, or one per stage; default
    the device's memory when planning analytically), ``optimizer`` (what the memory model counts per parameter),
    ``mixed_precision`` (None: fp32, or rather the weights' own dtype; ``"bf16"`` / ``"fp16"``:
    autocast, priced at the device's half-precision rate and sizes), ``sharded_data_parallel``
    (True: the data-parallel replicas shard their stages' weights, gradients and optimizer
    state with torch's FSDP2, ``"zero3"`` or ``"zero2"`` as the planner prices them, or that one
    named; False: each holds a whole copy; None: the planner decides),
    ``recompute`` (True:
    keep only stage inputs and run the forward again in backward; ``"pointwise"``: rebuild
    GELU / SiLU outputs in backward on the stages that hold several micro-batches; None:
    the tuner decides, and stages rebuild GELU / SiLU / LayerNorm outputs where that is as
    good as free or pays for graded micro-batches; False: neither), ``tracer`` (``"fx"``,
    ``"export"`` or ``"auto"``: fx, then ``torch.export``), ``dynamic_dims`` (which input dims
    an exported graph leaves dynamic: ``"auto"``, ``"batch"`` or ``"all"``, see
    ``replica.partition.trace.trace``), ``graded_microbatches``
    (smaller micro-batches where the pipeline fills and drains, when the simulator says the
    step gets at least ``options.min_gain`` shorter; gradients stay exact), ``options``
    (:class:`replica.PlannerOptions`: the planner's thresholds) and ``batch``:
    ``"global"`` (the default: ``example_inputs`` and every step take the batch the plain
    model would, on every rank; each data-parallel replica trains its slice) or
    ``"per_rank"`` (each replica is fed its own batch, e.g. by a loader that shards per
    rank; the number of replicas must then be fixed by ``data_parallel_size`` or
    ``num_stages``).
"""


def plan(
    model: torch.nn.Module,
    example_inputs: Any = (),
    *,
    example_kwargs: dict[str, Any] | None = None,
    world_size: int | None = None,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    schedule: str | None = None,
    data_parallel_size: int | None = None,
    tensor_parallel_size: int | None = None,
    device: Any = None,
    leaf_modules: Iterable[type | str | torch.nn.Module] = (),
    cost: str = "auto",
    memory_budget: float | Sequence[float] | None = None,
    optimizer: str = "adam",
    mixed_precision: str | None = None,
    sharded_data_parallel: bool | str | None = None,
    recompute: bool | str | None = None,
    tracer: str = "auto",
    dynamic_dims: str = "auto",
    graded_microbatches: bool = True,
    options: PlannerOptions | None = None,
    batch: str = "global",
) -> Plan:
    """Plan only: trace ``model`` (meta tensors welcome), price it on ``device`` and lay it out
    on ``world_size`` devices (None: one process running every stage, as ``auto_parallel``
    without a process group). ``auto_parallel`` with the same arguments on that world
    makes the same plan.
    """
    request = PlanRequest(
        world_size=world_size, num_stages=num_stages, num_microbatches=num_microbatches, schedule=schedule,
        data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size, device=device, cost=cost,
        memory_budget=memory_budget, recompute=recompute, graded_microbatches=graded_microbatches,
        optimizer=optimizer, precision=precision_name(mixed_precision), sharded_data_parallel=sharded_data_parallel,
        batch=batch,
        options=options or PlannerOptions())
    traced = trace(model, example_inputs, example_kwargs=example_kwargs, leaf_modules=leaf_modules, tracer=tracer,
                   dynamic_dims=dynamic_dims)
    return make_plan(traced, model, request)


plan.__doc__ = (plan.__doc__ or "") + _PLANNING_DOC


def _check_grad_dtype(grad_dtype: Any) -> None:
    if grad_dtype is None:
        return
    if not (isinstance(grad_dtype, torch.dtype) and grad_dtype.is_floating_point):
        raise ConfigError(f"grad_dtype must be a floating torch.dtype (e.g. torch.float32) or None (the weights' "
                          f"own dtype), got {grad_dtype!r}")
    if not hasattr(torch.Tensor, "grad_dtype"):
        raise ConfigError(f"grad_dtype={grad_dtype} needs Tensor.grad_dtype, which torch {torch.__version__} lacks; "
                          "upgrade torch, or leave grad_dtype=None (gradients in the weights' dtype)")


def _check_given_plan(given: Plan, world: int, **asked: Any) -> None:
    """A plan passed in must agree with what else was asked and fit this world."""
    for name, value in asked.items():
        planned = getattr(given, name)
        if value is not None and value != planned:
            raise ConfigError(
                f"{name}={value!r} disagrees with the plan passed in, which has {name}={planned!r}; "
                f"leave {name} out to use the plan's, or re-plan"
            )
    if world == 1 and given.data_parallel_size > 1:
        raise ConfigError(
            f"the plan passed in has {given.data_parallel_size} data-parallel replicas ({given.layout.describe()}), "
            f"which need a process group of {given.layout.world_size} (torchrun); in one process use a plan "
            "made without world_size (replica.plan(model, inputs, num_stages=...))"
        )
    if world > 1 and given.layout.world_size != world:
        raise ConfigError(
            f"the plan passed in lays out {given.layout.world_size} processes ({given.layout.describe()}) but this "
            f"process group has {world}; re-plan with world_size={world}"
        )


def auto_parallel(
    model: torch.nn.Module,
    example_inputs: Any = (),
    *,
    example_kwargs: dict[str, Any] | None = None,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    schedule: str | None = None,
    data_parallel_size: int | None = None,
    tensor_parallel_size: int | None = None,
    device: Any = None,
    leaf_modules: Iterable[type | str] = (),
    cost: str = "auto",
    memory_budget: float | Sequence[float] | None = None,
    optimizer: str = "adam",
    mixed_precision: str | None = None,
    sharded_data_parallel: bool | str | None = None,
    recompute: bool | str | None = None,
    tracer: str = "auto",
    dynamic_dims: str = "auto",
    graded_microbatches: bool = True,
    options: PlannerOptions | None = None,
    batch: str = "global",
    loss_fn: LossFn | None = None,
    loss_reduction: str = "mean",
    deferred_batchnorm: bool = True,
    plan: Plan | None = None,
    timeout_s: float = 300.0,
    init: Callable[[torch.nn.Module], None] | None = None,
    weights: str | os.PathLike[str] | None = None,
    grad_dtype: torch.dtype | None = None,
) -> PipelineModel:
    """Trace, plan and split ``model`` into a pipeline, and return it ready to train.

    In one process every stage runs here (the reference runtime). Under ``torch.distributed``
    (``torchrun``, or ``init_process_group``) every rank calls this alike, with the same
    inputs: rank 0 plans for the whole world (pipeline ranks × data-parallel replicas),
    every rank checks it traced the same graph, and each keeps only its own stages.

    ``loss_fn(output, target)`` must return a micro-batch's loss reduced as
    ``loss_reduction`` says (``"mean"``, the default of torch's losses, or ``"sum"``); the
    pipeline weighs micro-batches so the gradient equals the whole batch's.
    ``deferred_batchnorm`` (default True) updates BatchNorm running statistics once a step
    from every micro-batch's sums, as the plain model's whole-batch forward would (each
    micro-batch still normalizes with its own statistics). ``plan`` reuses
    a plan (e.g. ``Plan.from_json``) instead of planning again. ``timeout_s`` bounds every
    wait on another rank.

    A model built on meta (``with torch.device("meta"):``, or ``with replica.deferred_init():``
    for real buffers) is planned without its weights; then each rank allocates and initializes
    only the parameters and buffers of its own stages (in one process: all of them), on the
    CPU (NCCL: this rank's current GPU), as :func:`replica.materialize` would under the same
    seed: each module's ``reset_parameters()``, then ``init(module)`` when given; with
    ``weights`` (a ``.safetensors`` file, a Hugging Face directory or a Replica checkpoint) the
    saved tensors are then loaded by name. The seed is one draw from torch's generator on rank 0,
    shared with the plan, so the weights do not depend on the layout. The other stages'
    tensors stay on meta and are never allocated.

    ``mixed_precision="bf16"`` (or ``"fp16"``) runs every stage's forward and the loss under
    ``torch.autocast`` in that dtype, the weights and optimizer staying in theirs (torch's AMP
    recipe); a ``torch.autocast`` of your own around ``train_step`` means the same. fp16 needs
    loss scaling: ``pm.train_step(x, y, scaler=replica.GradScaler())``. A model whose weights
    are themselves bf16 or fp16 computes in them; its gradients are in that dtype too, as in
    plain torch, unless ``grad_dtype=torch.float32`` accumulates them (over micro-batches and
    steps) in fp32 (``Tensor.grad_dtype``).
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not any(True for _ in model.parameters()):
        raise ConfigError(
            f"{type(model).__name__} has no parameters: there is nothing to train, so nothing to pipeline. "
            "Pass the model that owns the weights (or run it directly)."
        )
    if getattr(model, "_replica_released", False):
        raise ConfigError(
            f"this {type(model).__name__} already went through a distributed auto_parallel on this rank, which "
            "freed the weights of the stages other ranks hold. Build (or load) the model again before "
            "pipelining it again, or keep using the first PipelineModel."
        )
    precision = precision_name(mixed_precision)
    _check_grad_dtype(grad_dtype)
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(f"loss_fn must be callable(output, target) -> scalar tensor, got {type(loss_fn).__name__}")
    if loss_reduction not in ("mean", "sum"):
        raise ConfigError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    if not isinstance(deferred_batchnorm, bool):
        raise ConfigError(f"deferred_batchnorm must be True or False, got {deferred_batchnorm!r}")
    if not timeout_s > 0:
        raise ConfigError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    if not on_meta and (init is not None or weights is not None):
        given = " and ".join(n for n, v in (("init=", init), ("weights=", weights)) if v is not None)
        raise ConfigError(
            f"{given} initialize or load a model built on meta, but {type(model).__name__} has no tensor on the "
            "meta device: its weights are already real. Build it under `with torch.device('meta'):` or "
            "`with replica.deferred_init():` to have each rank allocate only its own stages, or drop " + given
        )
    if init is not None and not callable(init):
        raise ConfigError(f"init must be callable(module) -> None, applied to each module, got {type(init).__name__}")
    if on_meta and init is None and weights is None:
        check_initializable(model)  # before planning, not after
    # the same draw on every rank (rank 0's reaches the others with the plan): the weights are
    # those replica.materialize gives under the same torch.manual_seed, whatever the layout
    seed = int(torch.randint(2**62, ()).item()) if on_meta else None
    world = dist.get_world_size() if distributed() else 1
    if plan is not None:
        _check_given_plan(plan, world, num_stages=num_stages, num_microbatches=num_microbatches,
                          schedule=None if schedule is None else str(schedule).lower(),
                          data_parallel_size=data_parallel_size,
                          precision=None if mixed_precision is None else precision)
        schedule = plan.schedule
    request = PlanRequest(
        world_size=None if world == 1 else world, num_stages=num_stages, num_microbatches=num_microbatches,
        schedule=schedule, data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
        device=device, cost=cost, memory_budget=memory_budget, recompute=recompute,
        graded_microbatches=graded_microbatches, optimizer=optimizer, precision=precision,
        sharded_data_parallel=sharded_data_parallel, batch=batch,
        options=options or PlannerOptions())
    traced = trace(model, example_inputs, example_kwargs=example_kwargs, leaf_modules=leaf_modules, tracer=tracer,
                   dynamic_dims=dynamic_dims)
    if world > 1:
        use_the_model_device(model)
    if plan is None and (world == 1 or dist.get_rank() == 0):
        plan = make_plan(traced, model, request)
    elif plan is not None and recompute == "pointwise" and not plan.recompute:
        plan = dataclasses.replace(plan, pointwise_recompute=True)
    try:
        if world > 1:
            plan, seed = agree_on_plan(plan, traced, seed)
        assert plan is not None
        device = None
        if on_meta:
            assert seed is not None
            device = materialize_own_stages(model, plan, world, init, weights, seed)
            traced = ready_for_runtime(traced, model, device, lambda: trace(
                model, example_inputs, example_kwargs=example_kwargs, leaf_modules=leaf_modules, tracer="fx",
                dynamic_dims=dynamic_dims))
        return PipelineModel(model, traced, plan, loss_fn=loss_fn, loss_reduction=loss_reduction,
                             batch=request.batch, deferred_batchnorm=deferred_batchnorm, timeout_s=timeout_s,
                             device=device, grad_dtype=grad_dtype)
    except RuntimeError as exc:  # a collective of the set-up failed: a peer died or hung
        raise PipelineError(
            f"setting up the pipeline on rank {dist.get_rank()} of {world} failed while the ranks exchanged the "
            f"plan and built their process groups: {type(exc).__name__}: {str(exc).splitlines()[0]}. Another "
            "rank died, hung, or never called auto_parallel."
        ) from exc


auto_parallel.__doc__ = (auto_parallel.__doc__ or "") + _PLANNING_DOC
