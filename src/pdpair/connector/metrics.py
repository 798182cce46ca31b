"""The connector's pod metrics server: /metrics, /healthz and /readyz of the signal accounts (signals.py), and the TP
ranks' exporters (no vllm import; safe anywhere).

Every metric comes from `pdpair.contract.POD_METRICS` (name, type, labels, help); nothing is retyped here.

Usage (one `SignalAccounts` per engine process and role; its registry is private, so three engines
created in a row in one process never collide on metric registration)::

    from pdpair.connector.metrics import serve
    from pdpair.connector.signals import SignalAccounts

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

Semantics of the accounts (waits, deficit, oldest wait, timeouts, /healthz's verdict): signals.py, where they are
decided. Here: /healthz answers 503 with JSON naming the oldest stuck transfer (id, peer, expected, received,
age_seconds) when the accounts say hung, else 200. /readyz (every engine pod's readiness probe) answers 200 once every
rank is paired with at least one decode of its peer set (prefill), the engine's own /health answers 200 and its warm-up is done (`readiness`). At TP > 1, rank 0 serves the pod's port with
`serve(..., ranks=PeerRanks(port, (1, ...)))` and each other rank runs `export_rank(port, accounts)`; see "TP
ranks" below.
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import threading
import urllib.request
from dataclasses import dataclass
from typing import Callable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import Metric as MetricFamily
from prometheus_client.samples import Sample

from pdpair import contract
from pdpair.httpserver import StoppableServer

from .signals import SignalAccounts
from .warmup import Warmup

__all__ = [
    "MetricsServer",
    "serve",
    "accounts_from_env",
    "export_rank",
    "PeerRanks",
    "RankExporter",
]


# --- HTTP ------------------------------------------------------------------------------------------
class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass


def _json(start_response, ok: bool, payload: dict) -> list[bytes]:
    body = json.dumps(payload).encode()
    status = "200 OK" if ok else "503 Service Unavailable"
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


ENGINE_HEALTH_TIMEOUT_SECONDS = 2.0  # below the readiness probe's 3 s timeout (pods.READINESS_PROBE) and the router's 2.5 s ask


def _engine_serves(url: str | None) -> str | None:
    """None when the engine's own /health answers 200 (or no URL: nothing to check), else why not."""
    if url is None:
        return None
    try:
        with urllib.request.urlopen(url, timeout=ENGINE_HEALTH_TIMEOUT_SECONDS) as resp:
            return None if resp.status == 200 else f"engine {url} answered {resp.status}"
    except (OSError, ValueError) as exc:  # refused while vLLM starts, a timeout, an HTTP error status
        return f"engine {url}: {exc}"


def readiness(accounts: SignalAccounts, ranks: "PeerRanks | None" = None,
              engine_health_url: str | None = None, warmup: "Warmup | None" = None) -> tuple[bool, dict]:
    """An engine pod's readiness (/readyz). Prefill: every TP rank paired with at least one decode of its peer set
    (pdpair_peer_paired{peer} says which), and the engine serving.
    Prefill starts beside decode and pairs once decode's listener accepts (side_channel.py retries until then), so a
    Ready prefill is one that can push KV now, never one still waiting for its decode. Decode pairs with whoever
    comes: its engine serving. Both: then `warmup` done (warmup.py: one completion through the engine's own API,
    so the first user request pays no first-call compile)."""
    if accounts.role != contract.ROLE_PREFILL:
        engine = _engine_serves(engine_health_url)
        if engine is not None:
            return False, {"status": engine}
        return _warmed(warmup, {})
    paired = {accounts.rank: accounts.paired}
    unreachable = {}
    for rank, snapshot in (ranks.fetch().items() if ranks is not None else ()):
        if isinstance(snapshot, dict):
            paired[str(rank)] = bool(snapshot.get("paired"))
        else:
            unreachable[str(rank)] = snapshot
    waiting = sorted((r for r, ok in paired.items() if not ok), key=int)
    engine = _engine_serves(engine_health_url) if not waiting and not unreachable else None
    body: dict = {"paired": {r: paired[r] for r in sorted(paired, key=int)}}
    if waiting:
        body["status"] = f"waiting for decode: rank{'s' if len(waiting) > 1 else ''} {', '.join(waiting)} not paired"
    elif unreachable:
        body["status"], body["unreachable_ranks"] = "rank_unreachable", unreachable
    elif engine is not None:
        body["status"] = engine
    else:
        return _warmed(warmup, body)
    return False, body


def _warmed(warmup: "Warmup | None", body: dict) -> tuple[bool, dict]:
    if warmup is None:
        return True, {**body, "status": "ok"}
    done, what = warmup.state()
    if not done:
        return False, {**body, "status": what}
    return True, {**body, "status": "ok", "warmup": what}


def _app(accounts: SignalAccounts, ranks: "PeerRanks | None" = None, engine_health_url: str | None = None,
         warmup: "Warmup | None" = None) -> Callable:
    metrics_app = make_wsgi_app(accounts.registry if ranks is None else _MergedRegistry(accounts, ranks))

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == contract.READYZ_PATH:
            return _json(start_response, *readiness(accounts, ranks, engine_health_url, warmup))
        if path == contract.HEALTHZ_PATH:
            if ranks is None:
                report = accounts.health()
                unhealthy, payload = report.hung, report.as_json()
            else:
                unhealthy, payload = _merged_health(accounts, ranks)
            return _json(start_response, not unhealthy, payload)
        if path in (contract.METRICS_PATH, "/"):
            return metrics_app(environ, start_response)
        body = b"not found: try /metrics, /healthz or /readyz\n"
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
    engine_health_url: str | None = None,
    warmup: "Warmup | None" = None,
) -> MetricsServer:
    """Serve /metrics and /healthz for `accounts` on `port` (0 = any free port, see `.port`) in a daemon thread.

    `hang_timeout_seconds` defaults to the accounts' own; a different value is refused (one pod, one timeout).
    `ranks`: the other TP ranks of this engine (each a worker process running `export_rank`); their per-rank series
    are merged into /metrics and their verdicts into /healthz at every request. `engine_health_url`: the engine's own
    /health, which /readyz checks once every rank is paired (prefill's readiness; see `readiness`). `warmup`: the
    engine's warm-up (warmup.py), which /readyz starts once the engine serves and waits for.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    if hang_timeout_seconds is not None and float(hang_timeout_seconds) != accounts.hang_timeout_seconds:
        raise ValueError(
            f"hang_timeout_seconds {hang_timeout_seconds} differs from the accounts' {accounts.hang_timeout_seconds}"
        )
    httpd = make_server(addr, port, _app(accounts, ranks, engine_health_url, warmup), ThreadingWSGIServer,
                        handler_class=_QuietHandler)
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
    return {"rank": accounts.rank, "families": families, "health": {**report.as_json(), "hung": report.hung},
            "paired": accounts.paired}


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
