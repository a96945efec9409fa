"""On request, CPU ranks keep the memory a micro-batch frees for the next one, as a GPU caching allocator does.

glibc hands the free top of its heap back to the kernel once it grows past a trim
threshold. A pipeline step frees and allocates the same activations micro-batch after
micro-batch, so the pages it handed back are faulted in again, zero-filled, moments later:
on the benchmark GPT's last rank 15,000-18,000 page faults a step (60-70 MiB zeroed),
against 2,000-3,500 for torch.distributed.pipelining's 1F1B in the same process.

:func:`keep_freed_memory` asks glibc (``mallopt``) to keep up to :data:`TRIM_THRESHOLD`
free at the heap top and to serve every block below :data:`MMAP_THRESHOLD` (glibc's own
ceiling for its adaptive threshold) from the heap. Setting either switches glibc's
adaptive thresholds off, so both are set: the trim threshold alone would leave every
block over 128 KiB to its own ``mmap``, faulted in at each allocation (25% slower here).

The settings are process-wide and last until the process ends; a peak the process reached
stays resident (peak RSS is unchanged: the pages were resident at the peak anyway). So
nothing in Replica calls it unasked: call ``replica.keep_freed_memory()`` in each CPU rank
(or pass ``keep_freed_memory=True`` to ``replica.get_trainer`` or
``replica.launch.run_local``). It does nothing where glibc is not the allocator, or where the
user tuned glibc's malloc already (``MALLOC_*_`` or ``GLIBC_TUNABLES``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

__all__ = ["keep_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

MMAP_THRESHOLD = 32 << 20  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
_USER_TUNED = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_applied: bool | None = None  # None until keep_freed_memory() is called


def keep_freed_memory() -> bool:
    """Tell glibc to keep freed memory for reuse, for the rest of the process (see the module's
    doc): CPU pipeline steps then stop faulting in the pages their previous micro-batch freed.
    Opt-in and process-wide; the first call decides, later ones return its answer. Returns
    whether the settings are in force (False: not glibc, or malloc tuned by the user)."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if any(k in os.environ for k in _USER_TUNED) or "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False  # the user's own settings win
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return False  # another allocator serves malloc: glibc's settings would not apply
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; the mmap threshold first, so that no block is mapped
    # one by one between the two calls
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
