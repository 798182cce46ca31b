"""The TP rank channel (pdpair.connector.pod_server, "TP ranks"): rank 0 and a rank's exporter on the real abstract Unix
socket, and a stranger on the same socket name, as any process of a hostNetwork pod on the node could be. Every
exchange is authenticated with the pair's key both ways; no mocks."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from pdpair import contract
from pdpair.connector.config import PeerAddress
from pdpair.connector.rank_channel import PeerRanks, _mac, export_rank, rank_channel_key, rank_socket_name
from pdpair.connector.pod_server import readiness, serve
from pdpair.connector.signals import SignalAccounts
from devcluster.ports import free_port

KEY = rank_channel_key("unit-test-side-channel-key-0123456789abcdef")
OTHER_KEY = rank_channel_key("another-pairs-side-channel-key-0123456789")
PEER = "10.0.0.7:20000"
DECODES = [{"host": "10.0.0.8", "portBase": 21000}]


class Recorder:
    """A rank's `on_peers` (PrefillWorker.set_peers in the engine): records every set it is given."""

    def __init__(self) -> None:
        self.applied: list[tuple] = []

    def __call__(self, peers):
        if peers is not None:
            self.applied.append(peers)
        return {f"{p.host}:{p.port_base}": False for p in (self.applied[-1] if self.applied else ())}


