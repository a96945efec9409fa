"""fp16 loss scaling for a pipeline whose gradients are spread over ranks.

``torch.amp.GradScaler`` decides from the gradients it can see whether a step overflowed. In a
pipeline each rank sees only its own stages' gradients (and, with data parallelism, one replica's
copy of them), so per-rank scalers would disagree: the rank where fp16 overflowed skips its step
and halves its scale while the others step and keep theirs. The stages then hold weights of
different steps, and the next loss is scaled by one scale and unscaled by another.
:class:`GradScaler` all-reduces each optimizer's inf/NaN flag over every rank of the job before
acting on it, so every rank skips or steps together and every scale moves alike, as FSDP's
``ShardedGradScaler`` does for shards.

Usage (every rank, the same calls in the same order)::

    scaler = replica.GradScaler()
    for x, y in batches:
        loss = pm.train_step(x, y, scaler=scaler)  # scales each micro-batch's loss on the last stage
        scaler.unscale_(opt)                       # optional: to clip or inspect true gradients
        scaler.step(opt)                           # skipped on every rank if any rank overflowed
        scaler.update()
        opt.zero_grad()
"""

from __future__ import annotations

import datetime
import math
from typing import Any

import torch
import torch.distributed as dist

from replica.errors import ConfigError, PipelineError

__all__ = ["GradScaler"]


