"""The local control plane really behaves like a cluster: scheduling onto kwok nodes, hostNetwork pod IPs,
pod deletion, ownerReference GC, namespace deletion, RBAC for ServiceAccount kubeconfigs, and the CLI."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
import uuid

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from devcluster import localcluster
from devcluster.build import KUBERNETES_VERSION, helm_path, kubectl_path
from devcluster.errors import ClusterError
from devcluster.localcluster import LocalCluster

pytestmark = pytest.mark.cluster


def _pod(name: str, node: str | None = None, host_network: bool = False, owner: dict | None = None) -> dict:
    metadata: dict = {"name": name}
    if owner:
        metadata["ownerReferences"] = [owner]
    spec: dict = {"containers": [{"name": "main", "image": "registry.invalid/pause:1"}],
                  "hostNetwork": host_network, "terminationGracePeriodSeconds": 30}
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}  # leaves the placement to kube-scheduler
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def _wait_pod_ready(core: client.CoreV1Api, namespace: str, name: str, timeout: float = 30) -> client.V1Pod:
    def ready():
        pod = core.read_namespaced_pod(name, namespace)
        conditions = {c.type: c.status for c in (pod.status.conditions or [])}
        return pod if pod.status.phase == "Running" and conditions.get("Ready") == "True" else None

    return _wait(ready, timeout, f"pod {namespace}/{name} Running and Ready")


def _gone(read) -> bool:
    try:
        read()
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


@pytest.fixture(scope="module")
def fake_node(local_cluster: LocalCluster) -> str:
    name = f"kwok-{uuid.uuid4().hex[:6]}"
    local_cluster.add_node(name, labels={"pdpair.io/test": "cluster"})
    return name


@pytest.fixture
def core(local_cluster: LocalCluster) -> client.CoreV1Api:
    return client.CoreV1Api(local_cluster.api_client())


def test_apiserver_reports_the_pinned_version(local_cluster: LocalCluster):
    info = client.VersionApi(local_cluster.api_client()).get_code()
    assert info.git_version == KUBERNETES_VERSION
    assert info.minor == KUBERNETES_VERSION.split(".")[1]


def test_fake_node_is_ready_with_loopback_address(local_cluster: LocalCluster, fake_node: str, core):
    node = core.read_node(fake_node)
    addresses = {a.type: a.address for a in node.status.addresses}
    assert addresses["InternalIP"] == "127.0.0.1"
    assert {c.type: c.status for c in node.status.conditions}["Ready"] == "True"
    assert node.status.allocatable["pods"] == localcluster.DEFAULT_NODE_CAPACITY["pods"]
    assert node.metadata.labels["pdpair.io/test"] == "cluster"


def test_add_node_honours_ip_and_extra_capacity(local_cluster: LocalCluster, core):
    name = f"kwok-gpu-{uuid.uuid4().hex[:6]}"
    local_cluster.add_node(name, ip="127.0.0.2", capacity={"nvidia.com/gpu": "8"})
    try:
        node = core.read_node(name)
        assert {a.type: a.address for a in node.status.addresses}["InternalIP"] == "127.0.0.2"
        assert node.status.allocatable["nvidia.com/gpu"] == "8"
        assert node.status.allocatable["cpu"] == localcluster.DEFAULT_NODE_CAPACITY["cpu"]
    finally:
        core.delete_node(name)


def test_scheduled_host_network_pod_gets_node_ip_and_becomes_ready(fake_node, cluster_namespace, core):
    core.create_namespaced_pod(cluster_namespace, _pod("hostnet", node=fake_node, host_network=True))
    pod = _wait_pod_ready(core, cluster_namespace, "hostnet")
    assert pod.spec.node_name == fake_node, "kube-scheduler should have bound the pod to the fake node"
    assert pod.status.pod_ip == "127.0.0.1"
    assert pod.status.host_ip == "127.0.0.1"
    assert pod.status.container_statuses[0].ready is True
    assert pod.status.container_statuses[0].state.running is not None


def test_pod_without_host_network_gets_a_pod_cidr_ip(fake_node, cluster_namespace, core):
    core.create_namespaced_pod(cluster_namespace, _pod("podnet", node=fake_node))
    pod = _wait_pod_ready(core, cluster_namespace, "podnet")
    assert pod.status.pod_ip.startswith("10.244."), pod.status.pod_ip


def test_deleted_pod_is_removed(fake_node, cluster_namespace, core):
    core.create_namespaced_pod(cluster_namespace, _pod("doomed", node=fake_node))
    _wait_pod_ready(core, cluster_namespace, "doomed")
    core.delete_namespaced_pod("doomed", cluster_namespace)  # graceful (30s): kwok finishes it at once
    _wait(lambda: _gone(lambda: core.read_namespaced_pod("doomed", cluster_namespace)), 15,
          "the deleted pod to disappear (kwok pod-delete stage)")


def test_owner_reference_garbage_collection(fake_node, cluster_namespace, core):
    owner = core.create_namespaced_config_map(cluster_namespace, {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    core.create_namespaced_pod(cluster_namespace, _pod("dependent", node=fake_node, owner=ref))
    _wait_pod_ready(core, cluster_namespace, "dependent")
    core.delete_namespaced_config_map("owner", cluster_namespace)
    _wait(lambda: _gone(lambda: core.read_namespaced_pod("dependent", cluster_namespace)), 30,
          "the garbage collector to remove the dependent pod")


def test_namespace_deletion_empties_and_removes_it(local_cluster: LocalCluster, core):
    name = f"t-del-{uuid.uuid4().hex[:6]}"
    local_cluster.create_namespace(name)
    core.create_namespaced_config_map(name, {"metadata": {"name": "content"}})
    core.delete_namespace(name)
    _wait(lambda: _gone(lambda: core.read_namespace(name)), 60, f"namespace {name} to be deleted")


def test_service_account_kubeconfig_is_subject_to_rbac(local_cluster: LocalCluster, cluster_namespace):
    path = local_cluster.service_account_kubeconfig(cluster_namespace, "no-rights", create=True)
    sa_core = client.CoreV1Api(config.new_client_from_config(config_file=str(path)))
    with pytest.raises(ApiException) as denied:
        sa_core.list_namespaced_pod(cluster_namespace)
    assert denied.value.status == 403
    assert f"system:serviceaccount:{cluster_namespace}:no-rights" in denied.value.body

    rbac = client.RbacAuthorizationV1Api(local_cluster.api_client())
    rbac.create_namespaced_role(cluster_namespace, {
        "metadata": {"name": "pod-reader"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]})
    rbac.create_namespaced_role_binding(cluster_namespace, {
        "metadata": {"name": "no-rights-reads-pods"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "no-rights", "namespace": cluster_namespace}]})
    # RBAC authorizer caches are informer-fed: allow a moment for the binding to arrive.
    _wait(lambda: _lists_pods(sa_core, cluster_namespace), 10, "the RoleBinding to take effect")
    with pytest.raises(ApiException) as still_denied:
        sa_core.list_namespaced_pod("default")
    assert still_denied.value.status == 403


def _lists_pods(core: client.CoreV1Api, namespace: str) -> bool:
    try:
        core.list_namespaced_pod(namespace)
        return True
    except ApiException as exc:
        if exc.status == 403:
            return False
        raise


def test_kubectl_and_helm_from_tools_script(local_cluster: LocalCluster, fake_node):
    assert kubectl_path().parent == helm_path().parent
    version = json.loads(subprocess.run([str(kubectl_path()), "version", "--client", "-o", "json"],
                                        capture_output=True, text=True, check=True).stdout)
    assert version["clientVersion"]["gitVersion"].startswith("v1.")
    helm = subprocess.run([str(helm_path()), "version", "--short"], capture_output=True, text=True, check=True)
    assert helm.stdout.startswith("v")
    nodes = local_cluster.kubectl("get", "nodes", "-o", "name").stdout.split()
    assert f"node/{fake_node}" in nodes


def test_cli_up_background_and_down(tmp_path: pathlib.Path):
    """A second cluster next to the session one (free ports), through the CLI, then stopped cleanly."""
    script = pathlib.Path(localcluster.__file__)
    workdir = tmp_path / "cli-cluster"
    up = subprocess.run([sys.executable, str(script), "up", "--dir", str(workdir), "--background"],
                        capture_output=True, text=True, timeout=240)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        described = json.loads((workdir / "cluster.json").read_text())
        kubeconfig = workdir / "kubeconfig"
        namespaces = subprocess.run([str(kubectl_path()), f"--kubeconfig={kubeconfig}", "get", "ns", "-o", "name"],
                                    capture_output=True, text=True, timeout=60)
        assert namespaces.returncode == 0, namespaces.stderr
        assert "namespace/kube-system" in namespaces.stdout.split()
    finally:
        down = subprocess.run([sys.executable, str(script), "down", "--dir", str(workdir)],
                              capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    for name, pid in described["pids"].items():
        assert not _alive(pid), f"{name} (pid {pid}) still running after down"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); read its state.
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_start_past_its_deadline_fails_with_log_tail_and_leaves_nothing_running(tmp_path: pathlib.Path):
    workdir = tmp_path / "too-slow"
    cluster = LocalCluster(workdir, start_timeout=0.2)
    with pytest.raises(ClusterError, match=r"not healthy at .* before the deadline") as failed:
        cluster.start()
    assert "log " in str(failed.value) and str(workdir / "logs") in str(failed.value)
    leftovers = [pid for pid in _pids_with_arg_containing(str(workdir)) if _alive(pid)]
    assert leftovers == [], f"processes of the failed cluster still running: {leftovers}"


def _pids_with_arg_containing(text: str) -> list[int]:
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if text.encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids
