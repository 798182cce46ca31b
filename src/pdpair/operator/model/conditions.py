"""Status helpers: the metav1.Condition setter that reports "changed" (timestamps come from model/timestamps.py).

lastTransitionTime moves only when the condition's status really flips; a reason or message change alone keeps
it. Callers write status only when something changed, so an idle pair causes no API writes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from pdpair.operator.model.timestamps import now_rfc3339

TRUE = "True"
FALSE = "False"
UNKNOWN = "Unknown"


@dataclass(frozen=True)
class Condition:
    type: str
    status: str
    reason: str
    message: str = ""

    def __post_init__(self) -> None:
        if self.status not in (TRUE, FALSE, UNKNOWN):
            raise ValueError(f"condition {self.type}: status must be True/False/Unknown, got {self.status!r}")
        if not self.reason or not self.reason[0].isalpha():
            raise ValueError(f"condition {self.type}: reason must be a CamelCase word, got {self.reason!r}")


def set_condition(
    conditions: list[dict[str, Any]],
    cond: Condition,
    *,
    observed_generation: int | None = None,
    now: str | None = None,
) -> bool:
    """Set `cond` in the list in place. Returns True when anything changed."""
    now = now or now_rfc3339()
    for existing in conditions:
        if existing.get("type") != cond.type:
            continue
        changed = False
        if existing.get("status") != cond.status:
            existing["status"] = cond.status
            existing["lastTransitionTime"] = now
            changed = True
        for key, value in (("reason", cond.reason), ("message", cond.message)):
            if existing.get(key) != value:
                existing[key] = value
                changed = True
        if observed_generation is not None and existing.get("observedGeneration") != observed_generation:
            existing["observedGeneration"] = observed_generation
            changed = True
        return changed
    new: dict[str, Any] = {
        "type": cond.type,
        "status": cond.status,
        "reason": cond.reason,
        "message": cond.message,
        "lastTransitionTime": now,
    }
    if observed_generation is not None:
        new["observedGeneration"] = observed_generation
    conditions.append(new)
    return True


def apply_conditions(
    conditions: Iterable[Mapping[str, Any]] | None,
    updates: Iterable[Condition],
    *,
    observed_generation: int | None = None,
    now: str | None = None,
) -> tuple[list[dict[str, Any]], bool]:
    """A copy of `conditions` with `updates` set, and whether anything changed."""
    result = [dict(c) for c in copy.deepcopy(list(conditions or []))]
    changed = False
    for cond in updates:
        changed |= set_condition(result, cond, observed_generation=observed_generation, now=now)
    return result, changed


def get_condition(conditions: Iterable[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions or () if c.get("type") == type_), None)


def status_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch (RFC 7386) that turns `old` status into `new`. Lists are replaced whole; a merge patch merges
    maps, so a key gone from a map (e.g. pods.router once the router is disabled) is sent as null."""
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if before == value:
            continue
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            patch[key] = {**dict(value), **{k: None for k in before if k not in value}}
        else:
            patch[key] = value
    return patch
