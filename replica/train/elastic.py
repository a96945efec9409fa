"""The trainer's name for :func:`replica.init_process_group` (torchrun's process group, safe across restarts)."""

from __future__ import annotations

from replica.process_group import init_process_group

__all__ = ["init_process_group"]
