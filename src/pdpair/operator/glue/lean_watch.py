"""kopf's watch events arrive without `metadata.managedFields`.

kopf keeps the latest body of every pair live for the pair's two daemons, and queues each object's events until that
object's worker takes them. `metadata.managedFields` (one entry per field manager, each a tree of every field it set:
the creator's spec, the reconciler's status and metadata patches, the health watch's `status.health`) is the largest
part of a pair's body that nobody reads: kopf never looks at it, and neither does pdpair (the diff-base is off,
diffbase.py; the indexes keep views, observed.py). Dropped as each event is read, it is never queued or kept.

kopf has no setting for this. Its queueing looks the watch stream up as `kopf._cogs.clients.watching.infinite_watch`
(kopf 1.45) at each stream's start; `install()` wraps that function. If a kopf upgrade moves it, `install()` raises
and the operator does not start (and the unit test fails), rather than silently keeping the fields.
"""

from __future__ import annotations

import functools
from typing import Any, AsyncIterator, Callable

_WRAPPED = "_pdpair_lean_watch"


def strip(raw_event: Any) -> Any:
    """The event with `object.metadata.managedFields` removed (in place); anything else (a bookmark marker, an error
    event) as it came."""
    if isinstance(raw_event, dict):
        obj = raw_event.get("object")
        if isinstance(obj, dict):
            meta = obj.get("metadata")
            if isinstance(meta, dict):
                meta.pop("managedFields", None)
    return raw_event


def lean(watch: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """`watch` (an async generator function of raw events) with every event stripped."""
    if getattr(watch, _WRAPPED, False):
        return watch

    @functools.wraps(watch)
    async def lean_watch(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        stream = watch(*args, **kwargs)
        try:
            async for raw_event in stream:
                yield strip(raw_event)
        finally:
            await stream.aclose()

    setattr(lean_watch, _WRAPPED, True)
    return lean_watch


def install() -> None:
    """Wrap kopf's watch stream (idempotent). Raises RuntimeError when this kopf has no such function."""
    from kopf._cogs.clients import watching

    watch = getattr(watching, "infinite_watch", None)
    if watch is None:
        raise RuntimeError("kopf._cogs.clients.watching.infinite_watch is gone (a kopf upgrade?): lean_watch.py "
                           "cannot drop managedFields from kopf's watch events; update it for this kopf")
    watching.infinite_watch = lean(watch)
