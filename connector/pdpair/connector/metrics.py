"""Pod-side metrics and /healthz of the pdpair connector (no vllm import; safe anywhere).

Every metric comes from `pdpair.contract.POD_METRICS` (name, type, labels, help); nothing is retyped here.

Usage (one `SignalAccounts` per engine process and role; its registry is private, so three engines
created in a row in one process never collide on metric registration)::

    from pdpair.connector.metrics import SignalAccounts, serve

    accounts = SignalAccounts(role="decode", hang_timeout_seconds=60, generation=3)
    server = serve(port, accounts)                 # /metrics and /healthz in a daemon thread
    ...
    deadline = time.monotonic() + 60
    accounts.open_wait("req-1", peer="10.0.0.7:20001", expected_signals=12, deadline=deadline)
    accounts.on_signals("req-1", received_total=5)     # cumulative count for this transfer
    accounts.on_signals("req-1", received_total=12)
    accounts.close_wait("req-1", outcome="ok", nbytes=1 << 20, seconds=0.012)
    accounts.on_handshake("ok")
    accounts.set_listener_ready(rank=0, ready=True)
    accounts.set_transport_counters("10.0.0.7:20001", inflight=3, slots=256, requeues=17)  # requeues: cumulative
    accounts.set_pair_generation(4)
    ...
    server.stop()                                  # port is free again when this returns

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

import json
import math
import os
import re
import socket
import socketserver
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import Metric as MetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from pdpair import contract
from pdpair.httpserver import StoppableServer

__all__ = [
    "SignalAccounts",
    "HealthReport",
    "MetricsServer",
    "serve",
    "accounts_from_env",
    "declare_pod_metrics",
    "export_rank",
    "PeerRanks",
    "RankExporter",
]

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
        self._bytes = m[contract.KV_TRANSFER_BYTES.name].labels(role=role, rank=self.rank)
        self._seconds = m[contract.KV_TRANSFER_SECONDS.name].labels(role=role, rank=self.rank)
        self._listener = m[contract.LISTENER_READY.name]
        self._handshakes = m[contract.HANDSHAKES.name]
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
            self._listener.labels(role=role, rank=self.rank).set(0)  # 0 until this rank's listener binds
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

    def count_failed_transfer(self) -> None:
        """A transfer that failed before any wait was opened (no paired prefill, no free slot, broken pair)."""
        self._transfers.labels(role=self.role, rank=self.rank, outcome=contract.OUTCOME_ERROR).inc()

    # --- side channel and transport --------------------------------------------------------------
    def on_handshake(self, outcome: str) -> None:
        """Count one side-channel uid exchange (ok | timeout | error, or another short lower-case word)."""
        if not isinstance(outcome, str) or not re.fullmatch(r"[a-z][a-z_]{0,31}", outcome):
            raise ValueError(f"handshake outcome must be a short lower_case word, got {outcome!r}")
        self._handshakes.labels(role=self.role, rank=self.rank, outcome=outcome).inc()

    def set_listener_ready(self, rank: int, ready: bool) -> None:
        _check_count("rank", rank)
        if str(rank) != self.rank:
            raise ValueError(f"these accounts belong to TP rank {self.rank}, not {rank}")
        if not isinstance(ready, bool):
            raise ValueError(f"ready must be a bool, got {ready!r}")
        self._listener.labels(role=self.role, rank=str(rank)).set(1 if ready else 0)

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


# --- HTTP ------------------------------------------------------------------------------------------
class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass


def _app(accounts: SignalAccounts, ranks: "PeerRanks | None" = None) -> Callable:
    metrics_app = make_wsgi_app(accounts.registry if ranks is None else _MergedRegistry(accounts, ranks))

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == contract.HEALTHZ_PATH:
            if ranks is None:
                report = accounts.health()
                unhealthy, payload = report.hung, report.as_json()
            else:
                unhealthy, payload = _merged_health(accounts, ranks)
            body = json.dumps(payload).encode()
            status = "503 Service Unavailable" if unhealthy else "200 OK"
            start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        if path in (contract.METRICS_PATH, "/"):
            return metrics_app(environ, start_response)
        body = b"not found: try /metrics or /healthz\n"
        start_response("404 Not Found", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]

    return app


class MetricsServer(StoppableServer):
    """A running /metrics + /healthz server; `stop()` frees the port and joins the thread."""


def serve(
    port: int,
    accounts: SignalAccounts,
    hang_timeout_seconds: float | None = None,
    addr: str = "0.0.0.0",
    ranks: "PeerRanks | None" = None,
) -> MetricsServer:
    """Serve /metrics and /healthz for `accounts` on `port` (0 = any free port, see `.port`) in a daemon thread.

    `hang_timeout_seconds` defaults to the accounts' own; a different value is refused (one pod, one timeout).
    `ranks`: the other TP ranks of this engine (each a worker process running `export_rank`); their per-rank series
    are merged into /metrics and their verdicts into /healthz at every request.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    if hang_timeout_seconds is not None and float(hang_timeout_seconds) != accounts.hang_timeout_seconds:
        raise ValueError(
            f"hang_timeout_seconds {hang_timeout_seconds} differs from the accounts' {accounts.hang_timeout_seconds}"
        )
    httpd = make_server(addr, port, _app(accounts, ranks), ThreadingWSGIServer, handler_class=_QuietHandler)
    # A short poll interval makes stop() quick (shutdown waits for the serve loop to notice).
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, name=f"pdpair-metrics-{httpd.server_address[1]}"
    )
    thread.daemon = True
    thread.start()
    return MetricsServer(httpd, thread)


