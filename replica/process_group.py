"""torch.distributed's process group from the launcher's environment: started once, safe across torchrun restarts."""

from __future__ import annotations

import atexit
import datetime
import os
import sys
from types import TracebackType

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from replica.errors import ConfigError, ReplicaError

__all__ = ["init_process_group", "ensure_process_group", "launched_world_size", "default_backend",
           "one_line_errors_off_rank_0"]

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_world_size() -> int:
    """The world the launcher (``torchrun``) started this process in: ``WORLD_SIZE``, or 1."""
    try:
        return max(int(os.environ.get("WORLD_SIZE", "1")), 1)
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} in the environment is not a number; "
                          "start the script with torchrun, which sets it") from None


def default_backend(device: torch.device | str | None = None) -> str:
    """NCCL for a CUDA device (None: CUDA when this machine has a GPU), gloo otherwise."""
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    return "nccl" if kind == "cuda" else "gloo"


def init_process_group(backend: str | None = None, *, timeout_s: float = 300.0) -> None:
    """``torch.distributed.init_process_group`` from torchrun's environment, safe across restarts.

    ``backend`` None: NCCL where this machine has a GPU (each rank's current GPU set to
    ``LOCAL_RANK``), gloo on CPUs. With ``--max-restarts``, torchrun (2.x) hands every attempt
    the agent's own TCPStore and the default group's keys land there unprefixed, so a restarted
    rank may read the previous attempt's address of a peer and fail with "Gloo connectFullMesh
    failed ... Connection refused". Here each attempt's keys live under ``attempt-N/``
    (``TORCHELASTIC_RESTART_COUNT``). Outside torchrun's agent this is the plain call.

    On ranks other than 0 a Replica error that ends the script prints as one line naming the
    rank (:func:`one_line_errors_off_rank_0`): the same error on every rank is read once, in full
    on rank 0, and a rank that lost a peer says so without a traceback.
    """
    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        raise ConfigError(f"init_process_group needs {missing} in the environment: start the script with torchrun "
                          "(or set them as torchrun would)")
    backend = default_backend() if backend is None else backend
    if backend == "nccl" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    timeout = datetime.timedelta(seconds=timeout_s)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        one_line_errors_off_rank_0()
        return
    agent_store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                           is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = PrefixStore(f"attempt-{attempt}/", agent_store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    one_line_errors_off_rank_0()


def ensure_process_group(call: str, device: torch.device | str | None = None, *, timeout_s: float = 300.0) -> int:
    """The world size this process runs in, starting the process group first when the launcher
    started several processes (``WORLD_SIZE > 1``) and none is started yet: ``call`` never runs as
    one of several independent single-process jobs. ``device``: where the model is (its backend:
    NCCL for CUDA, gloo for the CPU; None or meta: this machine's default). A launcher's
    environment that cannot start one is a ``ConfigError`` naming ``call``. A group started here is
    destroyed at exit (``atexit``), so a rank that ends on an error exits with it instead of aborting."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    world = launched_world_size()
    if world == 1:
        return 1
    if not dist.is_available():
        raise ConfigError(f"{call} runs under a launcher with WORLD_SIZE={world}, but this torch build has no "
                          "torch.distributed; install a build with it, or run one process")
    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        raise ConfigError(
            f"{call} runs in a world of {world} processes (WORLD_SIZE={world}) without a process group, and "
            f"cannot start one: {missing} missing from the environment. Start the script with torchrun, or call "
            "replica.init_process_group() (torch.distributed.init_process_group) before it"
        )
    kind = None if device is None or torch.device(device).type == "meta" else device
    init_process_group(default_backend(kind), timeout_s=timeout_s)
    atexit.register(_destroy)  # started here, ended here: a rank leaving on an error exits, not aborts
    return dist.get_world_size()


def _destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def one_line_errors_off_rank_0() -> None:
    """On a rank other than 0, print a :class:`ReplicaError` that ends the process as one line,
    ``replica: rank 3: ConfigError: ...`` (its first line), instead of a traceback; anything else,
    and everything on rank 0, prints as Python prints it. Process-wide (``sys.excepthook``): made
    by :func:`init_process_group`, which Replica calls only under a launcher."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    previous = sys.excepthook
    if rank == 0 or getattr(previous, "replica_rank", None) is not None:
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not isinstance(exc, ReplicaError):
            previous(kind, exc, tb)
            return
        first = (str(exc).splitlines() or [""])[0]
        more = " …" if "\n" in str(exc) or len(first) > 300 else ""
        line = f"replica: rank {rank}: {kind.__name__}: {first[:300]}{more}\n"
        sys.stderr.flush()  # one write of the whole line: ranks sharing a pipe do not splice their lines
        try:
            os.write(sys.stderr.fileno(), line.encode("utf-8", "replace"))
        except (AttributeError, OSError, ValueError):  # a stderr without a file (captured): Python's write
            sys.stderr.write(line)
            sys.stderr.flush()

    hook.replica_rank = rank  # type: ignore[attr-defined]
    sys.excepthook = hook
