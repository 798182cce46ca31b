"""A network partition on the real nodes (docs/design.md, "Lost nodes"): node n2's link to the hub goes down under
a serving pair whose decode and router run there, prefill on n1; n2's kubelet and engines keep running.

The controller manager runs at upstream defaults: after its node-monitor grace period it marks n2 Unknown and taints
it unreachable; the operator then counts n2 lost at once, fences the ports of the pods there, and restarts the pair
on n1 without waiting for deletions n2 cannot confirm. Measured from link-down: the restart decision, and the pair
serving again through its Service with outputs equal to the single engine's. A steady client in n1 counts its
failed requests (never retried): they fail while the partition is detected; none sent after generation 2 serves. During the partition the cut-off decode
still answers inside n2's network (a partition, not a stopped kubelet). Link up: n2's kubelet ends the old pods, the
fences go with them, no force delete.

Nothing pins a pod to a node here (the demo's pair pins them): preferred node affinity places decode and the router
on n2 and prefill on n1 at first, and lets the replacements go to n1.

Whichever comes first restarts the pair: the health watch (n2's pods unreachable three times, a budgeted restart)
or the lost node (outside the budget); the old pods go only once n2 counts as lost and their ports are fenced.

Cost: about 3 to 4 minutes on the session's cluster: two vLLM cold starts at once, twice (the pair, then its
replacement), the grace period (50 s on Kubernetes 1.36: measured 53.7 s from link-down to NodeLost) and the heal
(the fences go at the operator's next sweep: every 10 s in this session, conftest.operator_release). Runs last: it takes node n2 away for a while.
"""
from __future__ import annotations

import json
import subprocess
import time

import pytest
import yaml

from pdpair.contract import (
    ANNOTATION_RESTART_TIMES, COND_NODE_LOST, GROUP, LABEL_PORT_QUARANTINE,
    PLURAL,
)
from devcluster.product import (
    ENGINE_START_TIMEOUT, OPERATOR_NS, PROMPTS, completion, describe, fenced_ports, leader_pod_name, operator_logs,
    pair_manifest,
)
from devcluster.waiting import wait_for
from tests.e2e_realnode.load import Load

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(1800)]

NAME = "partition"
LOAD_CLIENTS = 2
LOAD_TIMEOUT = 10.0  # seconds per request: one sent to the cut-off router fails after it
CUT_NODE = "n2"


