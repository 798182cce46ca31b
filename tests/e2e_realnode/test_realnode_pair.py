"""The product on real Kubernetes nodes: images built here, `helm install` of the chart, an InferencePair whose
prefill and decode run vLLM in containers on two different nodes, and completions through the pair's Service.

Everything runs in the `real_cluster` fixture (devcluster/realnode.py): two nodes with containerd, runc, CNI,
kubelet and kube-proxy, in network namespaces of their own. The tiny model reaches the pods through a hostPath
volume (per-role pod templates), never through the image. Requests are sent from inside a node's namespace
(`real_cluster.node_exec`), i.e. from the cluster network.
"""
from __future__ import annotations

import json
import sys
import time

import pytest

from pdpair.contract import GROUP, PLURAL
from devcluster.product import (
    PROMPTS, completion, leader_pod_name, operator_logs, operator_pods,
)
from devcluster.waiting import wait_for

# The session's real cluster is torn down in the last test's teardown, which pytest-timeout counts too.
pytestmark = [pytest.mark.realnode, pytest.mark.timeout(2400)]


def test_engine_image_serves_the_hostpath_model_as_a_plain_pod(baseline_outputs):
    """The engine image runs vLLM in a container on a real node, with the model from a hostPath volume."""
    for prompt in PROMPTS:
        assert isinstance(baseline_outputs[prompt], str) and baseline_outputs[prompt].strip(), (prompt, baseline_outputs)
    assert baseline_outputs["__repeat__"] == baseline_outputs[PROMPTS[0]], "greedy output changed between requests"


