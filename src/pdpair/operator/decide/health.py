"""Is a pair healthy? The verdict from one tick's scrapes (scrape.py) and the pod facts; `status.health`, as the
health watch writes it and the reconciler reads it back, is health_status.py's. Pure: no I/O, no kopf (the planner
reads it).

The health daemon in the handlers calls, per pair and per tick:

    watched = watched_pods(pods, status.pairGeneration)    # instance key -> PodView (None: instance 0 is gone)
    targets = [ScrapeTarget(role, pod_name, pod_ip, metrics_port, instance), ...]   # those scrape_due says
    scrapes = await scrape.scrape_pods(targets, expected_generation=status.pairGeneration,
                                       hang_timeout_seconds=spec.connector.hangTimeoutSeconds, timeout=2.0)
    health, verdict = health_status.observe(status.get("health"), status.pairGeneration, scrapes,
                                            pods={key: view.raw for key, view in watched.items()}, now)
    patch = health_status.health_patch(status.get("health"), health, refresh_seconds)  # None: nothing worth a write
    ... patch status.health only, then wake the pair ...

and the reconciler reads the verdict back from `status.health` (`health_status.restart_finding`,
`signals_condition`), so nothing about health lives only in the operator's memory: a restarted operator reads the
same verdict and streaks.

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

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from pdpair import contract
from pdpair.contract import ROLES
from pdpair.operator.model.observed import PENDING_SCHEDULING, PodView, pending_for_scheduling

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
    "next_streak",
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
