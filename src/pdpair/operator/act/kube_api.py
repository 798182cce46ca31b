"""Every call of the official kubernetes client gets a deadline, here and nowhere else.

The client blocks a thread until the apiserver answers; without `_request_timeout` a half-open connection would
hold that thread (and the pair waiting on it) forever. `TimedApi` wraps an API object (CoreV1Api, ...) so each
method call gets `_request_timeout=(connect, read)` unless the caller gave one.
"""

from __future__ import annotations

import functools
import json
from typing import Any

CONNECT_TIMEOUT_CAP = 5.0  # a TCP connect to the apiserver that takes longer than this is not coming


def request_timeout(seconds: float) -> tuple[float, float]:
    """(connect, read) for urllib3: connect is capped, read gets the whole budget."""
    return (min(CONNECT_TIMEOUT_CAP, seconds), seconds)


class TimedApi:
    """Proxy of a kubernetes API object whose public methods always carry `_request_timeout`."""

    def __init__(self, api: Any, timeout_seconds: float) -> None:
        self._api = api
        self._timeout = request_timeout(timeout_seconds)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._api, name)
        if name.startswith("_") or not callable(attr):
            return attr

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("_request_timeout", self._timeout)
            return attr(*args, **kwargs)

        return call


def call_json(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` of the kubernetes client, its reply asked for with `_preload_content=False` and decoded
    as plain JSON; the connection goes back to the pool. Blocking: run it in an API thread
    (`asyncio.to_thread(call_json, api.list_..., ...)`), so the event loop never waits on a body's read.

    From kubernetes client 35 on, a reply is otherwise built into pydantic models (a created pod's ~0.2 ms of CPU,
    its managedFields included): for what the operator only reads a few fields of, or drops (call_dropped)."""
    return json.loads(_read(fn(*args, _preload_content=False, **kwargs)) or b"null")


def call_dropped(fn: Any, *args: Any, **kwargs: Any) -> None:
    """`fn(*args, **kwargs)` of the kubernetes client, its reply read and dropped (no model built); errors raise as
    usual (the client raises ApiException before returning a raw reply). Blocking: run it in an API thread."""
    _read(fn(*args, _preload_content=False, **kwargs))


def _read(reply: Any) -> bytes:
    """A raw reply's body; the connection back to the client's pool either way."""
    try:
        return reply.read()
    finally:
        reply.release_conn()


def api_status(exc: BaseException) -> int | None:
    """The HTTP status of a kubernetes client ApiException (None for any other exception)."""
    return getattr(exc, "status", None)
