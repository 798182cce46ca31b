"""Is a pair healthy? The verdict from one tick's scrapes (scrape.py) and the pod facts, and `status.health` as the
health watch writes it and the reconciler reads it back. Pure: no I/O, no kopf (the planner reads it).

The health daemon in the handlers calls, per pair and per tick:

    watched = watched_pods(pods, status.pairGeneration)    # instance key -> PodView (None: instance 0 is gone)
    targets = [ScrapeTarget(role, pod_name, pod_ip, metrics_port, instance), ...]   # those scrape_due says
    scrapes = await scrape.scrape_pods(targets, expected_generation=status.pairGeneration,
                                       hang_timeout_seconds=spec.connector.hangTimeoutSeconds, timeout=2.0)
    health, verdict = observe(status.get("health"), status.pairGeneration, scrapes,
                              pods={key: view.raw for key, view in watched.items()}, now)
    patch = health_patch(status.get("health"), health, refresh_seconds)  # None: nothing worth a write
    ... patch status.health only, then wake the pair ...

and the reconciler reads the verdict back from `status.health` (`restart_finding`, `signals_condition`), so nothing
about health lives only in the operator's memory: a restarted operator reads the same verdict and streaks.

Pod verdicts (`PodState`, judged by scrape.py): healthy; listener_lost (a decode reports its side-channel loop
stopped, `pdpair_listener_failed`; or, judged here, its side-channel ports refused the watch's TCP probe
`LISTENER_REFUSED_THRESHOLD` ticks in a row); hung (per `pdpair.contract.is_hung`; the details name the
stuck transfer, read from the pod's /healthz); stale_generation (`pdpair_pair_generation` differs from the pair's);
unreachable (connect error, timeout, non-200, unparsable, or the contract's series missing).
The pair verdict adds pod facts, in this order of precedence: a pod vanished, a pod Failed, a container restarted,
a decode's listener lost, a pod hung, a stale generation, a pod unreachable for `UNREACHABLE_THRESHOLD` scrapes in a
row (the streak is kept
in `status.health.roles.<role>.unreachableStreak`, or `status.health.instances.<role>-<index>` for an instance
>= 1). A pod Pending for scheduling makes the verdict `pending` (never restart then). Each rule is applied over every
watched instance (xPyD: every engine pod of the generation, `watched_pods`), and the verdict names the pod it is
about (`PairVerdict.pod`, `status.health.pod`, `Finding.pod`): the planner replaces that instance alone where it can.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping, Sequence

from pdpair import contract
from pdpair.contract import PHASE_FAILED, PHASE_READY, PHASE_RESTARTING, ROLES
from pdpair.operator.model.observed import PENDING_SCHEDULING, Finding, PodView, pending_for_scheduling
from pdpair.operator.model import timestamps
from pdpair.operator.model.conditions import FALSE, TRUE, UNKNOWN, Condition
from pdpair.operator.model.timestamps import now_rfc3339

__all__ = [
    "instance_key",
    "watched_pods",
    "scrape_due",
    "ScrapeTarget",
    "PodState",
    "PodScrape",
    "PairVerdict",
    "UNREACHABLE_THRESHOLD",
    "LISTENER_REFUSED_THRESHOLD",
    "watch_generation",
    "HEALTH_REFRESH_INTERVALS",
    "VERDICT_HEALTHY",
    "VERDICT_UNHEALTHY",
    "VERDICT_PENDING",
    "next_streak",
    "observe",
    "meaningful",
    "health_patch",
    "merge_patch",
    "read_health",
    "newest",
    "restart_finding",
    "signals_condition",
    "pod_fact",
    "container_config_error",
    "CONFIG_ERROR_REASONS",
    "pair_verdict",
    "REASON_HUNG",
    "REASON_STALE_GENERATION",
    "REASON_CONTAINER_RESTART",
    "REASON_POD_FAILED",
    "REASON_POD_VANISHED",
    "REASON_UNREACHABLE",
    "REASON_PORT_IN_USE",
    "REASON_NODE_LOST",
    "REASON_NODE_DRAIN",
    "REASON_LISTENER_LOST",
    "RESTART_REASONS",
]

# Restart reasons; the same words are the `reason` label of pdpair_operator_pair_restarts_total.
REASON_HUNG = "hung"
REASON_STALE_GENERATION = "stale_generation"
REASON_CONTAINER_RESTART = "container_restart"
REASON_POD_FAILED = "pod_failed"
REASON_POD_VANISHED = "pod_vanished"
REASON_UNREACHABLE = "unreachable"
REASON_PORT_IN_USE = "port_in_use"  # a leased port was busy on the node: re-leased, restarted outside the budget
REASON_NODE_LOST = "node_lost"  # a current pod's node is lost (nodes.py): its ports fenced, re-homed elsewhere
REASON_NODE_DRAIN = "node_drain"  # a Recreate pair's current pod is on a cordoned node: moved, outside the budget
# A served generation's decode lost its side-channel listener (it reports the loop stopped, or its ports refuse the
# watch's probe): prefill can no longer pair with it, so every request through the pair fails. Counted in the budget,
# like a hang: a listener that keeps dying is the pair's fault.
REASON_LISTENER_LOST = "listener_lost"
RESTART_REASONS = (
    REASON_HUNG,
    REASON_STALE_GENERATION,
    REASON_CONTAINER_RESTART,
    REASON_POD_FAILED,
    REASON_POD_VANISHED,
    REASON_UNREACHABLE,
    REASON_PORT_IN_USE,
    REASON_NODE_LOST,
    REASON_NODE_DRAIN,
    REASON_LISTENER_LOST,
)


class PodState(str, enum.Enum):
    HEALTHY = "healthy"
    LISTENER_LOST = "listener_lost"
    HUNG = "hung"
    STALE_GENERATION = "stale_generation"
    UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class ScrapeTarget:
    role: str
    pod: str
    host: str
    port: int
    instance: int = 0  # the pod's index within its role (label pdpair.io/instance): where its entry goes in status

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError(f"pod {self.pod!r} ({self.role}): no host (pod IP not known yet?)")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise ValueError(f"pod {self.pod!r} ({self.role}): metrics port must be 1..65535, got {self.port!r}")

    def url(self, path: str = contract.METRICS_PATH) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{path}"


@dataclass(frozen=True)
class PodMetrics:
    """What the health watch reads from one pod's exposition."""

    deficit_by_peer: dict[str, float]
    oldest_wait_seconds: float
    hang_timeout_seconds: float | None
    generation: int | None
    wait_timeouts: float
    transfers_ok: float = 0.0  # pdpair_kv_transfers_total{outcome="ok"}, summed over ranks
    listener_failed: tuple[str, ...] = ()  # TP ranks whose pdpair_listener_failed is 1 (decode: its loop stopped)

    @property
    def deficit(self) -> float:
        return sum(self.deficit_by_peer.values())


