"""The TP rank channel: one pod, several vLLM worker processes, one metrics port. Rank 0 serves PDPAIR_METRICS_PORT
(pod_server.py) and asks every other rank, over an abstract Unix socket named after that port, for its snapshot
(`PeerRanks`); each rank above 0 answers (`RankExporter`, `export_rank`) and takes rank 0's peer sets. Every exchange
is authenticated both ways with a key derived from the pair's side-channel key (`rank_channel_key`); the protocol is
described at RANK_FETCH_TIMEOUT_SECONDS below."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from prometheus_client.metrics_core import Metric as MetricFamily
from prometheus_client.samples import Sample

from pdpair import contract
from pdpair.httpserver import BoundedThreadingMixIn, DeadlineRequestMixIn, Limits, StoppableServer

from .signals import SignalAccounts

__all__ = ["export_rank", "PeerRanks", "RankExporter", "rank_channel_key", "rank_socket_name"]
logger = logging.getLogger("pdpair.connector.rank_channel")


# --- TP ranks: one pod, several worker processes, one metrics port -----------------------------------
# vLLM runs each TP rank in its own worker process, each with its own SignalAccounts. Rank 0 serves
# PDPAIR_METRICS_PORT; every other rank answers rank 0 on an abstract Unix socket named after that port (abstract:
# nothing on disk to clean up, gone when the process is). Rank 0 merges their per-rank series (those labelled `rank`)
# into /metrics and their verdicts into /healthz at each request, so a deficit on any rank is visible and judged.
#
# The rank channel is authenticated (`rank_channel_key`). On hostNetwork the abstract socket namespace is the node's:
# any process of any hostNetwork pod on the node can connect to a rank's name, or bind it first. Without a key such a
# process could push a peer set to a rank (repoint or unpair it) or, holding the name, feed rank 0 a fake snapshot
# (a hung rank reported healthy). Every exchange is a challenge-response both ways, one connection each:
#   1. the rank sends a fresh 16-byte nonce Ne (hex, one line);
#   2. rank 0 sends MAC(key, "request" | Ne | body) and the body, a JSON object with its own fresh nonce N0 (one line);
#   3. the rank checks the MAC before it parses the body; a wrong one is logged locally and the connection closed
#      with nothing more sent (the refusal tells the sender nothing); else it answers
#      MAC(key, "reply" | Ne | N0 | snapshot) and the snapshot, and rank 0 checks that MAC before it believes a word.
# The nonces make every message good for one exchange only (a captured request or answer cannot be replayed), and the
# labels keep a request from passing as an answer. A name held by a stranger makes the rank unreadable, so rank 0's
# /healthz and /readyz fail ("rank_unreachable") and the operator restarts the pod: never a silent lie.
RANK_FETCH_TIMEOUT_SECONDS = 1.0

_PER_RANK = frozenset(m.name for m in contract.POD_METRICS if "rank" in m.labels)

RANK_NONCE_BYTES = 16

# The most a snapshot may take on the channel: a rank's families with a label per decode of its peer set and per
# transfer kind are tens of KiB; rank 0 reads no further (a stranger must not make it buffer without end).
MAX_RANK_SNAPSHOT_BYTES = 8 << 20

# Connections a rank's exporter serves at once: rank 0 asks each rank once per /metrics, /healthz, /readyz or push
# it serves, and its HTTP server serves at most httpserver.Limits().max_connections at once.
RANK_MAX_CONNECTIONS = 16

_RANK_KEY_LABEL = b"pdpair TP rank channel v1"

_REQUEST_LABEL = b"request\0"

_REPLY_LABEL = b"reply\0"


def rank_channel_key(side_channel_key: str | bytes) -> bytes:
    """The TP rank channel's key, derived from the pair's side-channel key (PDPAIR_SIDE_CHANNEL_KEY, which every rank
    of both engine roles has): its own key, so that no MAC of the rank channel can ever pass on the side channel or
    the other way round. A ValueError for an empty key (the channel is never unauthenticated)."""
    secret = side_channel_key.encode() if isinstance(side_channel_key, str) else bytes(side_channel_key)
    if not secret:
        raise ValueError(f"the TP rank channel needs the pair's {contract.ENV_SIDE_CHANNEL_KEY}")
    return hmac.new(secret, _RANK_KEY_LABEL, hashlib.sha256).digest()


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).hexdigest().encode()


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) < 16:
        raise ValueError("the TP rank channel needs a key of at least 16 bytes (rank_channel_key)")
    return key


def rank_socket_name(metrics_port: int, rank: int) -> str:
    """The abstract Unix socket on which TP rank `rank` (> 0) of the engine serving `metrics_port` exports."""
    return f"\0pdpair-metrics-{metrics_port}-rank-{rank}"


def _family_key(name: str) -> str:
    """Contract name of a collected family (prometheus-client drops a counter's _total)."""
    return name if name in _PER_RANK else f"{name}_total"


def _snapshot(accounts: SignalAccounts, peers: dict[str, bool] | None = None) -> dict:
    families = []
    for family in accounts.registry.collect():
        if _family_key(family.name) not in _PER_RANK:
            continue  # pod-level series (generation, hang timeout): rank 0 exports its own
        families.append({
            "name": family.name, "type": family.type, "help": family.documentation,
            "samples": [[s.name, s.labels, s.value] for s in family.samples],
        })
    report = accounts.health()
    snapshot = {"rank": accounts.rank, "families": families, "health": {**report.as_json(), "hung": report.hung},
                "paired": accounts.paired, "listener_failure": accounts.listener_failure}
    if peers is not None:
        snapshot["peers"] = peers
    return snapshot


# How long a rank's exporter waits for rank 0's request line, in all, from the connection's accept.
RANK_REQUEST_TIMEOUT_SECONDS = 1.0


class _RankServer(BoundedThreadingMixIn, socketserver.UnixStreamServer):
    limits = Limits(max_connections=RANK_MAX_CONNECTIONS, read_seconds=RANK_REQUEST_TIMEOUT_SECONDS,
                    write_seconds=RANK_FETCH_TIMEOUT_SECONDS)


class RankExporter:
    """TP rank > 0: answers each authenticated connection on `rank_socket_name` with a JSON snapshot of its accounts
    (the exchange: "TP ranks" above; `key` from `rank_channel_key`). Rank 0's request is `{}` for the snapshot,
    `{"decodes": [...]}` (prefill's peer push) to apply a peer set first (`on_peers`: PrefillWorker.set_peers of this
    rank, given PeerAddress values; called with None for the state only); the snapshot then carries `peers` (this
    rank's pairing per decode), or `peers_error`. A request whose MAC fails is never parsed, let alone applied;
    `refused` counts them."""

    def __init__(self, metrics_port: int, accounts: SignalAccounts, key: bytes,
                 on_peers: Callable[[tuple | None], dict[str, bool]] | None = None) -> None:
        key = _check_key(key)
        exporter = self
        self.refused = 0
        self._refused_lock = threading.Lock()  # handler threads refuse at once

        class Handler(DeadlineRequestMixIn, socketserver.StreamRequestHandler):
            def handle(self) -> None:
                nonce = os.urandom(RANK_NONCE_BYTES)
                self.wfile.write(nonce.hex().encode() + b"\n")
                request = _read_request(self.rfile, key, nonce)
                if request is None:
                    exporter._refuse()
                    return  # nothing more is sent: the sender learns nothing
                theirs = request.pop("nonce")
                peers = error = None
                if on_peers is not None:
                    try:
                        peers = on_peers(_peer_set(request["decodes"]) if "decodes" in request else None)
                    except Exception as exc:  # noqa: BLE001 - rank 0 reports it; the exporter lives on
                        error = f"{type(exc).__name__}: {exc}"
                elif "decodes" in request:
                    error = "this rank takes no peer set (decode, or prefill without the peer push)"
                snapshot = _snapshot(accounts, peers)
                if error is not None:
                    snapshot["peers_error"] = error
                body = json.dumps(snapshot).encode()
                self.wfile.write(_mac(key, _REPLY_LABEL, nonce, theirs, body) + b" " + body)

        self.name = rank_socket_name(metrics_port, int(accounts.rank))
        server = _RankServer(self.name, Handler)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True,
                                  name=f"pdpair-rank-metrics-r{accounts.rank}")
        thread.start()
        self._serving = StoppableServer(server, thread)

    def _refuse(self) -> None:
        with self._refused_lock:
            self.refused += 1
            refused = self.refused
        # Logged here, never told to the sender; a stranger can send many, so the count shows, the lines do not pile up.
        if refused & (refused - 1) == 0:  # 1, 2, 4, 8, ...
            logger.warning("TP rank channel %r: refused %d unauthenticated or malformed request(s) (another process "
                           "on this node, or a rank with another key); nothing was applied", self.name[1:], refused)

    def stop(self, timeout: float = 5.0) -> None:
        self._serving.stop(timeout)


