"""The product on real Kubernetes nodes: images built here, `helm install` of the chart, an InferencePair whose
prefill and decode run vLLM in containers on two different nodes, and completions through the pair's Service.

Everything runs in the `real_cluster` fixture (tests/cluster/realnode.py): two nodes with containerd, runc, CNI,
kubelet and kube-proxy, in network namespaces of their own. The tiny model reaches the pods through a hostPath
volume (per-role pod templates), never through the image. Requests are sent from inside a node's namespace
(`real_cluster.node_exec`), i.e. from the cluster network.
"""
from __future__ import annotations

import json
import sys
import time

import pytest
import yaml

from pdpair.contract import GROUP, PLURAL
from tests.cluster.images import engine_image, operator_image
from tests.cluster.realnode_product import (
    OPERATOR_NS, baseline_pod, build_model, completion, install_operator, pair_manifest, unique,
)

# The session's real cluster is torn down in the last test's teardown, which pytest-timeout counts too.
pytestmark = [pytest.mark.realnode, pytest.mark.timeout(2400)]

PROMPTS = ["The quick brown fox", "Kubernetes runs pods;", "Prefill computes the prompt,", "Hello world! 0123"]
ENGINE_START_TIMEOUT = 600.0


def wait_for(fn, timeout: float, what: str, diagnose=lambda: ""):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{diagnose()}")
        time.sleep(1.0)


def describe(cluster, ns: str) -> str:
    pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
    events = cluster.kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp", check=False).stdout[-3000:]
    return f"pods:\n{pods}\nevents:\n{events}"


def pod_logs(cluster, ns: str, name: str) -> str:
    return cluster.kubectl("logs", "-n", ns, name, "--tail=60", check=False).stdout


@pytest.fixture(scope="module")
def images(real_cluster):
    """Operator and engine images (cached by content), imported into both nodes' containerd."""
    built = {"operator": operator_image(), "engine": engine_image()}
    t0 = time.monotonic()
    for image in built.values():
        real_cluster.import_image(image.archive)
    print(f"[realnode-e2e] images imported into {len(real_cluster.nodes)} nodes in {time.monotonic() - t0:.1f}s")
    return built


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("realnode-model") / "tiny")


@pytest.fixture(scope="module")
def namespace(real_cluster):
    name = unique("rn")
    real_cluster.create_namespace(name)
    yield name
    real_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def baseline_outputs(real_cluster, images, model_dir, namespace):
    """A single engine (no connector) as a plain Pod of the engine image, the model from a hostPath volume: the
    reference the pair's greedy outputs must equal. The pod is deleted afterwards to free its memory."""
    pod = baseline_pod("baseline", namespace, images["engine"].ref, model_dir, "n1")
    real_cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    try:
        t0 = time.monotonic()
        real_cluster.kubectl("wait", "-n", namespace, "--for=condition=Ready", "pod/baseline",
                             f"--timeout={int(ENGINE_START_TIMEOUT)}s", timeout=ENGINE_START_TIMEOUT + 30,
                             check=False)
        info = json.loads(real_cluster.kubectl("get", "pod", "-n", namespace, "baseline", "-o", "json").stdout)
        ready = {c["type"]: c["status"] for c in info["status"].get("conditions", [])}.get("Ready") == "True"
        assert ready, f"baseline engine pod not Ready:\n{describe(real_cluster, namespace)}\n" \
                      f"{pod_logs(real_cluster, namespace, 'baseline')}"
        print(f"[realnode-e2e] baseline engine pod Ready in {time.monotonic() - t0:.1f}s")
        ip = info["status"]["podIP"]
        outputs = {p: completion(real_cluster, "n1", ip, 8000, p) for p in PROMPTS}
        outputs["__repeat__"] = completion(real_cluster, "n1", ip, 8000, PROMPTS[0])
        return outputs
    finally:
        real_cluster.kubectl("delete", "pod", "-n", namespace, "baseline", "--wait=true", "--timeout=60s",
                             check=False, timeout=90)


def test_engine_image_serves_the_hostpath_model_as_a_plain_pod(baseline_outputs):
    """The engine image runs vLLM in a container on a real node, with the model from a hostPath volume."""
    for prompt in PROMPTS:
        assert isinstance(baseline_outputs[prompt], str) and baseline_outputs[prompt].strip(), (prompt, baseline_outputs)
    assert baseline_outputs["__repeat__"] == baseline_outputs[PROMPTS[0]], "greedy output changed between requests"


@pytest.fixture(scope="module")
def operator_release(real_cluster, images):
    """`helm install` of charts/pdpair with the image built here; the operator runs as a pod, in-cluster config."""
    t0 = time.monotonic()
    # The chart's probe timings: a 2 s period restarted the operator once on a busy machine (import takes >8 s).
    helm = install_operator(real_cluster, images["operator"].ref)
    print(f"[realnode-e2e] helm install --wait took {time.monotonic() - t0:.1f}s")
    yield helm
    helm("uninstall", "pdpair", "--namespace", OPERATOR_NS, "--wait", "--timeout", "120s")
    helm.close()


def _operator_pod(cluster) -> dict:
    pods = json.loads(cluster.kubectl("get", "pods", "-n", OPERATOR_NS, "-l", "app.kubernetes.io/name=pdpair",
                                      "-o", "json").stdout)["items"]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    return pods[0]


