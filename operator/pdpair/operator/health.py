"""Is a pair healthy? Scrape each pod's /metrics (aiohttp, concurrent, per-pod timeout) and read its pod facts.

No kopf import; the health daemon/timer in the handlers calls, per pair and per tick:

    targets = [ScrapeTarget(role, pod_name, pod_ip, metrics_port), ...]
    scrapes = await scrape_pods(targets, expected_generation=status.pairGeneration,
                                hang_timeout_seconds=spec.connector.hangTimeoutSeconds, timeout=2.0)
    verdict = pair_verdict(scrapes, pods={"decode": decode_pod_or_None, "prefill": ...}, unreachable=tracker)
    if verdict.restart: ... restart_policy.decide(...) ... metrics.pair_restarted(ns, name, verdict.reason)

Pod verdicts (`PodState`): healthy; hung (per `pdpair.contract.is_hung`; the details name the stuck transfer,
read from the pod's /healthz); stale_generation (`pdpair_pair_generation` differs from the pair's); unreachable
(connect error, timeout, non-200, unparsable, or the contract's series missing).
The pair verdict adds pod facts, in this order of precedence: a pod vanished, a pod Failed, a container restarted,
a pod hung, a stale generation, a pod unreachable for `UnreachableTracker.threshold` scrapes in a row. A pod Pending
for scheduling makes the verdict `pending` (never restart then). Parsing uses prometheus-client's parser.
"""

from __future__ import annotations

import asyncio
import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pdpair import contract
from pdpair.operator.desired import PENDING_SCHEDULING, pending_for_scheduling

