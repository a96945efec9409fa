"""The Keras-like front door: ``get_trainer`` builds the pipeline on the first batch, then trains,
evaluates, predicts and checkpoints, in one process or on every rank of ``torch.distributed`` alike.

    trainer = replica.get_trainer(config=replica.defaults.default_config(), model=model,
                                  loss=torch.nn.CrossEntropyLoss(),
                                  optimizer=torch.optim.Adam(model.parameters(), lr=1e-3))
    trainer.train_dataset(x_train, y_train, epochs=10)
    accuracy = trainer.evaluate(x_test, y_test)

Resuming: with ``config.checkpoint_dir`` set, the first ``train_dataset`` call of a trainer
loads the newest good checkpoint there (weights, optimizer, RNG states, data position).
Each checkpoint records which ``train_dataset`` call of the trainer's life wrote it, so
a restarted script replays its calls: those the checkpoint shows finished return at once,
the one it interrupted continues from the next batch, later ones run as usual.

A model built on meta (``with torch.device("meta"):``, or ``replica.deferred_init()``) trains
too: ``get_trainer(..., init=..., weights=...)`` hands both to ``auto_parallel``, so each rank
allocates only its own stages. Resumed, it is materialized from the checkpoint itself (each
rank reads only its own stages' tensors; no ``init`` needed for the parameters).
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from replica.amp import GradScaler
from replica.api import PipelineModel, auto_parallel
from replica.checkpoint import lock
from replica.checkpoint import store as ckpt
from replica.defaults import TrainerConfig, default_config
from replica.errors import ConfigError
from replica.meta import stage_device
from replica.parallel.compile import compile_seconds, compiled_stage, inductor_cache_dir
from replica.process_group import ensure_process_group
from replica.runtime import heap, microbatch
from replica.train.data import Batch, DataSource, Inputs, LoaderSource, make_source, num_samples_in, pad
from replica.train.loss import ModelLoss
from replica.train.metrics import batch_sums, metric_names
from replica.train.optim import OptimizerFactory, make_optimizer
from replica.train.report import Reporter
from replica.train.state import OTHER_MODEL, load_into_pipeline, save_pipeline
from replica.weights import WeightsError

__all__ = ["Trainer", "get_trainer"]

LossFn = Callable[[Any, Any], torch.Tensor]
Init = Callable[[torch.nn.Module], None]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _call(pm: PipelineModel, inputs: Inputs) -> Any:
    """``pm(**inputs)`` for a dict of keyword inputs, ``pm(*inputs)`` for positional ones."""
    return pm(**inputs) if isinstance(inputs, dict) else pm(*inputs)


def _take(out: Any, n: int) -> Any:
    """The first ``n`` samples of every batched tensor in ``out`` (drops padding)."""
    return tree_map(lambda t: t[:n] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, out)


class Trainer:
    """Trains ``model`` through an automatic pipeline; made by :func:`get_trainer`.

    Attributes: ``pipeline`` (the :class:`replica.PipelineModel`, None before the first
    batch), ``optimizer`` (for the parameters this rank holds), ``step`` (optimizer steps
    so far), ``epoch`` (finished epochs), ``history`` (one dict per epoch),
    ``resumed_from`` (the checkpoint loaded, or None), ``device`` (where batches go; for a
    model built on meta, meta until the pipeline is built).
    """

    def __init__(self, config: TrainerConfig, model: torch.nn.Module, loss: LossFn,
                 optimizer: torch.optim.Optimizer | OptimizerFactory, *, keep_freed_memory: bool = False,
                 init: Init | None = None, weights: str | os.PathLike[str] | None = None) -> None:
        self.config = config
        # under torchrun with no process group yet: start it now, before any rank reads a checkpoint
        ensure_process_group("replica.get_trainer", config.model_device or next(model.parameters()).device,
                             timeout_s=config.timeout_s)
        if keep_freed_memory:  # asked for: process-wide, for the rest of the process (runtime/heap.py)
            heap.keep_freed_memory()
        self._on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        if config.model_device is not None and not self._on_meta:  # a meta model: auto_parallel places its stages
            device = config.model_device
            if device.type == "cuda" and device.index is None and _distributed():
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            model.to(device)  # parameters stay the same objects: the optimizer still points at them
        self.model, self.loss, self._optimizer_arg = model, loss, optimizer
        self._loss_fn = ModelLoss(loss)  # a torch loss scores a ModelOutput's logits
        self._init, self._weights = init, weights
        self._compiled = False  # torch.compile's warm-up said
        self.device = next(model.parameters()).device
        self.loss_reduction = getattr(loss, "reduction", "mean")
        if self.loss_reduction not in ("mean", "sum"):
            raise ConfigError(
                f"the loss has reduction={self.loss_reduction!r}; the pipeline needs a scalar per micro-batch: "
                "use reduction='mean' (the default) or 'sum'"
            )
        self._model_names = {id(p): name for name, p in model.named_parameters()}
        self._plain_keys = frozenset(model.state_dict())
        self.pipeline: PipelineModel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._names: dict[int, str] = {}
        self.step = self.epoch = 0
        self._batch_in_epoch = 0
        self._call = self._call_start_epoch = 0
        self._calls = 0
        self._resume_checked = False
        self._writing = False  # this job holds checkpoint_dir's writer lock (train_dataset, save_checkpoint)
        self.scaler: GradScaler | None = None  # fp16's loss scaler, made with the pipeline
        self._resumed: dict[str, Any] | None = None  # the trainer state of the checkpoint loaded, until its call
        self._last_saved_step: int | None = None
        self._pending: ckpt.PendingSave | None = None  # a background save not yet published
        self._due = False  # a checkpoint fell due on an epoch's last step
        self._run: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        self.resumed_from: Path | None = None
        self._join_world()

    def _join_world(self) -> None:
        """Rank and world size, read again until the pipeline exists: a process group started after
        ``get_trainer`` still counts. Only rank 0 reports."""
        if self.pipeline is not None and hasattr(self, "reporter"):
            return
        self.rank = dist.get_rank() if _distributed() else 0
        self.world_size = dist.get_world_size() if _distributed() else 1
        self.is_main = self.rank == 0
        c = self.config
        self.reporter = Reporter(enabled=self.is_main, progress=c.progress, log_every_steps=c.log_every_steps,
                                 metrics_file=c.metrics_file)

    # --- the pipeline ----------------------------------------------------------------------
    def _meta_device(self) -> torch.device:
        """Where this rank's stages of a meta model will be materialized (config.device must agree)."""
        device, asked = stage_device(self.world_size), self.config.device
        want = self.config.model_device
        if want is not None:
            if want.type != device.type or (want.index is not None and want.index != device.index):
                where = "this rank's current GPU under NCCL" if device.type == "cuda" else "the CPU (one process, gloo)"
                raise ConfigError(
                    f"config.device={asked!r}, but a model built on meta is materialized where auto_parallel puts each "
                    f"rank's stages: {device} ({where}). Leave config.device None, or under NCCL call "
                    "torch.cuda.set_device(LOCAL_RANK) before get_trainer"
                )
        return device

    def _build(self, source: DataSource, batch_size: int, checkpoint: Path | None = None) -> None:
        """Trace, plan and split on a first (global) batch of ``batch_size``; a data set smaller
        than that is repeated to fill it, so the plan never depends on its size. A
        ``DataLoader``'s first batch is taken as it comes: the loader sets the batch size.
        A meta model is materialized from ``checkpoint`` (the one about to be resumed) when given:
        the weights it would load anyway, each rank only its own stages'."""
        if self._on_meta:
            self.device = self._meta_device()
        first = next(source.batches(epoch=0, batch_size=batch_size, shuffle=False, seed=0, merge_last=False))
        inputs = first[0] if isinstance(source, LoaderSource) else pad(first[0], batch_size)[0]
        c = self.config
        example = self._to_device((inputs, None))[0]
        args, kwargs = ((), example) if isinstance(example, dict) else (example, None)
        materialize: dict[str, Any] = {}
        if self._on_meta:
            materialize = {"init": self._init, "weights": checkpoint if checkpoint is not None else self._weights}
        planning = c.planning()
        if c.model_device is not None:  # the model was moved there: priced as where it runs
            planning["device"] = None
        try:
            pm = auto_parallel(self.model, args, example_kwargs=kwargs, loss_fn=self._loss_fn,
                               loss_reduction=self.loss_reduction, timeout_s=c.timeout_s, **materialize, **planning)
        except WeightsError as exc:
            if checkpoint is None:
                raise
            listing = str(exc).rsplit("\n", 1)[0]  # without read_weights' own advice
            raise ckpt.CheckpointError(f"cannot resume from {checkpoint}, the newest checkpoint in "
                                       f"config.checkpoint_dir: {listing}\n{OTHER_MODEL}") from exc
        # fp16 steps through a loss scaler whose inf checks every rank shares
        self.scaler = GradScaler(device=pm.device, timeout_s=c.timeout_s) if c.precision == "fp16" else None
        held = dict(pm.named_parameters())
        self._names = {id(p): name for name, p in held.items()}
        self.optimizer = make_optimizer(self._optimizer_arg, self._model_names, held)
        self.pipeline = pm
        p = pm.plan
        self.reporter.record("plan", num_stages=p.num_stages, num_microbatches=p.num_microbatches,
                             schedule=p.schedule, data_parallel_size=p.data_parallel_size,
                             world_size=self.world_size, weights=self._weights_source(checkpoint))
        micro = f"{p.num_microbatches} micro-batch{'es' if p.num_microbatches > 1 else ''}"
        self.reporter.say(f"replica: {self.world_size} process{'es' if self.world_size > 1 else ''}: "
                          f"{p.layout.describe()}, {micro} per replica, {p.precision}"
                          f"{', compiled' if p.compile else ''}; "
                          f"weights: {self._weights_source(checkpoint)}")

    def _weights_source(self, checkpoint: Path | None) -> str:
        """Where the weights the training starts from came from, in words."""
        if not self._on_meta:
            return "the model's own" + (" (then resumed from the checkpoint)" if checkpoint is not None else "")
        if checkpoint is not None:
            return f"checkpoint {checkpoint} (resumed; each rank read its own stages)"
        if self._weights is not None:
            return f"{self._weights} (each rank read its own stages)"
        init = "reset_parameters() then init" if self._init is not None else "reset_parameters()"
        return f"initialized by {init} from rank 0's seed"

    def _report_compile(self, seconds: float) -> None:
        """Say what torch.compile spent inside the step just taken (0.05 s and more): the warm-up, once
        in this trainer, and any later graphs."""
        if seconds < 0.05:
            return
        first = not self._compiled
        self._compiled = True
        self.reporter.compiled(step=self.step + 1, seconds=seconds, first=first,
                               cache=inductor_cache_dir() if first and self._inductor() else None)

    def _inductor(self) -> bool:
        assert self.pipeline is not None
        return any(getattr(compiled_stage(s.module), "backend", None) == "inductor" for s in self.pipeline.stages)

    @property
    def _min_batch(self) -> int:
        """The fewest samples a training step takes: a micro-batch per replica needs one each."""
        assert self.pipeline is not None
        return self.pipeline.plan.num_microbatches * self.pipeline.data_parallel_size

    def _to_device(self, batch: Batch) -> Batch:
        inputs = tree_map(lambda t: t.to(self.device, non_blocking=True), batch[0])
        target = batch[1].to(self.device, non_blocking=True) if isinstance(batch[1], torch.Tensor) else batch[1]
        return inputs, target

    def _agree(self, what: str, values: tuple[Any, ...]) -> None:
        """Every rank must call the same method on the same data, or the pipeline would hang."""
        if not _distributed():
            return
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, values)
        if any(v != everyone[0] for v in everyone):
            raise ConfigError(
                f"ranks called {what} with different arguments (call, samples, batch_size, ...): "
                + ", ".join(f"rank {r}: {v}" for r, v in enumerate(everyone))
                + ". Every rank must call the trainer's methods alike, on the same data."
            )

    # --- training --------------------------------------------------------------------------
    def train_dataset(self, x: Any, y: Any = None, epochs: int = 1, batch_size: int | None = None,
                      shuffle: bool | None = None,
                      on_step_end: Callable[["Trainer"], None] | None = None) -> list[dict[str, Any]]:
        """Train for ``epochs`` epochs over ``(x, y)`` tensors, a ``Dataset`` of ``(x, y)`` or a
        ``DataLoader`` (then ``y`` is None and the loader sets batch size and order). ``x`` is
        positional (a tensor, a tuple of them: ``model(*x)``) or keywords (a dict of tensors,
        as Hugging Face batches are: ``model(**x)``).

        ``batch_size`` samples per optimizer step (over all replicas); a last batch smaller
        than the pipeline takes (``num_microbatches × data_parallel_size``) is merged into the
        one before. ``on_step_end(trainer)`` runs after every optimizer step. Returns the
        history of the epochs this call ran.
        """
        c = self.config
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ConfigError(f"epochs must be a positive int, got {epochs!r}")
        batch_size = c.batch_size if batch_size is None else batch_size
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive int, got {batch_size!r}")
        shuffle = c.shuffle if shuffle is None else shuffle
        source = make_source(x, y, need_target=True)
        self._join_world()
        call, self._calls = self._calls, self._calls + 1
        self._run = {"batch_size": batch_size, "shuffle": bool(shuffle), "seed": c.seed,
                     "num_samples": source.num_samples}
        self._agree("train_dataset", (call, source.num_samples, batch_size, bool(shuffle), epochs))
        if c.checkpoint_dir is None:
            return self._train_call(source, call, epochs, batch_size, bool(shuffle), on_step_end)
        self._lock_checkpoint_dir()  # before anything reads or writes there
        self._writing = True
        try:
            return self._train_call(source, call, epochs, batch_size, bool(shuffle), on_step_end)
        finally:  # done writing, or failed: another job may continue from here
            self._writing = False
            if self.is_main:
                lock.release(c.checkpoint_dir)

    def _train_call(self, source: DataSource, call: int, epochs: int, batch_size: int, shuffle: bool,
                    on_step_end: Callable[["Trainer"], None] | None) -> list[dict[str, Any]]:
        """One ``train_dataset`` call, from resuming (its first) to its last checkpoint."""
        c = self.config
        found = None
        if c.checkpoint_dir is not None and not self._resume_checked:  # before building: a meta model loads it
            found = ckpt.latest_across_ranks(c.checkpoint_dir, quarantine=True)
        if self.pipeline is None:
            self._build(source, batch_size, checkpoint=found)
        if c.checkpoint_dir is not None and not self._resume_checked:
            self._resume_checked = True
            self._resumed = self._resume(found) if found is not None else None
        start_epoch, start_batch, self._call_start_epoch = self.epoch, 0, self.epoch
        if self._resumed is not None:
            if self._resumed["call"] > call:  # a later call wrote the checkpoint: this one had finished
                return []
            meta, self._resumed = self._resumed, None
            for key in ("batch_size", "shuffle", "seed", "num_samples"):
                if meta.get(key) != self._run[key]:
                    raise ConfigError(
                        f"checkpoint {meta['path']} was written by a run with {key}={meta.get(key)!r}, but this "
                        f"call has {key}={self._run[key]!r}: the data order would differ. Resume with the same "
                        "data and settings, or point config.checkpoint_dir at a new directory."
                    )
            start_batch, self._call_start_epoch = meta["batch"], meta["call_start_epoch"]
        self._call = call
        end_epoch = self._call_start_epoch + epochs
        history = []
        assert self.pipeline is not None
        self.pipeline.train()
        try:
            for epoch in range(start_epoch, end_epoch):
                history.append(self._train_epoch(source, epoch, end_epoch, start_batch if epoch == start_epoch else 0,
                                                 batch_size, bool(shuffle), on_step_end))
                self.epoch, self._batch_in_epoch = epoch + 1, 0
                if c.checkpoint_dir is not None and (c.checkpoint_every_steps is None or self._due):
                    self.save_checkpoint()
                self._due = False
        finally:
            self.reporter.close()
        if c.checkpoint_dir is not None and self._last_saved_step != self.step:
            self.save_checkpoint()
        if c.checkpoint_dir is not None:
            self.wait_for_checkpoint()  # train_dataset returns with its checkpoints published
        self.history += history
        return history

    def _train_epoch(self, source: DataSource, epoch: int, end_epoch: int, first: int, batch_size: int,
                     shuffle: bool, on_step_end: Callable[["Trainer"], None] | None) -> dict[str, Any]:
        assert self.pipeline is not None
        c, pm = self.config, self.pipeline
        d = pm.data_parallel_size
        batches = source.batches(epoch=epoch, batch_size=batch_size, shuffle=shuffle, seed=c.seed,
                                 merge_last=True, start=first)
        self.reporter.start_epoch(epoch, end_epoch, source.num_batches(batch_size, True), first)
        self._batch_in_epoch = first
        start, seen, loss_sum = time.perf_counter(), 0, 0.0
        upcoming = next(batches, None)
        while upcoming is not None:
            batch, upcoming = upcoming, next(batches, None)
            n = num_samples_in(batch[0])
            if n < self._min_batch:
                raise ConfigError(
                    f"a batch of {n} samples is too small for {pm.plan.num_microbatches} micro-batches × "
                    f"{d} replicas: use batches of at least {self._min_batch} samples (batch_size, or the "
                    "DataLoader's), or set num_microbatches lower"
                )
            inputs, target = self._to_device(batch)  # the global batch: each replica trains its slice
            pm.zero_grad()
            compiling = compile_seconds() if pm.plan.compile else None
            loss = float(pm.train_step(inputs, target, scaler=self.scaler))
            if compiling is not None:
                self._report_compile(compile_seconds() - compiling)
            if self.optimizer is not None and self.scaler is not None:
                self.scaler.step(self.optimizer)  # skipped on every rank when any rank's gradients overflowed
                self.scaler.update()
            elif self.optimizer is not None:
                self.optimizer.step()
            self.step += 1
            self._batch_in_epoch += 1
            seen += n
            loss_sum += loss * n
            elapsed = time.perf_counter() - start
            lr = self.optimizer.param_groups[0].get("lr") if self.optimizer is not None else None
            self.reporter.step(step=self.step, epoch=epoch, loss=loss, samples=n,
                               rate=seen / elapsed if elapsed > 0 else 0.0,
                               lr=float(lr) if isinstance(lr, (int, float, torch.Tensor)) else None,
                               num_epochs=end_epoch)
            if upcoming is None:  # the epoch's last step: train_dataset saves after moving to the next epoch
                self._due = c.checkpoint_every_steps is not None and self.step % c.checkpoint_every_steps == 0
            elif c.checkpoint_every_steps is not None and self.step % c.checkpoint_every_steps == 0:
                self.save_checkpoint()
            if on_step_end is not None:
                on_step_end(self)
        seconds = time.perf_counter() - start
        summary = {"epoch": epoch, "step": self.step, "loss": loss_sum / seen if seen else None,
                   "samples": seen, "seconds": seconds, "samples_per_s": seen / seconds if seconds > 0 else 0.0}
        self.reporter.end_epoch(summary, end_epoch)
        return summary

    # --- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Write ``checkpoint_dir/step-XXXXXXXX`` now (collective: every rank calls): each rank its own
        shards, through torch.distributed.checkpoint. With ``config.checkpoint_async`` the write goes
        on in the background and is published by the next save (or the end of ``train_dataset``);
        the path is returned either way."""
        c, pm = self.config, self.pipeline
        if c.checkpoint_dir is None or pm is None:
            raise ConfigError("save_checkpoint needs config.checkpoint_dir and a built pipeline (train first)")
        if not self._writing:  # a save of its own, outside train_dataset: the lock until it is published
            self._lock_checkpoint_dir()
            self._writing = True
            try:
                path = self.save_checkpoint()
                self.wait_for_checkpoint()
                return path
            finally:
                self._writing = False
                if self.is_main:
                    lock.release(c.checkpoint_dir)
        self.wait_for_checkpoint()  # one save in flight at most
        p = pm.plan
        meta = {"step": self.step, "epoch": self.epoch, "batch": self._batch_in_epoch, "call": self._call,
                "call_start_epoch": self._call_start_epoch, **self._run,
                **({} if self.scaler is None else {"scaler": self.scaler.state_dict()}),  # fp16's loss scale
                "layout": {"num_stages": p.num_stages, "num_microbatches": p.num_microbatches,
                           "schedule": p.schedule, "data_parallel_size": p.data_parallel_size,
                           "tensor_parallel_size": p.layout.tensor_parallel_size, "sharding": p.layout.sharding,
                           "shard_group_size": p.layout.shard_group_size, "describe": p.layout.describe(),
                           "world_size": self.world_size}}
        try:
            pending = save_pipeline(c.checkpoint_dir, self.step, pm, self.optimizer, self._names, self._plain_keys,
                                    meta, keep=c.keep_checkpoints, asynchronous=c.checkpoint_async)
        except RuntimeError as exc:  # a collective of the save failed: a peer died or hung
            if not _distributed():
                raise
            raise ckpt.CheckpointError(
                f"saving checkpoint step {self.step} failed on rank {self.rank} of {self.world_size} while the ranks "
                f"wrote it together: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}. Another rank died or "
                "hung; this step is not published and the one before it stays, to resume from"
            ) from exc
        self._last_saved_step = self.step
        path = ckpt.step_dir(c.checkpoint_dir, self.step)
        if pending.path is None:
            self._pending = pending
        else:
            self.reporter.record("checkpoint", step=self.step, path=str(path))
        return path

    def wait_for_checkpoint(self) -> Path | None:
        """Finish a background save (collective): wait for every rank's files and publish the step
        directory. Returns it, or None when no save was in flight."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        path = pending.finish()
        self.reporter.record("checkpoint", step=pending.step, path=str(path))
        return path

    def _lock_checkpoint_dir(self) -> None:
        """Rank 0 takes ``checkpoint_dir``'s writer lock for this job (``checkpoint/lock.py``); another
        job's lock is a ``CheckpointError`` on every rank, before any of them reads or writes there."""
        problem = None
        if self.is_main:
            try:
                lock.acquire(self.config.checkpoint_dir)
            except ckpt.CheckpointError as exc:
                problem = str(exc)
        if _distributed():
            box = [problem]
            dist.broadcast_object_list(box, src=0)
            problem = box[0]
        if problem is not None:
            raise ckpt.CheckpointError(problem if self.is_main else f"{problem} (found by rank 0)")

    def _resume(self, path: Path) -> dict[str, Any]:
        """Load checkpoint ``path`` (the newest good one of ``checkpoint_dir``, which every rank
        verified a share of) into this rank's stages: only the tensors they hold are read."""
        assert self.pipeline is not None
        found = str(path)
        try:
            meta = load_into_pipeline(found, self.pipeline, self.optimizer, self._names, self._plain_keys)
        except Exception as exc:
            self._all_ok(f"{type(exc).__name__}: {exc}")
            raise
        self._all_ok(None)
        meta["path"] = found
        if self.scaler is not None and meta.get("scaler"):
            self.scaler.load_state_dict(meta["scaler"])
        self.step, self.epoch, self._batch_in_epoch = meta["step"], meta["epoch"], meta["batch"]
        self._last_saved_step = self.step
        self.resumed_from = Path(found)
        self.reporter.record("resume", path=found, step=self.step, epoch=self.epoch, batch=meta["batch"])
        self.reporter.say(f"resumed from {found}: step {self.step}, epoch {self.epoch + 1}, "
                          f"batch {meta['batch']}")
        return meta

    def _all_ok(self, problem: str | None) -> None:
        """Raise on every rank if any rank failed, instead of leaving the others to time out."""
        if not _distributed():
            return
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, problem)
        failed = {r: p for r, p in enumerate(everyone) if p is not None}
        if failed and problem is None:
            raise ckpt.CheckpointError("resuming failed on other ranks: "
                                       + "; ".join(f"rank {r}: {p}" for r, p in failed.items()))

    # --- inference -------------------------------------------------------------------------
    def _outputs(self, source: DataSource, batch_size: int | None) -> Iterator[tuple[Any, Any, int]]:
        """``(output, target, n)`` per batch, in order, on every rank (each data-parallel replica
        runs its slice of each batch). Batches under a micro-batch per replica are padded."""
        c = self.config
        batch_size = c.batch_size if batch_size is None else batch_size
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive int, got {batch_size!r}")
        if self.pipeline is None:
            self._build(source, c.batch_size)
        pm = self.pipeline
        assert pm is not None
        was_training = self.model.training
        pm.eval()
        try:
            with torch.no_grad():
                batches = source.batches(epoch=0, batch_size=batch_size, shuffle=False, seed=0, merge_last=False)
                for batch in batches:
                    inputs, target = self._to_device(batch)
                    padded, n = pad(inputs, self._min_batch)
                    yield _take(_call(pm, padded), n), target, n
        finally:
            pm.train(was_training)

    def evaluate(self, x: Any, y: Any = None, metrics: str | Sequence[str] | None = None,
                 batch_size: int | None = None) -> float | dict[str, float]:
        """Accuracy for a classification loss (``CrossEntropyLoss``, ``NLLLoss``), else the mean
        loss; ``metrics=("loss", "accuracy")`` returns a dict of both. Every rank returns the same."""
        names, as_dict = metric_names(metrics, self.loss)
        source = make_source(x, y, need_target=True)
        self._join_world()
        self._agree("evaluate", (source.num_samples, batch_size, names))
        totals = torch.zeros(4, dtype=torch.float64)
        for out, target, n in self._outputs(source, batch_size):
            assert self.pipeline is not None
            if self.rank == 0:  # every rank holds the whole output: count it once
                out, target = self._loss_fn.prepare(out, target)
                totals += torch.tensor(batch_sums(self.loss, names, out, target, n), dtype=torch.float64)
        if _distributed():
            work = dist.all_reduce(totals, async_op=True)
            work.wait(datetime.timedelta(seconds=self.config.timeout_s))
        loss_sum, samples, correct, counted = totals.tolist()
        result = {}
        if "loss" in names:
            result["loss"] = loss_sum / max(samples, 1.0)
        if "accuracy" in names:
            result["accuracy"] = correct / max(counted, 1.0)
        self.reporter.record("evaluate", step=self.step, samples=int(samples), **result)
        return result if as_dict else result[names[0]]

    def predict(self, x: Any, batch_size: int | None = None) -> Any:
        """The model's outputs for every sample of ``x`` (a tensor, tuple, dict, Dataset or DataLoader),
        concatenated along dim 0; on every rank (each replica computes its slice of every batch)."""
        source = make_source(x, None, need_target=False)
        self._join_world()
        self._agree("predict", (source.num_samples, batch_size))
        outputs = [out for out, _, _ in self._outputs(source, batch_size)]
        return microbatch.merge(outputs)

    def __repr__(self) -> str:
        return (f"Trainer({type(self.model).__name__}, step={self.step}, epoch={self.epoch}, "
                f"pipeline={self.pipeline!r})")


