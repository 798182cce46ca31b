"""The connector's pod metrics server: /metrics, /healthz and /readyz of the signal accounts (signals.py), and the TP
ranks' exporters (no vllm import; safe anywhere).

Every metric comes from `pdpair.contract.POD_METRICS` (name, type, labels, help); nothing is retyped here.

Usage (one `SignalAccounts` per engine process and role; its registry is private, so three engines
created in a row in one process never collide on metric registration)::

    from pdpair.connector.pod_server import serve
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
rank is paired with at least one decode of its peer set (prefill), the engine's own /health answers 200 and its
warm-up is done (`readiness`); /startupz (its startup probe) once the engine's /health answers (`startup`); both
take `?wait=SECONDS` (contract.PROBE_WAIT_PARAM: held until they pass, `held`). At TP > 1, rank 0 serves the pod's port with
`serve(..., ranks=PeerRanks(port, (1, ...), key))` and each other rank runs `export_rank(port, accounts, key)`, with
`key = rank_channel_key(PDPAIR_SIDE_CHANNEL_KEY)`; see "TP ranks" below."""

from __future__ import annotations

import functools
import hmac
import json
import logging
import os
import socket
import threading
import time
import urllib.parse
import urllib.request
from typing import Any, Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from pdpair import contract
from pdpair.httpserver import BoundedThreadingMixIn, DeadlineRequestMixIn, Limits, StoppableServer

from .signals import SignalAccounts
from .warmup import Warmup
from pdpair.connector.rank_channel import PeerRanks, MergedRegistry, merged_health

__all__ = ["MetricsServer", "serve", "accounts_from_env", "PeerPush", "readiness", "startup", "warm_when_serving"]
logger = logging.getLogger("pdpair.connector.pod_server")


# --- HTTP ------------------------------------------------------------------------------------------
class _QuietHandler(DeadlineRequestMixIn, WSGIRequestHandler):
    """One request per connection (wsgiref), read within the server's Limits.read_seconds (slowloris)."""

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass

_BUSY = b"busy: the pod's metrics server is serving as many connections as it may; try again\n"


class _BoundedWSGIServer(BoundedThreadingMixIn, WSGIServer):
    """The pod's HTTP server: a thread per connection up to `limits.max_connections` (httpserver.Limits says why);
    one beyond is answered 503 by the accept loop, without a thread."""

    def refuse(self, request: socket.socket) -> None:
        request.setblocking(False)  # the accept loop must never wait on a client: a full buffer drops the answer
        request.send(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nRetry-After: 1\r\n"
                     b"Connection: close\r\nContent-Length: " + str(len(_BUSY)).encode() + b"\r\n\r\n" + _BUSY)


def _json(start_response, ok: bool, payload: dict) -> list[bytes]:
    body = json.dumps(payload).encode()
    status = "200 OK" if ok else "503 Service Unavailable"
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


# A held probe (`held`) starts its last check before its wait ends: wait + this stays below the probes' timeouts
# (pod_defaults.READINESS_PROBE, pod_defaults.PROBE_WAIT_SECONDS), and this stays below the router's 2.5 s ask.
ENGINE_HEALTH_TIMEOUT_SECONDS = 2.0

# How often the connector asks its engine's /health while it starts, to start the warm-up the moment it serves.
WARMUP_WATCH_INTERVAL_SECONDS = 0.2


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
    so the first user request pays no first-call compile). Prefill's warm-up starts as soon as its engine serves,
    paired or not."""
    if accounts.role != contract.ROLE_PREFILL:
        # A decode rank whose side-channel loop stopped pairs no prefill any more: not ready, at once, on any rank.
        failures = {accounts.rank: accounts.listener_failure}
        for rank, snapshot in (ranks.fetch().items() if ranks is not None else ()):
            if isinstance(snapshot, dict):
                failures[str(rank)] = snapshot.get("listener_failure")
        stopped = {rank: why for rank, why in failures.items() if why}
        if stopped:
            return False, {"status": "side-channel listener stopped", "listener_failure": stopped}
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
    engine = _engine_serves(engine_health_url)
    body: dict = {"paired": {r: paired[r] for r in sorted(paired, key=int)}}
    if waiting:
        body["status"] = f"waiting for decode: rank{'s' if len(waiting) > 1 else ''} {', '.join(waiting)} not paired"
        # The warm-up needs only the engine (its completion moves no KV): started while prefill still waits for
        # decode's listener, it is done by the time the pairing comes, instead of following it on the path to the
        # pair's first answer.
        if engine is None:
            body["warmup"] = _warmed(warmup, {})[1]["status"]
    elif unreachable:
        body["status"], body["unreachable_ranks"] = "rank_unreachable", unreachable
    elif engine is not None:
        body["status"] = engine
    else:
        return _warmed(warmup, body)
    return False, body


def startup(engine_health_url: str | None) -> tuple[bool, dict]:
    """An engine pod's startup (/startupz, the operator's default startupProbe): its engine's own /health answers
    200. The same check as vLLM's /health, here so that the probe can be held (`held`)."""
    engine = _engine_serves(engine_health_url)
    return (True, {"status": "serving"}) if engine is None else (False, {"status": engine})


