"""Network namespaces of the real-node cluster: `ip` commands, running code inside a namespace (in_netns) and the
loopback forwarder that lets the root namespace reach the apiserver in the hub namespace."""
from __future__ import annotations

import contextlib
import ctypes
import selectors
import socket
import subprocess
import threading
from typing import Callable

from devcluster.errors import ClusterError

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


def in_netns(netns: str, fn: Callable[[], object]) -> object:
    """Runs fn in a fresh thread that has joined network namespace `netns` (setns is per thread); sockets
    created there stay in that namespace. Returns fn's result or raises its exception."""
    result: dict = {}

    def target() -> None:
        try:
            with open(f"/run/netns/{netns}") as fh:
                if _libc.setns(fh.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({netns}) failed")
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, name=f"netns-{netns}", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result.get("value")


class LoopbackForwarder:
    """127.0.0.1:<port> in the root namespace -> host:port inside a network namespace (one thread per
    connection). This is how tests and the CLI user reach the apiserver without any route out of the cluster."""

    def __init__(self, netns: str, target: tuple[str, int]):
        self.netns = netns
        self.target = target
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="apiserver-forwarder", daemon=True)

    def start(self) -> "LoopbackForwarder":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            upstream = in_netns(self.netns, lambda: socket.create_connection(self.target, timeout=10))
        except OSError:
            conn.close()
            return
        upstream.settimeout(None)
        sel = selectors.DefaultSelector()
        sel.register(conn, selectors.EVENT_READ, upstream)
        sel.register(upstream, selectors.EVENT_READ, conn)
        try:
            while not self._closed:
                for key, _ in sel.select(timeout=1.0):
                    data = key.fileobj.recv(65536)
                    if not data:
                        return
                    key.data.sendall(data)
        except OSError:
            pass
        finally:
            sel.close()
            conn.close()
            upstream.close()
