"""Per-role scale objects on the real control plane (docs/xpyd.md section 2): the operator makes `<pair>-prefill` and
`<pair>-decode` (InferencePairRole, owned by the pair, seeded from the inline counts); `kubectl scale` moves
spec.replicas through the /scale subresource and that count wins over a re-applied inline one (condition
ReplicasFromScaleTarget, an Event); a deleted role object is made again from the inline count; a real
HorizontalPodAutoscaler (kube-controller-manager's, default --horizontal-pod-autoscaler-sync-period 15 s, controller
enabled by the default --controllers=*) reads /scale (AbleToScale=True, SucceededGetScale) and writes it (a count
above its maxReplicas is brought back to it); deleting the pair deletes the role objects (garbage collector).

Needs the reconciler to call scale_sync.sync_scale_targets and plan from scale_targets.effective_spec. kwok nodes
(no engines): the instances never become Ready, which nothing here needs. One test, about 1-2 minutes on a quiet box.
"""

from __future__ import annotations

import json

import pytest

from pdpair.contract import (
    COND_REPLICAS_FROM_SCALE_TARGET,
    GROUP,
    KIND,
    ROLE_OBJECT_KIND,
    ROLE_OBJECT_PLURAL,
    ROLES,
    VERSION,
)
from pdpair.operator.decide import scale_targets
from devcluster.waiting import wait_for
from tests.e2e.operator_helpers import Api, cleanup_pairs, condition, operator, pool_of_free_ports

pytestmark = pytest.mark.cluster

PAIR = "scaled"
HPA_SYNC = 15  # kube-controller-manager's default --horizontal-pod-autoscaler-sync-period (devcluster keeps it)


def role_objects(api, ns) -> dict:
    items = api.custom.list_namespaced_custom_object(GROUP, VERSION, ns, ROLE_OBJECT_PLURAL)["items"]
    return {o["metadata"]["name"]: o for o in items}


