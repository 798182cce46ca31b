"""Which watch events wake a pair's reconcile pass: those that change something the pass reads.

Every watch event of a pair, of its PodDisruptionBudget and of its role objects used to wake the pair's pass
(handlers.py: Runtime.wake). Most of them change nothing a pass reads: the operator's own status writes to the pair
(3-4 per pair while it starts) and to its role objects (2-3), and the disruption controller's status updates of the
PDB. Each still cost a pass (observe, plan, compare status) and kept the event loop busy while 1000 pairs started.
The pass reads its own status writes from its write-through copy (reconciler.PairReconciler.status), never from
the event, and every step that waits on something no event announces comes back by its own delay (pass_timing.py).

A key per object holds what a pass reads of it; an event wakes the pair when the key differs from the one its last
event had (the first event of an object always wakes). Comparing with the last event, not with what the last pass
saw, keeps kopf's batching safe: when a spec change and an own status write reach kopf in one batch, kopf hands over
the latest body, whose generation differs from the last one seen, and it wakes.

- pair: metadata.generation (the spec), labels, annotations (restart records, kopf's handler progress),
  deletionTimestamp, and status.health (the health watch's findings, written by the health daemon: a restart decision
  waits on it); not the rest of status, which only this pair's reconciler writes;
- PodDisruptionBudget and role object: metadata.generation (the spec: the budget's shape, the role's replicas,
  bumped by the apiserver on spec changes only), labels, owner references, deletionTimestamp; not status (the
  disruption controller's for a PDB, this operator's own for a role object).

Pods are not filtered: the pass reads their status (phase, readiness, IP, node), which is what their events bring.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

EVENT_DELETED = "DELETED"


def _frozen(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def pair_key(body: Mapping[str, Any]) -> tuple:
    meta = body.get("metadata") or {}
    return (meta.get("generation"), meta.get("deletionTimestamp"), _frozen(meta.get("labels")),
            _frozen(meta.get("annotations")), _frozen((body.get("status") or {}).get("health")))


def dependent_key(body: Mapping[str, Any]) -> tuple:
    """A PodDisruptionBudget's or a role object's: its spec (by generation) and what ties it to its pair."""
    meta = body.get("metadata") or {}
    return (meta.get("generation"), meta.get("deletionTimestamp"), _frozen(meta.get("labels")),
            _frozen([ref.get("uid") for ref in meta.get("ownerReferences") or []]))


class WakeFilter:
    """The last key seen per (kind, object uid); `changed` says whether an event should wake the pair."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], tuple] = {}

    def changed(self, kind: str, uid: str, key: tuple, event_type: str | None) -> bool:
        if event_type == EVENT_DELETED:
            self._seen.pop((kind, uid), None)
            return True
        before = self._seen.get((kind, uid))
        self._seen[(kind, uid)] = key
        return before != key

    def __len__(self) -> int:
        return len(self._seen)
