"""glibc malloc settings and trimming for the operator process (issue 23, item 4: RSS at 1000 pairs).

The operator's RSS is a high-water mark: creating 1000 pairs churns large blocks (watch bodies decoded from JSON,
TLS buffers of 128 KiB per connection, API replies) through glibc's malloc, which keeps what is freed. A measurement
at 300 pairs (tracemalloc plus mallinfo2, mid-burst) saw 62 MiB free but kept inside malloc's heap beside 110 MiB in
use, and Python's own objects were 94 MiB of a 291 MiB RSS. Three settings, all glibc's own:

- `M_ARENA_MAX` 2: the 32 API threads otherwise get up to 8 x cores arenas, each keeping its own freed memory;
- `M_MMAP_THRESHOLD` fixed at 128 KiB: glibc raises the threshold each time a large mmapped block is freed (up to
  32 MiB), after which such blocks come from the heap and fragment it; fixed, they are mmapped and unmapped;
- `malloc_trim(0)` every TRIM_INTERVAL seconds (in a thread): gives the free pages inside the heap back to the OS.

On a libc without these (musl), each is a no-op. Nothing here changes what the operator keeps alive.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from typing import Any

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
ARENA_MAX = 2
MMAP_THRESHOLD = 128 * 1024
TRIM_INTERVAL = 10.0

_libc: Any = None


def libc() -> Any:
    """glibc through ctypes, or None when the C library has no mallopt/malloc_trim."""
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc = lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else False
        except OSError:
            _libc = False
    return _libc or None


def tune_malloc() -> bool:
    """Set the arena cap and the fixed mmap threshold (call early, before the API threads start). True if set."""
    lib = libc()
    if lib is None:
        return False
    ok = bool(lib.mallopt(M_ARENA_MAX, ARENA_MAX)) and bool(lib.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    if not ok:
        log.info("mallopt refused the arena cap or the mmap threshold")
    return ok


def trim() -> bool:
    """malloc_trim(0): True when memory went back to the OS."""
    lib = libc()
    return bool(lib.malloc_trim(0)) if lib is not None else False


async def trim_forever(interval: float = TRIM_INTERVAL) -> None:
    """Trim every `interval` seconds until cancelled (a task of the operator's startup)."""
    if libc() is None:
        return
    while True:
        await asyncio.sleep(interval)
        await asyncio.to_thread(trim)