def held(check: Callable[[], tuple[bool, dict]], wait: float,
         interval: float = contract.PROBE_WAIT_POLL_SECONDS) -> tuple[bool, dict]:
    """check()'s answer, asked again every `interval` seconds while it fails, for at most `wait` seconds (a probe's
    contract.PROBE_WAIT_PARAM): the kubelet learns that the pod passes within `interval` of it, not a probe period
    later. No new check starts after `wait`; one that started runs to its own bound (ENGINE_HEALTH_TIMEOUT_SECONDS)."""
    deadline = time.monotonic() + wait
    while True:
        ok, body = check()
        pause = contract.probe_hold_pause(ok, deadline - time.monotonic(), interval)
        if pause is None:
            return ok, body
        time.sleep(pause)


def _query_value(environ: dict, name: str) -> str | None:
    values = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True).get(name)
    return values[-1] if values else None


def _warmed(warmup: "Warmup | None", body: dict) -> tuple[bool, dict]:
    if warmup is None:
        return True, {**body, "status": "ok"}
    done, what = warmup.state()
    if not done:
        return False, {**body, "status": what}
    return True, {**body, "status": "ok", "warmup": what}


# --- the peer push (prefill): PUT /pdpair/v1/peers ----------------------------------------------------------


_STATUS = {200: "200 OK", 400: "400 Bad Request", 401: "401 Unauthorized", 404: "404 Not Found",
           405: "405 Method Not Allowed", 408: "408 Request Timeout", 409: "409 Conflict", 413: "413 Payload Too Large",
           502: "502 Bad Gateway", 503: "503 Service Unavailable"}


