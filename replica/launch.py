"""Start N local CPU processes joined by gloo on 127.0.0.1: for tests, notebooks and benchmarks."""

from __future__ import annotations

import datetime
import os
import pickle
import random
import socket
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from replica.errors import ConfigError, PipelineError
from replica.runtime.heap import keep_freed_memory as _keep_freed_memory

__all__ = ["run_local", "free_port"]


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a launcher to listen on (torchrun's ``--master-port``).

    Picked below the kernel's ephemeral range (``ip_local_port_range``), where the kernel never
    hands ports out itself: the many connections other jobs open (gloo's, a test's) cannot take it
    between now and the launcher's bind, as they could take a port the kernel picked."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default range starts here
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # that range is full: any the kernel picks
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, timeout_s: float, threads: int, keep_freed_memory: bool,
            environ: dict[str, str], cwd: str, gpus: tuple[int, ...] | None, fn: Callable[..., Any],
            args: tuple[Any, ...], results: Any) -> None:
    # forked from the fork server, which has the environment and directory of the run that started it:
    # take the caller's, as a spawned process would
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)  # this fresh process's own settings: the caller's are untouched
    if keep_freed_memory:
        _keep_freed_memory()
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        # a client of the store the parent listens on: no rank binds a port, so none can find it taken
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        if gpus is not None:  # this rank's GPU, current before NCCL starts
            torch.cuda.set_device(gpus[rank])
        dist.init_process_group("gloo" if gpus is None else "nccl", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        dist.barrier()  # every rank connected before any may leave
        try:
            # pickled here: a tensor put on the queue would be shared through this process,
            # unreadable once it has exited
            results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # report to the parent instead of dying silently
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _context(gpus: tuple[int, ...] | None) -> Any:
    """CPU ranks: fresh processes forked from one fork server that has imported torch and Replica (and
    the caller's main script, as spawning would; and transformers, where the caller has imported it
    when the server starts): each rank starts in milliseconds instead of importing them again (about
    3 CPU-seconds a rank each, most of a small test's cost). The server forks before
    any thread or process group exists, so the fork is as clean as a spawn. GPU ranks are spawned:
    CUDA does not survive a fork of a process that touched it (the caller's script may have)."""
    if gpus is not None:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Hugging Face's library, where the caller has imported it: a rank that builds a model from it
    # would import it again (2.8 CPU-s: its lazy module tables and modeling_utils)
    extras = [m for m in _PRELOADED_IF_IMPORTED if m in sys.modules]
    ctx.set_forkserver_preload(["__main__", "torch", "replica", *extras])
    return ctx


_PRELOADED_IF_IMPORTED = ("transformers", "transformers.modeling_utils")


def _check_gpus(gpus: Sequence[int] | None, world_size: int) -> tuple[int, ...] | None:
    if gpus is None:
        return None
    gpus = tuple(gpus)
    if len(gpus) != world_size or len(set(gpus)) != len(gpus) \
            or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus):
        raise ConfigError(f"run_local(gpus={list(gpus)}) must name {world_size} different GPU indices, one a rank "
                          f"(world_size={world_size})")
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if max(gpus) >= have:
        raise ConfigError(f"run_local(gpus={list(gpus)}) names GPU {max(gpus)}, but this machine has {have} CUDA "
                          f"device(s){'' if have else ' (no CUDA: leave gpus=None for CPU ranks on gloo)'}")
    return gpus


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    threads_per_rank: int = 1,
    allow_dead: bool = False,
    keep_freed_memory: bool = False,
    grace_s: float = 60.0,
    gpus: Sequence[int] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes (forked from a fork server, gloo
    on 127.0.0.1, ``threads_per_rank`` torch threads each) and return each rank's result.

    ``fn`` and its results must be picklable (a module-level function). A rank that
    raises, dies or outlives ``timeout_s`` makes this raise ``PipelineError`` with
    every rank's report; no process is left behind (a rank still running ``grace_s`` after
    ``timeout_s`` is killed: a hang, not only a stuck collective). With ``allow_dead`` a rank that died
    without a report (killed on purpose by a test) reads as ``None`` instead. With
    ``keep_freed_memory`` each rank first calls :func:`replica.keep_freed_memory` (glibc keeps
    freed memory for the next micro-batch; what the benchmarks measure with). ``gpus``: rank r runs on
    GPU ``gpus[r]`` (current device) and the group is NCCL's; None: CPU ranks on gloo.
    """
    if not isinstance(keep_freed_memory, bool):
        raise ConfigError(f"run_local(keep_freed_memory=...) must be True or False, got {keep_freed_memory!r}")
    gpus = _check_gpus(gpus, world_size)
    ctx = _context(gpus)
    results = ctx.Queue()
    # The parent holds the rendezvous store, listening on a port the OS picked, until every rank is done.
    # A port picked free and bound later by rank 0 could be taken in between by another run's ranks
    # (pytest-xdist workers start theirs side by side): EADDRINUSE on rank 0 and a 45 s wait on the others.
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                           wait_for_workers=False)
    port = int(server.port)
    settings = (timeout_s, threads_per_rank, keep_freed_memory, dict(os.environ), os.getcwd(), gpus)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, *settings, fn, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    reports: dict[int, tuple[str, Any]] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s + grace_s)
    try:
        while len(reports) < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
                reports[rank] = (status, value)
            except Exception:  # queue.Empty: check for ranks that died without a word
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in reports]
                if dead and all(not p.is_alive() for p in procs):
                    break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        del server
    errors = {r: v for r, (s, v) in reports.items() if s == "error"}
    missing = [] if allow_dead else [r for r in range(world_size) if r not in reports]
    if errors or missing:
        lines = [f"rank {r}: {v}" for r, v in sorted(errors.items())]
        lines += [f"rank {r}: no report (exit code {procs[r].exitcode})" for r in missing]
        raise PipelineError(f"{len(errors) + len(missing)} of {world_size} ranks failed:\n" + "\n".join(lines))
    return [pickle.loads(reports[r][1]) if r in reports else None for r in range(world_size)]
