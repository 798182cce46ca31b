"""A lost node (docs/design.md, "Lost nodes"), on the real control plane with kwok nodes: the pair is re-homed on a
Ready node without waiting for pods its lost node can never confirm gone, the lost pods' ports stay fenced to them
for as long as those pods exist (longer than the busy-port quarantine's TTL), and the heal frees them.

The partition: kwok stops keeping a node once its managing label is removed (no heartbeat, no pod status, no
deletion confirmed: a cut-off kubelet as the API sees it), and the test reports the node NotReady as its kubelet
would before going silent, with the not-ready NoSchedule taint the node lifecycle controller adds. The heal puts
the label back: kwok confirms the pending deletions, the fence sweep frees the ports.

Cost: about 1 minute, kwok only, no engine (the decode listener is a socket the test holds).
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone

import pytest

from pdpair.contract import (
    COND_NODE_LOST,
    LABEL_GENERATION,
    LABEL_ROLE,
    ROLE_DECODE,
    ROLE_PREFILL,
)
from pdpair.operator.model.config import ENV_BUSY_PORT_QUARANTINE, ENV_NODE_LOST_SECONDS, ENV_SWEEP_INTERVAL
from tests.e2e.ha_support import DecodeListeners
from tests.e2e.operator_helpers import NO_HEALTH, Api, condition, operator, own_nodes, pool_of_free_ports
from devcluster.kwok import FAKE_NODE_LABEL
from devcluster.waiting import wait_for

pytestmark = pytest.mark.cluster

NODE_LOST_SECONDS = 3
QUARANTINE_SECONDS = 5  # the busy-port TTL, shortened: a fence must outlive it
POOL_LABEL = "pdpair.test/node-lost-pool"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def declared_ports(pod):
    return {int(p.container_port) for c in pod.spec.containers for p in c.ports or []}


def test_a_partitioned_node_is_left_behind_with_its_ports_fenced_and_the_pair_serves_again(
        platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    pool = f"nl-{uuid.uuid4().hex[:6]}"
    lost, good = f"{pool}-lost", f"{pool}-good"
    # Two nodes of the test's own, tainted so no other test's pod lands there; `good` cordoned until the pair runs,
    # so both pods start on `lost`.
    placement = own_nodes(cluster, api, POOL_LABEL, pool, (lost, good), cordoned=(good,))
    env = {**NO_HEALTH, ENV_NODE_LOST_SECONDS: str(NODE_LOST_SECONDS), ENV_SWEEP_INTERVAL: "2",
           ENV_BUSY_PORT_QUARANTINE: str(QUARANTINE_SECONDS)}
    listeners = DecodeListeners(api, ns)
    try:
        with operator(platform, ns, pool_of_free_ports(30), tmp_path, env=env):
            api.create_pair(ns, "nl", decode=dict(placement), prefill=dict(placement))
            wait_for(lambda: (api.pair(ns, "nl").get("status") or {}).get("phase") == "Ready", 90, "pair Ready")
            old = {p.metadata.labels[LABEL_ROLE]: p for p in api.core.list_namespaced_pod(ns).items}
            assert {p.spec.node_name for p in old.values()} == {lost}
            old_ports = set().union(*(declared_ports(p) for p in old.values()))

            # The partition: kwok lets go of the node; its kubelet said NotReady before going silent.
            api.core.patch_node(lost, {"metadata": {"labels": {FAKE_NODE_LABEL[0]: None}}})
            time.sleep(1)  # kwok's last status write (if one was in flight) lands before ours
            # The cut is when NotReady is stamped (the operator counts nodeLostSeconds from lastTransitionTime, whole
            # seconds, so up to 1 s earlier): not after the patches below, which took 2 s on a CI box at load 42 and
            # made a correct decision look early.
            cut = time.monotonic()
            stamp = _now()
            api.core.patch_node_status(lost, {"status": {"conditions": [
                {"type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": "partition (test)",
                 "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}]}})
            api.core.patch_node(lost, {"spec": {"taints": [
                {"key": POOL_LABEL, "value": pool, "effect": "NoSchedule"},
                {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}], "unschedulable": False}})
            api.core.patch_node(good, {"spec": {"unschedulable": False}})

            def restarted():
                pair = api.pair(ns, "nl")
                return pair if (pair.get("status") or {}).get("restarts") == 1 else None

            pair = wait_for(restarted, 60, "the node-lost restart")
            decided = time.monotonic() - cut
            assert decided >= NODE_LOST_SECONDS - 1, (f"restarted {decided:.1f}s after NotReady was stamped, before "
                                                      f"nodeLostSeconds: {pair['status'].get('lastRestart')}")
            assert lost in pair["status"]["lastRestart"]["reason"], pair["status"]["lastRestart"]
            nodelost = wait_for(lambda: (lambda c: c if c and c["status"] == "True" else None)(
                condition(api.pair(ns, "nl"), COND_NODE_LOST)), 30, "condition NodeLost True")
            assert lost in nodelost["message"]

            # Re-homed: generation 2 Ready on the good node, while generation 1's pods still exist on the lost one.
            def ready_again():
                pair = api.pair(ns, "nl")
                status = pair.get("status") or {}
                return pair if status.get("phase") == "Ready" and status.get("pairGeneration") == 2 else None

            wait_for(ready_again, 90, "generation 2 Ready")
            serving = f"{time.monotonic() - cut:.1f}"
            pods = api.core.list_namespaced_pod(ns).items
            new = [p for p in pods if p.metadata.labels[LABEL_GENERATION] == "2"]
            assert sorted(p.metadata.labels[LABEL_ROLE] for p in new) == [ROLE_DECODE, ROLE_PREFILL]
            assert {p.spec.node_name for p in new} == {good}
            stranded = [p for p in pods if p.metadata.uid in {o.metadata.uid for o in old.values()}]
            assert len(stranded) == 2 and all(p.metadata.deletion_timestamp for p in stranded), \
                "the lost node's pods should still exist, deleted but unconfirmed"
            new_ports = set().union(*(declared_ports(p) for p in new))
            assert not new_ports & old_ports, f"generation 2 shares ports {new_ports & old_ports} with the lost pods"
            fenced = api.fences(f"{ns}/")
            assert old_ports <= set(fenced), (sorted(old_ports), fenced)
            reasons = {e.reason for e in api.events(ns) if e.involved_object.name == "nl"}
            assert "NodeLost" in reasons

            # The partition outlives the busy-port quarantine's TTL and several sweeps: the fences hold.
            time.sleep(QUARANTINE_SECONDS + 4)
            assert old_ports <= set(api.fences(f"{ns}/")), "a fence ended while its pod still exists"
            assert (api.pair(ns, "nl")["status"]).get("restarts") == 1, "restarted more than once"

            # The heal: kwok takes the node back, confirms the deletions; the sweep frees the fenced ports.
            api.core.patch_node(lost, {"metadata": {"labels": {FAKE_NODE_LABEL[0]: FAKE_NODE_LABEL[1]}},
                                       "spec": {"taints": [{"key": POOL_LABEL, "value": pool,
                                                            "effect": "NoSchedule"}]}})
            healed = time.monotonic()
            wait_for(lambda: not [p for p in api.core.list_namespaced_pod(ns).items
                                  if p.metadata.labels[LABEL_GENERATION] == "1"], 60, "the lost pods gone after the heal")
            wait_for(lambda: not old_ports & set(api.fences()), 30, "the fences released")
            freed = f"{time.monotonic() - healed:.1f}"
            wait_for(lambda: (condition(api.pair(ns, "nl"), COND_NODE_LOST) or {}).get("status") == "False", 30,
                     "condition NodeLost False")
            print(f"\nnode lost: restart decided {decided:.1f}s after the cut (nodeLostSeconds {NODE_LOST_SECONDS}), "
                  f"generation 2 Ready {serving}s after the cut; fences released {freed}s after the heal")
            api.delete_pair(ns, "nl")
            wait_for(lambda: not api.pairs(ns), 60, "pair deleted")
    finally:
        listeners.stop()
        for name in (lost, good):
            cluster.kubectl("delete", "node", name, "--wait=false", check=False)