@dataclass(frozen=True)
class PodScrape:
    target: ScrapeTarget
    state: PodState
    message: str
    metrics: PodMetrics | None = None
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0  # how long the scrape took


# --- which pods the watch judges ----------------------------------------------------------------------
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


def instance_key(role: str, instance: int) -> str:
    """An engine instance's key in status.health: its role for instance 0 (`status.health.roles.<role>`, the key a
    1P1D pair always had), `<role>-<index>` for the others (`status.health.instances.<role>-<index>`)."""
    return role if instance == 0 else f"{role}-{instance}"


def _role_of(key: str) -> str:
    return key.partition("-")[0]  # roles have no dash (contract.ROLES)


def watched_pods(pods: Iterable[PodView], generation: int) -> dict[str, PodView | None]:
    """The engine pods of `generation` the health watch judges, by `instance_key`: instance 0 of each role first (in
    contract.ROLES order; None when the role has none: the pair lost it), then every other instance by role and
    index, except one draining or being deleted: a scale-down (or a user) is removing it, and vLLM exits 0 on
    SIGTERM, so its end is no failure (the rule of recreate.broken_reason). An instance >= 1 that is not there is not
    judged either (instances.py creates it)."""
    first: dict[str, PodView | None] = {role: None for role in ROLES}
    others: list[PodView] = []
    for pod in pods:
        if pod.generation != generation or pod.role not in first:
            continue
        if pod.instance == 0:
            first[pod.role] = pod
        elif not pod.deleting and pod.draining_since is None:
            others.append(pod)
    others.sort(key=lambda p: (ROLES.index(p.role), p.instance))
    return {**first, **{instance_key(p.role, p.instance): p for p in others}}


