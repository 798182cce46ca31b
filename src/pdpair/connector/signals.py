"""The connector's signal accounting and hang detection: `SignalAccounts`, one per engine process, TP rank and
role, counts the completion signals each KV transfer waits for, decides when the pod is hung
(`pdpair.contract.is_hung`), and holds the pod metrics that follow from it on a private registry (so three engines
created in a row in one process never collide on metric registration). pod_server.py serves them (/metrics, /healthz,
TP ranks > 0); nothing here opens a socket. No vllm import; safe anywhere.

Semantics:
- One `SignalAccounts` per TP rank (`rank=`); every per-rank series carries `rank`. At TP > 1, rank 0 serves the
  pod's port with `serve(..., ranks=PeerRanks(port, (1, ...)))` and each other rank runs `export_rank(port, accounts)`;
  see "TP ranks" below.
- A wait is *open* from `open_wait` until `close_wait`. It is *waiting* while received < expected.
- `pdpair_signal_deficit{peer}` = sum of (expected - received) over open waits of that peer, computed at scrape
  time; every peer seen once keeps a series (0 when nothing is missing), so "deficit == 0" is observable.
- `pdpair_signal_wait_oldest_seconds` = age of the oldest wait still waiting (0 when none), at scrape time.
- `pdpair_hang_timeout_seconds` = the hang timeout this pod applies, so alert rules compare per pod without
  copying the timeout into the chart.
- `pdpair_signal_wait_timeouts_total` counts each wait once: when it is closed with outcome "timeout", or when a
  scrape (or /healthz) sees it still waiting past its deadline, whichever comes first. So a connector whose own wait
  is stuck still shows its timeouts.
- /healthz: 503 with JSON naming the oldest stuck transfer (id, peer, expected, received, age_seconds) when
  `pdpair.contract.is_hung(total deficit, oldest wait, hang timeout)`, else 200.

All methods are thread-safe (vLLM worker threads call them). Bad input raises ValueError at once.
"""

from __future__ import annotations

import math
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pdpair import contract

__all__ = ["SignalAccounts", "HealthReport", "StuckTransfer", "declare_pod_metrics"]

_LABEL_VALUE = re.compile(r"^[A-Za-z0-9_.:\-\[\]/]{1,128}$")
_OUTCOMES = (contract.OUTCOME_OK, contract.OUTCOME_TIMEOUT, contract.OUTCOME_ERROR)
# Derived at scrape time by _DerivedCollector rather than stored in prometheus-client objects.
_DERIVED = (contract.SIGNAL_DEFICIT, contract.SIGNAL_WAIT_OLDEST_SECONDS)


def _check_label(what: str, value: str) -> str:
    if not isinstance(value, str) or not _LABEL_VALUE.match(value):
        raise ValueError(f"{what} must be a non-empty string of [A-Za-z0-9_.:-[]/] (max 128), got {value!r}")
    return value


def _check_transfer_id(value: str) -> str:
    # Not a label (only /healthz shows it), so any request id vLLM or a client chose is fine.
    if not isinstance(value, str) or not value or len(value) > 1024:
        raise ValueError(f"transfer_id must be a non-empty string of at most 1024 characters, got {value!r}")
    return value