def _device_type(device: Any) -> str:
    """The device type torch's scaler takes ("cuda", "cpu", ...); None: CUDA when there is one."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"GradScaler(device={device!r}) is not a device; pass 'cuda', 'cpu' (or a torch.device), or leave it "
            "None for CUDA when available, else the CPU"
        ) from None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_arguments(device_type: str, init_scale: Any, growth_factor: Any, backoff_factor: Any,
                     growth_interval: Any, enabled: Any, process_group: Any, timeout_s: Any) -> None:
    """Refuse values torch would accept silently (a zero scale) or stop on with a bare AssertionError."""
    if not isinstance(enabled, bool):
        raise ConfigError(f"GradScaler(enabled={enabled!r}) must be True or False")
    if enabled and device_type == "cuda" and not torch.cuda.is_available():
        # torch would warn and quietly stop scaling: fp16 gradients would then underflow unnoticed
        raise ConfigError(
            "GradScaler(device='cuda') but CUDA is not available here; pass device='cpu' (or leave device None) "
            "to scale on the CPU, or enabled=False to train without loss scaling"
        )
    if not _number(init_scale) or init_scale <= 0:
        raise ConfigError(
            f"GradScaler(init_scale={init_scale!r}) must be a finite number > 0: the loss is multiplied by it "
            "before backward (fp16 training usually starts at the default, 2.**16)"
        )
    if not _number(growth_factor) or growth_factor <= 1:
        raise ConfigError(
            f"GradScaler(growth_factor={growth_factor!r}) must be a finite number > 1: the scale is multiplied by "
            "it after growth_interval steps without an overflow (default 2.0)"
        )
    if not _number(backoff_factor) or not 0 < backoff_factor < 1:
        raise ConfigError(
            f"GradScaler(backoff_factor={backoff_factor!r}) must be a number in (0, 1): the scale is multiplied "
            "by it after an overflow (default 0.5)"
        )
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
        raise ConfigError(
            f"GradScaler(growth_interval={growth_interval!r}) must be an int >= 1: the number of steps without "
            "an overflow before the scale grows (default 2000)"
        )
    if not _number(timeout_s) or timeout_s <= 0:
        raise ConfigError(
            f"GradScaler(timeout_s={timeout_s!r}) must be a number of seconds > 0: how long step() waits for "
            "the other ranks' inf/NaN checks before failing (default 300, as auto_parallel's)"
        )
    if process_group is not None and not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise ConfigError(
            f"GradScaler(process_group=...) must be a torch.distributed ProcessGroup or None (the whole world), "
            f"got {type(process_group).__name__}"
        )


def _wire(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``tensor`` where the group's backend can all-reduce it: gloo takes CPU tensors, NCCL CUDA ones."""
    backend = str(dist.get_backend(group)).lower()
    if tensor.is_cuda and "nccl" not in backend:
        return tensor.cpu()
    if tensor.device.type == "cpu" and backend == "nccl":
        return tensor.to(torch.device("cuda", torch.cuda.current_device()))
    return tensor


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN checks are the whole job's: an overflow in any rank's
    gradients skips the optimizer step on every rank, and every rank's scale moves alike.

    Arguments are torch's, with ``device`` defaulting to "cuda" when CUDA is available, else "cpu",
    plus ``process_group`` (the ranks whose checks are combined; None: the whole world, pipeline
    and data-parallel ranks alike) and ``timeout_s`` (how long a check waits for the other ranks
    before raising :class:`~replica.PipelineError`). In one process, or when ``torch.distributed``
    is not initialized, it behaves as ``torch.amp.GradScaler``; ``enabled=False`` makes every
    method a no-op and ``step`` a plain ``optimizer.step()``.

    Each ``unscale_(opt)`` (or ``step(opt)`` without one) is one all-reduce, so every rank must
    step the same number of optimizers in the same order; an optimizer that holds no gradient on
    this rank still takes part (it reports no overflow). Ranks that never call ``scale`` (those
    without the last stage) must have their scale set by :meth:`ready`, which
    ``pm.train_step(..., scaler=scaler)`` does.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        process_group: Any = None,
        timeout_s: float = 300.0,
    ) -> None:
        device_type = _device_type(device)
        _check_arguments(device_type, init_scale, growth_factor, backoff_factor, growth_interval, enabled,
                         process_group, timeout_s)
        super().__init__(device_type, init_scale=float(init_scale), growth_factor=float(growth_factor),
                         backoff_factor=float(backoff_factor), growth_interval=growth_interval, enabled=enabled)
        self.process_group = process_group
        self.timeout_s = float(timeout_s)

    def ready(self, device: str | torch.device) -> None:
        """Create the scale and growth tracker on ``device`` if they do not exist yet, exactly as the
        first ``scale()`` would; a no-op afterwards or when disabled.

        A rank without the last stage never scales a loss, yet must unscale its gradients by the
        same scale: every rank starts from ``init_scale`` here and the shared inf/NaN checks keep
        the scales equal from then on."""
        try:
            where = torch.device(device)
        except (RuntimeError, TypeError):
            raise ConfigError(f"GradScaler.ready(device={device!r}) is not a device; pass the pipeline's "
                              "device, e.g. 'cpu' or torch.device('cuda', local_rank)") from None
        if self._enabled and self._scale is None:
            self._lazy_init_scale_growth_tracker(where)

    # --- torch.amp.GradScaler's hooks -------------------------------------------------------------
    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's check, with an error that says what to call on a rank that scales no loss."""
        if self._scale is None or self._growth_tracker is None:
            where = f" on rank {dist.get_rank()}" if dist.is_available() and dist.is_initialized() else ""
            raise PipelineError(
                f"GradScaler.{funcname}() was called{where} before the scale was set: nothing has called "
                "scaler.scale(loss) here. Pass scaler= to pm.train_step(...), which scales the loss on the last "
                "stage and readies every rank's scaler, or call scaler.ready(device) on each rank that does "
                "not scale a loss itself"
            )
        return self._scale, self._growth_tracker

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        """torch's unscaling and inf/NaN check, then the flag all-reduced over the ranks.

        Every path to a step decision goes through here (``unscale_``, ``step``, and the fused
        optimizers' ``_check_inf_per_device``). The per-device flags are folded into one tensor
        on the scale's device, even when this optimizer holds no gradient here: every rank then
        joins exactly one collective per optimizer, and ``step``/``update`` always find a check."""
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        verdict = torch.zeros_like(found_inf)
        for flag in per_device.values():
            verdict += flag.to(verdict.device)
        self._all_reduce(verdict)
        return {verdict.device: verdict}

    # --- across ranks ------------------------------------------------------------------------------
    def _group(self) -> Any:
        """The group to reduce over, or None when this process is alone in it."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None  # -1 when this rank is not a member

    def _all_reduce(self, verdict: torch.Tensor) -> None:
        """``verdict`` becomes the largest over the group's ranks: nonzero if any found an inf or NaN."""
        group = self._group()
        if group is None:
            return
        wire = _wire(verdict, group)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        others = dist.get_world_size(group) - 1
        what = f"the inf/NaN checks of the {others} other rank{'s' if others > 1 else ''}"
        hint = ("GradScaler.step and unscale_ all-reduce whether any rank's gradients overflowed: a rank died, hung, "
                f"or did not step the same optimizers in the same order. The timeout is {self.timeout_s:g} s "
                "(replica.GradScaler(timeout_s=...))")
        try:
            work = dist.all_reduce(wire, op=dist.ReduceOp.MAX, group=group, async_op=True)
            done = work.wait(timeout)
        except Exception as exc:  # gloo raises on a closed connection or a timeout
            reason = str(exc).splitlines()[0] if str(exc) else ""
            raise PipelineError(f"rank {dist.get_rank()} gave up waiting for {what} ({type(exc).__name__}: "
                                f"{reason}). {hint}") from exc
        if done is False:
            raise PipelineError(f"rank {dist.get_rank()} timed out waiting for {what}. {hint}")
        if wire is not verdict:
            verdict.copy_(wire)
