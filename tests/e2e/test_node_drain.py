"""A drained node (docs/design.md, "Drained nodes"), on the real control plane with kwok nodes, under the chart's
ServiceAccount: `kubectl drain` of the node a serving pair runs on. The pair's PodDisruptionBudget refuses the
drain's evictions of its Ready pods; the operator sees the node cordoned and moves the pair itself (Surge: a new
generation beside the old one, switched, then the old one deleted, so the pair never stops being Ready; Recreate: an
ordered restart, reason node_drain, outside the restart budget); the drain then finds the pods gone and ends.

Cost: about 40 s for both cases, kwok only, no engine (the decode listener is a socket the test holds).
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from pdpair.contract import LABEL_GENERATION, LABEL_PAIR_UID, LABEL_ROLE, ROLE_DECODE, ROLE_PREFILL
from pdpair.operator.build import disruption
from tests.e2e.ha_support import DecodeListeners
from tests.e2e.operator_helpers import NO_HEALTH, Api, operator, own_nodes, pool_of_free_ports
from devcluster.waiting import wait_for

pytestmark = pytest.mark.cluster

POOL_LABEL = "pdpair.test/node-drain-pool"
DRAIN_TIMEOUT = 120


def _evict(api, ns, name):
    """The Eviction API, as `kubectl drain` calls it: the HTTP status (201 evicted, 429 refused by a budget)."""
    from kubernetes.client.exceptions import ApiException

    try:
        api.core.create_namespaced_pod_eviction(name, ns, {"apiVersion": "policy/v1", "kind": "Eviction",
                                                           "metadata": {"name": name, "namespace": ns}})
        return 201
    except ApiException as exc:
        return exc.status


@pytest.mark.parametrize("strategy", ["Surge", "Recreate"])
def test_a_drained_node_waits_for_the_pair_to_move_off_it(platform, cluster_namespace, tmp_path, strategy):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    pool = f"nd-{uuid.uuid4().hex[:6]}"
    drained, spare = f"{pool}-drained", f"{pool}-spare"
    # Two nodes of the test's own, tainted so no other test's pod lands there; `spare` cordoned until the pair runs,
    # so its pods start on `drained`.
    placement = own_nodes(cluster, api, POOL_LABEL, pool, (drained, spare), cordoned=(spare,))
    listeners = DecodeListeners(api, ns)
    try:
        with operator(platform, ns, pool_of_free_ports(30), tmp_path, env=NO_HEALTH):
            api.create_pair(ns, "nd", decode=dict(placement), prefill=dict(placement), rolloutStrategy=strategy,
                            rollout={"drainSeconds": 2})
            wait_for(lambda: (api.pair(ns, "nd").get("status") or {}).get("phase") == "Ready", 90, "pair Ready")
            uid = api.pair(ns, "nd")["metadata"]["uid"]
            old = {p.metadata.labels[LABEL_ROLE]: p for p in api.core.list_namespaced_pod(ns).items}
            assert {p.spec.node_name for p in old.values()} == {drained}

            # The pair's budget: one, owned by the pair, selecting its pods, no disruption allowed.
            budget = wait_for(lambda: next(iter(api.policy.list_namespaced_pod_disruption_budget(ns).items), None),
                              30, "the pair's PodDisruptionBudget")
            assert [o.uid for o in budget.metadata.owner_references] == [uid]
            assert budget.spec.min_available == disruption.NO_READY_POD_EVICTED
            assert budget.spec.max_unavailable is None
            assert budget.spec.selector.match_labels == {LABEL_PAIR_UID: uid}
            assert budget.spec.unhealthy_pod_eviction_policy == "AlwaysAllow"
            # An eviction of a Ready pod of the serving pair is refused (the API answers 429).
            wait_for(lambda: _evict(api, ns, old[ROLE_DECODE].metadata.name) == 429, 30,
                     "an eviction refused by the budget (the disruption controller computes it first)")
            # The disruption controller computes the budget without the pods' controller's /scale (an InferencePair
            # has none): no CalculateExpectedPodCountFailed, as maxUnavailable caused (seen in CI).
            failed = [e.message for e in api.events(ns) if e.reason == "CalculateExpectedPodCountFailed"]
            assert failed == [], failed
            if strategy == "Recreate":
                # A budget an older operator made (maxUnavailable 0) is patched back to the current spec.
                name = budget.metadata.name
                api.policy.patch_namespaced_pod_disruption_budget(
                    name, ns, {"spec": {"minAvailable": None, "maxUnavailable": 0}})
                wait_for(lambda: api.policy.read_namespaced_pod_disruption_budget(name, ns).spec.min_available
                         == disruption.NO_READY_POD_EVICTED, 30, "the outdated budget patched back")

            api.core.patch_node(spare, {"spec": {"unschedulable": False}})
            drain: dict = {}

            def run_drain():
                drain["proc"] = cluster.kubectl("drain", drained, "--ignore-daemonsets", "--delete-emptydir-data",
                                                f"--timeout={DRAIN_TIMEOUT}s", check=False, timeout=DRAIN_TIMEOUT + 30)

            started = time.monotonic()
            thread = threading.Thread(target=run_drain)
            thread.start()
            phases = []
            while thread.is_alive():
                status = api.pair(ns, "nd").get("status") or {}
                phases.append(status.get("phase"))
                time.sleep(0.2)
            thread.join()
            took = time.monotonic() - started
            proc = drain["proc"]
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert not [p for p in api.core.list_namespaced_pod(ns).items if p.spec.node_name == drained]

            def moved():
                status = api.pair(ns, "nd").get("status") or {}
                return status if status.get("phase") == "Ready" and status.get("pairGeneration") == 2 \
                    and "rollout" not in status else None

            status = wait_for(moved, 60, "generation 2 Ready")
            new = [p for p in api.core.list_namespaced_pod(ns).items if p.metadata.labels[LABEL_GENERATION] == "2"]
            assert sorted(p.metadata.labels[LABEL_ROLE] for p in new) == [ROLE_DECODE, ROLE_PREFILL]
            assert {p.spec.node_name for p in new} == {spare}
            messages = [e.message or "" for e in api.events(ns) if e.involved_object.name == "nd"]
            if strategy == "Surge":
                # Re-homed without a gap: Ready at every look while the drain ran; a rollout, not a restart.
                assert set(phases) == {"Ready"}, sorted(set(phases))
                assert int(status.get("restarts") or 0) == 0, status
                assert "disruption budget" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
                assert any("cordoned" in m and "re-homing" in m for m in messages), messages
            else:
                assert int(status.get("restarts") or 0) == 1 and "cordoned" in status["lastRestart"]["reason"], status
            print(f"\nnode drain ({strategy}): drain done {took:.1f}s after it began; phases seen: "
                  f"{sorted(set(p for p in phases if p))}")
            api.delete_pair(ns, "nd")
            wait_for(lambda: not api.pairs(ns), 60, "pair deleted")
    finally:
        listeners.stop()
        for name in (drained, spare):
            cluster.kubectl("delete", "node", name, "--wait=false", check=False)
