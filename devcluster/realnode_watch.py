"""Watch recorders for the real-node e2e: what the API server saw, in order. Pods and pairs live in one etcd, whose
revision is every object's resourceVersion, so events of different watches are ordered by it (no sleeps, no
timestamps of whole seconds)."""
from __future__ import annotations

import json
import threading
import time

from pdpair.contract import COND_DECODE_LISTENING


class Recorder:
    """Records a watch's events as (monotonic time, resourceVersion, type, object as JSON), from the
    resourceVersion of a list taken at construction (nothing in between is missed; no sleep needed)."""

    def __init__(self, api_client, list_fn, *args):
        from kubernetes import watch

        self.events: list[tuple[float, int, str, dict]] = []
        self.error: BaseException | None = None
        self._api_client, self._list, self._args = api_client, list_fn, args
        self._watch = watch.Watch()
        self._stopping = False
        initial = json.loads(list_fn(*args, _preload_content=False).data)
        self._rv = initial["metadata"]["resourceVersion"]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stopping:  # a watch ends after timeout_seconds: resume from the last version seen
                for ev in self._watch.stream(self._list, *self._args, resource_version=self._rv, timeout_seconds=120):
                    obj = ev["object"]
                    if not isinstance(obj, dict):
                        obj = self._api_client.sanitize_for_serialization(obj)
                    self._rv = obj["metadata"]["resourceVersion"]
                    self.events.append((time.monotonic(), int(self._rv), ev["type"], obj))
        except Exception as exc:
            if not self._stopping:
                self.error = exc

    def stop(self) -> None:
        self._stopping = True
        self._watch.stop()


def pod_steps(events) -> list[tuple[float, int, str]]:
    """(time, resourceVersion, "create NAME" | "delete NAME") from a pod watch: a creation, and the first sign of a
    deletion (deletionTimestamp set, or DELETED)."""
    steps, deleting = [], set()
    for t, rv, kind, pod in events:
        name = pod["metadata"]["name"]
        if kind == "ADDED":
            steps.append((t, rv, f"create {name}"))
        elif (kind == "DELETED" or pod["metadata"].get("deletionTimestamp")) and name not in deleting:
            deleting.add(name)
            steps.append((t, rv, f"delete {name}"))
    return steps


def listening_since(events, generation: int) -> tuple[float, int] | None:
    """(time, resourceVersion) of the first pair version with DecodeListening True at `generation`."""
    for t, rv, _, pair in events:
        status = pair.get("status") or {}
        if int(status.get("pairGeneration") or 0) != generation:
            continue
        if any(c["type"] == COND_DECODE_LISTENING and c["status"] == "True" for c in status.get("conditions") or []):
            return t, rv
    return None