def _read_request(rfile: Any, key: bytes, nonce: bytes) -> dict | None:
    """Rank 0's request line, authenticated against this exchange's `nonce`: the object, with its own "nonce" as
    bytes, or None (refused) when it is late, too long, its MAC is wrong, or it is not such an object."""
    try:
        line = rfile.readline(contract.MAX_PEERS_BODY_BYTES + 256)
    except OSError:  # the deadline (TimeoutError) or a reset
        return None
    if not line.endswith(b"\n"):
        return None
    mac, _, body = line[:-1].partition(b" ")
    if not hmac.compare_digest(mac, _mac(key, _REQUEST_LABEL, nonce, body)):
        return None
    try:
        request = json.loads(body)
        request["nonce"] = bytes.fromhex(request["nonce"])
    except (ValueError, TypeError, KeyError):
        return None
    return request if len(request["nonce"]) == RANK_NONCE_BYTES else None


def _peer_set(decodes: list[dict]) -> tuple:
    from pdpair.connector.config import PeerAddress

    return tuple(PeerAddress(str(d["host"]), int(d["portBase"])) for d in decodes)


def export_rank(metrics_port: int, accounts: SignalAccounts, key: bytes,
                on_peers: Callable[[tuple | None], dict[str, bool]] | None = None) -> RankExporter:
    return RankExporter(metrics_port, accounts, key, on_peers)