def accounts_from_env(environ: dict[str, str] | None = None, registry: CollectorRegistry | None = None) -> SignalAccounts:
    """Build accounts from PDPAIR_ROLE, PDPAIR_HANG_TIMEOUT_SECONDS and PDPAIR_GENERATION (as the operator sets them)."""
    env = os.environ if environ is None else environ
    missing = [n for n in (contract.ENV_ROLE, contract.ENV_HANG_TIMEOUT_SECONDS) if not env.get(n)]
    if missing:
        raise ValueError(f"missing environment: {', '.join(missing)}")
    try:
        timeout = float(env[contract.ENV_HANG_TIMEOUT_SECONDS])
        generation = int(env.get(contract.ENV_GENERATION, "0"))
    except ValueError as exc:
        raise ValueError(
            f"{contract.ENV_HANG_TIMEOUT_SECONDS} must be a number and {contract.ENV_GENERATION} an int: {exc}"
        ) from None
    return SignalAccounts(env[contract.ENV_ROLE], timeout, generation=generation, registry=registry)


# --- TP ranks: one pod, several worker processes, one metrics port -----------------------------------
# vLLM runs each TP rank in its own worker process, each with its own SignalAccounts. Rank 0 serves
# PDPAIR_METRICS_PORT; every other rank answers rank 0 on an abstract Unix socket named after that port (abstract:
# nothing on disk to clean up, gone when the process is). Rank 0 merges their per-rank series (those labelled `rank`)
# into /metrics and their verdicts into /healthz at each request, so a deficit on any rank is visible and judged.
RANK_FETCH_TIMEOUT_SECONDS = 1.0
_PER_RANK = frozenset(m.name for m in contract.POD_METRICS if "rank" in m.labels)


def rank_socket_name(metrics_port: int, rank: int) -> str:
    """The abstract Unix socket on which TP rank `rank` (> 0) of the engine serving `metrics_port` exports."""
    return f"\0pdpair-metrics-{metrics_port}-rank-{rank}"


def _family_key(name: str) -> str:
    """Contract name of a collected family (prometheus-client drops a counter's _total)."""
    return name if name in _PER_RANK else f"{name}_total"


def _snapshot(accounts: SignalAccounts) -> dict:
    families = []
    for family in accounts.registry.collect():
        if _family_key(family.name) not in _PER_RANK:
            continue  # pod-level series (generation, hang timeout): rank 0 exports its own
        families.append({
            "name": family.name, "type": family.type, "help": family.documentation,
            "samples": [[s.name, s.labels, s.value] for s in family.samples],
        })
    report = accounts.health()
    return {"rank": accounts.rank, "families": families, "health": {**report.as_json(), "hung": report.hung}}


