"""`status.health`: what the health watch writes (`observe`: the pair verdict of one tick with the streaks carried
over from the last write, per role for instance 0 and per `<role>-<index>` beyond it; `health_patch`: a write only
when something meaningful changed, else every `HEALTH_REFRESH_INTERVALS` ticks) and what the reconciler and the
planner read back (`read_health`, `newest`, `restart_finding`, `signals_condition`). Pure: no I/O, no kopf. Separate
from health.py, which judges pods and the pair from one tick's scrapes; this module only records and reads that
judgement, so nothing about health lives only in the operator's memory."""

from __future__ import annotations

import dataclasses
import math
from datetime import datetime, timezone
from typing import Any, Mapping, Sequence

from pdpair import contract
from pdpair.contract import PHASE_FAILED, PHASE_READY, PHASE_RESTARTING
from pdpair.operator.decide.health import (
    LISTENER_REFUSED_THRESHOLD,
    REASON_UNREACHABLE,
    RESTART_REASONS,
    PairVerdict,
    PodScrape,
    PodState,
    instance_key,
    next_streak,
    pair_verdict,
)
from pdpair.operator.model import timestamps
from pdpair.operator.model.conditions import FALSE, TRUE, UNKNOWN, Condition
from pdpair.operator.model.observed import Finding
from pdpair.operator.model.timestamps import now_rfc3339

__all__ = [
    "watch_generation",
    "HEALTH_REFRESH_INTERVALS",
    "VERDICT_HEALTHY",
    "VERDICT_UNHEALTHY",
    "VERDICT_PENDING",
    "observe",
    "meaningful",
    "health_patch",
    "merge_patch",
    "read_health",
    "newest",
    "restart_finding",
    "signals_condition",
]

VERDICT_HEALTHY = "Healthy"
VERDICT_UNHEALTHY = "Unhealthy"
VERDICT_PENDING = "Pending"
VERDICTS = (VERDICT_HEALTHY, VERDICT_UNHEALTHY, VERDICT_PENDING)
# A change of verdict, reason, the pod it names, an instance's pod, state, streak, or whether signals are missing is
# written at once (over `roles` and `instances`); anything else (observedAt, oldest wait, the exact deficit,
# transfer counts, scrape times) at most every this many health intervals (5 min at the default 10 s): 1000 idle pairs then cost 3.3 writes/s, and a busy pair (its transfer count
# and in-flight deficit move every scrape) no more than an idle one.
HEALTH_REFRESH_INTERVALS = 30
MESSAGE_MAX = 1024


def _role_entry(
    scrape: PodScrape, before: Mapping[str, Any], stamp: str, unreachable: bool | None = None, listener_streak: int = 0
) -> dict[str, Any]:
    """One instance's entry (a `roles` or an `instances` entry: one shape): `before` is the same pod's entry from
    status ({} for a new pod or generation). `unreachable`: whether the scrape itself failed (default: its state
    says so; a state judged from the listener probe keeps the scrape's own streak). `listener_streak`: a decode's
    refused side-channel probes in a row, written only when above 0 (a healthy entry keeps the shape it had)."""
    entry: dict[str, Any] = {
        "pod": scrape.target.pod,
        "state": scrape.state.value,
        "deficit": int(before.get("deficit") or 0),
        "oldestWaitSeconds": float(before.get("oldestWaitSeconds") or 0.0),
        "transfers": int(before.get("transfers") or 0),
        "unreachableStreak": next_streak(int(before.get("unreachableStreak") or 0),
                                         scrape.state is PodState.UNREACHABLE if unreachable is None else unreachable),
    }
    if listener_streak > 0:
        entry["listenerStreak"] = listener_streak
    for key in ("lastTransferTime", "lastScrapeTime"):
        if before.get(key):
            entry[key] = before[key]
    m = scrape.metrics
    if m is not None:  # it answered: the numbers are fresh (unreachable keeps the last ones it told)
        count = int(m.transfers_ok)
        # Grown since the count in status, or a counter that restarted from 0 and has counted again.
        if count > entry["transfers"] or (count < entry["transfers"] and count > 0):
            entry["lastTransferTime"] = stamp
        entry.update(deficit=int(m.deficit), oldestWaitSeconds=round(m.oldest_wait_seconds, 1), transfers=count,
                     lastScrapeTime=stamp)
    return entry


