"""Join the process group under ``torchrun`` so that a restarted attempt never meets the last one's keys."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from replica.errors import ConfigError

__all__ = ["init_process_group"]


def init_process_group(backend: str = "gloo", *, timeout_s: float = 300.0) -> None:
    """``torch.distributed.init_process_group`` from torchrun's environment, safe across restarts.

    With ``--max-restarts``, torchrun (2.x) hands every attempt the agent's own TCPStore
    and the default group's keys land there unprefixed, so a restarted rank may read the
    previous attempt's address of a peer and fail with "Gloo connectFullMesh failed ...
    Connection refused". Here each attempt's keys live under ``attempt-N/``
    (``TORCHELASTIC_RESTART_COUNT``). Outside torchrun this is the plain call.
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"init_process_group needs {missing} in the environment: start the script with torchrun "
                          "(or set them as torchrun would)")
    timeout = datetime.timedelta(seconds=timeout_s)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        return
    agent_store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = PrefixStore(f"attempt-{attempt}/", agent_store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