def _liveness_probe_successes(cluster, node: str, pod: str) -> float:
    """The kubelet's own count of successful liveness probes of the operator container (/metrics/probes)."""
    raw = cluster.kubectl("get", "--raw", f"/api/v1/nodes/{node}/proxy/metrics/probes").stdout
    total = 0.0
    for line in raw.splitlines():
        if (line.startswith("prober_probe_total{") and 'probe_type="Liveness"' in line and f'pod="{pod}"' in line
                and 'result="successful"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_operator_runs_as_pods_with_the_charts_service_account_liveness_and_one_leader(real_cluster, operator_release):
    """The chart's default: 2 replicas, in-cluster config, the chart's ServiceAccount, liveness probed by the
    kubelet on both (the standby serves /healthz too), and exactly one of them holding the leader Lease."""
    pods = operator_pods(real_cluster)
    assert len(pods) == 2, [p["metadata"]["name"] for p in pods]
    for pod in pods:
        spec, status = pod["spec"], pod["status"]
        assert spec["serviceAccountName"] == "pdpair-operator", spec["serviceAccountName"]
        container = spec["containers"][0]
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz", container["livenessProbe"]
        assert not any(e["name"] == "KUBECONFIG" for e in container.get("env", [])), "in-cluster config expected"
        assert status["phase"] == "Running" and status["containerStatuses"][0]["ready"], status
        # The kubelet really probes it: its probe counter for this pod grows past two successes.
        wait_for(lambda: _liveness_probe_successes(real_cluster, spec["nodeName"], pod["metadata"]["name"]) >= 2,
                 120, "two successful liveness probes by the kubelet", diagnose=lambda: operator_logs(real_cluster),
                 interval=1.0)
        assert status["containerStatuses"][0]["restartCount"] == 0
    leader = wait_for(lambda: leader_pod_name(real_cluster), 120, "an operator replica holding the leader Lease",
                      diagnose=lambda: operator_logs(real_cluster), interval=1.0)
    assert leader in {p["metadata"]["name"] for p in pods}, leader


def test_pair_on_two_nodes_serves_through_its_service_like_a_single_engine(real_cluster, baseline_outputs,
                                                                          serving_pair):
    """The package's shared pair (serving_pair.py) serves from two nodes like the single engine, its KV crossed the
    nodes, and the health watch judged its current generation Healthy; its pods run locked down (runAsNonRoot, seccomp
    RuntimeDefault, no privilege escalation, no capability, no ServiceAccount token: read back from the API). Cost: no vLLM cold start of its own (the
    shared pair is Ready from the fault scenarios before it; alone, this test creates it: 2 cold starts)."""
    name, namespace = serving_pair.name, serving_pair.namespace
    t0 = time.monotonic()
    status = serving_pair.ready()
    generation = int(status["pairGeneration"])
    print(f"[realnode-e2e] the shared pair serves at generation {generation} ({time.monotonic() - t0:.1f}s to settle)")

    def pair():
        return serving_pair.get() or {}

    diagnose = serving_pair.diagnose
    pods = list(serving_pair.pods().values())
    by_role = {p["metadata"]["labels"]["pdpair.io/role"]: p for p in pods}
    assert by_role["prefill"]["spec"]["nodeName"] == "n1" and by_role["decode"]["spec"]["nodeName"] == "n2", \
        {r: p["spec"].get("nodeName") for r, p in by_role.items()}
    assert by_role["prefill"]["status"]["podIP"] != by_role["decode"]["status"]["podIP"]
    # Locked down, and serving so: the live pods carry the operator's security defaults (the devcluster's templates set
    # none) and no ServiceAccount token; the engines take the side-channel key from the pair's Secret, the router never.
    locked = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}, "allowPrivilegeEscalation": False,
              "capabilities": {"drop": ["ALL"]}}
    for role, pod in by_role.items():
        main = next(c for c in pod["spec"]["containers"] if c["name"] == ("router" if role == "router" else "engine"))
        assert main["securityContext"] == locked, (role, main.get("securityContext"))
        assert pod["spec"]["automountServiceAccountToken"] is False, role
        refs = {e["name"]: (e.get("valueFrom") or {}).get("secretKeyRef") for e in main.get("env") or []}
        assert (refs.get("PDPAIR_SIDE_CHANNEL_KEY") is None) == (role == "router"), (role, refs)
    # Decode first: prefill is created in the pass after decode (beside it), so never before it.
    assert by_role["decode"]["metadata"]["creationTimestamp"] <= by_role["prefill"]["metadata"]["creationTimestamp"]

    # The KV really crosses nodes: decode's connector counts finished transfers and bytes.
    decode = by_role["decode"]
    metrics_port = next(p["containerPort"] for p in decode["spec"]["containers"][0]["ports"] if p["name"] == "metrics")
    metrics_url = f"http://{decode['status']['podIP']}:{metrics_port}/metrics"

    def transfers_ok() -> float:
        text = real_cluster.node_exec("n1", [sys.executable, "-c", "import sys, urllib.request; print(urllib.request."
                                             "urlopen(sys.argv[1], timeout=10).read().decode())", metrics_url]).stdout
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pdpair_kv_transfers_total{") and 'outcome="ok"' in line)

    transfers_before = transfers_ok()  # the shared pair may have served earlier scenarios' requests
    ip, port = serving_pair.service()
    outputs = {PROMPTS[0]: completion(real_cluster, "n1", ip, port, PROMPTS[0]),
               **{p: completion(real_cluster, "n2", ip, port, p) for p in PROMPTS[1:]}}
    expected = {p: baseline_outputs[p] for p in PROMPTS}
    assert outputs == expected, f"pair outputs differ from the single engine:\npair: {outputs}\nbaseline: {expected}"
    wait_for(lambda: transfers_ok() >= transfers_before + len(PROMPTS), 30,
             f"{len(PROMPTS)} more ok KV transfers counted by decode (from {transfers_before})",
             diagnose=lambda: f"counted {transfers_ok()}", interval=1.0)

    # KV health on the resource, from the real engines' metrics: the health watch judged this generation Healthy,
    # SignalsHealthy follows it, and `kubectl get -o wide` shows it.
    def judged() -> dict:
        health = pair().get("status", {}).get("health") or {}
        return health if health.get("verdict") == "Healthy" and health.get("pairGeneration") == generation else {}

    health = wait_for(judged, 90, f"status.health Healthy for generation {generation}", diagnose=diagnose, interval=1.0)
    assert {role: health["roles"][role]["state"] for role in ("decode", "prefill")} == {
        "decode": "healthy", "prefill": "healthy"}, health
    assert health["roles"]["decode"]["pod"] == decode["metadata"]["name"], health
    conditions = {c["type"]: c for c in pair()["status"]["conditions"]}
    assert conditions["SignalsHealthy"]["status"] == "True", conditions["SignalsHealthy"]
    wide = real_cluster.kubectl("get", f"{PLURAL}.{GROUP}", name, "-n", namespace, "-o", "wide").stdout
    header, row = wide.splitlines()[:2]
    assert "KV HEALTH" in header and "Healthy" in row.split(), wide
    print(f"[realnode-e2e] status.health: {json.dumps(health['roles'])}")
