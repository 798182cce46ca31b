"""What every handle of the binding shares: the in-use bracket that lets close() wake and wait out the threads inside
a C call before the C object is freed, the Region value that names registered memory, and the argument checks that
run before any C call (timeouts, unsigned ints, region indexes)."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

from ._errors import Closed
from ._pdpair_native import lib


def _timeout_ms(timeout: float) -> int:
    """Seconds -> whole milliseconds (rounded up). Every wait needs a finite deadline."""
    if timeout is None or isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
    if not math.isfinite(timeout) or timeout < 0:
        raise ValueError(f"timeout must be finite and >= 0 seconds, got {timeout!r}")
    return math.ceil(timeout * 1000)


class _InUse:
    """`with handle._in_use() as ptr:` around every C call of a handle: counts the call in (`_enter`, which refuses a
    closed handle) and out (`_leave`) whatever happens, the one owner of that bracket."""

    __slots__ = ("_handle",)

    def __init__(self, handle: "_Handle") -> None:
        self._handle = handle

    def __enter__(self) -> Any:
        return self._handle._enter()

    def __exit__(self, *exc: object) -> None:
        self._handle._leave()


class _Handle:
    """Counts the Python threads inside a C call, so close() can wake them (C shutdown) and wait until they have
    left before the C object is freed: no call ever uses a freed pointer."""

    def __init__(self, ptr: Any, what: str):
        self._ptr = ptr
        self._what = what
        self._cv = threading.Condition()
        self._active = 0
        self._closed = False

    def _enter(self) -> Any:
        with self._cv:
            if self._closed:
                raise Closed(lib.PDPAIR_CLOSED, f"this {self._what} is closed")
            self._active += 1
            return self._ptr

    def _leave(self) -> None:
        with self._cv:
            self._active -= 1
            if self._active == 0:
                self._cv.notify_all()

    def _in_use(self) -> _InUse:
        return _InUse(self)

    def _begin_close(self) -> Any | None:
        with self._cv:
            if self._closed:
                return None
            self._closed = True
            return self._ptr

    def _wait_idle(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._active == 0)

    @property
    def closed(self) -> bool:
        return self._closed


@dataclass(frozen=True)
class Region:
    """A registered local memory region: pass it (or its index) as the local side of a put."""

    index: int
    address: int
    size: int


def _region_index(region: Region | int) -> int:
    if isinstance(region, Region):
        return region.index
    if isinstance(region, int) and not isinstance(region, bool) and 0 <= region < 2**32:
        return region
    raise TypeError(f"a region is a Region or a region index, got {region!r}")


def _u64(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {value!r}")
    return value


def _u32(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**32:
        raise ValueError(f"{name} must be an int in [0, 2**32), got {value!r}")
    return value
