"""A threaded HTTP server that can be stopped: shut down, port freed, thread joined (or a clear error).

Shared by the pods' exporter (pdpair.connector.metrics) and the operator's metrics endpoint (pdpair.operator.metrics,
which runs prometheus-client's own server): neither package imports the other for it.
"""

from __future__ import annotations

import threading
from typing import Any


class StoppableServer:
    """A running server (socketserver API: shutdown, server_close, server_address) and the thread serving it."""

    def __init__(self, httpd: Any, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        self.port: int = httpd.server_address[1]

    def stop(self, timeout: float = 5.0) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"HTTP server thread on port {self.port} did not stop within {timeout}s")

    def __enter__(self) -> "StoppableServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
