"""The executor's side of a rollout's end (reconciler.reconcile_once), replayed against fake API objects.

A rollout ends with a status write (status.rollout removed), then the release of the other generation's port set.
The pass that does it may die between the two; the next pass must release that set all the same.
"""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace
from typing import Any

from kubernetes.client.exceptions import ApiException

from pdpair.contract import (
    LABEL_PAIR,
    LABEL_PAIR_NAMESPACE,
    LABEL_PAIR_UID,
    LABEL_PORT_LEASE,
    LABEL_PORT_SLOT,
    LABEL_PURPOSE,
    LABEL_ROLE,
    ROLE_DECODE,
    ROLE_PREFILL,
    ROLE_ROUTER,
)
from pdpair.operator.decide import surge as r
from pdpair.operator.model import timestamps
from pdpair.operator.model.config import OperatorConfig, PortPool
from pdpair.operator.model.pair_spec import spec_fingerprint
from pdpair.operator.model.observed import PodView
from pdpair.operator.act.port_leaser import PortLeaser
from pdpair.operator.decide.port_blocks import assign, lease_name, lease_slot, status_ports
from tests.port_blocks_support import spec_blocks
from pdpair.operator.act.reconciler import PairReconciler, Runtime
from tests.crd_defaults import with_crd_defaults
from tests.unit.operator.fake_leases import Leases as FakeLeases

NS, OPS, UID = "ns", "ops", "uid-p"
SPEC = with_crd_defaults({"metadata": {"name": "p"}, "spec": {
    "model": "m", "image": "img:2", "rolloutStrategy": "Surge", "router": {"replicas": 1},
    "rollout": {"drainSeconds": 1, "progressDeadlineSeconds": 600}}})["spec"]


class Leases(FakeLeases):
    def slots(self) -> set[str]:
        return {lease_slot(lease.metadata.labels) for lease in self.items.values()}


class Pair:
    """The pair object: status patches land in the body, as the watch would deliver them."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def patch_namespaced_custom_object_status(self, group, version, namespace, plural, name, patch):
        status = self.body.setdefault("status", {})
        for key, value in patch["status"].items():
            if value is None:
                status.pop(key, None)
            else:
                status[key] = copy.deepcopy(value)
        meta = self.body["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
        return {"metadata": {"resourceVersion": meta["resourceVersion"]}}

    def patch_namespaced_custom_object(self, *args, **kwargs):
        return {}


class Core:
    """Pods, Services and Events: accepted and forgotten (the test hands the reconciler its pods)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def lease_both_slots(leases: Leases) -> dict[str, list[dict[str, Any]]]:
    """Both port sets of the pair leased, as a Surge rollout leaves them; their status.ports by set."""
    ports: dict[str, list[dict[str, Any]]] = {}
    first = 20000
    for slot in ("a", "b"):
        assignments = []
        for block in spec_blocks(SPEC):
            assignments += assign(block, first)
            first += block.count
        for a in assignments:
            labels = {LABEL_PORT_LEASE: "true", LABEL_PAIR: "p", LABEL_PAIR_NAMESPACE: NS, LABEL_PAIR_UID: UID,
                      LABEL_ROLE: a.role, LABEL_PURPOSE: a.purpose, LABEL_PORT_SLOT: slot}
            leases.items[lease_name(a.port)] = SimpleNamespace(
                metadata=SimpleNamespace(name=lease_name(a.port), uid=f"lease-{a.port}", labels=labels), spec=None)
        ports[slot] = status_ports(assignments)
    return ports


def generation_2_pods() -> tuple[PodView, ...]:
    return tuple(PodView(f"p-{role}-g2", role, 2, spec_fingerprint(SPEC), phase="Running", ready=True, ip="10.0.0.2",
                         scheduled=True, uid=f"uid-{role}-2") for role in (ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER))


def reconciler(pair: Pair, leases: Leases) -> PairReconciler:
    config = OperatorConfig(namespace=OPS, port_pool=PortPool(20000, 20099))
    rt = Runtime(config=config, core=Core(), custom=pair, leaser=PortLeaser(leases, OPS, config.port_pool))
    return PairReconciler(rt, pair.body, emit=lambda *event: None)


def test_a_pass_that_dies_releasing_a_drained_port_set_is_redone():
    leases = Leases()
    ports = lease_both_slots(leases)
    # generation 2 serves on set b; generation 1 (set a) drained and its pods are gone: this pass ends the rollout
    rollout = {"fromGeneration": 1, "toGeneration": 2, "phase": r.PHASE_DRAINING, "portSlot": "b",
               "specHash": spec_fingerprint(SPEC), "startedAt": timestamps.rfc3339(0), "switchedAt": timestamps.rfc3339(0),
               "ports": ports["a"], "pods": []}
    pair = Pair({"metadata": {"name": "p", "namespace": NS, "uid": UID, "generation": 2, "resourceVersion": "1"},
                 "spec": SPEC, "status": {"pairGeneration": 2, "phase": "Ready", "portSlot": "b",
                                          "ports": ports["b"], "rollout": rollout}})
    pods = generation_2_pods()

    first = reconciler(pair, leases)
    leases.fail_deletes = 1  # the first lease delete of set a fails: the pass dies after its status write
    try:
        asyncio.run(first.reconcile_once(pods))
    except ApiException:
        pass
    else:
        raise AssertionError("the fake's lease delete did not fail")
    assert "rollout" not in pair.body["status"] and leases.slots() == {"a", "b"}

    # the same reconciler's next pass, and a fresh one (a new leader) for a second leak, both release set a
    asyncio.run(first.reconcile_once(pods))
    assert leases.slots() == {"b"}
    assert {p["port"] for p in pair.body["status"]["ports"]} == {p["port"] for p in ports["b"]}

    lease_both_slots(leases)  # set a leaked again; status as the rollout left it (set b serves)
    asyncio.run(reconciler(pair, leases).reconcile_once(pods))
    assert leases.slots() == {"b"}
    assert len(leases.items) == len(ports["b"])