def next_listener_streak(previous: int, refused: tuple[int, ...] | None) -> int:
    """A decode's refused side-channel probes in a row after one more tick: `refused` is the ports that refused
    (() = every rank accepted: back to 0; None = not probed, or no definite answer: unchanged). Capped at the
    threshold, as the unreachable streak, so a dead listener does not rewrite status every tick."""
    if refused is None:
        return max(0, previous)
    return min(LISTENER_REFUSED_THRESHOLD, max(0, previous) + 1) if refused else 0


def _listener_lost(scrape: PodScrape, streak: int, refused: tuple[int, ...] | None) -> PodScrape:
    """The scrape, judged listener_lost once its decode's probe refused LISTENER_REFUSED_THRESHOLD ticks in a row
    (whatever its /metrics said: a pod that still answers there but no longer listens serves nobody)."""
    if streak < LISTENER_REFUSED_THRESHOLD or scrape.state is PodState.LISTENER_LOST:
        return scrape
    t = scrape.target
    ports = f"port{'s' if refused and len(refused) > 1 else ''} {', '.join(map(str, refused))}" if refused else "ports"
    return dataclasses.replace(scrape, state=PodState.LISTENER_LOST, message=(
        f"{t.role} pod {t.pod}: side-channel listener lost: {t.host} refused the operator's probe on {ports}, "
        f"{streak} health checks in a row"))


def _same_pod(entries: Any, key: str, pod: str) -> Mapping[str, Any]:
    """The written entry `key` if it is about `pod`, else {}: nothing carries over to another pod."""
    entry = entries.get(key) if isinstance(entries, Mapping) else None
    return entry if isinstance(entry, Mapping) and entry.get("pod") == pod else {}


def observe(
    previous: Mapping[str, Any] | None,
    generation: int,
    scrapes: Sequence[PodScrape],
    pods: Mapping[str, Mapping[str, Any] | None],
    now: datetime | None = None,
    refused: Mapping[str, tuple[int, ...] | None] | None = None,
) -> tuple[dict[str, Any], PairVerdict]:
    """One scrape of a Ready pair (or of one that served and lost Ready: watch_generation) -> (the new
    `status.health`, the verdict). `previous` is `status.health` as written
    (None or another generation's: nothing carries over). `pods` is pair_verdict's (instance key -> pod object).
    `refused`: per decode pod name, the side-channel ports that refused the watch's TCP probe this tick (() = all
    accepted; None or absent = no definite answer, the streak holds; next_listener_streak).

    Instance 0 of each role is written under `roles.<role>` (as a 1P1D pair always had it), every other scraped
    instance under `instances.<role>-<index>` (the key is left out when there is none, so a 1P1D pair's status is
    what it was); `pod` names the pod of an Unhealthy verdict (left out otherwise, or when it is about the pair as a
    whole). Streaks and transfer counts carry over per entry only while its pod is the same."""
    stamp = now_rfc3339(now)
    before = read_health(previous)
    same_generation = before is not None and before.get("pairGeneration") == generation
    prior_roles = (before.get("roles") or {}) if same_generation else {}
    prior_instances = (before.get("instances") or {}) if same_generation else {}
    roles: dict[str, dict[str, Any]] = {}
    instances: dict[str, dict[str, Any]] = {}
    judged: list[PodScrape] = []
    for scrape in scrapes:
        key = instance_key(scrape.target.role, scrape.target.instance)
        table, prior = (roles, prior_roles) if scrape.target.instance == 0 else (instances, prior_instances)
        before_entry = _same_pod(prior, key, scrape.target.pod)
        ports = (refused or {}).get(scrape.target.pod)
        streak = next_listener_streak(int(before_entry.get("listenerStreak") or 0), ports)
        unreachable = scrape.state is PodState.UNREACHABLE
        scrape = _listener_lost(scrape, streak, ports)
        judged.append(scrape)
        table[key] = _role_entry(scrape, before_entry, stamp, unreachable, streak)
    streaks = {e["pod"]: e["unreachableStreak"] for e in (*roles.values(), *instances.values())}
    verdict = pair_verdict(judged, pods, unreachable_streaks=streaks)
    word = VERDICT_UNHEALTHY if verdict.restart else VERDICT_PENDING if verdict.pending else VERDICT_HEALTHY
    health: dict[str, Any] = {
        "pairGeneration": generation,
        "observedAt": stamp,
        "verdict": word,
        "reason": verdict.reason or "",
        "message": verdict.message[:MESSAGE_MAX],
        "roles": roles,
    }
    if verdict.restart and verdict.pod:
        health["pod"] = verdict.pod
        uid = next(((p.get("metadata") or {}).get("uid") for p in pods.values()
                    if p and (p.get("metadata") or {}).get("name") == verdict.pod), None)
        if uid:  # the replaced instance's pod comes back under the same name: the uid tells the two apart
            health["podUid"] = str(uid)
    if instances:
        health["instances"] = instances
    return health, verdict