def scrape_due(pod: PodView) -> bool:
    """Whether the watch scrapes this watched pod: it has an address and its engine has started (every container
    passed its startup probe: vLLM's /health, once the model is loaded), or it is Ready. The watch runs only for a
    Ready pair, but an instance of it can still be loading: a scale-up's, or one replaced alone (instance 0 too:
    instances.heal), and its metrics server may not answer while it loads. Scraping it then would count that as
    unreachable and replace an instance that is only slow to load (the real nodes showed that loop: a replaced decode
    0 replaced again every ~40 s until its budget was spent). Its failures before that are pod facts (Failed,
    restarted), judged anyway, and the kubelet's startup probe is its deadline, as for the pair's first start."""
    if not pod.ip:
        return False
    if pod.ready:
        return True
    statuses = ((pod.raw or {}).get("status") or {}).get("containerStatuses") or []
    return bool(statuses) and all(cs.get("started") for cs in statuses)


# --- pod facts and the pair verdict ----------------------------------------------------------------
@dataclass(frozen=True)
class PodFact:
    role: str
    reason: str | None  # a REASON_* when the pod itself is failing, else None
    pending_scheduling: bool
    message: str
    pod: str = ""  # the pod's name ("" when no pod object was found: nothing to name)


# A container waiting with one of these reasons cannot be created from its configuration: a Secret or ConfigMap, or
# a key in one, that its env names is missing (spec.apiKeySecret's Secret, a template's secretKeyRef), or its image
# runs as root under runAsNonRoot. The kubelet retries by itself and the pod stays Pending, started once the object
# exists; a restart would meet the same error, so it is no restart reason: the planner names it in the pair's status.
CONFIG_ERROR_REASONS = ("CreateContainerConfigError",)


def container_config_error(pod: Mapping[str, Any] | None) -> str:
    """Why a container of the pod (API JSON; init containers first) cannot be created from its configuration: the
    kubelet's waiting reason and message (e.g. `secret "pair-api-key" not found`, `couldn't find key api-key in Secret
    ns/pair-api-key`); "" when none waits so."""
    status = (pod or {}).get("status") or {}
    for cs in list(status.get("initContainerStatuses") or []) + list(status.get("containerStatuses") or []):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in CONFIG_ERROR_REASONS:
            return (f"container {cs.get('name')} cannot be created ({waiting['reason']}): "
                    f"{waiting.get('message') or 'no message given'}")
    return ""


def pod_fact(role: str, pod: Mapping[str, Any] | None) -> PodFact:
    """What the pod object (API JSON, camelCase; None = not found) says about itself."""
    if pod is None:
        return PodFact(role, REASON_POD_VANISHED, False, f"{role} pod is gone")
    name = (pod.get("metadata") or {}).get("name", "?")
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return PodFact(role, REASON_POD_VANISHED, False, f"{role} pod {name} is being deleted", name)
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        why = status.get("reason") or status.get("message") or "no reason given"
        return PodFact(role, REASON_POD_FAILED, False, f"{role} pod {name} Failed: {why}", name)
    if status.get("phase") == "Succeeded":
        return PodFact(role, REASON_POD_FAILED, False, f"{role} pod {name} exited (Succeeded): a server must not end",
                       name)
    for cs in status.get("containerStatuses") or []:
        count = cs.get("restartCount") or 0
        if count > 0:
            last = ((cs.get("lastState") or {}).get("terminated") or {}).get("reason") or "unknown"
            return PodFact(
                role,
                REASON_CONTAINER_RESTART,
                False,
                f"{role} pod {name}: container {cs.get('name')} restarted {count}x (last: {last})",
                name,
            )
    if pending_for_scheduling(pod):
        return PodFact(role, None, True, f"{role} pod {name} is {PENDING_SCHEDULING}", name)
    if config_error := container_config_error(pod):  # no restart reason: the kubelet retries, a restart would not help
        return PodFact(role, None, False, f"{role} pod {name}: {config_error}", name)
    return PodFact(role, None, False, f"{role} pod {name} {status.get('phase', 'Unknown')}", name)


