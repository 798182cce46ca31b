"""The real-node cluster itself (devcluster/realnode.py): two kubelets on containerd+runc+CNI in network
namespaces of their own, kube-proxy Services across nodes, the `kubernetes` Service from a pod, no route out,
and a teardown that leaves nothing on the host."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from devcluster.images import debian_base
from devcluster.hoststate import KUBELET_HOST_SYSCTLS, _read_sysctl
from devcluster.realnode import RealNodeCluster
from devcluster.product import FETCH_STATUS_SNIPPET, SERVICE_PROGRAMMING_SECONDS

# The session's real cluster is torn down in the last test's teardown, which pytest-timeout counts too.
pytestmark = [pytest.mark.realnode, pytest.mark.timeout(2400)]

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


@pytest.fixture(scope="module")
def base_image(real_cluster):
    image = debian_base()
    real_cluster.import_image(image.archive)
    return image


def test_two_real_nodes_are_ready_with_their_own_addresses(real_cluster):
    nodes = json.loads(real_cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == ["n1", "n2"]
    for node in nodes:
        info = node["status"]["nodeInfo"]
        assert info["kubeletVersion"] == "v1.36.3" and info["containerRuntimeVersion"] == "containerd://2.4.2", info
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True"
    ips = {n["metadata"]["name"]: next(a["address"] for a in n["status"]["addresses"] if a["type"] == "InternalIP")
           for n in nodes}
    assert ips == {"n1": "198.18.0.2", "n2": "198.18.0.3"}


def test_no_namespace_has_a_default_route(real_cluster):
    for netns in real_cluster.describe()["netns"]:
        routes = subprocess.run(["ip", "-n", netns, "route", "show", "default"], capture_output=True, text=True,
                                check=True).stdout
        assert routes.strip() == "", f"{netns} has a default route: {routes}"


def test_pods_reach_a_service_on_the_other_node_and_the_apiserver(real_cluster, base_image, cluster_ns):
    manifest = {"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "server", "namespace": cluster_ns,
                                                          "labels": {"app": "server"}},
         "spec": {"nodeName": "n2", "containers": [{
             "name": "c", "image": base_image.ref, "imagePullPolicy": "Never",
             "command": ["python3", "-m", "http.server", "8080"],
             "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}}]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "server", "namespace": cluster_ns},
         "spec": {"selector": {"app": "server"}, "ports": [{"port": 80, "targetPort": 8080}]}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "client", "namespace": cluster_ns},
         "spec": {"nodeName": "n1", "containers": [{
             "name": "c", "image": base_image.ref, "imagePullPolicy": "Never", "command": ["sleep", "3600"]}]}},
    ]}
    real_cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    real_cluster.kubectl("wait", "-n", cluster_ns, "--for=condition=Ready", "pod/server", "pod/client",
                         "--timeout=120s", timeout=130)
    svc_ip = real_cluster.kubectl("get", "svc", "-n", cluster_ns, "server", "-o", "jsonpath={.spec.clusterIP}").stdout
    fetch = ["python3", "-c", FETCH_STATUS_SNIPPET, f"http://{svc_ip}/", str(SERVICE_PROGRAMMING_SECONDS)]
    within = SERVICE_PROGRAMMING_SECONDS + 30
    # pod on n1 -> Service -> pod on n2 (kube-proxy DNAT, routed between the node namespaces)
    assert real_cluster.kubectl("exec", "-n", cluster_ns, "client", "--", *fetch,
                                timeout=within).stdout.strip() == "200"
    # hairpin: the server pod through its own Service
    assert real_cluster.kubectl("exec", "-n", cluster_ns, "server", "--", *fetch,
                                timeout=within).stdout.strip() == "200"
    # the node namespace itself (what tests use to reach the cluster network)
    assert real_cluster.node_exec("n1", [sys.executable, *fetch[1:]], timeout=within).stdout.strip() == "200"
    # the `kubernetes` Service from a pod, TLS verified against the ServiceAccount's CA, authenticated
    api = ("import json, os, ssl, urllib.request\n"
           f"ctx = ssl.create_default_context(cafile='{SERVICE_ACCOUNT}/ca.crt')\n"
           f"token = open('{SERVICE_ACCOUNT}/token').read()\n"
           "url = 'https://%s:%s/api/v1/namespaces/' % (os.environ['KUBERNETES_SERVICE_HOST'], "
           "os.environ['KUBERNETES_SERVICE_PORT']) + open('" + SERVICE_ACCOUNT + "/namespace').read()\n"
           "req = urllib.request.Request(url, headers={'Authorization': 'Bearer ' + token})\n"
           "try:\n    urllib.request.urlopen(req, context=ctx, timeout=10)\n"
           "except urllib.error.HTTPError as e:\n    print(e.code, json.load(e)['reason'])\n")
    out = real_cluster.kubectl("exec", "-n", cluster_ns, "client", "--", "python3", "-c", api).stdout
    # RBAC answers (the default ServiceAccount may not read namespaces): the request reached the real apiserver.
    assert out.strip() == "403 Forbidden", out
    assert "GET / HTTP/1.1\" 200" in real_cluster.kubectl("logs", "-n", cluster_ns, "server").stdout


def test_teardown_leaves_nothing_on_the_host():
    before = {k: _read_sysctl(k) for k in KUBELET_HOST_SYSCTLS}
    cluster = RealNodeCluster(nodes=1, log=print)
    cluster.start()
    try:
        pid = cluster.node("n1").pid("kubelet")
        assert cluster.kubectl("get", "node", "n1").returncode == 0
    finally:
        cluster.stop()
    assert cluster.leftovers() == []
    assert not cluster.workdir.exists()
    assert {k: _read_sysctl(k) for k in KUBELET_HOST_SYSCTLS} == before
    assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0, "kubelet still alive"


def test_a_cluster_whose_harness_was_killed_is_swept_by_the_next_start():
    """SIGKILL of the process that owns a cluster leaves its namespaces (and maybe cgroups) behind; the next
    RealNodeCluster start (sweep_stale_clusters) removes them."""
    import os
    import pathlib
    import signal
    import time

    code = ("import sys, time; from devcluster.realnode import RealNodeCluster\n"
            "c = RealNodeCluster(nodes=1); c.start()\n"
            "print('UP', c.prefix, flush=True); time.sleep(600)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pathlib.Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = child.stdout.readline()
        assert line.startswith("UP "), f"child cluster did not start: {line!r}"
        prefix = line.split()[1]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    netns = sorted(p.name for p in pathlib.Path("/run/netns").iterdir() if p.name.startswith(prefix))
    assert netns == [f"{prefix}-hub", f"{prefix}-n1"], netns  # what a killed harness leaves
    deadline = time.monotonic() + 60
    while True:  # the node supervisor (PR_SET_PDEATHSIG) finishes its own cleanup first
        from devcluster.hoststate import sweep_stale_clusters
        swept = sweep_stale_clusters()
        if any(name.startswith(prefix) for name in swept) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not [p for p in pathlib.Path("/run/netns").iterdir() if p.name.startswith(prefix)]
    assert not list(pathlib.Path("/sys/fs/cgroup").glob(f"*/{prefix}-*"))
