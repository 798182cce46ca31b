"""When a failing pair may be restarted: backoff, a restart budget per window, and the scheduling gate.

Pure functions on numbers and timestamps (seconds since the epoch); no client, no clock, no kopf.

- The first restart in a window happens at once; restart k+1 waits `backoff_for(k)` after restart k, where
  backoff_for(n) = min(backoffSeconds * 2**(n-1), maxBackoffSeconds).
- At most `maxRestarts` restarts within any `windowSeconds`: one more is "budget exhausted" (phase Failed, stop).
- Never restart while a pair pod is Pending for scheduling (LWS's RecreateGroupAfterStart idea: a pair that has not
  started cannot be repaired by recreating it, it would only burn the budget).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from pdpair.operator.model.observed import PENDING_SCHEDULING

__all__ = [
    "RestartPolicy",
    "Action",
    "Decision",
    "backoff_for",
    "restarts_in_window",
    "prune",
    "decide",
]


@dataclass(frozen=True)
class RestartPolicy:
    """spec.restartPolicy of an InferencePair (defaults as in the CRD)."""

    max_restarts: int = 5
    window_seconds: float = 1800
    backoff_seconds: float = 10
    max_backoff_seconds: float = 300

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"restartPolicy.maxRestarts must be an int >= 0, got {self.max_restarts!r}")
        for name, value in (
            ("windowSeconds", self.window_seconds),
            ("backoffSeconds", self.backoff_seconds),
            ("maxBackoffSeconds", self.max_backoff_seconds),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"restartPolicy.{name} must be a finite number >= 0, got {value!r}")
        if self.window_seconds <= 0:
            raise ValueError(f"restartPolicy.windowSeconds must be > 0, got {self.window_seconds!r}")
        if self.max_backoff_seconds < self.backoff_seconds:
            raise ValueError(
                f"restartPolicy.maxBackoffSeconds ({self.max_backoff_seconds}) must be >= backoffSeconds "
                f"({self.backoff_seconds})"
            )

    @classmethod
    def from_spec(cls, restart_policy: Mapping[str, Any] | None) -> "RestartPolicy":
        """From the CRD's camelCase `spec.restartPolicy` (missing keys take the defaults)."""
        spec = dict(restart_policy or {})
        known = {"maxRestarts", "windowSeconds", "backoffSeconds", "maxBackoffSeconds"}
        unknown = set(spec) - known
        if unknown:
            raise ValueError(f"restartPolicy: unknown keys {sorted(unknown)} (known: {sorted(known)})")
        d = cls()
        return cls(
            max_restarts=spec.get("maxRestarts", d.max_restarts),
            window_seconds=spec.get("windowSeconds", d.window_seconds),
            backoff_seconds=spec.get("backoffSeconds", d.backoff_seconds),
            max_backoff_seconds=spec.get("maxBackoffSeconds", d.max_backoff_seconds),
        )


def backoff_for(policy: RestartPolicy, n: int) -> float:
    """The wait after the n-th restart (n >= 1) of a window before the next one may happen."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if policy.backoff_seconds == 0:
        return 0.0
    # 2**(n-1) overflows floats for large n; past the cap the answer is the cap anyway.
    if n - 1 >= 64 or policy.backoff_seconds * 2 ** (n - 1) >= policy.max_backoff_seconds:
        return float(policy.max_backoff_seconds)
    return float(policy.backoff_seconds * 2 ** (n - 1))


def _times(restart_times: Iterable[float]) -> list[float]:
    out = []
    for t in restart_times:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ValueError(f"restart times must be finite numbers (epoch seconds), got {t!r}")
        out.append(float(t))
    return sorted(out)


def restarts_in_window(policy: RestartPolicy, restart_times: Iterable[float], now: float) -> list[float]:
    """The restarts that count against the budget at `now` (those less than windowSeconds old), oldest first."""
    return [t for t in _times(restart_times) if now - t < policy.window_seconds]


def prune(policy: RestartPolicy, restart_times: Iterable[float], now: float) -> list[float]:
    """What is worth storing in status: the restarts still inside the window."""
    return restarts_in_window(policy, restart_times, now)


class Action(str, enum.Enum):
    RESTART_NOW = "RestartNow"
    WAIT = "Wait"  # backoff: try again at `not_before`
    BUDGET_EXHAUSTED = "BudgetExhausted"  # phase Failed, stop restarting
    PENDING_SCHEDULING = "PendingScheduling"  # a pod is not scheduled yet: do nothing


@dataclass(frozen=True)
class Decision:
    action: Action
    restarts_in_window: int
    not_before: float | None = None  # epoch seconds, for WAIT
    message: str = ""


def decide(
    policy: RestartPolicy, restart_times: Iterable[float], now: float, *, pods_pending_scheduling: bool = False
) -> Decision:
    """May a pair that needs a restart be restarted at `now`? `restart_times`: earlier restarts (epoch seconds)."""
    recent = restarts_in_window(policy, restart_times, now)
    count = len(recent)
    if pods_pending_scheduling:
        return Decision(Action.PENDING_SCHEDULING, count, message=f"a pair pod is {PENDING_SCHEDULING}: not restarting")
    if count >= policy.max_restarts:
        return Decision(
            Action.BUDGET_EXHAUSTED,
            count,
            message=f"{count} restarts within {policy.window_seconds:g}s (maxRestarts {policy.max_restarts})",
        )
    if count:
        not_before = recent[-1] + backoff_for(policy, count)
        if now < not_before:
            return Decision(
                Action.WAIT,
                count,
                not_before=not_before,
                message=f"backing off {not_before - now:.1f}s more after restart {count} of this window",
            )
    return Decision(Action.RESTART_NOW, count, message=f"restart {count + 1} of at most {policy.max_restarts}")