UNREACHABLE_THRESHOLD = 3  # a pod that just started has no metrics server yet: one failed scrape is no verdict
# A served decode's side-channel ports refusing the watch's TCP probe (connection refused, or a self-connect: nothing
# listens) this many ticks in a row is a lost listener. Two, not one: a refusal is a definite answer (a probe that
# times out counts neither way: a loaded operator or node is no verdict), but one tick may fall in the moment a
# listener is re-bound; two ticks are one health interval apart (10 s by default), so the verdict comes within
# 2 intervals (20 s), a third of the default 60 s hang timeout, leaving the restart's own latency room inside it. A
# decode that reports its loop stopped (pdpair_listener_failed) is judged at once, on the first tick.
LISTENER_REFUSED_THRESHOLD = 2


def next_streak(previous: int, unreachable: bool) -> int:
    """The unreachable streak after one more scrape. Capped at the threshold: past it nothing changes, so a pod that
    stays silent does not rewrite status every interval."""
    return min(UNREACHABLE_THRESHOLD, max(0, previous) + 1) if unreachable else 0


@dataclass(frozen=True)
class PairVerdict:
    restart: bool
    reason: str | None  # REASON_* when restart
    pending: bool  # a pod is Pending for scheduling: do not restart
    message: str
    scrapes: tuple[PodScrape, ...] = ()
    facts: tuple[PodFact, ...] = ()
    pod: str = ""  # the pod a restart verdict is about ("" = the pair as a whole, or no restart)

    @property
    def hung(self) -> bool:
        return self.reason == REASON_HUNG


_PRECEDENCE = (REASON_POD_VANISHED, REASON_POD_FAILED, REASON_CONTAINER_RESTART)


def pair_verdict(
    scrapes: Sequence[PodScrape],
    pods: Mapping[str, Mapping[str, Any] | None],
    unreachable_streaks: Mapping[str, int] | None = None,
) -> PairVerdict:
    """Combine one tick's scrapes with the pod objects (`instance_key` -> pod or None: `watched_pods`; a 1P1D pair's
    keys are its roles) into a restart verdict. Each rule of the precedence is applied over every instance before
    the next rule, in the order of `pods` and of `scrapes`; the verdict names the pod it is about.

    `unreachable_streaks` (pod name -> consecutive unreachable scrapes, this one included): a pod is failing at
    UNREACHABLE_THRESHOLD. Without it, a single unreachable scrape counts as failing.
    """
    facts = tuple(pod_fact(_role_of(key), pod) for key, pod in pods.items())
    scrapes = tuple(scrapes)
    for reason in _PRECEDENCE:
        for f in facts:
            if f.reason == reason:
                return PairVerdict(True, reason, False, f.message, scrapes, facts, f.pod)
    pending = [f for f in facts if f.pending_scheduling]
    if pending:
        return PairVerdict(False, None, True, "; ".join(f.message for f in pending), scrapes, facts)
    # A lost listener first: prefill's transfers to that decode then hang too, and the listener is why.
    for state, reason in ((PodState.LISTENER_LOST, REASON_LISTENER_LOST), (PodState.HUNG, REASON_HUNG),
                          (PodState.STALE_GENERATION, REASON_STALE_GENERATION)):
        for s in scrapes:
            if s.state is state:
                return PairVerdict(True, reason, False, s.message, scrapes, facts, s.target.pod)
    for s in scrapes:
        if s.state is PodState.UNREACHABLE and (
            unreachable_streaks is None or unreachable_streaks.get(s.target.pod, 0) >= UNREACHABLE_THRESHOLD
        ):
            return PairVerdict(True, REASON_UNREACHABLE, False, s.message, scrapes, facts, s.target.pod)
    return PairVerdict(False, None, False, "healthy", scrapes, facts)


# --- status.health: what the watch writes and the reconciler reads back -------------------------------
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
