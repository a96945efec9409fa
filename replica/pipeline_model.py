"""``PipelineModel``: a model cut into stages, called like the model and trained by ``train_step``."""

from __future__ import annotations

import datetime
import weakref
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from replica.amp import GradScaler
from replica.errors import ConfigError, PipelineError
from replica.parallel.fsdp import full_tensor
from replica.parallel.mesh import ParallelMesh, build_mesh
from replica.parallel.parallelize import parallelize
from replica.partition.modes import following, frozen_mode_ops
from replica.partition.plan import Plan
from replica.partition.split import StageModule, split
from replica.partition.trace import Traced
from replica.precision import ambient_autocast, autocast_dtype
from replica.runtime import microbatch
from replica.runtime.distributed import DistributedRuntime
from replica.runtime.local import LocalRuntime, LossFn
from replica.runtime.shapes import ShapeOracle
from replica.schedules.schedule import plan_schedule  # plan_schedule: re-exported
from replica.schedules.simulate import Timeline
from replica.stage.batchnorm import defer_batchnorm

__all__ = ["PipelineModel", "plan_schedule", "released"]

# the models whose remote stages' weights a distributed PipelineModel freed on this rank
_RELEASED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def released(model: torch.nn.Module) -> bool:
    """Whether a distributed pipeline on this rank freed the weights ``model`` holds for other ranks."""
    return model in _RELEASED


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class PipelineModel:
    """A model cut into pipeline stages; call it like the model, train it with ``train_step``."""

    def __init__(
        self,
        model: torch.nn.Module,
        traced: Traced,
        plan: Plan,
        *,
        loss_fn: LossFn | None,
        loss_reduction: str,
        batch: str = "global",
        deferred_batchnorm: bool = True,
        timeout_s: float,
        device: torch.device | None = None,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.plan = plan
        self.precision = plan.precision
        self.loss_fn = loss_fn
        self.loss_reduction = loss_reduction
        self.batch = batch  # "global": every rank gets the whole batch, each replica takes its slice
        self.input_spec = traced.inputs
        self.graph = traced.graph  # what the plan was made from: the report places every op by it
        self._traced_training = traced.training
        self._frozen_mode = frozen_mode_ops(traced.module)
        self.all_stages: list[StageModule] = split(traced, plan)
        if deferred_batchnorm:
            defer_batchnorm(self.all_stages, plan.num_microbatches)  # running statistics of the whole batch
        self.schedule = plan_schedule(plan)
        self._canonical = {alias: name for name, aliases in plan.tied_parameters.items() for alias in aliases}
        distributed = _distributed()
        tp = plan.layout.tensor_parallel_size
        if not distributed and tp > 1:
            raise ConfigError(
                f"this plan cuts layers across {tp} tensor-parallel ranks ({plan.layout.describe()}): it runs only "
                f"across processes; launch {plan.layout.world_size} of them with torchrun, or plan with "
                "tensor_parallel_size=1"
            )
        mesh: ParallelMesh | None = None
        if distributed:
            if device is None:  # a materialized meta model names its own: the rest of it stays on meta
                device = next(model.parameters()).device
            mesh = build_mesh(plan.layout, device.type, datetime.timedelta(seconds=timeout_s))
            sharded = plan.layout.sharded and plan.data_parallel_size > 1  # gathers weights in autocast's dtype
            # made before any stage is cut: it runs the plain graph on fake copies
            oracle = ShapeOracle(traced.module, plan.stages, device, traced.out_spec,
                                 param_dtype=autocast_dtype(self.precision) if sharded else None)
        # the one ordered step: experts -> TP -> stage rewrites -> (activation checkpointing, compile) -> FSDP2
        flags = parallelize(self.all_stages, plan, self.schedule, mesh, canonical=self._canonical, model=model)
        self.mesh = mesh
        self.runtime: LocalRuntime | DistributedRuntime
        if mesh is not None:
            assert device is not None
            self.runtime = DistributedRuntime(self.all_stages, self.schedule, plan, mesh, flags, oracle,
                                              timeout_s=timeout_s, device=device, recompute=flags.whole_stage,
                                              precision=self.precision)
            self.stages = [s for s in self.all_stages if s.stage_index in self.runtime.stages]
            self.pipeline_rank = mesh.pipeline_rank
            self.data_parallel_rank = mesh.data_parallel_rank
            self.tensor_parallel_rank = mesh.tensor_parallel_rank
            self._release_remote_weights()
        else:
            self.runtime = LocalRuntime(self.all_stages, self.schedule, recompute=flags.whole_stage,
                                        pointwise_recompute=plan.pointwise_recompute,
                                        rebuilds=plan.rebuilds, precision=self.precision)
            self.stages = self.all_stages
            self.pipeline_rank = 0
            self.data_parallel_rank = 0
            self.tensor_parallel_rank = 0
        self.data_parallel_size = plan.data_parallel_size
        self.device = next((p.device for p in self.parameters()), torch.device("cpu"))
        if grad_dtype is not None:
            for p in self.parameters():
                if p.is_floating_point() and p.dtype != grad_dtype:
                    p.grad_dtype = grad_dtype  # autograd and the deferred W accumulate in it

    def _release_remote_weights(self) -> None:
        """Free the storage of every weight no local stage reads: a rank holds only its stages."""
        mine = {id(t) for s in self.stages for t in [*s.module.parameters(), *s.module.buffers()]}
        _RELEASED.add(self.model)  # auto_parallel refuses it again; nothing is written onto the model
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if id(t) not in mine:
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)

    # --- running ---------------------------------------------------------------------
    def _pack(self, inputs: Any, kwargs: dict[str, Any], what: str = "inputs") -> tuple[Any, ...]:
        """The graph's inputs for a call: ``inputs`` a tensor, a tuple or list of them
        (positional), or a dict (keywords, like ``model(**batch)``); ``kwargs`` more keywords."""
        if isinstance(inputs, dict):
            args, kwargs = (), {**inputs, **kwargs}
        else:
            args = inputs if isinstance(inputs, tuple) else tuple(inputs) if isinstance(inputs, list) else (inputs,)
        assert self.input_spec is not None
        return self.input_spec.pack(args, kwargs, what)

    def _microbatches(self, args: tuple[Any, ...], what: str = "inputs") -> list[tuple[Any, ...]]:
        return microbatch.split(args, self.plan.num_microbatches, what, self.plan.microbatch_shares)

    def replica_slice(self, values: Any, what: str = "inputs") -> Any:
        """This data-parallel replica's slice of a global batch: rows ``r·n/d`` to
        ``(r+1)·n/d`` of every batched tensor in ``values`` (replica ``r`` of ``d``). Every
        step of a ``batch="global"`` pipeline takes it by itself; a loader feeding a
        ``batch="per_rank"`` pipeline can shard with it. ``values`` itself with one replica."""
        d, r = self.data_parallel_size, self.data_parallel_rank
        if d == 1:
            return values
        n = microbatch.batch_size([values], what)
        if n < d * self.plan.num_microbatches:
            raise ConfigError(
                f"{what} have a batch of {n} samples, too few for {d} data-parallel replicas × "
                f"{self.plan.num_microbatches} micro-batches ({self.plan.layout.describe()}): feed at least "
                f"{d * self.plan.num_microbatches} samples"
            )
        return microbatch.split([values], d, what)[r][0]

    def _gather_replicas(self, out: Any, total: int) -> Any:
        """Every replica's outputs of a global batch of ``total`` samples, in replica order."""
        assert isinstance(self.runtime, DistributedRuntime) and self.runtime.data_parallel_group is not None
        leaves, spec = tree_flatten(out)
        gathered = []
        for leaf in leaves:
            if not (isinstance(leaf, torch.Tensor) and leaf.dim() > 0):
                gathered.append(leaf)
                continue
            sizes = microbatch.sizes(total, self.data_parallel_size)  # each replica's slice, padded to the largest
            padded = leaf.new_zeros((sizes[0], *leaf.shape[1:]))
            padded[:leaf.shape[0]] = leaf
            parts = [torch.empty_like(padded) for _ in sizes]
            work = dist.all_gather(parts, padded, group=self.runtime.data_parallel_group, async_op=True)
            self.runtime._wait(work, "the other replicas' outputs", "the data-parallel replicas")
            gathered.append(torch.cat([part[:size] for part, size in zip(parts, sizes)]))
        return tree_unflatten(gathered, spec)

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """Pipelined forward, called like the model (positional and keyword inputs as traced);
        the output, in the model's own type, backpropagates into the model like ``model(...)``'s.
        With data-parallel replicas each runs its slice of the batch and every rank returns
        the whole batch's output (``batch="per_rank"``: its replica's). Across processes it is
        inference: call it under ``torch.no_grad()`` and train with :meth:`train_step` (the
        stages on other ranks cannot backpropagate a loss computed here)."""
        if isinstance(self.runtime, DistributedRuntime) and torch.is_grad_enabled():
            raise PipelineError(
                "pm(...) across processes is inference: its output cannot backpropagate into the stages other "
                "ranks hold. Call it under torch.no_grad() (or torch.inference_mode()), and train with "
                "pm.train_step(inputs, target)"
            )
        args = self._pack(inputs, kwargs)
        sliced = self.batch == "global" and self.data_parallel_size > 1
        if sliced:
            total = microbatch.batch_size(args)
            args = self.replica_slice(args)
        self._check_mode()
        with following(self.model):
            out = microbatch.merge(self.runtime.forward(self._microbatches(args)))
        return self._gather_replicas(out, total) if sliced else out

    def train_step(self, inputs: Any, target: Any, *, scaler: Any = None, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of every micro-batch. Each parameter's ``.grad`` receives the
        gradient of the whole batch's loss (accumulated, as ``loss.backward()`` would);
        returns that loss, detached. ``inputs`` are as the model takes them: a tensor, a tuple
        of positional inputs, or a dict of keyword inputs; ``kwargs`` add keyword inputs.

        ``scaler`` (a :class:`replica.GradScaler`, for fp16): each micro-batch's loss is
        scaled by it, as ``scaler.scale(loss).backward()`` would, so ``.grad`` holds the scaled
        gradients for ``scaler.step(optimizer)``; the loss returned is unscaled."""
        step = self._step_arguments(inputs, target, kwargs, "train_step")
        scale = self._loss_scale(scaler)
        if scale is not None:
            step = (*step[:3], [w * scale for w in step[3]])
        with following(self.model):
            loss = self.runtime.train_step(*step).loss
        return loss if scale is None else loss / scale.to(loss.device)

    def _loss_scale(self, scaler: Any) -> torch.Tensor | None:
        """The scaler's current scale on every rank (each rank's scaler must be ready for its
        ``unscale_``, whether or not it computes a loss), or None without one."""
        if scaler is None:
            if self.precision == "fp16" or ambient_autocast(self.device.type) == torch.float16:
                raise ConfigError(
                    "fp16 training needs loss scaling, or small gradients underflow to zero: pass "
                    "pm.train_step(inputs, target, scaler=scaler) with scaler = replica.GradScaler(), then "
                    "scaler.step(optimizer) and scaler.update(); or train in bf16 (mixed_precision='bf16')"
                )
            return None
        if not isinstance(scaler, torch.amp.GradScaler):
            raise ConfigError(f"scaler must be a replica.GradScaler (a torch.amp.GradScaler), got "
                              f"{type(scaler).__name__}")
        if isinstance(self.runtime, DistributedRuntime) and not isinstance(scaler, GradScaler):
            raise ConfigError(
                "across processes the scaler must be a replica.GradScaler: torch's own checks only this rank's "
                "gradients for inf/NaN, so one rank could skip a step that another takes and the replicas drift "
                "apart. Use scaler = replica.GradScaler() (the same arguments)"
            )
        if not scaler.is_enabled():
            return None
        return scaler.scale(torch.ones((), device=self.device))

    def measure_step(self, inputs: Any, target: Any, **kwargs: Any) -> tuple[torch.Tensor, Timeline]:
        """:meth:`train_step` (the same gradients and loss) that also times every action:
        returns ``(loss, timeline)``, the measured :class:`~replica.schedules.simulate.Timeline`
        of this replica's pipeline ranks, on each of them. An action's interval starts when
        its inputs have arrived, so waits for a peer show as idle time; a backward that sends
        its input gradients before its weight gradients reads as a B and a W. Draw it beside
        the plan's prediction with ``replica.visualize(pm, path, measured=timeline)``, or
        write it for chrome://tracing with ``replica.viz.chrome.write_chrome_trace``.
        Distributed, every pipeline rank must call it for the same step (it starts with a
        barrier and ends gathering the ranks' records)."""
        step = self._step_arguments(inputs, target, kwargs, "measure_step")
        with following(self.model):
            result, timeline = self.runtime.measure_step(*step)
        return result.loss, timeline

    def _step_arguments(self, inputs: Any, target: Any, kwargs: dict[str, Any],
                        call: str) -> tuple[list[tuple[Any, ...]], list[Any], LossFn, list[float]]:
        """A training step's micro-batches, their targets, the loss and each one's weight."""
        if self.loss_fn is None:
            raise PipelineError(
                f"{call} needs a loss: pass loss_fn=callable(output, target) -> scalar to "
                "replica.auto_parallel(...), e.g. loss_fn=torch.nn.functional.cross_entropy"
            )
        args = self._pack(inputs, kwargs)
        n_in = microbatch.batch_size(args)
        n_target = microbatch.batch_size([target], "target")
        if n_in != n_target:
            raise ConfigError(f"inputs have a batch of {n_in} samples but target has {n_target}; they must match")
        # The replicas' gradients are averaged, so each replica's loss is scaled to d times its
        # part of the step's loss: a sum's part is its own sum (d); a mean's part is its slice's
        # share of the batch (d · n_r / n), or 1/d of it when each replica is fed its own batch (1).
        d, scale = self.data_parallel_size, float(self.data_parallel_size)
        if self.batch == "global" and d > 1:  # this replica's slice of the batch
            args, target = self.replica_slice(args), self.replica_slice(target, "target")
            if self.loss_reduction == "mean":
                scale = d * microbatch.batch_size(args) / n_in
        elif self.loss_reduction == "mean":
            scale = 1.0
        mbs = self._microbatches(args)
        targets = [t[0] for t in self._microbatches((target,), "target")]
        weights = microbatch.loss_weights(mbs, self.loss_reduction)
        if scale != 1.0:
            weights = [w * scale for w in weights]
        self._check_mode()
        return mbs, targets, self.loss_fn, weights

    def _check_mode(self) -> None:
        """Dropout follows ``train()``/``eval()``; ops frozen at trace time cannot."""
        if self.model.training != self._traced_training and self._frozen_mode:
            mode = "training" if self.model.training else "eval"
            traced = "training" if self._traced_training else "eval"
            raise PipelineError(
                f"{type(self.model).__name__} is in {mode} mode but was traced in {traced} mode, and ops "
                f"{self._frozen_mode[:3]} (batch norm) keep the traced mode's behaviour. Call "
                f"model.{'train' if self._traced_training else 'eval'}() first, or plan a second pipeline "
                f"with the model in {mode} mode."
            )

    @property
    def is_last_stage_here(self) -> bool:
        """Whether this process runs the last stage (where the loss is computed)."""
        return any(s.is_last for s in self.stages)

    # --- parameters ------------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The parameters this process holds, under their original names (a tied one once,
        under the name the plain model's ``named_parameters`` gives it)."""
        seen: set[int] = set()
        for stage in self.stages:
            for name, p in stage.module.named_parameters(remove_duplicate=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield prefix + self._canonical.get(name, name), p

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Original keys (every alias of a tied weight too), for the weights this process
        holds: in one process the whole model's, loadable by the plain model. Sharded
        replicas gather each tensor whole (a collective: every replica of the stage calls it)."""
        if isinstance(self.runtime, LocalRuntime):
            return self.model.state_dict()
        return {key: full_tensor(value).detach() for key, value in self.held_state().items()}

    def held_state(self) -> dict[str, torch.Tensor]:
        """:meth:`state_dict`'s tensors themselves, as this process holds them (a sharded
        replica's parameters are DTensor shards): what a checkpoint loads into."""
        if isinstance(self.runtime, LocalRuntime):
            return self.model.state_dict(keep_vars=True)
        out: dict[str, torch.Tensor] = {}
        for stage in self.stages:
            for key, value in stage.module.state_dict(keep_vars=True).items():
                out.setdefault(key, value)
                for alias in self.plan.tied_parameters.get(self._canonical.get(key, key), ()):
                    out.setdefault(alias, value)
                canonical = self._canonical.get(key)
                if canonical is not None:
                    out.setdefault(canonical, value)
        return out

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> Any:
        """Load whole tensors by original name (the plain model's ``state_dict``, or this one's).
        In one process: the model's own ``load_state_dict``. Across processes each rank copies
        only the tensors it holds, cut as it holds them (a sharded replica's or tensor-parallel
        rank's part); ``strict``: a tensor this rank holds missing from ``state_dict``, a key the
        model does not have, or a shape that differs is a ``ConfigError`` before anything is
        copied. Returns torch's ``(missing_keys, unexpected_keys)``."""
        from torch.nn.modules.module import _IncompatibleKeys

        from replica.parallel.fsdp import shard_like

        if isinstance(self.runtime, LocalRuntime):
            return self.model.load_state_dict(state_dict, strict=strict)
        known = set(self.model.state_dict(keep_vars=True))
        held = {k: v for k, v in self.held_state().items() if k in known}
        missing = sorted(k for k in held if k not in state_dict)
        unexpected = sorted(k for k in state_dict if k not in known)
        wrong = [f"{k}: {tuple(state_dict[k].shape)} for {tuple(v.shape)}" for k, v in held.items()
                 if k in state_dict and tuple(state_dict[k].shape) != tuple(v.shape)]
        if wrong or (strict and (missing or unexpected)):
            raise ConfigError(
                f"load_state_dict: {len(missing)} tensors this rank holds are missing (e.g. {missing[:3]}), "
                f"{len(unexpected)} keys are not the model's (e.g. {unexpected[:3]}), {len(wrong)} shapes differ "
                f"({wrong[:3]}); pass the plain model's state_dict (or strict=False to skip missing and unknown keys)"
            )
        with torch.no_grad():
            for key, tensor in held.items():
                if key in state_dict:
                    tensor.copy_(shard_like(state_dict[key].to(dtype=tensor.dtype), tensor))
        return _IncompatibleKeys(missing, unexpected)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)
        for p in self.parameters():  # those only the stages hold (an expert-parallel shard)
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def train(self, mode: bool = True) -> "PipelineModel":
        self.model.train(mode)
        return self

    def eval(self) -> "PipelineModel":
        return self.train(False)

    def __repr__(self) -> str:
        return (f"PipelineModel({self.plan.model_name}, num_stages={self.plan.num_stages}, "
                f"num_microbatches={self.plan.num_microbatches}, schedule={self.plan.schedule!r})")
