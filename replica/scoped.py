"""A value each thread sees, set for the length of a ``with`` block: the one thread-local context Replica uses."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Generic, Iterator, TypeVar

__all__ = ["Scoped"]

T = TypeVar("T")


class Scoped(Generic[T]):
    """``scoped.get()`` is ``default`` until a ``with scoped.using(value):`` in this thread sets
    it; the previous value comes back when the block ends, however it ends."""

    def __init__(self, default: T) -> None:
        self._local = threading.local()
        self._default = default

    def get(self) -> T:
        return getattr(self._local, "value", self._default)

    @contextmanager
    def using(self, value: T) -> Iterator[None]:
        previous = self.get()
        self._local.value = value
        try:
            yield
        finally:
            self._local.value = previous