def test_role_objects_follow_kubectl_scale_and_an_hpa_and_go_with_the_pair(platform, cluster_namespace, tmp_path):
    from kubernetes import client

    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    names = {role: scale_targets.role_object_name(PAIR, role) for role in ROLES}
    with operator(platform, ns, pool_of_free_ports(120), tmp_path) as proc:
        def diagnose() -> str:
            return (f"role objects: {json.dumps(role_objects(api, ns), indent=1)[-3000:]}\n"
                    f"events: {[(e.reason, e.message) for e in api.events(ns)][-20:]}\noperator log:\n{proc.log_tail()}")

        pair = api.create_pair(ns, PAIR, prefill={"replicas": 1}, decode={"replicas": 1})
        uid = pair["metadata"]["uid"]

        # 1. The operator makes one role object per role, owned by the pair, seeded from the inline counts, and
        #    writes its status (the /scale selector of the role's pods).
        objects = wait_for(lambda: (lambda o: o if set(names.values()) <= set(o) else None)(role_objects(api, ns)),
                           90, "both role objects", diagnose=diagnose)
        for role, name in names.items():
            body = objects[name]
            assert body["kind"] == ROLE_OBJECT_KIND
            assert body["spec"] == {"pair": PAIR, "role": role, "replicas": 1}
            [ref] = body["metadata"]["ownerReferences"]
            assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (KIND, PAIR, uid, True)
        for role, name in names.items():
            wait_for(lambda: (role_objects(api, ns)[name].get("status") or {}).get("selector")
                     == scale_targets.role_selector(uid, role), 60, f"{name}'s status.selector", diagnose=diagnose)

        # 2. kubectl scale moves spec.replicas through /scale (steps 4 and 5 use the short name ipr).
        cluster.kubectl("scale", f"inferencepairrole/{names['decode']}", "--replicas=2", "-n", ns)
        assert role_objects(api, ns)[names["decode"]]["spec"]["replicas"] == 2
        scale = json.loads(cluster.kubectl("get", "--raw", f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/"
                                           f"{ROLE_OBJECT_PLURAL}/{names['decode']}/scale").stdout)
        assert scale["spec"]["replicas"] == 2
        assert scale["status"]["selector"] == scale_targets.role_selector(uid, "decode")
        wait_for(lambda: (api.pair(ns, PAIR).get("status") or {}).get("decode", {}).get("desired") == 2, 60,
                 "the pair to plan 2 decode instances", diagnose=diagnose)

        # 3. The pair re-applied with inline 3: the role object's 2 stays the count, and the pair says why.
        api.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, "inferencepairs", PAIR,
                                                  {"spec": {"decode": {"replicas": 3}}})
        # (True already since kubectl scale made the counts differ, 1 inline against 2: wait for the new inline 3)
        cond = wait_for(lambda: (lambda c: c if c.get("status") == "True" and "replicas is 3" in c.get("message", "")
                                 else None)(condition(api.pair(ns, PAIR), COND_REPLICAS_FROM_SCALE_TARGET)), 60,
                        "ReplicasFromScaleTarget=True naming the inline 3", diagnose=diagnose)
        assert "spec.decode.replicas is 3" in cond["message"] and f"{names['decode']} says 2" in cond["message"]
        wait_for(lambda: any(e.reason == scale_targets.EVENT_REASON_OVERRIDDEN and names["decode"] in (e.message or "")
                             for e in api.events(ns)), 60, "the ReplicasFromScaleTarget Event", diagnose=diagnose)
        assert role_objects(api, ns)[names["decode"]]["spec"]["replicas"] == 2
        assert api.pair(ns, PAIR)["status"]["decode"]["desired"] == 2

        # 4. A deleted role object is made again from the inline count (the escape hatch).
        old_uid = role_objects(api, ns)[names["prefill"]]["metadata"]["uid"]
        cluster.kubectl("delete", f"ipr/{names['prefill']}", "-n", ns)
        remade = wait_for(lambda: (lambda o: o if o and o["metadata"]["uid"] != old_uid else None)(
            role_objects(api, ns).get(names["prefill"])), 60, "the prefill role object made again", diagnose=diagnose)
        assert remade["spec"]["replicas"] == 1

        # 5. A HorizontalPodAutoscaler drives the decode role through /scale.
        hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
               "metadata": {"name": f"{PAIR}-decode", "namespace": ns},
               "spec": {"scaleTargetRef": {"apiVersion": f"{GROUP}/{VERSION}", "kind": ROLE_OBJECT_KIND,
                                           "name": names["decode"]},
                        "minReplicas": 1, "maxReplicas": 3,
                        "metrics": [{"type": "Resource", "resource": {
                            "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}}]}}
        autoscaling = client.AutoscalingV2Api(cluster.api_client())
        autoscaling.create_namespaced_horizontal_pod_autoscaler(ns, hpa)

        seen = []

        def able_to_scale():
            status = autoscaling.read_namespaced_horizontal_pod_autoscaler(f"{PAIR}-decode", ns).status
            found = next((c for c in status.conditions or () if c.type == "AbleToScale"), None)
            if found is not None and (found.status, found.reason) not in seen:
                seen.append((found.status, found.reason))
            return found if found is not None and found.status == "True" else None

        # A CRD made moments ago may be unknown to the controller manager's cached discovery ("no matches for kind":
        # FailedGetScale) until it resets that cache (every 30 s): the HPA then gets the scale on its next sync.
        able = wait_for(able_to_scale, 4 * HPA_SYNC + 60, "the HPA's AbleToScale=True",
                        diagnose=lambda: f"AbleToScale seen: {seen}\n{diagnose()}")
        print(f"\nAbleToScale seen in order: {seen}")
        assert (able.status, able.reason) == ("True", "SucceededGetScale"), (able.status, able.reason, able.message)
        # above maxReplicas the HPA scales without metrics (there is no metrics server here): it writes /scale
        cluster.kubectl("scale", f"ipr/{names['decode']}", "--replicas=5", "-n", ns)
        wait_for(lambda: role_objects(api, ns)[names["decode"]]["spec"]["replicas"] == 3, 4 * HPA_SYNC + 30,
                 "the HPA to bring the decode role back to its maxReplicas 3", diagnose=diagnose)
        autoscaling.delete_namespaced_horizontal_pod_autoscaler(f"{PAIR}-decode", ns)

        # 6. Deleting the pair deletes its role objects (ownerReference, garbage collector).
        cleanup_pairs(api, ns)
        wait_for(lambda: not role_objects(api, ns), 120, "the role objects to be garbage-collected", diagnose=diagnose)
    assert api.leases(ns) == []