def _check_count(what: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an int >= 0, got {value!r}")
    return value


def _check_seconds(what: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


def declare_pod_metrics(registry: CollectorRegistry) -> dict[str, object]:
    """Create every stored pod metric of the contract on `registry`; returns {contract name: metric object}.

    The two derived gauges (deficit, oldest wait) are not created here: `SignalAccounts` exports them at scrape time.
    """
    kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
    made: dict[str, object] = {}
    for metric in contract.POD_METRICS:
        if metric in _DERIVED:
            continue
        factory = kinds.get(metric.kind)
        if factory is None:
            raise ValueError(f"contract metric {metric.name} has unknown kind {metric.kind!r}")
        made[metric.name] = factory(metric.base_name, metric.help, labelnames=metric.labels, registry=registry)
    return made


@dataclass
class _Wait:
    transfer_id: str
    peer: str
    expected: int
    received: int
    opened_at: float
    deadline: float
    timeout_counted: bool = False


@dataclass(frozen=True)
class StuckTransfer:
    transfer_id: str
    peer: str
    expected: int
    received: int
    age_seconds: float


@dataclass(frozen=True)
class HealthReport:
    hung: bool
    deficit: int
    oldest_wait_seconds: float
    hang_timeout_seconds: float
    stuck: StuckTransfer | None  # the oldest wait still missing signals, if any

    def as_json(self) -> dict:
        body: dict = {
            "status": "hung" if self.hung else "ok",
            "deficit": self.deficit,
            "oldest_wait_seconds": round(self.oldest_wait_seconds, 3),
            "hang_timeout_seconds": self.hang_timeout_seconds,
        }
        if self.stuck is not None:
            body["transfer"] = {
                "id": self.stuck.transfer_id,
                "peer": self.stuck.peer,
                "expected": self.stuck.expected,
                "received": self.stuck.received,
                "age_seconds": round(self.stuck.age_seconds, 3),
            }
        return body


class SignalAccounts:
    """The connector's signal bookkeeping and the pod metrics it implies (see the module docstring)."""

    def __init__(
        self,
        role: str,
        hang_timeout_seconds: float,
        *,
        generation: int = 0,
        rank: int = 0,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if role not in contract.ROLES:
            raise ValueError(f"role must be one of {contract.ROLES}, got {role!r}")
        hang_timeout_seconds = _check_seconds("hang_timeout_seconds", hang_timeout_seconds)
        if hang_timeout_seconds <= 0:
            raise ValueError(f"hang_timeout_seconds must be > 0, got {hang_timeout_seconds!r}")
        self.role = role
        self.rank = str(_check_count("rank", rank))  # the TP rank (worker) these accounts belong to
        self.hang_timeout_seconds = hang_timeout_seconds
        self.registry = registry if registry is not None else CollectorRegistry()
        self._clock = clock
        self._lock = threading.Lock()
        self._listener_failure: str | None = None  # decode: why its side-channel loop stopped (never reset)
        self._waits: dict[str, _Wait] = {}
        self._peers: set[str] = set()
        self._requeues_seen: dict[str, int] = {}

        # Registered first: its collect() counts waits past their deadline, so the timeout counter collected
        # after it in the same scrape already includes them.
        self.registry.register(_DerivedCollector(self))
        m = declare_pod_metrics(self.registry)
        self._expected = m[contract.SIGNALS_EXPECTED.name]
        self._received = m[contract.SIGNALS_RECEIVED.name]
        self._timeouts = m[contract.SIGNAL_WAIT_TIMEOUTS.name].labels(role=role, rank=self.rank)
        self._transfers = m[contract.KV_TRANSFERS.name]
        self._rejected = m[contract.KV_TRANSFERS_REJECTED.name]
        self._bytes = m[contract.KV_TRANSFER_BYTES.name].labels(role=role, rank=self.rank)
        self._seconds = m[contract.KV_TRANSFER_SECONDS.name].labels(role=role, rank=self.rank)
        self._blocks_held = m[contract.KV_BLOCKS_HELD.name].labels(role=role, rank=self.rank)  # 0 from the start
        self._listener = m[contract.LISTENER_READY.name]
        self._listener_failed = m[contract.LISTENER_FAILED.name]
        self._handshakes = m[contract.HANDSHAKES.name]
        self._paired_gauge = m[contract.PEER_PAIRED.name]
        self._paired: dict[str, bool] = {}  # prefill: decode peer label -> paired
        self._inflight = m[contract.TRANSPORT_INFLIGHT.name]
        self._slots = m[contract.TRANSPORT_SLOTS.name]
        self._requeues = m[contract.TRANSPORT_REQUEUES.name]
        self._generation = m[contract.PAIR_GENERATION.name]
        m[contract.HANG_TIMEOUT_SECONDS.name].labels(role=role).set(hang_timeout_seconds)
        # Series that exist from the start, so rules see 0 rather than "absent".
        for outcome in _OUTCOMES:
            self._transfers.labels(role=role, rank=self.rank, outcome=outcome)
            self._handshakes.labels(role=role, rank=self.rank, outcome=outcome)
        if role == contract.ROLE_DECODE:
            for reason in contract.REJECTED_REASONS:
                self._rejected.labels(role=role, rank=self.rank, reason=reason)
            self._listener.labels(role=role, rank=self.rank).set(0)  # 0 until this rank's listener binds
            self._listener_failed.labels(role=role, rank=self.rank).set(0)
        # Prefill: each decode's pdpair_peer_paired{peer} is 0 from the moment the worker takes it into its peer set
        # (set_paired(False, peer)) until its edge pairs.
        self.set_pair_generation(generation)

    # --- transfers -------------------------------------------------------------------------------
    def open_wait(self, transfer_id: str, peer: str, expected_signals: int, deadline: float) -> None:
        """Start waiting for `expected_signals` from `peer`; `deadline` is a time.monotonic() value."""
        _check_transfer_id(transfer_id)
        _check_label("peer", peer)
        _check_count("expected_signals", expected_signals)
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not math.isfinite(deadline):
            raise ValueError(f"deadline must be a finite time.monotonic() value, got {deadline!r}")
        with self._lock:
            if transfer_id in self._waits:
                raise ValueError(f"transfer {transfer_id!r} already has an open wait")
            self._waits[transfer_id] = _Wait(transfer_id, peer, expected_signals, 0, self._clock(), float(deadline))
            self._remember_peer(peer)
            self._expected.labels(role=self.role, rank=self.rank, peer=peer).inc(expected_signals)

    def on_signals(self, transfer_id: str, received_total: int) -> None:
        """Record that `received_total` signals (cumulative, for this transfer) have arrived."""
        _check_count("received_total", received_total)
        with self._lock:
            wait = self._open(transfer_id)
            if received_total < wait.received:
                raise ValueError(
                    f"transfer {transfer_id!r}: received_total went down ({wait.received} -> {received_total})"
                )
            if received_total > wait.expected:
                raise ValueError(
                    f"transfer {transfer_id!r}: {received_total} signals received but only {wait.expected} expected"
                )
            self._received.labels(role=self.role, rank=self.rank, peer=wait.peer).inc(received_total - wait.received)
            wait.received = received_total

    def close_wait(self, transfer_id: str, outcome: str, nbytes: int, seconds: float) -> None:
        """Finish a transfer: outcome is ok | timeout | error; nbytes moved; seconds it took."""
        if outcome not in _OUTCOMES:
            raise ValueError(f"outcome must be one of {_OUTCOMES}, got {outcome!r}")
        _check_count("nbytes", nbytes)
        seconds = _check_seconds("seconds", seconds)
        with self._lock:
            wait = self._open(transfer_id)
            del self._waits[transfer_id]
            if outcome == contract.OUTCOME_TIMEOUT and not wait.timeout_counted:
                self._timeouts.inc()
            self._transfers.labels(role=self.role, rank=self.rank, outcome=outcome).inc()
            self._bytes.inc(nbytes)
            self._seconds.observe(seconds)

    def count_rejected_transfer(self, reason: str) -> None:
        """A load that failed because its data was refused on arrival (close_wait counts it as an error too)."""
        if reason not in contract.REJECTED_REASONS:
            raise ValueError(f"reason must be one of {contract.REJECTED_REASONS}, got {reason!r}")
        self._rejected.labels(role=self.role, rank=self.rank, reason=reason).inc()

    def count_failed_transfer(self) -> None:
        """A transfer that failed before any wait was opened (no paired prefill, no free slot, broken pair)."""
        self._transfers.labels(role=self.role, rank=self.rank, outcome=contract.OUTCOME_ERROR).inc()

    # --- side channel and transport --------------------------------------------------------------
    def on_handshake(self, outcome: str) -> None:
        """Count one side-channel uid exchange (ok | timeout | error, or another short lower-case word)."""
        if not isinstance(outcome, str) or not re.fullmatch(r"[a-z][a-z_]{0,31}", outcome):
            raise ValueError(f"handshake outcome must be a short lower_case word, got {outcome!r}")
        self._handshakes.labels(role=self.role, rank=self.rank, outcome=outcome).inc()

    def set_paired(self, paired: bool, peer: str) -> None:
        """Prefill: this rank finished the handshake with decode `peer` (True), or has not yet / its side channel
        dropped (False). The first call for a peer creates its series."""
        if self.role != contract.ROLE_PREFILL:
            raise ValueError(f"only prefill pairs with a peer; these accounts are {self.role}'s")
        if not isinstance(paired, bool):
            raise ValueError(f"paired must be a bool, got {paired!r}")
        _check_label("peer", peer)
        with self._lock:
            self._paired[peer] = paired
            self._paired_gauge.labels(role=self.role, rank=self.rank, peer=peer).set(1 if paired else 0)

    def forget_peer(self, peer: str) -> None:
        """Prefill: decode `peer` left the peer set (its edge is closed): its pdpair_peer_paired series goes."""
        with self._lock:
            if self._paired.pop(peer, None) is not None:
                try:
                    self._paired_gauge.remove(self.role, self.rank, peer)
                except KeyError:
                    pass

    @property
    def paired(self) -> bool:
        """Prefill: this rank is paired with at least one decode (its readiness)."""
        with self._lock:
            return any(self._paired.values())

    def paired_peers(self) -> dict[str, bool]:
        """Prefill: each decode of the peer set -> paired."""
        with self._lock:
            return dict(self._paired)

    def set_listener_ready(self, rank: int, ready: bool) -> None:
        _check_count("rank", rank)
        if str(rank) != self.rank:
            raise ValueError(f"these accounts belong to TP rank {self.rank}, not {rank}")
        if not isinstance(ready, bool):
            raise ValueError(f"ready must be a bool, got {ready!r}")
        self._listener.labels(role=self.role, rank=str(rank)).set(1 if ready else 0)

    def set_listener_failed(self, reason: str) -> None:
        """Decode: this rank's side-channel loop stopped without being asked to (it pairs no prefill any more);
        decode's /readyz answers 503 naming `reason` from now on (metrics.readiness), so the pod is replaced."""
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"reason must be a non-empty string, got {reason!r}")
        with self._lock:
            self._listener_failure = reason[:1024]
        # The series the health watch and the alert read (contract.LISTENER_FAILED); /readyz reads the reason.
        self._listener_failed.labels(role=self.role, rank=self.rank).set(1)

    @property
    def listener_failure(self) -> str | None:
        """Why this rank's side-channel loop stopped, None while it serves (or never started)."""
        with self._lock:
            return self._listener_failure

    def set_blocks_held(self, blocks: int) -> None:
        """Prefill: the KV blocks of finished requests it holds for a decode's Pull right now."""
        self._blocks_held.set(_check_count("blocks", blocks))

    def set_transport_counters(self, peer: str, inflight: int, slots: int, requeues: int) -> None:
        """Copy the transport's per-peer counters; `requeues` is the transport's cumulative count.

        A lower `requeues` than last time means the transport was recreated: counting restarts from it.
        """
        _check_label("peer", peer)
        _check_count("inflight", inflight)
        _check_count("slots", slots)
        _check_count("requeues", requeues)
        with self._lock:
            last = self._requeues_seen.get(peer, 0)
            delta = requeues - last if requeues >= last else requeues
            self._requeues_seen[peer] = requeues
            self._inflight.labels(rank=self.rank, peer=peer).set(inflight)
            self._slots.labels(rank=self.rank, peer=peer).set(slots)
            self._requeues.labels(rank=self.rank, peer=peer).inc(delta)

    def set_pair_generation(self, generation: int) -> None:
        _check_count("generation", generation)
        self._generation.set(generation)

    # --- derived state ---------------------------------------------------------------------------
    def health(self) -> HealthReport:
        """Deficit, oldest wait and verdict now; also counts waits that passed their deadline."""
        deficits, report = self._evaluate()
        del deficits
        return report

    def open_transfers(self) -> int:
        with self._lock:
            return len(self._waits)

    def _evaluate(self) -> tuple[dict[str, int], HealthReport]:
        with self._lock:
            now = self._clock()
            deficits = {peer: 0 for peer in self._peers}
            oldest: _Wait | None = None
            for wait in self._waits.values():
                missing = wait.expected - wait.received
                if missing <= 0:
                    continue
                deficits[wait.peer] += missing
                if oldest is None or wait.opened_at < oldest.opened_at:
                    oldest = wait
                if now >= wait.deadline and not wait.timeout_counted:
                    wait.timeout_counted = True
                    self._timeouts.inc()
            total = sum(deficits.values())
            oldest_age = max(0.0, now - oldest.opened_at) if oldest else 0.0
            stuck = (
                StuckTransfer(oldest.transfer_id, oldest.peer, oldest.expected, oldest.received, oldest_age)
                if oldest
                else None
            )
        hung = contract.is_hung(total, oldest_age, self.hang_timeout_seconds)
        return deficits, HealthReport(hung, total, oldest_age, self.hang_timeout_seconds, stuck)

    def _open(self, transfer_id: str) -> _Wait:
        wait = self._waits.get(transfer_id)
        if wait is None:
            raise ValueError(f"transfer {transfer_id!r} has no open wait (never opened, or already closed)")
        return wait

    def _remember_peer(self, peer: str) -> None:
        if peer not in self._peers:
            self._peers.add(peer)
            self._received.labels(role=self.role, rank=self.rank, peer=peer)


class _DerivedCollector(Collector):
    """Exports the deficit and oldest-wait gauges from the open waits at scrape time."""

    def __init__(self, accounts: SignalAccounts) -> None:
        self._accounts = accounts

    def describe(self) -> Iterable:
        return [self._deficit_family(), self._oldest_family()]

    def collect(self) -> Iterator:
        deficits, report = self._accounts._evaluate()
        deficit = self._deficit_family()
        for peer, missing in sorted(deficits.items()):
            deficit.add_metric([self._accounts.role, self._accounts.rank, peer], missing)
        yield deficit
        oldest = self._oldest_family()
        oldest.add_metric([self._accounts.role, self._accounts.rank], report.oldest_wait_seconds)
        yield oldest

    @staticmethod
    def _deficit_family() -> GaugeMetricFamily:
        m = contract.SIGNAL_DEFICIT
        return GaugeMetricFamily(m.name, m.help, labels=m.labels)

    @staticmethod
    def _oldest_family() -> GaugeMetricFamily:
        m = contract.SIGNAL_WAIT_OLDEST_SECONDS
        return GaugeMetricFamily(m.name, m.help, labels=m.labels)