__all__ = [
    "ScrapeTarget",
    "PodState",
    "PodScrape",
    "PairVerdict",
    "UnreachableTracker",
    "parse_pod_metrics",
    "scrape_pod",
    "scrape_pods",
    "pod_fact",
    "pair_verdict",
    "REASON_HUNG",
    "REASON_STALE_GENERATION",
    "REASON_CONTAINER_RESTART",
    "REASON_POD_FAILED",
    "REASON_POD_VANISHED",
    "REASON_UNREACHABLE",
    "REASON_PORT_IN_USE",
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
RESTART_REASONS = (
    REASON_HUNG,
    REASON_STALE_GENERATION,
    REASON_CONTAINER_RESTART,
    REASON_POD_FAILED,
    REASON_POD_VANISHED,
    REASON_UNREACHABLE,
    REASON_PORT_IN_USE,
)


class PodState(str, enum.Enum):
    HEALTHY = "healthy"
    HUNG = "hung"
    STALE_GENERATION = "stale_generation"
    UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class ScrapeTarget:
    role: str
    pod: str
    host: str
    port: int

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


def parse_pod_metrics(text: str) -> PodMetrics:
    """Read the health-relevant series from exposition text; ValueError if it is not a pdpair pod's."""
    deficit: dict[str, float] = {}
    oldest = 0.0
    hang_timeout: float | None = None
    generation: float | None = None
    timeouts = 0.0
    seen: set[str] = set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == contract.SIGNAL_DEFICIT.name:
                peer = s.labels.get("peer", "")
                deficit[peer] = deficit.get(peer, 0.0) + s.value
            elif s.name == contract.SIGNAL_WAIT_OLDEST_SECONDS.name:
                oldest = max(oldest, s.value)
            elif s.name == contract.HANG_TIMEOUT_SECONDS.name:
                hang_timeout = s.value if hang_timeout is None else min(hang_timeout, s.value)
            elif s.name == contract.PAIR_GENERATION.name:
                generation = s.value
            elif s.name == contract.SIGNAL_WAIT_TIMEOUTS.name:
                timeouts += s.value
            else:
                continue
            seen.add(s.name)
    required = (contract.PAIR_GENERATION.name, contract.SIGNAL_WAIT_OLDEST_SECONDS.name)
    missing = [n for n in required if n not in seen]
    if missing:
        raise ValueError(f"not a pdpair pod's metrics: missing {', '.join(missing)}")
    if generation is None or not math.isfinite(generation) or generation != int(generation):
        raise ValueError(f"{contract.PAIR_GENERATION.name} is not an integer: {generation!r}")
    return PodMetrics(deficit, oldest, hang_timeout, int(generation), timeouts)


def _judge(
    target: ScrapeTarget, metrics: PodMetrics, expected_generation: int | None, hang_timeout_seconds: float | None
) -> tuple[PodState, str]:
    timeout = hang_timeout_seconds if hang_timeout_seconds is not None else metrics.hang_timeout_seconds
    if timeout is None:
        raise ValueError(
            f"no hang timeout for pod {target.pod}: pass the pair's, or the pod must export "
            f"{contract.HANG_TIMEOUT_SECONDS.name}"
        )
    if contract.is_hung(metrics.deficit, metrics.oldest_wait_seconds, timeout):
        return PodState.HUNG, (
            f"{target.role} pod {target.pod} hung: {metrics.deficit:g} signals missing, oldest wait "
            f"{metrics.oldest_wait_seconds:.1f}s > hang timeout {timeout:g}s"
        )
    if expected_generation is not None and metrics.generation != expected_generation:
        return PodState.STALE_GENERATION, (
            f"{target.role} pod {target.pod} reports generation {metrics.generation}, the pair is at "
            f"{expected_generation}"
        )
    return PodState.HEALTHY, f"{target.role} pod {target.pod} healthy"


async def scrape_pod(
    session: aiohttp.ClientSession,
    target: ScrapeTarget,
    *,
    expected_generation: int | None,
    hang_timeout_seconds: float | None = None,
    timeout: float = 2.0,
) -> PodScrape:
    """Scrape one pod within `timeout` seconds in total (never raises for the pod's faults)."""
    loop = asyncio.get_running_loop()
    started = loop.time()

    def done(state: PodState, message: str, metrics: PodMetrics | None = None, details=None) -> PodScrape:
        return PodScrape(target, state, message, metrics, details or {}, loop.time() - started)

    try:
        async with asyncio.timeout(timeout):
            async with session.get(target.url()) as resp:
                body = await resp.text()
                if resp.status != 200:
                    return done(PodState.UNREACHABLE, f"{target.url()} answered HTTP {resp.status}")
            try:
                metrics = parse_pod_metrics(body)
                state, message = _judge(target, metrics, expected_generation, hang_timeout_seconds)
            except ValueError as exc:
                return done(PodState.UNREACHABLE, f"{target.url()}: {exc}")
            details: dict[str, Any] = {}
            if state is PodState.HUNG:
                details = {"deficit_by_peer": metrics.deficit_by_peer, "oldest_wait_seconds": metrics.oldest_wait_seconds}
                stuck = await _stuck_transfer(session, target)
                if stuck:
                    details["transfer"] = stuck
                    message += (
                        f"; stuck transfer {stuck.get('id')} from {stuck.get('peer')}: "
                        f"{stuck.get('received')}/{stuck.get('expected')} signals"
                    )
            return done(state, message, metrics, details)
    except TimeoutError:
        return done(PodState.UNREACHABLE, f"{target.url()} did not answer within {timeout:g}s")
    except (aiohttp.ClientError, OSError) as exc:
        return done(PodState.UNREACHABLE, f"{target.url()}: {type(exc).__name__}: {exc}")


async def _stuck_transfer(session: aiohttp.ClientSession, target: ScrapeTarget) -> dict[str, Any] | None:
    """The transfer /healthz names (best effort: the verdict comes from /metrics alone)."""
    try:
        async with session.get(target.url(contract.HEALTHZ_PATH)) as resp:
            body = json.loads(await resp.text())
    except (aiohttp.ClientError, OSError, ValueError):
        return None
    transfer = body.get("transfer") if isinstance(body, dict) else None
    return transfer if isinstance(transfer, dict) else None


async def scrape_pods(
    targets: Sequence[ScrapeTarget],
    *,
    expected_generation: int | None,
    hang_timeout_seconds: float | None = None,
    timeout: float = 2.0,
    session: aiohttp.ClientSession | None = None,
) -> list[PodScrape]:
    """Scrape all targets concurrently; each has its own `timeout`, so one slow pod delays no other."""
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout!r}")
    own = session is None
    if own:
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout))
    try:
        return list(
            await asyncio.gather(
                *(
                    scrape_pod(
                        session,
                        t,
                        expected_generation=expected_generation,
                        hang_timeout_seconds=hang_timeout_seconds,
                        timeout=timeout,
                    )
                    for t in targets
                )
            )
        )
    finally:
        if own:
            await session.close()


# --- pod facts and the pair verdict ----------------------------------------------------------------
@dataclass(frozen=True)
class PodFact:
    role: str
    reason: str | None  # a REASON_* when the pod itself is failing, else None
    pending_scheduling: bool
    message: str


