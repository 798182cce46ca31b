"""Every place pdpair reaches into kopf beyond its documented API, in one module: what to check when kopf is upgraded
(pinned in pyproject.toml). Each part fails loudly (the operator does not start, a unit test fails) if the kopf
internal it relies on moves, rather than silently losing what it buys.

1. The lean watch: kopf's watch events arrive without `metadata.managedFields`.

   kopf keeps the latest body of every pair live for the pair's two daemons, and queues each object's events until that
   object's worker takes them. `metadata.managedFields` (one entry per field manager, each a tree of every field it set:
   the creator's spec, the reconciler's status and metadata patches, the health watch's `status.health`) is the largest
   part of a pair's body that nobody reads: kopf never looks at it, and neither does pdpair (the diff-base is off,
   part 2; the indexes keep views, observed.py). Dropped as each event is read, it is never queued or kept.

   kopf has no setting for this. Its queueing looks the watch stream up as `kopf._cogs.clients.watching.infinite_watch`
   (kopf 1.45) at each stream's start; `install()` wraps that function. If a kopf upgrade moves it, `install()` raises
   and the operator does not start (and the unit test fails), rather than silently keeping the fields.

2. No diff-base: kopf's `last-handled-configuration` is neither built nor stored.

   kopf keeps a diff-base so that on.create / on.update / on.field handlers learn what changed. For that it builds the
   "essence" of the object (a deep copy of its body) on **every** watch event of **every** watched kind (pairs, pods,
   nodes, Services, PodDisruptionBudgets, role objects), and patches it into an annotation of each object that has a
   changing handler. This operator has none of those handlers: its passes are level-triggered (reconciler.py reads the
   live spec each pass), and the pair's one changing handler is on.delete (handlers.release_ports), which kopf detects
   from `deletionTimestamp`, not from a diff. So the diff-base was pure cost: one deep copy per watch event and one
   PATCH of each pair (plus the watch event that PATCH brings back, kopf's processing of it and the pass it woke): one
   of the operator's ~20 writes per pair at 1000 pairs (docs/benchmarks.md).

   `NoDiffBaseStorage` hands kopf one constant, empty essence as both the stored and the current one: every event that
   is not a deletion is then "no change" (kopf's NOOP), nothing is stored, nothing is copied. `diff_dependent_handlers`
   is what handlers.py checks at startup: an on.create/on.update/on.resume/on.field handler added later would never
   fire with this storage, so the operator refuses to start with one instead of ignoring it silently.

3. Quiet wake-ups: the "Handler '<name>' succeeded." INFO line kopf logs after each watch-event handler, dropped for
   the operator's wake-up handlers only (handlers.WAKE_UP_HANDLERS), by matching kopf's log text: 17.7k of the log's
   24k lines while 1000 pairs started, 5-7% of the event loop (py-spy). Failures are still logged.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, AsyncIterator, Callable, Iterable

import kopf

# --- 1. the lean watch ---------------------------------------------------------------------------------------------
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
        raise RuntimeError("kopf._cogs.clients.watching.infinite_watch is gone (a kopf upgrade?): kopf_internals.py "
                           "cannot drop managedFields from kopf's watch events; update it for this kopf")
    watching.infinite_watch = lean(watch)


# --- 2. no diff-base -----------------------------------------------------------------------------------------------
# The changing-handler reasons that work without a diff-base (kopf detects deletion from deletionTimestamp).
DIFF_FREE_REASONS = frozenset({"delete"})
EMPTY_ESSENCE: Any = kopf.BodyEssence()


class NoDiffBaseStorage(kopf.DiffBaseStorage):
    def build(self, *, body: Any, extra_fields: Iterable[Any] | None = None) -> Any:
        return EMPTY_ESSENCE

    def fetch(self, *, body: Any) -> Any:
        return EMPTY_ESSENCE

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        return None


def diff_dependent_handlers(registry: Any) -> list[str]:
    """The ids of registered changing handlers that need a diff-base (anything but on.delete): must be none."""
    found = []
    for handler in registry._changing.get_all_handlers():
        reason = getattr(handler, "reason", None)
        value = getattr(reason, "value", reason)
        if value not in DIFF_FREE_REASONS:
            found.append(str(handler.id))
    return found


# --- 3. quiet wake-ups ---------------------------------------------------------------------------------------------
class QuietWakeUps(logging.Filter):
    """A filter for kopf's object logger: drops the INFO "succeeded" line of the wake-up handlers, nothing else."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.messages = frozenset(f"Handler {name!r} succeeded." for name in names)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO and record.msg in self.messages)


def quiet_wake_ups(names: tuple[str, ...]) -> None:
    """Installs QuietWakeUps(names) on kopf's object logger, once."""
    objects = logging.getLogger("kopf.objects")
    if not any(isinstance(f, QuietWakeUps) for f in objects.filters):
        objects.addFilter(QuietWakeUps(names))
