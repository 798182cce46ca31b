"""glibc malloc settings and trimming for the operator process (RSS at 1000 pairs: docs/benchmarks.md).

The operator's RSS is a high-water mark: creating 1000 pairs churns large blocks (watch bodies decoded from JSON,
TLS buffers of 128 KiB per connection, API replies) through glibc's malloc, which keeps what is freed. A measurement
at 300 pairs (tracemalloc plus mallinfo2, mid-burst) saw 62 MiB free but kept inside malloc's heap beside 110 MiB in
use, and Python's own objects were 94 MiB of a 291 MiB RSS. Three settings, all glibc's own:

- `M_ARENA_MAX` 2: the 32 API threads otherwise get up to 8 x cores arenas, each keeping its own freed memory;
- `M_MMAP_THRESHOLD` fixed at 128 KiB: glibc raises the threshold each time a large mmapped block is freed (up to
  32 MiB), after which such blocks come from the heap and fragment it; fixed, they are mmapped and unmapped;
- `malloc_trim(0)` every TRIM_INTERVAL seconds (in a thread): gives the free pages inside the heap back to the OS.

On a libc without these (musl), each is a no-op. Nothing here changes what the operator keeps alive.

Python's cyclic garbage collector, tuned for the same process (`tune_gc`, `freeze_startup`): with its defaults
(700, 10, 10) it ran about 85 young collections a second while 1000 pairs started, so any object living past a
tenth of a second (a pass's frames and futures across an API call, a reply waiting for its thread) was promoted to
the oldest generation, and full collections (each one walks every tracked object of the process) ran 34 times on
the way to Ready, up to 1.7 s each: 37 of the operator's 61 CPU-seconds went to the collector (measured with
gc.callbacks, docs/benchmarks.md). `GC_THRESHOLDS` lets young objects die young (a young collection every 50000 net
allocations instead of 700), and `freeze_startup` moves what the startup made (modules, kopf, the kubernetes client:
about 147000 objects) out of the collector's sight for good: 9 s in the collector with both. Reference cycles are
still collected, only less often.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
from typing import Any

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
ARENA_MAX = 2
MMAP_THRESHOLD = 128 * 1024
TRIM_INTERVAL = 10.0

GC_THRESHOLDS = (50_000, 20, 20)  # gc.set_threshold: young, middle, old (CPython's defaults: 700, 10, 10)

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


def tune_gc() -> None:
    """Set GC_THRESHOLDS (call early, as tune_malloc)."""
    gc.set_threshold(*GC_THRESHOLDS)


def freeze_startup() -> int:
    """Collect once, then move every object the startup made into the collector's permanent generation (gc.freeze),
    so no later collection walks them. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


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