def _liveness_probe_successes(cluster, node: str, pod: str) -> float:
    """The kubelet's own count of successful liveness probes of the operator container (/metrics/probes)."""
    raw = cluster.kubectl("get", "--raw", f"/api/v1/nodes/{node}/proxy/metrics/probes").stdout
    total = 0.0
    for line in raw.splitlines():
        if (line.startswith("prober_probe_total{") and 'probe_type="Liveness"' in line and f'pod="{pod}"' in line
                and 'result="successful"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_operator_runs_as_a_pod_with_the_charts_service_account_and_liveness(real_cluster, operator_release):
    pod = _operator_pod(real_cluster)
    spec, status = pod["spec"], pod["status"]
    assert spec["serviceAccountName"] == "pdpair-operator", spec["serviceAccountName"]
    container = spec["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz", container["livenessProbe"]
    assert not any(e["name"] == "KUBECONFIG" for e in container.get("env", [])), "in-cluster config expected"
    assert status["phase"] == "Running" and status["containerStatuses"][0]["ready"], status
    # The kubelet really probes it: its probe counter for this pod grows past two successes.
    wait_for(lambda: _liveness_probe_successes(real_cluster, spec["nodeName"], pod["metadata"]["name"]) >= 2, 120,
             "two successful liveness probes by the kubelet",
             lambda: real_cluster.kubectl("logs", "-n", OPERATOR_NS, pod["metadata"]["name"], "--tail=40",
                                          check=False).stdout)
    assert status["containerStatuses"][0]["restartCount"] == 0


def test_pair_on_two_nodes_serves_through_its_service_like_a_single_engine(
        real_cluster, operator_release, baseline_outputs, images, model_dir, namespace):
    name = "tiny-tcp"
    body = pair_manifest(name, namespace, images["engine"].ref, model_dir, prefill_node="n1", decode_node="n2")
    t_apply = time.monotonic()
    real_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))

    def pair():
        return json.loads(real_cluster.kubectl("get", f"{PLURAL}.{GROUP}", name, "-n", namespace, "-o", "json").stdout)

    def diagnose() -> str:
        out = [describe(real_cluster, namespace), json.dumps(pair().get("status"), indent=1)[-3000:]]
        pods = json.loads(real_cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
        for p in pods:
            out.append(f"--- {p['metadata']['name']}:\n{pod_logs(real_cluster, namespace, p['metadata']['name'])}")
        out.append("--- operator:\n" + real_cluster.kubectl("logs", "-n", OPERATOR_NS, "deploy/pdpair-operator",
                                                             "--tail=60", check=False).stdout)
        return "\n".join(out)

    wait_for(lambda: pair().get("status", {}).get("phase") == "Ready", ENGINE_START_TIMEOUT + 120,
             "pair phase Ready", diagnose)
    t_ready = time.monotonic() - t_apply

    pods = json.loads(real_cluster.kubectl("get", "pods", "-n", namespace, "-l", f"pdpair.io/pair={name}",
                                           "-o", "json").stdout)["items"]
    by_role = {p["metadata"]["labels"]["pdpair.io/role"]: p for p in pods}
    assert by_role["prefill"]["spec"]["nodeName"] == "n1" and by_role["decode"]["spec"]["nodeName"] == "n2", \
        {r: p["spec"].get("nodeName") for r, p in by_role.items()}
    assert by_role["prefill"]["status"]["podIP"] != by_role["decode"]["status"]["podIP"]
    # Decode first: the operator creates prefill only after decode's listener accepted.
    assert by_role["decode"]["metadata"]["creationTimestamp"] <= by_role["prefill"]["metadata"]["creationTimestamp"]

    svc = json.loads(real_cluster.kubectl("get", "service", name, "-n", namespace, "-o", "json").stdout)
    ip, port = svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["port"]
    first = completion(real_cluster, "n1", ip, port, PROMPTS[0])
    t_first_token = time.monotonic() - t_apply
    print(f"[realnode-e2e] apply -> pair Ready {t_ready:.1f}s, apply -> first completion {t_first_token:.1f}s")
    outputs = {PROMPTS[0]: first, **{p: completion(real_cluster, "n2", ip, port, p) for p in PROMPTS[1:]}}
    expected = {p: baseline_outputs[p] for p in PROMPTS}
    assert outputs == expected, f"pair outputs differ from the single engine:\npair: {outputs}\nbaseline: {expected}"

    # The KV really crossed nodes: decode's connector counted finished transfers and bytes.
    decode = by_role["decode"]
    metrics_port = next(p["containerPort"] for p in decode["spec"]["containers"][0]["ports"] if p["name"] == "metrics")
    metrics_url = f"http://{decode['status']['podIP']}:{metrics_port}/metrics"

    def transfers_ok() -> float:
        text = real_cluster.node_exec("n1", [sys.executable, "-c", "import sys, urllib.request; print(urllib.request."
                                             "urlopen(sys.argv[1], timeout=10).read().decode())", metrics_url]).stdout
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pdpair_kv_transfers_total{") and 'outcome="ok"' in line)

    wait_for(lambda: transfers_ok() >= len(PROMPTS), 30, f"{len(PROMPTS)} ok KV transfers counted by decode",
             lambda: f"counted {transfers_ok()}")
    real_cluster.kubectl("delete", f"{PLURAL}.{GROUP}", name, "-n", namespace, "--wait=true", "--timeout=120s",
                         timeout=150)
    wait_for(lambda: not json.loads(real_cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"],
             120, "the pair's pods to go", lambda: describe(real_cluster, namespace))