class _Unauthenticated(ValueError):
    pass


@dataclass(frozen=True)
class PeerRanks:
    """The other TP ranks of this engine, read through their exporters; `key` from `rank_channel_key`."""

    metrics_port: int
    ranks: tuple[int, ...]
    key: bytes = field(repr=False)
    timeout: float = RANK_FETCH_TIMEOUT_SECONDS

    def __post_init__(self) -> None:
        _check_key(self.key)

    def fetch(self, request: dict | None = None) -> dict[int, dict | str]:
        """rank -> its snapshot, or why it could not be read. `request`: sent first (RankExporter says what)."""
        out: dict[int, dict | str] = {}
        for rank in self.ranks:
            try:
                out[rank] = self._exchange(rank, request or {})
            except _Unauthenticated as exc:
                out[rank] = str(exc)
            except (OSError, ValueError) as exc:
                out[rank] = f"{type(exc).__name__}: {exc}"
        return out

    def _exchange(self, rank: int, request: dict) -> dict:
        deadline = time.monotonic() + self.timeout
        name = rank_socket_name(self.metrics_port, rank)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout)
            sock.connect(name)
            reader = _DeadlineLines(sock, deadline)
            theirs = bytes.fromhex(reader.line(2 * RANK_NONCE_BYTES + 1).decode("ascii", "replace").strip())
            if len(theirs) != RANK_NONCE_BYTES:
                raise ValueError("no nonce")
            nonce = os.urandom(RANK_NONCE_BYTES)
            body = json.dumps({**request, "nonce": nonce.hex()}).encode()
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(_mac(self.key, _REQUEST_LABEL, theirs, body) + b" " + body + b"\n")
            answer = reader.rest(MAX_RANK_SNAPSHOT_BYTES)
        mac, _, snapshot = answer.partition(b" ")
        if not hmac.compare_digest(mac, _mac(self.key, _REPLY_LABEL, theirs, nonce, snapshot)):
            # The name answered but not with the pair's key: a stranger on the node holds it, or the rank's process
            # has another key (never its snapshot: nothing of it is believed).
            raise _Unauthenticated(f"the answer on {name[1:]!r} was not authenticated with the pair's key")
        snapshot_doc = json.loads(snapshot)
        if not isinstance(snapshot_doc, dict):
            raise ValueError("the snapshot is not an object")
        return snapshot_doc


class _DeadlineLines:
    """Reads of one socket, bounded in all by `deadline` and each by a size."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline, self._buffer = sock, deadline, b""

    def _recv(self) -> bytes:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the rank did not answer in time")
        self._sock.settimeout(left)
        return self._sock.recv(65536)

    def line(self, limit: int) -> bytes:
        while b"\n" not in self._buffer:
            if len(self._buffer) > limit:
                raise ValueError("line too long")
            chunk = self._recv()
            if not chunk:
                raise ValueError("closed before a line")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def rest(self, limit: int) -> bytes:
        chunks, size = [self._buffer], len(self._buffer)
        while chunk := self._recv():
            size += len(chunk)
            if size > limit:
                raise ValueError(f"the snapshot is over {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)


class MergedRegistry:
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


def merged_health(accounts: SignalAccounts, ranks: PeerRanks) -> tuple[bool, dict]:
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
