"""A fake coordination.k8s.io Lease API of one namespace, as the apiserver keeps Leases (create-if-absent is a 409,
a delete of a missing one a 404), for the executor's unit tests (test_port_leaser.py, test_rollout_executor.py).
Test code only."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kubernetes.client.exceptions import ApiException


class Leases:
    """`fail_deletes`: that many deletes raise a 500 first (a flaky apiserver)."""

    def __init__(self) -> None:
        self.items: dict[str, Any] = {}
        self.fail_deletes = 0

    def list_namespaced_lease(self, namespace, label_selector="", limit=None, _continue=None):
        want = dict(term.split("=", 1) for term in label_selector.split(",") if term)
        items = [lease for lease in self.items.values()
                 if all((lease.metadata.labels or {}).get(k) == v for k, v in want.items())]
        return SimpleNamespace(items=items, metadata=SimpleNamespace(var_continue=None))

    def create_namespaced_lease(self, namespace, body):
        if body.metadata.name in self.items:
            raise ApiException(status=409, reason="AlreadyExists")
        body.metadata.uid, body.metadata.resource_version = f"lease-{body.metadata.name}", "1"
        self.items[body.metadata.name] = body
        return body

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
