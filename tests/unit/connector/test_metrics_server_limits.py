"""The pod's metrics server (pdpair.connector.metrics.serve on pdpair.httpserver's bounds) against clients that
misbehave, over real TCP on loopback: a slowloris, more held connections than the cap, and a peer push with a wrong
token and a huge body. No mocks; every bound is the server's own (short `Limits` so the tests stay short)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from pdpair import contract
from pdpair.connector.pod_server import PeerPush, serve
from pdpair.contract import MAX_PEERS_BODY_BYTES
from pdpair.connector.signals import SignalAccounts
from pdpair.httpserver import Limits

TOKEN = "unit-test-token-0123456789"
# Generous against a busy 2-core box: only ever an upper bound on what should take milliseconds.
PATIENCE = 20.0


def connection_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith("-conn") and "WSGI" in t.name]


def metrics(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=PATIENCE) as resp:
        resp.read()
        return resp.status


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_a_slowloris_does_not_block_metrics_and_is_closed_after_the_read_deadline():
    """A client that trickles its headers a byte at a time (each byte well within any per-read timeout) is served
    nothing and cut off once `read_seconds` (1 s here) passed since its accept, while /metrics answers others
    meanwhile. Cost: about 1 s (the deadline); the only timing asserted is that it was not cut off before it."""
    server = serve(0, SignalAccounts("decode", 30.0), addr="127.0.0.1", limits=Limits(read_seconds=1.0))
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=PATIENCE) as slow:
            started = time.monotonic()
            slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            assert metrics(server.port) == 200  # served while the slowloris holds its connection
            closed_by_server = False
            for byte in b"X-Slow: " + b"a" * 10_000:
                try:
                    slow.sendall(bytes([byte]))
                except OSError:  # reset: the server closed it
                    closed_by_server = True
                    break
                slow.settimeout(0.1)
                try:
                    if slow.recv(65536) == b"":  # closed, with no answer
                        closed_by_server = True
                        break
                except TimeoutError:
                    pass
                except OSError:  # reset: closed with bytes of ours unread (a busy box's timing)
                    closed_by_server = True
                    break
                assert time.monotonic() - started < PATIENCE, "the slowloris was never cut off"
            elapsed = time.monotonic() - started
        assert closed_by_server and elapsed >= 1.0, elapsed
        assert metrics(server.port) == 200
    finally:
        server.stop()


def test_connections_beyond_the_cap_are_refused_without_a_thread():
    """With `max_connections` (4 here) connections held open (each sent half a request), a fifth is answered 503 at
    once by the accept loop, before it sends a byte: the server's connection threads stay 4. Once the held ones go, /metrics is served
    again. Cost: about 0.3 s (the held connections are closed by the test, not by the 30 s read deadline)."""
    cap = 4
    server = serve(0, SignalAccounts("decode", 30.0), addr="127.0.0.1",
                   limits=Limits(max_connections=cap, read_seconds=30.0))
    held: list[socket.socket] = []
    try:
        before = len(connection_threads())
        for _ in range(cap):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=PATIENCE)
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")
            held.append(sock)
        deadline = time.monotonic() + PATIENCE
        while len(connection_threads()) < before + cap:
            assert time.monotonic() < deadline, "the held connections never got their threads"
            time.sleep(0.02)
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", server.port), timeout=PATIENCE) as extra:
                # Nothing sent: the refusal comes before any request is read (and a refused socket closed with
                # unread bytes could reach this client as a reset instead of the answer).
                reply = read_all(extra)
            assert reply.startswith(b"HTTP/1.0 503 Service Unavailable") and b"busy" in reply, reply[:200]
            assert len(connection_threads()) == before + cap  # never a thread for the one refused
    finally:
        for sock in held:
            sock.close()
    try:
        deadline = time.monotonic() + PATIENCE
        while True:  # the slots free as the held connections' threads notice their close
            try:
                if metrics(server.port) == 200:
                    break
            except urllib.error.HTTPError as exc:
                assert exc.code == 503
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        server.stop()


@pytest.fixture
def push_server():
    push = PeerPush(TOKEN, generation=3, apply=lambda peers: {})
    server = serve(0, SignalAccounts("prefill", 30.0), addr="127.0.0.1", peers=push,
                   limits=Limits(read_seconds=30.0))
    yield server
    server.stop()


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-token-0123456789", f"Basic {TOKEN}"])
def test_the_token_is_checked_before_the_body_is_read(push_server, authorization):
    """A PUT of the peer set with no token or a wrong one and a Content-Length of 1 TiB, of which not a byte is
    sent, is answered 401 at once: the server never waits for the body (it would wait out its 30 s read deadline,
    then 408). The same with the right token is 413 at once. Cost: milliseconds each."""
    for auth, status in ((authorization, b"401"), (f"Bearer {TOKEN}", b"413")):
        head = (f"PUT {contract.PEERS_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {1 << 40}\r\n" + (f"Authorization: {auth}\r\n" if auth else "") + "\r\n")
        with socket.create_connection(("127.0.0.1", push_server.port), timeout=PATIENCE) as sock:
            started = time.monotonic()
            sock.sendall(head.encode())
            reply = read_all(sock)
        assert reply.split(b" ", 2)[1] == status, reply[:300]
        assert time.monotonic() - started < 30.0  # answered, not timed out waiting for a body
        if status == b"401":
            assert b"bearer token" in reply and b"generation" not in reply


def test_a_body_that_never_comes_is_408_at_the_read_deadline():
    """With the right token, a body announced and not sent is given up at the read deadline (1 s here) with 408;
    nothing is applied. Cost: about 1 s."""
    applied = []
    push = PeerPush(TOKEN, generation=3, apply=lambda peers: applied.append(peers) or {})
    server = serve(0, SignalAccounts("prefill", 30.0), addr="127.0.0.1", peers=push, limits=Limits(read_seconds=1.0))
    try:
        body = json.dumps({"epoch": 1, "generation": 3, "decodes": []}).encode()
        head = (f"PUT {contract.PEERS_PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")
        with socket.create_connection(("127.0.0.1", server.port), timeout=PATIENCE) as sock:
            sock.sendall(head.encode() + body[:5])
            reply = read_all(sock)
        assert reply.split(b" ", 2)[1] == b"408", reply[:300]
        assert applied == []
        assert len(body) < MAX_PEERS_BODY_BYTES
    finally:
        server.stop()