def get_trainer(config: TrainerConfig | None = None, model: torch.nn.Module | None = None,
                loss: LossFn | None = None,
                optimizer: torch.optim.Optimizer | OptimizerFactory | None = None, *,
                keep_freed_memory: bool = False, init: Init | None = None,
                weights: str | os.PathLike[str] | None = None) -> Trainer:
    """A :class:`Trainer` for ``model``. ``optimizer``: one built on ``model.parameters()`` (rebuilt
    per rank for the parameters it holds, by name, keeping class, defaults and param groups)
    or a factory ``params -> optimizer``. The pipeline is built on the first batch.
    ``keep_freed_memory``: call :func:`replica.keep_freed_memory` (CPU ranks, glibc) first.
    ``init`` and ``weights``: for a model built on meta, as :func:`replica.auto_parallel` takes
    them (each rank materializes only its own stages); a checkpoint being resumed wins over
    ``weights``."""
    if not isinstance(keep_freed_memory, bool):
        raise ConfigError(f"keep_freed_memory must be True or False, got {keep_freed_memory!r}")
    config = default_config() if config is None else config
    if not isinstance(config, TrainerConfig):
        raise ConfigError(f"config must be a replica.defaults.TrainerConfig (default_config()), got "
                          f"{type(config).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not any(True for _ in model.parameters()):
        raise ConfigError(f"{type(model).__name__} has no parameters: there is nothing to train")
    # under torchrun: the process group first, so that an error below reads once (rank 0), not once per rank
    ensure_process_group("replica.get_trainer", config.model_device or next(model.parameters()).device,
                         timeout_s=config.timeout_s)
    if loss is None or not callable(loss):
        raise ConfigError(f"loss must be callable(output, target) -> scalar (e.g. torch.nn.CrossEntropyLoss()), "
                          f"got {type(loss).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer) and not callable(optimizer):
        raise ConfigError(
            f"optimizer must be a torch.optim.Optimizer on model.parameters() or a factory params -> optimizer, "
            f"got {type(optimizer).__name__}"
        )
    if init is not None and not callable(init):
        raise ConfigError(f"init must be callable(module) -> None, applied to each module, got {type(init).__name__}")
    if (init is not None or weights is not None) and not any(t.is_meta for t in [*model.parameters(),
                                                                                  *model.buffers()]):
        given = " and ".join(n for n, v in (("init=", init), ("weights=", weights)) if v is not None)
        raise ConfigError(
            f"{given} initialize or load a model built on meta, but {type(model).__name__} has no tensor on the meta "
            "device: its weights are already real. Build it under `with torch.device('meta'):` or "
            "`with replica.deferred_init():` to have each rank allocate only its own stages, or drop " + given
        )
    return Trainer(config, model, loss, optimizer, keep_freed_memory=keep_freed_memory, init=init, weights=weights)
