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

import threading
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


def _cut(api, node, pool):
    """The partition: kwok lets go of `node`, which reported NotReady (with the not-ready taint) before going silent.
    Returns the monotonic time NotReady was stamped."""
    api.core.patch_node(node, {"metadata": {"labels": {FAKE_NODE_LABEL[0]: None}}})
    time.sleep(1)  # kwok's last status write (if one was in flight) lands before ours
    # The cut is when NotReady is stamped (the operator counts nodeLostSeconds from lastTransitionTime, whole seconds,
    # so up to 1 s earlier): not after the patches below, which took 2 s on a CI box at load 42 and made a correct
    # decision look early.
    cut = time.monotonic()
    stamp = _now()
    api.core.patch_node_status(node, {"status": {"conditions": [
        {"type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": "partition (test)",
         "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}]}})
    api.core.patch_node(node, {"spec": {"taints": [
        {"key": POOL_LABEL, "value": pool, "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]}})
    return cut


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

            # The partition: kwok lets go of the node; its kubelet said NotReady before going silent (_cut).
            cut = _cut(api, lost, pool)
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


def test_a_lost_node_in_a_serving_xpyd_pair_replaces_only_its_pods_on_the_same_generation(
        platform, cluster_namespace, tmp_path):
    """2P2D with two router replicas on two nodes of the test's own, nothing pinned: each role spreads over both
    nodes (the default preferred anti-affinity). Router 0's node is cut off: its router, prefill and decode are
    force-deleted once their ports are fenced and come back under the same names on the other node, while the other
    node's pods (router 1 among them) keep serving: the Ready condition stays True, the pair keeps generation 1, no
    restart is counted, and the fences outlive the force-deleted pods until the node is back. Cost: about 40 s,
    kwok only, no engine."""
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    pool = f"nx-{uuid.uuid4().hex[:6]}"
    nodes = (f"{pool}-a", f"{pool}-b")
    placement = own_nodes(cluster, api, POOL_LABEL, pool, nodes)
    env = {**NO_HEALTH, ENV_NODE_LOST_SECONDS: str(NODE_LOST_SECONDS), ENV_SWEEP_INTERVAL: "2"}
    listeners = DecodeListeners(api, ns)

    def pods():
        return {p.metadata.name: p for p in api.core.list_namespaced_pod(ns).items}

    def serving(pair):
        status = pair.get("status") or {}
        return (status.get("phase") == "Ready" and (status.get("prefill") or {}).get("readyOfDesired") == "2/2"
                and (status.get("decode") or {}).get("readyOfDesired") == "2/2"
                and (condition(pair, "Ready") or {}).get("status") == "True")

    try:
        with operator(platform, ns, pool_of_free_ports(40), tmp_path, env=env):
            api.create_pair(ns, "nx", router={"enabled": True, **placement}, decode={"replicas": 2, **placement},
                            prefill={"replicas": 2, **placement})
            wait_for(lambda: serving(api.pair(ns, "nx")), 90, "2P2D Ready")
            wait_for(lambda: all(n in pods() and pods()[n].status.phase == "Running" for n in ("nx-router-g1",
                                                                                             "nx-router-g1-1")),
                     30, "both router replicas running",
                     diagnose=lambda: "; ".join(f"{n}: {p.status.phase} on {p.spec.node_name}" for n, p in pods().items())
                     + f"\n{api.pair(ns, 'nx')['spec']['router']}\n{[p['name'] for p in api.pair(ns, 'nx')['status']['ports']]}")
            before = pods()
            by_role: dict[str, set[str]] = {}
            for pod in before.values():
                by_role.setdefault(pod.metadata.labels[LABEL_ROLE], set()).add(pod.spec.node_name)
            assert by_role[ROLE_PREFILL] == by_role[ROLE_DECODE] == by_role["router"] == set(nodes), \
                f"a role did not spread over both nodes: {by_role}"
            lost = before["nx-router-g1"].spec.node_name  # router 0's: router 1 serves from the other node
            on_lost = {n for n, p in before.items() if p.spec.node_name == lost}
            kept = {n: p.metadata.uid for n, p in before.items() if n not in on_lost}
            lost_ports = set().union(*(declared_ports(before[n]) for n in on_lost))

            cut = _cut(api, lost, pool)
            not_ready: list[str] = []  # the Ready condition as sampled through the loss: router 1 keeps serving
            sampling = threading.Event()

            def sample():
                while not sampling.wait(0.2):
                    ready = condition(api.pair(ns, "nx"), "Ready") or {}
                    if ready.get("status") != "True":
                        not_ready.append(f"{ready.get('reason')}: {ready.get('message')}")

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()

            def replaced():
                now = pods()
                return all(n in now and now[n].metadata.uid != before[n].metadata.uid
                           and now[n].spec.node_name != lost for n in on_lost)

            wait_for(replaced, 60, "the lost node's pods re-created elsewhere under their names")
            decided = time.monotonic() - cut
            assert lost_ports <= set(api.fences(f"{ns}/")), "a force-deleted pod's ports are not fenced"
            wait_for(lambda: serving(api.pair(ns, "nx")), 60, "2P2D Ready again")
            back = time.monotonic() - cut
            sampling.set()
            sampler.join(10)
            assert not not_ready, f"the Ready condition left True while router 1 served: {not_ready[:3]}"
            pair = api.pair(ns, "nx")
            assert pair["status"]["pairGeneration"] == 1 and not pair["status"].get("restarts"), pair["status"]
            now = pods()
            assert {n: now[n].metadata.uid for n in kept} == kept, "a pod on the other node was touched"
            assert not [n for n, p in now.items() if p.metadata.deletion_timestamp], "a pod left terminating"
            reasons = [e.reason for e in api.events(ns) if e.involved_object.name == "nx"]
            assert reasons.count("PodForceDeleted") == len(on_lost), reasons

            # The fences outlive the force-deleted pods while the node is lost (several sweeps), and go once it is back.
            time.sleep(5)
            assert lost_ports <= set(api.fences(f"{ns}/")), "a fence ended while its node is still lost"
            api.core.patch_node(lost, {"metadata": {"labels": {FAKE_NODE_LABEL[0]: FAKE_NODE_LABEL[1]}},
                                       "spec": {"taints": [{"key": POOL_LABEL, "value": pool,
                                                            "effect": "NoSchedule"}]}})
            wait_for(lambda: not lost_ports & set(api.fences()), 30, "the fences released once the node is back")
            print(f"\nxPyD node lost: {sorted(on_lost)} replaced {decided:.1f}s after the cut, Ready again "
                  f"{back:.1f}s after it, generation 1, no restart")
            api.delete_pair(ns, "nx")
            wait_for(lambda: not api.pairs(ns), 60, "pair deleted")
    finally:
        listeners.stop()
        for name in nodes:
            cluster.kubectl("delete", "node", name, "--wait=false", check=False)