def prefer(node: str) -> dict:
    return {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": {
        "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}}]}}


def unpinned_manifest(namespace: str, engine_ref: str, model_dir) -> dict:
    body = pair_manifest(NAME, namespace, engine_ref, model_dir, prefill_node="n1", decode_node=CUT_NODE)
    for role, node in (("prefill", "n1"), ("decode", CUT_NODE), ("router", CUT_NODE)):
        template = body["spec"][role]["template"]["spec"]
        del template["nodeSelector"]
        template["affinity"] = prefer(node)
    return body


def test_a_partitioned_node_is_left_behind_and_the_pair_serves_from_the_other_node(
        real_cluster, operator_release, baseline_outputs, images, model_dir, namespace):
    cluster = real_cluster

    def pair():
        return json.loads(cluster.kubectl("get", f"{PLURAL}.{GROUP}", NAME, "-n", namespace, "-o", "json").stdout)

    def pods():
        return json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]

    def fences() -> dict[int, str]:
        return fenced_ports(json.loads(cluster.kubectl("get", "leases", "-n", OPERATOR_NS, "-l",
                                                       f"{LABEL_PORT_QUARANTINE}=true", "-o", "json").stdout)["items"],
                            f"{namespace}/")

    def declared(pod) -> set[int]:
        return {int(p["containerPort"]) for c in pod["spec"]["containers"] for p in c.get("ports") or []}

    def diagnose() -> str:
        return "\n".join([describe(cluster, namespace), json.dumps(pair().get("status"), indent=1)[-3000:],
                          "--- operator:\n" + operator_logs(cluster)])

    def serving(generation: int):
        status = pair().get("status") or {}
        return status if status.get("phase") == "Ready" and status.get("pairGeneration") == generation else None

    def answers() -> dict[str, str]:
        svc = json.loads(cluster.kubectl("get", "service", NAME, "-n", namespace, "-o", "json").stdout)
        ip, port = svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["port"]
        return {p: completion(cluster, "n1", ip, port, p) for p in PROMPTS}

    hub_link = f"v{CUT_NODE}"  # n2's veth end on the hub's bridge (devcluster/realnode.py)
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(unpinned_manifest(namespace, images["engine"].ref,
                                                                                model_dir)))
    try:
        wait_for(lambda: serving(1), 2 * ENGINE_START_TIMEOUT, "generation 1 Ready", diagnose=diagnose, interval=1.0)
        old = {p["metadata"]["labels"]["pdpair.io/role"]: p for p in pods()}
        assert (old["decode"]["spec"]["nodeName"], old["router"]["spec"]["nodeName"],
                old["prefill"]["spec"]["nodeName"]) == (CUT_NODE, CUT_NODE, "n1"), {r: p["spec"]["nodeName"]
                                                                                    for r, p in old.items()}
        old_ports = set().union(*(declared(p) for r, p in old.items() if r != "prefill"))
        leader_on_cut = (leader_pod_name(cluster) or "") in {
            p["metadata"]["name"] for p in json.loads(cluster.kubectl(
                "get", "pods", "-n", OPERATOR_NS, "--field-selector", f"spec.nodeName={CUT_NODE}", "-o", "json"
            ).stdout)["items"]}

        # A steady client in n1 (two threads, 10 s per request, a failed request counted and never retried): its
        # requests fail while the partition is being detected, none sent once the new generation serves.
        svc = json.loads(cluster.kubectl("get", "service", NAME, "-n", namespace, "-o", "json").stdout)
        load = Load(cluster, svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["port"], LOAD_CLIENTS, LOAD_TIMEOUT)
        loading = time.time()
        link = ["ip", "-n", cluster.hub, "link", "set", hub_link]
        try:
            wait_for(lambda: load.ok_since(loading) >= LOAD_CLIENTS, 120, "the client's answers before the cut",
                     diagnose=lambda: json.dumps(load.records[-3:]), interval=1.0)
            subprocess.run(link + ["down"], check=True)
            cut, cut_wall = time.monotonic(), time.time()
            # Whichever comes first restarts the pair once: the health watch (n2's pods unreachable 3 times, a
            # budgeted restart) or the lost node (the unreachable taint after the grace period, outside the budget).
            # Either way the old pods can only go once n2 counts as lost and their ports are fenced.
            restarted = wait_for(lambda: (lambda s: s if s.get("restarts") else None)(pair().get("status") or {}),
                                 300, "the restart", diagnose=diagnose, interval=1.0)
            decided = time.monotonic() - cut
            reason = restarted["lastRestart"]["reason"]

            def node_lost():
                found = [c for c in (pair().get("status") or {}).get("conditions") or []
                         if c["type"] == COND_NODE_LOST and c["status"] == "True"]
                return found[0] if found else None

            lost_condition = wait_for(node_lost, 300, "condition NodeLost", diagnose=diagnose, interval=1.0)
            lost_after = time.monotonic() - cut
            assert CUT_NODE in lost_condition["message"], lost_condition
            nodes = json.loads(cluster.kubectl("get", "node", CUT_NODE, "-o", "json").stdout)
            ready = next(c for c in nodes["status"]["conditions"] if c["type"] == "Ready")

            # The cut-off decode still runs and answers inside n2's network: a partition, not a stopped node.
            http = next(int(p["containerPort"]) for c in old["decode"]["spec"]["containers"]
                        for p in c.get("ports") or [] if p.get("name") == "http")
            alive = completion(cluster, CUT_NODE, old["decode"]["status"]["podIP"], http, PROMPTS[0], refused_for=0)
            assert alive == baseline_outputs[PROMPTS[0]]

            wait_for(lambda: serving(2), 2 * ENGINE_START_TIMEOUT, "generation 2 Ready", diagnose=diagnose,
                     interval=1.0)
            assert answers() == {p: baseline_outputs[p] for p in PROMPTS}
            # The Service kept the port clients know (service.kept_service_port), though the router's was fenced.
            assert json.loads(cluster.kubectl("get", "service", NAME, "-n", namespace, "-o", "json").stdout)[
                "spec"]["ports"][0]["port"] == svc["spec"]["ports"][0]["port"]
            serving_again, serving_wall = time.monotonic() - cut, time.time()
            wait_for(lambda: load.ok_since(serving_wall) >= 2 * LOAD_CLIENTS, 120, "the client's answers after",
                     diagnose=lambda: json.dumps(load.records[-3:]), interval=1.0)
            now = pods()
            new = [p for p in now if p["metadata"]["labels"]["pdpair.io/generation"] == "2"]
            assert {p["spec"]["nodeName"] for p in new} == {"n1"}, [(p["metadata"]["name"], p["spec"]["nodeName"])
                                                                  for p in new]
            stranded = [p for p in now if p["metadata"]["uid"] in {o["metadata"]["uid"] for o in old.values()}
                        and p["spec"]["nodeName"] == CUT_NODE]
            assert stranded and all(p["metadata"].get("deletionTimestamp") for p in stranded), stranded
            new_ports = set().union(*(declared(p) for p in new))
            assert not new_ports & old_ports, f"generation 2 shares {new_ports & old_ports} with the cut-off pods"
            assert old_ports <= set(fences()), (sorted(old_ports), fences())
            counted = json.loads((pair()["metadata"].get("annotations") or {}).get(ANNOTATION_RESTART_TIMES, "[]"))
            by_node_rule = "re-homing generation" in reason  # planner.failure's node_lost message
            assert len(counted) <= 1 and by_node_rule == (not counted), (reason, counted)
        finally:
            subprocess.run(link + ["up"], check=True)
            records = load.stop()
        healed = time.monotonic()
        failed = [r for r in records if not r["ok"]]
        late = [r for r in failed if r["t"] >= serving_wall]
        assert not late, f"requests sent after generation 2 served failed: {late[:3]}"
        wrong = [r for r in records if r["ok"] and r["text"] != baseline_outputs[r["prompt"]]]
        assert not wrong, wrong[:3]
        first_ok = min((r["t"] + r["dur"] for r in records if r["ok"] and r["t"] >= cut_wall), default=None)
        wait_for(lambda: not [p for p in pods() if p["metadata"]["labels"]["pdpair.io/generation"] == "1"], 300,
                 "n2's kubelet ends the old pods", diagnose=diagnose, interval=1.0)
        old_gone = time.monotonic() - healed
        wait_for(lambda: not old_ports & set(fences()), 120, "the fences released (one operator sweep)",
                 diagnose=diagnose, interval=2.0)
        released = time.monotonic() - healed
        assert pair()["status"]["restarts"] == 1
        print(f"\n[realnode-e2e] partition of {CUT_NODE} (operator leader there: {leader_on_cut}): restart decided "
              f"{decided:.1f}s after link-down ({reason[:120]}); NodeLost {lost_after:.1f}s after link-down (node "
              f"Ready={ready['status']} since {ready['lastTransitionTime']}); serving again from n1 "
              f"{serving_again:.1f}s after link-down; link up: old pods gone in {old_gone:.1f}s, fences released "
              f"in {released:.1f}s; the client: {len(failed)} of {len(records)} requests failed, all sent before "
              f"generation 2 served, its first answer after the cut "
              f"{(first_ok - cut_wall) if first_ok else float('nan'):.1f}s after link-down")
    finally:
        cluster.kubectl("delete", f"{PLURAL}.{GROUP}", NAME, "-n", namespace, "--wait=true", "--timeout=180s",
                        timeout=210, check=False)