class RankExporter:
    """TP rank > 0: answers each connection on `rank_socket_name` with a JSON snapshot of its accounts."""

    def __init__(self, metrics_port: int, accounts: SignalAccounts) -> None:
        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.sendall(json.dumps(_snapshot(accounts)).encode())

        class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True

        self.name = rank_socket_name(metrics_port, int(accounts.rank))
        self._server = Server(self.name, Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True,
            name=f"pdpair-rank-metrics-r{accounts.rank}",
        )
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"rank metrics thread {self._thread.name} did not stop within {timeout}s")


def export_rank(metrics_port: int, accounts: SignalAccounts) -> RankExporter:
    return RankExporter(metrics_port, accounts)


@dataclass(frozen=True)
class PeerRanks:
    """The other TP ranks of this engine, read through their exporters."""

    metrics_port: int
    ranks: tuple[int, ...]
    timeout: float = RANK_FETCH_TIMEOUT_SECONDS

    def fetch(self) -> dict[int, dict | str]:
        """rank -> its snapshot, or why it could not be read."""
        out: dict[int, dict | str] = {}
        for rank in self.ranks:
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.settimeout(self.timeout)
                    sock.connect(rank_socket_name(self.metrics_port, rank))
                    chunks = []
                    while chunk := sock.recv(65536):
                        chunks.append(chunk)
                out[rank] = json.loads(b"".join(chunks))
            except (OSError, ValueError) as exc:
                out[rank] = f"{type(exc).__name__}: {exc}"
        return out


class _MergedRegistry:
    """What make_wsgi_app needs of a registry: collect() yields rank 0's families with the other ranks' samples."""

    def __init__(self, accounts: SignalAccounts, ranks: PeerRanks) -> None:
        self._accounts, self._ranks = accounts, ranks

    def collect(self) -> Iterator:
        families = {f.name: f for f in self._accounts.registry.collect()}
        for snapshot in self._ranks.fetch().values():
            if not isinstance(snapshot, dict):
                continue  # unreachable: /healthz says so; its series are absent, never invented
            for remote in snapshot["families"]:
                family = families.get(remote["name"])
                if family is None:
                    family = families[remote["name"]] = MetricFamily(remote["name"], remote["help"], remote["type"])
                family.samples.extend(Sample(n, labels, float(v)) for n, labels, v in remote["samples"])
        yield from families.values()

    def restricted_registry(self, names):  # make_wsgi_app's ?name[]= filter
        return self


def _merged_health(accounts: SignalAccounts, ranks: PeerRanks) -> tuple[bool, dict]:
    """(unhealthy, body): hung if any rank is hung, 'rank_unreachable' if a rank cannot be read."""
    local = accounts.health()
    per_rank: dict[str, dict] = {accounts.rank: {**local.as_json(), "hung": local.hung}}
    unreachable: dict[str, str] = {}
    for rank, snapshot in ranks.fetch().items():
        if isinstance(snapshot, dict):
            per_rank[str(rank)] = snapshot["health"]
        else:
            unreachable[str(rank)] = snapshot
    hung = sorted((r for r, h in per_rank.items() if h["hung"]), key=int)
    body: dict = {
        "status": "hung" if hung else ("rank_unreachable" if unreachable else "ok"),
        "deficit": sum(h["deficit"] for h in per_rank.values()),
        "oldest_wait_seconds": max(h["oldest_wait_seconds"] for h in per_rank.values()),
        "hang_timeout_seconds": accounts.hang_timeout_seconds,
    }
    stuck = [(r, h["transfer"]) for r, h in per_rank.items() if "transfer" in h and (not hung or r in hung)]
    if stuck:
        rank, transfer = max(stuck, key=lambda item: item[1]["age_seconds"])
        body["transfer"] = {**transfer, "rank": int(rank)}
    body["ranks"] = {
        r: {"status": h["status"], "deficit": h["deficit"], "oldest_wait_seconds": h["oldest_wait_seconds"]}
        for r, h in sorted(per_rank.items(), key=lambda item: int(item[0]))
    }
    if unreachable:
        body["unreachable_ranks"] = unreachable
    return bool(hung or unreachable), body