def _meaningful_entries(entries: Any) -> tuple:
    if not isinstance(entries, Mapping):
        return ()
    return tuple(sorted((key, e.get("pod"), e.get("state"), e.get("unreachableStreak"), bool(e.get("deficit")),
                         e.get("listenerStreak") or 0)
                        for key, e in entries.items() if isinstance(e, Mapping)))


def meaningful(health: Mapping[str, Any] | None) -> tuple:
    """What a write is due for at once: the verdict, the pod it names, and each instance's pod, state, streaks and
    'signals missing or not' (instance 0's under `roles`, the others' under `instances`)."""
    if not health:
        return ()
    return (
        health.get("pairGeneration"), health.get("verdict"), health.get("reason"), health.get("pod") or "",
        _meaningful_entries(health.get("roles")), _meaningful_entries(health.get("instances")),
    )


def _age_seconds(stamp: Any, now: datetime) -> float:
    then = timestamps.parse(stamp)
    return (now - then).total_seconds() if then is not None else math.inf


def health_patch(
    previous: Mapping[str, Any] | None, health: Mapping[str, Any], refresh_seconds: float, now: datetime | None = None
) -> dict[str, Any] | None:
    """The merge patch of `status.health` that is due now, or None: a meaningful change is written at once, the
    rest only once the written observedAt is `refresh_seconds` old."""
    now = now or datetime.now(timezone.utc)
    if previous and meaningful(previous) == meaningful(health) and (
        _age_seconds(previous.get("observedAt"), now) < refresh_seconds
    ):
        return None
    patch = merge_patch(previous or {}, health)
    return patch or None


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The RFC 7386 merge patch turning `old` into `new`, recursively (a key gone is sent as null)."""
    patch: dict[str, Any] = {k: None for k in old if k not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            inner = merge_patch(before, value)
            if inner:
                patch[key] = inner
        elif before != value:
            patch[key] = value
    return patch


def watch_generation(status: Mapping[str, Any] | None) -> int | None:
    """The generation the watch judges now, or None (nothing to judge). A Ready pair's; and one that served and is
    Ready no more while status.health is still about it (the watch judged it while it was Ready), unless it is
    restarting or Failed. That second case is the point: a pair whose decode lost its listener loses Ready within
    about 16 s (prefill's readiness needs the pairing, decode's /readyz fails at once, 16 probes of 1 s each), and
    its phase goes back to PrefillStarting; a watch that judged only Ready pairs then stopped judging it, and
    status.health kept saying Healthy, with no restart, for as long as the pods lived. A generation still starting
    is never judged (the kubelet's startup probe is its deadline); a restart moves pairGeneration past the health."""
    status = status or {}
    generation = int(status.get("pairGeneration") or 0)
    phase = status.get("phase")
    if not generation or phase in (PHASE_RESTARTING, PHASE_FAILED):
        return None
    if phase == PHASE_READY:
        return generation
    judged = read_health(status.get("health"))
    return generation if judged is not None and judged["pairGeneration"] == generation else None


def read_health(health: Any) -> Mapping[str, Any] | None:
    """`status.health` if it is one this operator could have written, else None (never judged)."""
    if not isinstance(health, Mapping) or health.get("verdict") not in VERDICTS:
        return None
    generation = health.get("pairGeneration")
    if isinstance(generation, bool) or not isinstance(generation, int):
        return None
    return health


def newest(written: Any, listed: Any) -> Mapping[str, Any] | None:
    """The newer of the watch's own last write and the body's `status.health` (the body may lag behind our write;
    by (pairGeneration, observedAt): RFC 3339 UTC strings of one format sort by time). A tie goes to our write."""
    ours, theirs = read_health(written), read_health(listed)
    if ours is None or theirs is None:
        return ours if theirs is None else theirs
    key = lambda h: (h["pairGeneration"], str(h.get("observedAt") or ""))  # noqa: E731
    return ours if key(ours) >= key(theirs) else theirs


def _current(health: Any, generation: int) -> Mapping[str, Any] | None:
    h = read_health(health)
    return h if h is not None and h["pairGeneration"] == generation else None


def restart_finding(health: Any, generation: int | None = None) -> Finding | None:
    """The restart finding `status.health` holds about `generation` (default: the generation it judged), if its
    verdict is unhealthy; `Finding.pod` is the pod it names (`status.health.pod`; "" = the pair as a whole)."""
    h = read_health(health)
    if h is None or (generation is not None and h["pairGeneration"] != generation) or h["verdict"] != VERDICT_UNHEALTHY:
        return None
    reason = h.get("reason")
    return Finding(reason if reason in RESTART_REASONS else REASON_UNREACHABLE, str(h.get("message") or "unhealthy"),
                   int(h["pairGeneration"]), pod=str(h.get("pod") or ""), pod_uid=str(h.get("podUid") or ""))


def announce(verdict: Any, told: Finding | None) -> bool:
    """Whether a tick's verdict is news to tell (an Unhealthy Event): it asks for a restart and status did not
    already hold a restart finding about that pod. Once per verdict about a pod: an xPyD pair whose hung instance
    was replaced alone keeps its generation, so a later hang of another instance is news too."""
    return bool(verdict.restart) and (told is None or told.pod != verdict.pod)


def condition_reason(code: str | None) -> str:
    """A restart reason code as a condition reason: hung -> Hung, stale_generation -> StaleGeneration."""
    return "".join(part.capitalize() for part in (code or "unhealthy").split("_"))


def signals_condition(health: Any, generation: int) -> Condition:
    """SignalsHealthy from `status.health`. Each new generation starts Unknown (NotJudged), so a verdict about an
    older one (e.g. the hang that caused this restart) never stands."""
    h = _current(health, generation)
    if h is None:
        return Condition(contract.COND_SIGNALS_HEALTHY, UNKNOWN, "NotJudged",
                         f"no signal-health verdict for generation {generation} yet")
    message = str(h.get("message") or "")[:MESSAGE_MAX]
    if h["verdict"] == VERDICT_UNHEALTHY:
        return Condition(contract.COND_SIGNALS_HEALTHY, FALSE, condition_reason(h.get("reason")), message)
    if h["verdict"] == VERDICT_PENDING:
        return Condition(contract.COND_SIGNALS_HEALTHY, UNKNOWN, "PodsPending", message)
    return Condition(contract.COND_SIGNALS_HEALTHY, TRUE, "Healthy", message)