def pod_fact(role: str, pod: Mapping[str, Any] | None) -> PodFact:
    """What the pod object (API JSON, camelCase; None = not found) says about itself."""
    if pod is None:
        return PodFact(role, REASON_POD_VANISHED, False, f"{role} pod is gone")
    name = (pod.get("metadata") or {}).get("name", "?")
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return PodFact(role, REASON_POD_VANISHED, False, f"{role} pod {name} is being deleted")
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        why = status.get("reason") or status.get("message") or "no reason given"
        return PodFact(role, REASON_POD_FAILED, False, f"{role} pod {name} Failed: {why}")
    if status.get("phase") == "Succeeded":
        return PodFact(role, REASON_POD_FAILED, False, f"{role} pod {name} exited (Succeeded): a server must not end")
    for cs in status.get("containerStatuses") or []:
        count = cs.get("restartCount") or 0
        if count > 0:
            last = ((cs.get("lastState") or {}).get("terminated") or {}).get("reason") or "unknown"
            return PodFact(
                role,
                REASON_CONTAINER_RESTART,
                False,
                f"{role} pod {name}: container {cs.get('name')} restarted {count}x (last: {last})",
            )
    if pending_for_scheduling(pod):
        return PodFact(role, None, True, f"{role} pod {name} is {PENDING_SCHEDULING}")
    return PodFact(role, None, False, f"{role} pod {name} {status.get('phase', 'Unknown')}")


class UnreachableTracker:
    """Counts consecutive unreachable scrapes per pod; a pod is failing after `threshold` in a row.

    A pod that just started has no metrics server yet, so one failed scrape is no verdict.
    """

    def __init__(self, threshold: int = 3) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise ValueError(f"threshold must be an int >= 1, got {threshold!r}")
        self.threshold = threshold
        self._streaks: dict[str, int] = {}

    def update(self, scrapes: Iterable[PodScrape]) -> dict[str, int]:
        seen = set()
        for s in scrapes:
            seen.add(s.target.pod)
            self._streaks[s.target.pod] = self._streaks.get(s.target.pod, 0) + 1 if s.state is PodState.UNREACHABLE else 0
        for pod in list(self._streaks):
            if pod not in seen:
                del self._streaks[pod]
        return dict(self._streaks)

    def failing(self, pod: str) -> bool:
        return self._streaks.get(pod, 0) >= self.threshold


@dataclass(frozen=True)
class PairVerdict:
    restart: bool
    reason: str | None  # REASON_* when restart
    pending: bool  # a pod is Pending for scheduling: do not restart
    message: str
    scrapes: tuple[PodScrape, ...] = ()
    facts: tuple[PodFact, ...] = ()

    @property
    def hung(self) -> bool:
        return self.reason == REASON_HUNG


_PRECEDENCE = (REASON_POD_VANISHED, REASON_POD_FAILED, REASON_CONTAINER_RESTART)


def pair_verdict(
    scrapes: Sequence[PodScrape],
    pods: Mapping[str, Mapping[str, Any] | None],
    unreachable: UnreachableTracker | None = None,
) -> PairVerdict:
    """Combine one tick's scrapes with the pod objects (role -> pod or None) into a restart verdict.

    `unreachable` is updated with these scrapes; without one, a single unreachable scrape counts as failing.
    """
    facts = tuple(pod_fact(role, pod) for role, pod in pods.items())
    if unreachable is not None:
        unreachable.update(scrapes)
    scrapes = tuple(scrapes)
    for reason in _PRECEDENCE:
        for f in facts:
            if f.reason == reason:
                return PairVerdict(True, reason, False, f.message, scrapes, facts)
    pending = [f for f in facts if f.pending_scheduling]
    if pending:
        return PairVerdict(False, None, True, "; ".join(f.message for f in pending), scrapes, facts)
    for state, reason in ((PodState.HUNG, REASON_HUNG), (PodState.STALE_GENERATION, REASON_STALE_GENERATION)):
        for s in scrapes:
            if s.state is state:
                return PairVerdict(True, reason, False, s.message, scrapes, facts)
    for s in scrapes:
        if s.state is PodState.UNREACHABLE and (unreachable is None or unreachable.failing(s.target.pod)):
            return PairVerdict(True, REASON_UNREACHABLE, False, s.message, scrapes, facts)
    return PairVerdict(False, None, False, "healthy", scrapes, facts)
