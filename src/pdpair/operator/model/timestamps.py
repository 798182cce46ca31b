"""The one owner of the operator's timestamps: RFC 3339 in whole seconds with a Z (`2026-12-06T10:53:32Z`), as
Kubernetes writes metav1.Time and as pdpair writes its own status fields (lastRestart.time, rollout.startedAt and
switchedAt, health.observedAt, conditions' lastTransitionTime, Events' times)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

RFC3339 = "%Y-%m-%dT%H:%M:%SZ"


def rfc3339(epoch_seconds: float) -> str:
    """Epoch seconds as RFC 3339 (UTC, whole seconds)."""
    return datetime.fromtimestamp(epoch_seconds, timezone.utc).strftime(RFC3339)


def now_rfc3339(now: datetime | None = None) -> str:
    """`now` (default: this moment) as RFC 3339 (UTC, whole seconds)."""
    now = now or datetime.now(timezone.utc)
    return now.astimezone(timezone.utc).strftime(RFC3339)


def parse(value: Any) -> datetime | None:
    """An RFC 3339 timestamp (whole seconds, Z) or a datetime (naive = UTC) as an aware datetime; None when empty
    or not in that form (a status field another writer spoiled is treated as absent, never raised)."""
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    if not value:
        return None
    try:
        return datetime.strptime(str(value), RFC3339).replace(tzinfo=timezone.utc)
    except ValueError:
        return None


def epoch(value: Any) -> float | None:
    """`parse(value)` as epoch seconds, None when it is None."""
    parsed = parse(value)
    return parsed.timestamp() if parsed is not None else None
