"""A fake coordination.k8s.io Lease API of one namespace, as the apiserver keeps Leases (create-if-absent is a 409,
a delete of a missing one a 404), for the executor's unit tests (test_port_leaser.py, test_rollout_executor.py).
Test code only."""

from __future__ import annotations

import json
from typing import Any

from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException


class RawReply:
    """What the client returns with `_preload_content=False`: the reply's bytes, read once, then the connection back."""

    def __init__(self, obj: Any) -> None:
        self._data = json.dumps(ApiClient().sanitize_for_serialization(obj)).encode()
        self.released = False

    def read(self) -> bytes:
        return self._data

    def release_conn(self) -> None:
        self.released = True


class Leases:
    """`fail_deletes`: that many deletes raise a 500 first (a flaky apiserver)."""

    def __init__(self) -> None:
        self.items: dict[str, Any] = {}
        self.fail_deletes = 0

    def list_namespaced_lease(self, namespace, label_selector="", limit=None, _continue=None, _preload_content=False):
        assert not _preload_content, "the leaser reads lists raw (api.call_json)"
        want = dict(term.split("=", 1) for term in label_selector.split(",") if term)
        items = [lease for lease in self.items.values()
                 if all((lease.metadata.labels or {}).get(k) == v for k, v in want.items())]
        return RawReply({"items": items, "metadata": {}})

    def create_namespaced_lease(self, namespace, body, _preload_content=True):
        if body.metadata.name in self.items:
            raise ApiException(status=409, reason="AlreadyExists")
        body.metadata.uid, body.metadata.resource_version = f"lease-{body.metadata.name}", "1"
        self.items[body.metadata.name] = body
        return body if _preload_content else RawReply(body)

    def read_namespaced_lease(self, name, namespace):
        if name not in self.items:
            raise ApiException(status=404, reason="NotFound")
        return self.items[name]

    def replace_namespaced_lease(self, name, namespace, body):
        body.metadata.uid = f"lease-{name}-replaced"
        self.items[name] = body
        return body

    def delete_namespaced_lease(self, name, namespace, body=None):
        if self.fail_deletes:
            self.fail_deletes -= 1
            raise ApiException(status=500, reason="InternalError")
        if self.items.pop(name, None) is None:
            raise ApiException(status=404, reason="NotFound")
