"""The pairs' Kubernetes Events, posted by a few workers over the operator's own API client.

kopf.event() queues each Event for a per-object worker, and every worker posts through kopf's aiohttp session, whose
connector has no connection limit (`TCPConnector(limit=0)`). With 1000 pairs finishing their steps together, about a
thousand workers posted at once, each on a connection (and TLS handshake) of its own: at 300 pairs the operator's
sockets went 140 -> 198 and its RSS +11 MiB while the queued Events went out; at 1000 pairs +98 MiB (354 -> 452 MiB),
and that memory stayed (glibc keeps what OpenSSL and aiohttp freed).

Here one queue feeds `workers` tasks; each posts in a thread with the kubernetes client, whose urllib3 pool reuses
the connections the reconciler's calls already hold, and without deserialising the reply into a V1Event. The same
Event (pair, type, reason, message) queued twice is posted once with its count. The queue is bounded (`limit`): past
it new Events are dropped and counted in the log, never the operator's memory.

Imports nothing of kubernetes or kopf: `post` is the blocking call (namespace, body) -> None.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import Any, Callable

from pdpair.contract import GROUP, KIND, VERSION

from pdpair.operator.act.kube_api import call_dropped
from pdpair.operator.model.timestamps import now_rfc3339

log = logging.getLogger(__name__)

EVENT_SOURCE = "pdpair-operator"
MESSAGE_LIMIT = 1024
DEFAULT_WORKERS = 4
DEFAULT_LIMIT = 10000
RETRY_DELAYS = (1.0, 2.0, 5.0)  # then the Event is logged and dropped: Events are auxiliary


@dataclass
class _Queued:
    namespace: str
    name: str
    uid: str
    type: str
    reason: str
    message: str
    first: str  # RFC 3339, when first emitted
    last: str
    count: int = 1


def event_body(item: _Queued) -> dict[str, Any]:
    """The core/v1 Event for a queued one (kubectl describe shows it under the pair, From pdpair-operator)."""
    return {
        "metadata": {"generateName": f"{item.name}.", "namespace": item.namespace},
        "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": item.name,
                           "namespace": item.namespace, "uid": item.uid},
        "type": item.type, "reason": item.reason, "message": item.message,
        "source": {"component": EVENT_SOURCE}, "reportingComponent": EVENT_SOURCE,
        "firstTimestamp": item.first, "lastTimestamp": item.last, "count": item.count,
    }


class EventPoster:
    def __init__(self, post: Callable[[str, dict[str, Any]], Any], workers: int = DEFAULT_WORKERS,
                 limit: int = DEFAULT_LIMIT, retry_delays: tuple[float, ...] = RETRY_DELAYS) -> None:
        self._post = post
        self.workers = max(1, workers)
        self.limit = limit
        self.retry_delays = retry_delays
        self._queue: collections.deque[tuple] = collections.deque()
        self._pending: dict[tuple, _Queued] = {}
        self._ready = asyncio.Event()
        self._busy = 0
        self.posted = 0
        self.dropped = 0
        self.failed = 0

    def __len__(self) -> int:
        return len(self._queue)

    def emit(self, namespace: str, name: str, uid: str, type_: str, reason: str, message: str) -> None:
        """Queue an Event on the pair (never blocks, never raises). Call from the event loop's thread."""
        message = message[:MESSAGE_LIMIT]
        key = (uid, type_, reason, message)
        now = now_rfc3339()
        queued = self._pending.get(key)
        if queued is not None:
            queued.count += 1
            queued.last = now
            return
        if len(self._queue) >= self.limit:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("%d Events dropped: %d queued, not posted yet (latest: %s %s on %s/%s)",
                            self.dropped, len(self._queue), type_, reason, namespace, name)
            return
        self._pending[key] = _Queued(namespace, name, uid, type_, reason, message, now, now)
        self._queue.append(key)
        self._ready.set()

    def _next(self) -> _Queued | None:
        if not self._queue:
            return None
        return self._pending.pop(self._queue.popleft())

    async def _post_one(self, item: _Queued) -> None:
        body = event_body(item)
        for attempt, delay in enumerate((*self.retry_delays, None)):
            try:
                await asyncio.to_thread(self._post, item.namespace, body)
                self.posted += 1
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if delay is None:
                    self.failed += 1
                    log.warning("posting the %s Event on %s/%s failed %d times (%s); dropped",
                                item.reason, item.namespace, item.name, attempt + 1, exc)
                    return
                await asyncio.sleep(delay)

    async def _worker(self) -> None:
        while True:
            item = self._next()
            if item is None:
                self._ready.clear()
                await self._ready.wait()
                continue
            self._busy += 1
            try:
                await self._post_one(item)
            finally:
                self._busy -= 1

    async def run(self) -> None:
        """Post until cancelled (a task of the operator's startup)."""
        await asyncio.gather(*(self._worker() for _ in range(self.workers)))

    async def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until nothing is queued or being posted (shutdown; tests)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._queue or self._busy:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True


def kubernetes_post(core: Any) -> Callable[[str, dict[str, Any]], None]:
    """The blocking post for EventPoster over a (Timed) CoreV1Api: the reply is read and dropped, not turned into a
    V1Event (the kubernetes client's deserialisation costs more CPU than the request)."""

    def post(namespace: str, body: dict[str, Any]) -> None:
        call_dropped(core.create_namespaced_event, namespace, body)

    return post