def stranger(port: int, line: bytes, rank: int = 1) -> tuple[bytes, bytes]:
    """Connect as a stranger, read the exporter's nonce line, send `line` (formatted with that nonce's bytes when it
    is a callable), and return (nonce line, everything answered after it until the exporter closed)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(rank_socket_name(port, rank))
        nonce = b""
        while not nonce.endswith(b"\n"):
            nonce += sock.recv(1)
        sock.sendall(line(bytes.fromhex(nonce.decode())) if callable(line) else line)
        rest = b""
        while chunk := sock.recv(65536):
            rest += chunk
        return nonce, rest


def signed(key: bytes, request: dict):
    def line(nonce: bytes) -> bytes:
        body = json.dumps(request).encode()
        return _mac(key, b"request\0", nonce, body) + b" " + body + b"\n"
    return line


def test_a_peer_set_without_the_key_is_refused_and_not_applied():
    """A peer set sent to a rank by anyone without the pair's key is never applied and answered with nothing: the
    old unauthenticated line, one signed with another key, one with a garbage MAC, and a correctly signed one replayed
    on a later connection (its nonce is spent). Rank 0 with the key then applies the same set. Cost: about 0.1 s."""
    port = free_port()
    rank1 = SignalAccounts("prefill", 30.0, rank=1)
    recorder = Recorder()
    exporter = export_rank(port, rank1, KEY, recorder)
    try:
        attempts = [
            json.dumps({"decodes": DECODES}).encode() + b"\n",                      # no MAC at all (the old protocol)
            signed(OTHER_KEY, {"decodes": DECODES, "nonce": "00" * 16}),           # another pair's key
            b"f" * 64 + b" " + json.dumps({"decodes": DECODES, "nonce": "00" * 16}).encode() + b"\n",
        ]
        for line in attempts:
            nonce, answer = stranger(port, line)
            assert len(bytes.fromhex(nonce.decode())) == 16
            assert answer == b""  # the refusal tells the sender nothing
        captured: list[bytes] = []

        def record(nonce: bytes) -> bytes:
            captured.append(signed(KEY, {"decodes": DECODES, "nonce": "11" * 16})(nonce))
            return b"\n"  # an empty line (refused): the stranger keeps the signed one for later

        stranger(port, record)
        assert stranger(port, captured[0])[1] == b""  # replayed: signed for the earlier nonce
        assert recorder.applied == [] and exporter.refused == len(attempts) + 2

        snapshot = PeerRanks(port, (1,), KEY).fetch({"decodes": DECODES})[1]
        assert isinstance(snapshot, dict), snapshot
        assert recorder.applied == [(PeerAddress("10.0.0.8", 21000),)]
        assert snapshot["peers"] == {"10.0.0.8:21000": False} and snapshot["rank"] == "1"
    finally:
        exporter.stop()


def test_rank_zero_believes_no_answer_without_the_key():
    """A stranger holding a rank's socket name (bound before the rank, as a squatter would) and answering a healthy,
    paired snapshot, with no MAC or a wrong one, is not believed: the rank is unreadable, so prefill's /readyz and
    /healthz say rank_unreachable instead of ready. An exporter with another pair's key is refused both ways. Cost:
    about 0.2 s."""
    port = free_port()
    fake = {"rank": "1", "families": [], "paired": True,
            "health": {"status": "ok", "deficit": 0, "oldest_wait_seconds": 0.0, "hung": False}}
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(rank_socket_name(port, 1))
    squatter.listen(8)
    stop = threading.Event()

    def answer_falsely() -> None:
        n = 0
        while not stop.is_set():
            try:
                conn, _ = squatter.accept()
            except OSError:
                return
            with conn:
                conn.sendall(("ab" * 16 + "\n").encode())
                conn.settimeout(5)
                try:
                    conn.recv(65536)
                except OSError:
                    pass
                body = json.dumps(fake).encode()
                conn.sendall(body if n % 2 == 0 else b"e" * 64 + b" " + body)
                n += 1

    thread = threading.Thread(target=answer_falsely, daemon=True)
    thread.start()
    rank0 = SignalAccounts("prefill", 30.0, rank=0)
    rank0.set_paired(True, PEER)
    ranks = PeerRanks(port, (1,), KEY)
    server = serve(0, rank0, addr="127.0.0.1", ranks=ranks)
    try:
        for _ in range(2):  # no MAC, then a wrong one
            answer = ranks.fetch()[1]
            assert isinstance(answer, str) and "not authenticated" in answer, answer
        ready, body = readiness(rank0, ranks)
        assert not ready and body["status"] == "rank_unreachable", body
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            reply = sock.makefile("rb").read()
        assert reply.startswith(b"HTTP/1.0 503") and b'"rank_unreachable"' in reply
    finally:
        stop.set()
        squatter.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone would not free the name
        squatter.close()
        server.stop()
        thread.join(5)
        assert not thread.is_alive()

    other = export_rank(port, SignalAccounts("prefill", 30.0, rank=1), OTHER_KEY, Recorder())
    try:
        answer = PeerRanks(port, (1,), KEY, timeout=2.0).fetch({"decodes": DECODES})[1]
        assert isinstance(answer, str), answer  # the exporter refused the request: closed without an answer
        assert other.refused == 1
    finally:
        other.stop()


def test_a_rank_without_a_key_is_refused_at_start():
    """The channel is never unauthenticated: no key, no exporter and no reader. Cost: milliseconds."""
    with pytest.raises(ValueError, match=contract.ENV_SIDE_CHANNEL_KEY):
        rank_channel_key("")
    with pytest.raises(ValueError, match="needs a key"):
        PeerRanks(free_port(), (1,), b"")
    with pytest.raises(ValueError, match="needs a key"):
        export_rank(free_port(), SignalAccounts("decode", 30.0, rank=1), b"short")


def test_a_stranger_that_never_sends_does_not_hold_the_rank():
    """A stranger that connects and sends nothing is cut off at the exporter's read deadline
    (RANK_REQUEST_TIMEOUT_SECONDS), and rank 0 is served meanwhile. Cost: about 1 s (the deadline)."""
    port = free_port()
    exporter = export_rank(port, SignalAccounts("decode", 30.0, rank=1), KEY)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
            idle.settimeout(30)
            idle.connect(rank_socket_name(port, 1))
            started = time.monotonic()
            assert isinstance(PeerRanks(port, (1,), KEY, timeout=10).fetch()[1], dict)
            rest = b""
            while chunk := idle.recv(65536):
                rest += chunk
            assert rest.endswith(b"\n") and len(rest) == 33  # its nonce, then closed
            assert time.monotonic() - started < 25  # closed by the exporter, not by this test's own timeout
    finally:
        exporter.stop()
