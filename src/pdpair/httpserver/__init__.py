"""A threaded HTTP server that can be stopped: shut down, port freed, thread joined (or a clear error); and the bounds
a server reachable from every pod of a cluster needs (`Limits`, `BoundedThreadingMixIn`, `DeadlineRequestMixIn`).

Shared by the pods' exporter (pdpair.connector.pod_server) and the operator's metrics endpoint (pdpair.operator.act.metrics,
which runs prometheus-client's own server): neither package imports the other for it.
"""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("pdpair.httpserver")

__all__ = ["StoppableServer", "Limits", "BoundedThreadingMixIn", "DeadlineRequestMixIn"]


class StoppableServer:
    """A running server (socketserver API: shutdown, server_close, server_address) and the thread serving it; a TCP
    server's `port`, or None for another address family (the TP rank channel's abstract Unix socket)."""

    def __init__(self, httpd: Any, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        address = httpd.server_address
        self.port: int | None = address[1] if isinstance(address, tuple) else None

    def stop(self, timeout: float = 5.0) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout)
        if self._thread.is_alive():
            where = f"on port {self.port}" if self.port is not None else f"{self._thread.name}"
            raise RuntimeError(f"server thread {where} did not stop within {timeout}s")

    def __enter__(self) -> "StoppableServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class Limits:
    """What one server spends on its clients. The engine pods serve on the node's network (hostNetwork by default), so
    any pod of the cluster can connect: without these, slow or idle connections (slowloris) each held a thread for
    ever, and enough of them exhausted the engine's threads and pids.

    `max_connections`: connections served at once, one thread each; the one beyond is answered at once from the
    accept loop (`BoundedThreadingMixIn.refuse`) and closed, never given a thread. 16 covers every client a pod has
    (the kubelet's probes, Prometheus, the operator's scrapes and pushes, a router's readiness asks) with room over,
    while /readyz and /startupz may each be held for up to contract.PROBE_WAIT_MAX_SECONDS (5 s).
    `read_seconds`: the whole request (line, headers and body) must have arrived within this long of the accept; a
    client that trickles it is cut off then, however often it sends a byte. Every legitimate client sends its request
    at once (the largest, a pushed peer set, is at most 1 MiB).
    `write_seconds`: each write of the answer; a client that never reads it is cut off then."""

    max_connections: int = 16
    read_seconds: float = 5.0
    write_seconds: float = 5.0

    def __post_init__(self) -> None:
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) or \
                self.max_connections < 1:
            raise ValueError(f"max_connections must be an int >= 1, got {self.max_connections!r}")
        for name in ("read_seconds", "write_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")


class BoundedThreadingMixIn:
    """socketserver mix-in (before the server class): a daemon thread per connection, at most
    `limits.max_connections` at once. A connection beyond the cap is handed to `refuse` (default: nothing) and
    closed in the accept loop itself: no thread, no queue that grows. Errors of a connection (a client's timeout or
    reset) are logged at debug level, not printed: they are the client's, and anyone can cause them."""

    limits: Limits = Limits()
    daemon_threads = True

    def __init__(self, *args: Any, limits: Limits | None = None, **kwargs: Any) -> None:
        if limits is not None:
            self.limits = limits
        self._slots = threading.BoundedSemaphore(self.limits.max_connections)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                self.refuse(request)
                _drain(request)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            threading.Thread(target=self._serve_one, args=(request, client_address), daemon=True,
                             name=f"{type(self).__name__}-conn").start()
        except BaseException:
            self._slots.release()
            self.shutdown_request(request)
            raise

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - the client's timeout or reset: handle_error says so quietly
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def refuse(self, request: socket.socket) -> None:
        """Answer a connection beyond the cap (the accept loop calls this: it must not block)."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("connection from %s ended with an error", client_address or "a local peer", exc_info=True)


def _drain(request: socket.socket) -> None:
    """Read, without waiting, what a refused client already sent: closing a socket with unread bytes resets the
    connection, and the client would then see the reset instead of the refusal written just before it."""
    request.setblocking(False)
    for _ in range(16):
        try:
            if not request.recv(65536):
                return
        except (BlockingIOError, InterruptedError):
            return


class DeadlineRequestMixIn:
    """socketserver.StreamRequestHandler mix-in (before the handler class): the request must be read within
    `server.limits.read_seconds` of the accept, in all (each read waits only for what is left of it), and each
    write of the answer gets `server.limits.write_seconds`. A read past the deadline raises TimeoutError."""

    def setup(self) -> None:
        super().setup()  # type: ignore[misc]
        limits: Limits = getattr(self.server, "limits", Limits())  # type: ignore[attr-defined]
        sock: socket.socket = self.connection  # type: ignore[attr-defined]
        old_rfile, old_wfile = self.rfile, self.wfile  # type: ignore[has-type]
        self.rfile = io.BufferedReader(_DeadlineReader(sock, time.monotonic() + limits.read_seconds))
        self.wfile = _TimedWriter(sock, limits.write_seconds)
        old_rfile.close()  # the makefile() it came from holds a reference that keeps the socket open otherwise
        old_wfile.close()


class _DeadlineReader(io.RawIOBase):
    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not read within its deadline")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _TimedWriter(io.BufferedIOBase):
    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self._sock = sock
        self._seconds = seconds

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._sock.settimeout(self._seconds)  # sendall: the bound is on the whole write
        self._sock.sendall(data)
        with memoryview(data) as view:
            return view.nbytes
