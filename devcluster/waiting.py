"""The one polling helper of the dev cluster, the e2e, real-node and engine tests, and the demos."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, what: str, *, interval: float = 0.25,
             diagnose: Callable[[], str] | None = None) -> T:
    """Polls predicate() every `interval` seconds until it returns something truthy, which is returned. After
    `timeout` seconds it fails with an AssertionError naming `what`, the timeout, the last value and, when given,
    diagnose()'s text (pod listings, logs)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f"\n{diagnose()}" if diagnose is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {value!r}){detail}")
        time.sleep(interval)
