"""The front door: ``plan`` and ``auto_parallel`` trace the model and ask the planner, with the same arguments."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from replica.errors import ConfigError, PipelineError, ReplicaError
from replica.materialize import check_initializable
from replica.meta import materialize_own_stages, ready_for_runtime
from replica.partition.plan import Plan
from replica.partition.trace import Traced, trace
from replica.pipeline_model import PipelineModel, released
from replica.planner import make_plan
from replica.planner.agree import agree_on_plan, use_the_model_device
from replica.planner.request import PlanningOptions, PlanRequest, split_planning, with_planning_signature
from replica.precision import precision_name
from replica.process_group import ensure_process_group, launched_world_size
from replica.runtime.local import LossFn

__all__ = ["auto_parallel", "plan", "PipelineModel"]

_PLANNING_DOC = """
    Planning keywords (the same for ``plan``, ``auto_parallel`` and ``replica.defaults.TrainerConfig``,
    defined once by :class:`replica.planner.PlanningOptions`; None leaves the choice to the planner):
    """ + (PlanningOptions.__doc__ or "").split("\n\n", 1)[-1]


@with_planning_signature
def plan(
    model: torch.nn.Module,
    example_inputs: Any = (),
    *,
    example_kwargs: dict[str, Any] | None = None,
    world_size: int | None = None,
    **planning: Any,
) -> Plan:
    """Plan only: trace ``model`` (meta tensors welcome), price it on ``device`` and lay it out
    on ``world_size`` devices (None: one process running every stage, as ``auto_parallel``
    without a process group). ``auto_parallel`` with the same arguments on that world
    makes the same plan. Under a launcher (``torchrun``: ``WORLD_SIZE > 1``, or a started process
    group of several) ``world_size`` None is that world, as ``auto_parallel`` there lays it out.
    """
    if world_size is None:
        world_size = _launched_world()
    request = PlanRequest(world_size=world_size, **split_planning(planning, "replica.plan"))
    return make_plan(_trace(model, example_inputs, example_kwargs, request), model, request)


def _launched_world() -> int | None:
    """The world ``auto_parallel`` would run in here: a started group's size, else the launcher's."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else launched_world_size()
    return world if world > 1 else None


def _trace(model: torch.nn.Module, example_inputs: Any, example_kwargs: dict[str, Any] | None,
           request: PlanningOptions, tracer: str | None = None) -> Traced:
    return trace(model, example_inputs, example_kwargs=example_kwargs, leaf_modules=request.leaf_modules,
                 tracer=tracer or request.tracer, dynamic_dims=request.dynamic_dims)


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


# planning keywords a plan does not record: with plan= given, nothing is planned, so they do nothing
_PLANNING_ONLY = ("device", "cost", "memory_budget", "optimizer", "graded_microbatches", "options")


def _planned(given: Plan, name: str) -> Any:
    """What ``given`` decided for the planning keyword ``name`` (None: it records nothing)."""
    layout = given.layout
    return {
        "num_stages": given.num_stages, "num_microbatches": given.num_microbatches, "schedule": given.schedule,
        "data_parallel_size": given.data_parallel_size, "tensor_parallel_size": layout.tensor_parallel_size,
        "sharded_data_parallel": layout.sharding, "shard_group_size": layout.dp_shard,
        "sequence_parallel": layout.sequence_parallel, "expert_parallel_size": layout.expert_parallel_size,
        "mixed_precision": given.precision, "compile": given.compile, "float8": given.float8,
        "recompute": "pointwise" if given.pointwise_recompute else given.recompute,
        "grad_sync": (syncs.pop() if len(syncs := {s.grad_sync for s in given.stages}) == 1 else "mixed")
        if layout.sharded else None,
    }.get(name)


def _agrees(name: str, asked: Any, planned: Any) -> bool:
    if name == "schedule":
        return asked == "auto" or asked == planned
    if name == "sharded_data_parallel":
        return planned == asked if isinstance(asked, str) else (planned != "none") == asked
    if name == "mixed_precision":
        return precision_name(asked) == planned
    return asked == planned


def _check_given_plan(given: Plan, world: int, asked: dict[str, Any]) -> None:
    """A plan passed in must agree with every planning keyword also given, and fit this world."""
    for name, value in asked.items():
        if value is None or name in ("tracer", "dynamic_dims", "leaf_modules", "batch"):
            continue  # how to trace again, and what the steps are fed: not planning decisions
        if name in _PLANNING_ONLY:
            raise ConfigError(
                f"{name}={value!r} is an input to planning, but a plan was passed in (plan=), so nothing is planned "
                f"and {name} would do nothing; leave {name} out, or re-plan with it (replica.plan(..., {name}=...))"
            )
        planned = _planned(given, name)
        if not _agrees(name, value, planned):
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


@with_planning_signature
def auto_parallel(
    model: torch.nn.Module,
    example_inputs: Any = (),
    *,
    example_kwargs: dict[str, Any] | None = None,
    loss_fn: LossFn | None = None,
    loss_reduction: str = "mean",
    deferred_batchnorm: bool = True,
    plan: Plan | None = None,
    timeout_s: float = 300.0,
    init: Callable[[torch.nn.Module], None] | None = None,
    weights: str | os.PathLike[str] | None = None,
    grad_dtype: torch.dtype | None = None,
    **planning: Any,
) -> PipelineModel:
    """Trace, plan and split ``model`` into a pipeline, and return it ready to train.

    In one process every stage runs here (the reference runtime). Under ``torch.distributed``
    (``torchrun``; a process group not started yet is started here from the launcher's
    environment, NCCL for a CUDA model, else gloo) every rank calls this alike, with the same
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
    if released(model):
        raise ConfigError(
            f"this {type(model).__name__} already went through a distributed auto_parallel on this rank, which "
            "freed the weights of the stages other ranks hold. Build (or load) the model again before "
            "pipelining it again, or keep using the first PipelineModel."
        )
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
    # under torchrun with no process group yet: start it (never train as one of several independent worlds of 1)
    world = ensure_process_group("replica.auto_parallel", next(model.parameters()).device, timeout_s=timeout_s)
    planning = split_planning(planning, "replica.auto_parallel")
    if plan is not None:
        _check_given_plan(plan, world, planning)
        request: PlanningOptions = PlanningOptions(**planning)
    else:
        request = PlanRequest(world_size=None if world == 1 else world, **planning)
    traced = _trace(model, example_inputs, example_kwargs, request)
    if world > 1:
        use_the_model_device(model)
    failed: ReplicaError | None = None  # rank 0's, handed to every rank: the same error everywhere, no hang
    if plan is None and (world == 1 or dist.get_rank() == 0):
        assert isinstance(request, PlanRequest)
        try:
            plan = make_plan(traced, model, request)
        except ReplicaError as exc:
            if world == 1:
                raise
            failed = exc
    try:
        if world > 1:
            plan, seed = agree_on_plan(plan, traced, seed, failed=failed)
        assert plan is not None
        device = None
        if on_meta:
            assert seed is not None
            device = materialize_own_stages(model, plan, world, init, weights, seed)
            traced = ready_for_runtime(traced, model, device,
                                       lambda: _trace(model, example_inputs, example_kwargs, request, tracer="fx"))
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