class PeerPush:
    """Prefill's `PUT /pdpair/v1/peers` (docs/xpyd.md section 3): the whole desired set of decodes, level-triggered,
    `{"epoch": n, "generation": g, "decodes": [{"host": h, "portBase": p, ...}, ...]}` (other keys of a decode are
    ignored). Bearer token (PDPAIR_PEERS_TOKEN, compared in constant time) else 401; the pod's generation else 409
    (a prefill pairs only with decodes of its generation); an epoch older than the last one applied else 409 (a
    deposed operator leader cannot undo its successor's push; the same epoch again is applied again). Rank 0
    applies the set itself (`apply`, PrefillWorker.set_peers) and forwards it to every other TP rank's exporter (each
    a worker process with its own edges); the answer is each rank's pairing per decode, 502 when a rank could not be
    reached (the operator pushes again). `GET` answers the same state without changing it."""

    def __init__(self, token: str, generation: int, apply: Callable[[tuple], dict[str, bool]],
                 ranks: "PeerRanks | None" = None) -> None:
        self._token = token.encode()
        self.generation = generation
        self._apply = apply
        self._ranks = ranks
        self._lock = threading.Lock()
        self.epoch: int | None = None
        self._decodes: list[dict] | None = None

    def authorized(self, authorization: str) -> bool:
        """The request's Authorization header carries the bearer token (compared in constant time)."""
        scheme, _, token = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._token)

    def handle(self, method: str, authorization: str, body: bytes) -> tuple[int, dict]:
        if not self.authorized(authorization):
            return 401, _UNAUTHORIZED
        if method == "GET":
            with self._lock:
                try:
                    local = self._local_state()
                except Exception as exc:  # noqa: BLE001 - e.g. the worker is still being built
                    return 503, {"error": f"the peer set cannot be read yet: {type(exc).__name__}: {exc}"}
                return self._state(local, self._forward(None))
        if method != "PUT":
            return 405, {"error": f"{method} is not allowed: PUT the whole peer set, or GET its state"}
        try:
            epoch, decodes, peers = self._parse(body)
        except _Conflict as exc:
            return 409, {"error": str(exc)}
        except ValueError as exc:
            return 400, {"error": str(exc)}
        with self._lock:  # one push at a time, applied in epoch order
            if self.epoch is not None and epoch < self.epoch:
                return 409, {"error": f"epoch {epoch} is older than the last one applied ({self.epoch})",
                             "epoch": self.epoch}
            try:
                local = self._apply(peers)
            except Exception as exc:  # noqa: BLE001 - e.g. the worker is still being built: push again
                return 503, {"error": f"the peer set was not applied: {type(exc).__name__}: {exc}"}
            self.epoch, self._decodes = epoch, decodes
            return self._state(local, self._forward(decodes))

    def _parse(self, body: bytes) -> tuple[int, list[dict], tuple]:
        from pdpair.connector.config import ConfigError, check_peer_set, parse_peer

        try:
            doc = json.loads(body)
        except ValueError as exc:
            raise ValueError(f"the body is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise ValueError("the body must be a JSON object {epoch, generation, decodes}")
        epoch, generation, decodes = doc.get("epoch"), doc.get("generation"), doc.get("decodes")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        if isinstance(generation, bool) or not isinstance(generation, int):
            raise ValueError(f"generation must be an integer, got {generation!r}")
        if generation != self.generation:
            raise _Conflict(f"generation {generation}: this prefill is generation {self.generation} and pairs only "
                            "with decodes of its own generation")
        if not isinstance(decodes, list):
            raise ValueError("decodes must be a list of {host, portBase}")
        peers, clean = [], []
        for i, item in enumerate(decodes):
            if not isinstance(item, dict) or not isinstance(item.get("host"), str):
                raise ValueError(f"decodes[{i}] must be an object with a string host and an integer portBase")
            host, port = item["host"].strip("[]"), item.get("portBase")
            if isinstance(port, bool) or not isinstance(port, int):
                raise ValueError(f"decodes[{i}].portBase must be an integer, got {port!r}")
            try:
                peers.append(parse_peer(f"[{host}]:{port}" if ":" in host else f"{host}:{port}", f"decodes[{i}]"))
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
            clean.append({"host": host, "portBase": port})
        try:
            return epoch, clean, check_peer_set(peers, "decodes")
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    def _local_state(self) -> dict[str, bool]:
        return self._apply(None)

    def _forward(self, decodes: list[dict] | None) -> dict[int, dict | str]:
        if self._ranks is None:
            return {}
        request = {} if decodes is None else {"decodes": decodes}
        return self._ranks.fetch(request)

    def _state(self, local: dict[str, bool], remote: dict[int, dict | str]) -> tuple[int, dict]:
        ranks: dict[str, Any] = {"0": local}
        unreachable = {}
        for rank, snapshot in remote.items():
            if isinstance(snapshot, dict) and "peers" in snapshot and "peers_error" not in snapshot:
                ranks[str(rank)] = snapshot["peers"]
            else:
                unreachable[str(rank)] = snapshot.get("peers_error") if isinstance(snapshot, dict) else snapshot
        every = set().union(*(set(state) for state in ranks.values())) if ranks else set()
        body: dict[str, Any] = {
            "epoch": self.epoch, "generation": self.generation, "ranks": ranks,
            # a decode is paired when every rank is (what the operator's "serving" needs)
            "paired": {peer: all(state.get(peer, False) for state in ranks.values()) for peer in sorted(every)},
        }
        if unreachable:
            body["unreachable_ranks"] = unreachable
            return 502, body
        return 200, body


class _Conflict(ValueError):
    pass


_UNAUTHORIZED = {"error": f"a valid bearer token is required (the pair's {contract.ENV_PEERS_TOKEN})"}


def _peers_request(push: PeerPush | None, environ, start_response) -> list[bytes]:
    if push is None:
        return _reply(start_response, 404, {"error": f"no peer push on this pod (decode, or prefill without "
                                                      f"{contract.ENV_PEERS_TOKEN})"})
    method = environ.get("REQUEST_METHOD", "GET")
    authorization = environ.get("HTTP_AUTHORIZATION", "")
    # The token first: nobody without it makes this pod read (or wait for) a single byte of a body.
    if not push.authorized(authorization):
        return _reply(start_response, 401, _UNAUTHORIZED)
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = -1
    if length < 0 or length > contract.MAX_PEERS_BODY_BYTES:
        return _reply(start_response, 413 if length > 0 else 400, {"error": "bad Content-Length"})
    try:
        body = environ["wsgi.input"].read(length) if length else b""
    except OSError:  # the request's read deadline (httpserver.Limits.read_seconds) passed, or a reset
        return _reply(start_response, 408, {"error": "the body did not arrive in time"})
    if len(body) != length:
        return _reply(start_response, 400, {"error": "the body is shorter than its Content-Length"})
    status, payload = push.handle(method, authorization, body)
    return _reply(start_response, status, payload)


def _reply(start_response, status: int, payload: dict) -> list[bytes]:
    body = json.dumps(payload).encode()
    start_response(_STATUS[status], [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


def _app(accounts: SignalAccounts, ranks: "PeerRanks | None" = None, engine_health_url: str | None = None,
         warmup: "Warmup | None" = None, peers: PeerPush | None = None) -> Callable:
    metrics_app = make_wsgi_app(accounts.registry if ranks is None else MergedRegistry(accounts, ranks))

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == contract.PEERS_PATH:
            return _peers_request(peers, environ, start_response)
        if path in (contract.READYZ_PATH, contract.STARTUPZ_PATH):
            try:
                wait = contract.parse_probe_wait(_query_value(environ, contract.PROBE_WAIT_PARAM))
            except ValueError as exc:
                return _reply(start_response, 400, {"error": str(exc)})
            if path == contract.STARTUPZ_PATH:
                return _json(start_response, *held(lambda: startup(engine_health_url), wait))
            return _json(start_response, *held(lambda: readiness(accounts, ranks, engine_health_url, warmup), wait))
        if path == contract.HEALTHZ_PATH:
            if ranks is None:
                report = accounts.health()
                unhealthy, payload = report.hung, report.as_json()
            else:
                unhealthy, payload = merged_health(accounts, ranks)
            return _json(start_response, not unhealthy, payload)
        if path in (contract.METRICS_PATH, "/"):
            return metrics_app(environ, start_response)
        body = b"not found: try /metrics, /healthz, /readyz or /startupz\n"
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
    peers: PeerPush | None = None,
    limits: Limits | None = None,
) -> MetricsServer:
    """Serve /metrics and /healthz for `accounts` on `port` (0 = any free port, see `.port`) in a daemon thread.

    `hang_timeout_seconds` defaults to the accounts' own; a different value is refused (one pod, one timeout).
    `ranks`: the other TP ranks of this engine (each a worker process running `export_rank`); their per-rank series
    are merged into /metrics and their verdicts into /healthz at every request. `engine_health_url`: the engine's own
    /health, which /readyz checks once every rank is paired (prefill's readiness; see `readiness`). `warmup`: the
    engine's warm-up (warmup.py), which /readyz starts once the engine serves and waits for. `peers`: prefill's
    peer push (`PeerPush`), served on contract.PEERS_PATH. `limits`: connections at once and the read and write
    deadlines (httpserver.Limits; its defaults unless a test shortens them).
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    if hang_timeout_seconds is not None and float(hang_timeout_seconds) != accounts.hang_timeout_seconds:
        raise ValueError(
            f"hang_timeout_seconds {hang_timeout_seconds} differs from the accounts' {accounts.hang_timeout_seconds}"
        )
    httpd = make_server(addr, port, _app(accounts, ranks, engine_health_url, warmup, peers),
                        functools.partial(_BoundedWSGIServer, limits=limits or Limits()), handler_class=_QuietHandler)
    # A short poll interval makes stop() quick (shutdown waits for the serve loop to notice).
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, name=f"pdpair-metrics-{httpd.server_address[1]}"
    )
    thread.daemon = True
    thread.start()
    if warmup is not None and engine_health_url is not None:
        warm_when_serving(warmup, engine_health_url, thread.is_alive)
    return MetricsServer(httpd, thread)


def warm_when_serving(warmup: "Warmup", engine_health_url: str, alive: Callable[[], bool],
                      interval: float = WARMUP_WATCH_INTERVAL_SECONDS) -> threading.Thread:
    """Start `warmup` as soon as the engine's /health answers 200, polled every `interval` seconds while `alive()`
    (the metrics server runs), instead of at the kubelet's first /readyz after it: that probe comes up to a startup
    and a readiness period after the engine serves, and the warm-up then took another period to be seen done, on the
    pair's path to Ready (measured on the real nodes: 2.2 s from prefill's API server up to its Ready). /readyz still
    starts it itself if this has not yet (`_warmed`). A refused connection while vLLM starts costs next to nothing."""
    def watch() -> None:
        while alive():
            if _engine_serves(engine_health_url) is None:
                warmup.state()  # starts it (once; a /readyz may have already)
                return
            time.sleep(interval)

    thread = threading.Thread(target=watch, name="pdpair-warmup-watch", daemon=True)
    thread.start()
    return thread


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
