"""No diff-base: kopf's `last-handled-configuration` is neither built nor stored.

kopf keeps a diff-base so that on.create / on.update / on.field handlers learn what changed. For that it builds the
"essence" of the object (a deep copy of its body) on **every** watch event of **every** watched kind (pairs, pods,
nodes, Services, PodDisruptionBudgets, role objects), and patches it into an annotation of each object that has a
changing handler. This operator has none of those handlers: its passes are level-triggered (reconciler.py reads the
live spec each pass), and the pair's one changing handler is on.delete (handlers.release_ports), which kopf detects
from `deletionTimestamp`, not from a diff. So the diff-base was pure cost: one deep copy per watch event and one PATCH
of each pair (plus the watch event that PATCH brings back, kopf's processing of it and the pass it woke): one of the
operator's ~20 writes per pair at 1000 pairs (docs/benchmarks.md).

`NoDiffBaseStorage` hands kopf one constant, empty essence as both the stored and the current one: every event that is
not a deletion is then "no change" (kopf's NOOP), nothing is stored, nothing is copied. `diff_dependent_handlers`
is what handlers.py checks at startup: an on.create/on.update/on.resume/on.field handler added later would never
fire with this storage, so the operator refuses to start with one instead of ignoring it silently.
"""

from __future__ import annotations

from typing import Any, Iterable

import kopf

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
