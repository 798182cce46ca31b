"""The rendered chart applies server-side to a real apiserver (RBAC on), and the operator's ServiceAccount can do
exactly what the operator needs: every needed verb is allowed, a set of others is denied.

Checks go through `kubectl auth can-i --as=system:serviceaccount:<ns>:<sa>` (the apiserver's own authorizer),
and a few through real requests made with the ServiceAccount's token.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from pdpair import contract
from devcluster.build import helm_path
from devcluster.monitoring_crds import install_prometheus_operator_crds

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pdpair"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))

pytestmark = pytest.mark.cluster


def helm_template(release: str, namespace: str, *args: str) -> str:
    home = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdpair-helm-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, **{f"HELM_{k}_HOME": str(home / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}}
    proc = subprocess.run([str(helm_path()), "template", release, str(CHART), "--namespace", namespace, *args],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


CLUSTER_SCOPED = ("ClusterRole", "ClusterRoleBinding", "PriorityLevelConfiguration", "FlowSchema")


@pytest.fixture(scope="module")
def release(local_cluster):
    """The chart (CRD included) applied for real in a fresh namespace; cluster-scoped RBAC removed afterwards."""
    namespace = f"pdpair-{uuid.uuid4().hex[:8]}"
    name = f"r{uuid.uuid4().hex[:6]}"
    local_cluster.create_namespace(namespace)
    rendered = helm_template(name, namespace, "--include-crds")
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    proc = local_cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=pdpair-tests",
                                 "-f", "-", input=rendered)
    yield {"namespace": namespace, "name": name, "docs": docs, "apply_output": proc.stdout}
    for doc in docs:
        if doc["kind"] in CLUSTER_SCOPED:
            local_cluster.kubectl("delete", doc["kind"].lower(), doc["metadata"]["name"], "--wait=false", check=False)
    local_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture(scope="module")
def service_account(release) -> str:
    [sa] = [d for d in release["docs"] if d["kind"] == "ServiceAccount"]
    return f"system:serviceaccount:{release['namespace']}:{sa['metadata']['name']}"


@pytest.fixture(scope="module")
def other_namespace(local_cluster):
    name = f"other-{uuid.uuid4().hex[:8]}"
    local_cluster.create_namespace(name)
    yield name
    local_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def qualified(doc: dict) -> str:
    """kind.group/name as kubectl prints and accepts it, e.g. deployment.apps/x, serviceaccount/x."""
    group = doc["apiVersion"].rpartition("/")[0]
    return f"{doc['kind'].lower()}{'.' + group if group else ''}/{doc['metadata']['name']}"


def test_every_rendered_object_was_applied(release, local_cluster):
    kinds = {d["kind"] for d in release["docs"]}
    assert kinds == {"CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                     "RoleBinding", "Deployment", "Service", "PodDisruptionBudget", "Secret",
                     "PriorityLevelConfiguration", "FlowSchema"}
    for doc in release["docs"]:
        assert f"{qualified(doc)} serverside-applied" in release["apply_output"], release["apply_output"]
        namespace = ["-n", release["namespace"]] if "namespace" in doc["metadata"] else []
        local_cluster.kubectl("get", qualified(doc), *namespace)


@pytest.mark.parametrize("plural", [contract.PLURAL, contract.ROLE_OBJECT_PLURAL])
def test_crd_from_the_chart_is_established(local_cluster, release, plural):
    local_cluster.wait_crd_established(f"{plural}.{contract.GROUP}")
    crd = json.loads(local_cluster.kubectl("get", "crd", f"{plural}.{contract.GROUP}", "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions.get("Established") == "True" and conditions.get("NamesAccepted") == "True", conditions


# A scenario with every monitoring object on (no charts/pdpair/ci/ file turns monitoring on).
MONITORING_ON = [f"--set=monitoring.{piece}.enabled=true"
                 for piece in ("podMonitor", "serviceMonitor", "prometheusRule", "dashboard")] + [
    "--set=monitoring.podMonitor.engineMetrics=true"]  # the PodMonitor's second endpoint (vLLM's own metrics)


@pytest.fixture(scope="module")
def monitoring_crds(local_cluster) -> list[str]:
    """prometheus-operator's real CRDs (monitoring.coreos.com/v1), so PodMonitor, ServiceMonitor and PrometheusRule
    are validated by the apiserver against upstream's schema like every other object (tests/e2e/
    test_monitoring_apply.py has the detailed checks)."""
    return install_prometheus_operator_crds(local_cluster)


@pytest.mark.parametrize("values", [None, *CI_VALUES, MONITORING_ON],
                         ids=lambda v: "defaults" if v is None else "monitoring-on" if v is MONITORING_ON else v.name)
def test_every_scenario_passes_a_server_side_dry_run(local_cluster, release, monitoring_crds, values):
    args = MONITORING_ON if values is MONITORING_ON else ["-f", str(values)] if values else []
    watched = (yaml.safe_load(values.read_text()) or {}).get("operator", {}).get("watchNamespaces", []) if isinstance(
        values, Path) else []
    for namespace in watched:  # the namespaced RBAC's Roles go there, and the chart wants them to exist
        if local_cluster.kubectl("get", "namespace", namespace, check=False).returncode != 0:
            local_cluster.create_namespace(namespace)
    rendered = helm_template("dry", release["namespace"], *args)
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    if not docs:
        assert values is not None and "crd-only" in values.name, "only the CRD-only scenario renders nothing"
        return
    served = set(local_cluster.kubectl("api-versions").stdout.split())
    unserved = {d["apiVersion"] for d in docs} - served
    assert not unserved, f"rendered objects of API versions the apiserver does not serve: {unserved}"
    if values is MONITORING_ON:
        assert {"PodMonitor", "ServiceMonitor", "PrometheusRule"} <= {d["kind"] for d in docs}
    # fieldValidation=Strict: an unknown or duplicate field is an error, not silently pruned.
    proc = local_cluster.kubectl("apply", "--server-side", "--dry-run=server", "--validate=strict",
                                 "--field-manager=pdpair-tests", "-f", "-", input=yaml.safe_dump_all(docs))
    assert proc.stdout.count("(server dry run)") == len(docs), proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr


def can_i(cluster, who: str, verb: str, resource: str, namespace: str | None, subresource: str | None = None) -> bool:
    args = ["auth", "can-i", verb, resource, f"--as={who}"]
    args += ["-n", namespace] if namespace else ["--all-namespaces"]
    if subresource:
        args.append(f"--subresource={subresource}")
    proc = cluster.kubectl(*args, check=False)
    answer = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert answer in ("yes", "no"), f"kubectl {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return answer == "yes"


PAIRS = f"{contract.PLURAL}.{contract.GROUP}"
ROLE_OBJECTS = f"{contract.ROLE_OBJECT_PLURAL}.{contract.GROUP}"  # InferencePairRole, the per-role scale objects
ANY = "any"  # a namespace the operator has no special relation to (pairs live anywhere)
OWN = "own"  # the release namespace (port leases)

# (verb, resource, subresource, where)
ALLOWED = [
    *[(v, PAIRS, None, ANY) for v in ("get", "list", "watch", "patch", "update")],
    *[(v, PAIRS, None, None) for v in ("list", "watch")],  # cluster-wide
    ("get", PAIRS, "status", ANY),
    ("patch", PAIRS, "status", ANY),
    ("update", PAIRS, "status", ANY),
    ("update", PAIRS, "finalizers", ANY),
    *[(v, ROLE_OBJECTS, None, ANY) for v in ("get", "list", "watch", "create", "patch")],
    *[(v, ROLE_OBJECTS, None, None) for v in ("list", "watch")],
    *[(v, ROLE_OBJECTS, "status", ANY) for v in ("get", "patch", "update")],
    *[(v, "pods", None, ANY) for v in ("get", "list", "watch", "create", "delete", "patch")],
    ("create", "secrets", None, ANY),  # the pairs' push-token Secrets (xPyD); never read
    *[(v, "pods", None, None) for v in ("list", "watch")],
    *[(v, "services", None, ANY) for v in ("get", "list", "watch", "create", "delete", "patch")],
    *[(v, "services", None, None) for v in ("list", "watch")],
    *[(v, "events", None, ANY) for v in ("create", "patch")],
    *[(v, "events.events.k8s.io", None, ANY) for v in ("create", "patch")],
    *[(v, "namespaces", None, None) for v in ("list", "watch")],
    *[(v, "nodes", None, None) for v in ("get", "list", "watch")],  # read only: lost nodes (docs/design.md)
    *[(v, "poddisruptionbudgets.policy", None, ANY) for v in ("get", "list", "watch", "create", "patch")],
    *[(v, "customresourcedefinitions.apiextensions.k8s.io", None, None) for v in ("list", "watch")],
    *[(v, "leases.coordination.k8s.io", None, OWN) for v in ("get", "list", "watch", "create", "delete", "update",
                                                              "patch")],
]

DENIED = [
    ("get", "secrets", None, OWN),
    ("list", "secrets", None, ANY),
    ("get", "configmaps", None, ANY),
    ("create", PAIRS, None, ANY),
    ("update", ROLE_OBJECTS, "finalizers", ANY),
    ("delete", PAIRS, None, ANY),
    ("update", "pods", None, ANY),
    *[(v, ROLE_OBJECTS, None, ANY) for v in ("update", "delete")],  # the garbage collector deletes them
    ("create", "pods", "exec", ANY),
    ("get", "pods", "log", ANY),
    ("get", "pods.metrics.k8s.io", None, ANY),
    ("create", "deployments.apps", None, ANY),
    ("update", "services", None, ANY),
    ("patch", "services", "status", ANY),
    ("delete", "nodes", None, None),
    # patched only back to the current shape (budget_outdated), never deleted or replaced
    *[(v, "poddisruptionbudgets.policy", None, ANY) for v in ("delete", "update")],
    ("patch", "nodes", None, None),
    ("update", "nodes", "status", None),
    ("create", "leases.coordination.k8s.io", None, ANY),
    ("delete", "leases.coordination.k8s.io", None, ANY),
    ("delete", "events", None, ANY),
    ("create", "namespaces", None, None),
    ("delete", "namespaces", None, None),
    ("get", "namespaces", None, None),
    ("create", "customresourcedefinitions.apiextensions.k8s.io", None, None),
    ("update", "customresourcedefinitions.apiextensions.k8s.io", None, None),
    ("create", "clusterroles.rbac.authorization.k8s.io", None, None),
    ("create", "rolebindings.rbac.authorization.k8s.io", None, OWN),
    ("create", "serviceaccounts", "token", OWN),
    ("impersonate", "serviceaccounts", None, ANY),
]


def where(case_where: str | None, release: dict, other: str) -> str | None:
    return {ANY: other, OWN: release["namespace"], None: None}[case_where]


def case_id(case) -> str:
    verb, resource, sub, at = case
    return f"{verb}-{resource}{'/' + sub if sub else ''}-{at or 'cluster'}"


@pytest.mark.parametrize("case", ALLOWED, ids=[case_id(c) for c in ALLOWED])
def test_operator_is_allowed(local_cluster, release, service_account, other_namespace, case):
    verb, resource, sub, at = case
    assert can_i(local_cluster, service_account, verb, resource, where(at, release, other_namespace), sub)


@pytest.mark.parametrize("case", DENIED, ids=[case_id(c) for c in DENIED])
def test_operator_is_denied(local_cluster, release, service_account, other_namespace, case):
    verb, resource, sub, at = case
    assert not can_i(local_cluster, service_account, verb, resource, where(at, release, other_namespace), sub)


def test_service_account_token_does_real_work_and_nothing_more(local_cluster, release, other_namespace):
    """The same answers from real requests made with the ServiceAccount's token (not impersonation)."""
    [sa] = [d for d in release["docs"] if d["kind"] == "ServiceAccount"]
    kubeconfig = local_cluster.service_account_kubeconfig(release["namespace"], sa["metadata"]["name"])
    ns = release["namespace"]
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": {"name": "pdpair-port-20000", "namespace": ns, "labels": {contract.LABEL_PORT_LEASE: "true"}},
             "spec": {"holderIdentity": "ns/pair/uid"}}
    local_cluster.kubectl("create", "-f", "-", input=json.dumps(lease), kubeconfig=kubeconfig)
    local_cluster.kubectl("delete", "lease", "pdpair-port-20000", "-n", ns, kubeconfig=kubeconfig)
    local_cluster.kubectl("get", PAIRS, "--all-namespaces", kubeconfig=kubeconfig)
    local_cluster.kubectl("get", "pods", "-n", other_namespace, kubeconfig=kubeconfig)
    denied = local_cluster.kubectl("get", "secrets", "-n", ns, kubeconfig=kubeconfig, check=False)
    assert denied.returncode != 0 and "Forbidden" in denied.stderr, denied.stderr
    denied = local_cluster.kubectl("create", "-f", "-", input=json.dumps({**lease, "metadata": {
        **lease["metadata"], "namespace": other_namespace}}), kubeconfig=kubeconfig, check=False)
    assert denied.returncode != 0 and "Forbidden" in denied.stderr, denied.stderr


PRIORITY_LEVEL_HEADER = re.compile(r"x-kubernetes-pf-prioritylevel-uid:\s*([0-9a-f-]{36})", re.IGNORECASE)


def test_operator_requests_run_in_the_charts_priority_level(local_cluster, release, other_namespace):
    """API Priority and Fairness classifies a request made with the ServiceAccount's token into the chart's own
    priority level (the apiserver names the level it used in every response's X-Kubernetes-PF-PriorityLevel-UID),
    and the FlowSchema is not dangling. A request of the cluster admin is not in that level."""
    [sa] = [d for d in release["docs"] if d["kind"] == "ServiceAccount"]
    [level] = [d for d in release["docs"] if d["kind"] == "PriorityLevelConfiguration"]
    [schema] = [d for d in release["docs"] if d["kind"] == "FlowSchema"]
    assert schema["spec"]["priorityLevelConfiguration"]["name"] == level["metadata"]["name"]
    level_uid = json.loads(local_cluster.kubectl("get", "prioritylevelconfiguration", level["metadata"]["name"],
                                                 "-o", "json").stdout)["metadata"]["uid"]
    kubeconfig = local_cluster.service_account_kubeconfig(release["namespace"], sa["metadata"]["name"])
    proc = local_cluster.kubectl("get", "pods", "-n", other_namespace, "-v=8", kubeconfig=kubeconfig)
    assert set(PRIORITY_LEVEL_HEADER.findall(proc.stderr)) == {level_uid}, proc.stderr[-3000:]
    admin = local_cluster.kubectl("get", "pods", "-n", other_namespace, "-v=8")
    assert PRIORITY_LEVEL_HEADER.findall(admin.stderr) and level_uid not in PRIORITY_LEVEL_HEADER.findall(admin.stderr)

    def dangling() -> str | None:
        found = json.loads(local_cluster.kubectl("get", "flowschema", schema["metadata"]["name"], "-o", "json").stdout)
        return {c["type"]: c["status"] for c in found.get("status", {}).get("conditions", [])}.get("Dangling")
    deadline = time.monotonic() + 30  # the apiserver's APF controller writes the condition after the create
    while dangling() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert dangling() == "False"


def test_service_account_runs_the_operator_steps_on_a_pair(local_cluster, release, other_namespace):
    """What the operator does to a pair, done with its token: finalizer, status, an owned pod, cleanup."""
    [sa] = [d for d in release["docs"] if d["kind"] == "ServiceAccount"]
    kubeconfig = local_cluster.service_account_kubeconfig(release["namespace"], sa["metadata"]["name"])
    pair = {"apiVersion": contract.API_VERSION, "kind": contract.KIND,
            "metadata": {"name": "rbac-pair", "namespace": other_namespace},
            "spec": {"model": "/models/tiny", "image": "ghcr.io/pdpair/pdpair:0.1.0"}}
    created = json.loads(local_cluster.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(pair)).stdout)
    as_operator = {"kubeconfig": kubeconfig}
    ns = ["-n", other_namespace]

    local_cluster.kubectl("patch", PAIRS, "rbac-pair", *ns, "--type=merge", "-p",
                          json.dumps({"metadata": {"finalizers": [contract.FINALIZER]}}), **as_operator)
    local_cluster.kubectl("patch", PAIRS, "rbac-pair", *ns, "--subresource=status", "--type=merge", "-p",
                          json.dumps({"status": {"phase": contract.PHASE_PENDING, "pairGeneration": 1}}), **as_operator)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "rbac-pair-decode-1", "namespace": other_namespace,
                        "labels": {contract.LABEL_PAIR: "rbac-pair", contract.LABEL_ROLE: contract.ROLE_DECODE},
                        # what kopf.adopt() writes
                        "ownerReferences": [{"apiVersion": contract.API_VERSION, "kind": contract.KIND,
                                             "name": "rbac-pair", "uid": created["metadata"]["uid"],
                                             "controller": True, "blockOwnerDeletion": True}]},
           "spec": {"containers": [{"name": "engine", "image": "ghcr.io/pdpair/pdpair:0.1.0"}]}}
    local_cluster.kubectl("create", "-f", "-", input=json.dumps(pod), **as_operator)
    local_cluster.kubectl("delete", "pod", "rbac-pair-decode-1", *ns, "--wait=false", **as_operator)
    local_cluster.kubectl("patch", PAIRS, "rbac-pair", *ns, "--type=json", "-p",
                          json.dumps([{"op": "remove", "path": "/metadata/finalizers"}]), **as_operator)
    read = json.loads(local_cluster.kubectl("get", PAIRS, "rbac-pair", *ns, "-o", "json").stdout)
    assert read["status"]["phase"] == contract.PHASE_PENDING
    # but the operator cannot delete the pair itself
    denied = local_cluster.kubectl("delete", PAIRS, "rbac-pair", *ns, check=False, **as_operator)
    assert denied.returncode != 0 and "Forbidden" in denied.stderr, denied.stderr


def test_helm_install_then_uninstall_keeps_the_crd(local_cluster, release):
    """Real `helm install`/`helm uninstall` against the apiserver: the release's objects come and go, the CRD
    (crds/) stays, as charts/pdpair/README.md promises."""
    namespace = f"helm-{uuid.uuid4().hex[:8]}"
    name = f"h{uuid.uuid4().hex[:6]}"
    home = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdpair-helm-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "KUBECONFIG": str(local_cluster.kubeconfig),
           **{f"HELM_{k}_HOME": str(home / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}}

    def helm(*args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(helm_path()), *args], capture_output=True, text=True, env=env, timeout=180)
        assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}{proc.stderr}"
        return proc

    helm("install", name, str(CHART), "--namespace", namespace, "--create-namespace")
    try:
        status = json.loads(helm("status", name, "--namespace", namespace, "-o", "json").stdout)
        assert status["info"]["status"] == "deployed"
        local_cluster.kubectl("get", "deployment", f"{name}-pdpair-operator", "-n", namespace)
        local_cluster.kubectl("get", "clusterrole", f"{name}-pdpair-operator")
    finally:
        helm("uninstall", name, "--namespace", namespace)
    gone = local_cluster.kubectl("get", "clusterrole", f"{name}-pdpair-operator", check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr, gone.stderr
    local_cluster.kubectl("get", "crd", f"{contract.PLURAL}.{contract.GROUP}")
    local_cluster.kubectl("get", "crd", f"{contract.ROLE_OBJECT_PLURAL}.{contract.GROUP}")
    local_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_namespaced_install_runs_the_operator_and_admits_network_policies(platform, tmp_path):
    """operator.watchNamespaces set (and operator.networkPolicy.enabled): the chart's RBAC applied for real, the
    operator run under its ServiceAccount against the real apiserver. Its ClusterRole only reads nodes, namespaces
    and CRDs; the pods it may make are in the watched namespace only; a hostNetwork pair reaches Ready there (its
    decode listener opened by the test on the kwok node's 127.0.0.1), with no Forbidden in the operator's log; a pair
    off the host network gets its NetworkPolicy, which the apiserver admits as the operator built it, and the
    hostNetwork pair gets none. The dev cluster's bridge CNI does not enforce NetworkPolicies: whether packets are
    dropped is not tested here.

    Cost: one operator process beside the module's cluster (kwok nodes from the e2e `platform` fixture), one pair to
    Ready; 9 s, plus 4 s for the `platform` fixture when no earlier test made it (measured on the shared 2-core box
    under a CI run, load average 4-5)."""
    import socket

    from kubernetes import client

    from devcluster import operator_process
    from devcluster.build import helm_path
    from devcluster.waiting import wait_for
    from pdpair.operator.build import network_policy
    from pdpair.operator.model.config import ENV_NETWORK_POLICY, ENV_WATCH_NAMESPACES
    from tests.e2e.operator_helpers import DECODE_SIDECHANNEL_0, NO_HEALTH, Api, cleanup_pairs, pool_of_free_ports

    cluster, _ = platform
    suffix = uuid.uuid4().hex[:8]
    watched, elsewhere, operator_ns = f"nsw-{suffix}", f"nso-{suffix}", f"nsop-{suffix}"
    release_name = f"ns{suffix[:6]}"
    for namespace in (watched, elsewhere):
        cluster.create_namespace(namespace)
    values = ("--set", f"operator.watchNamespaces={{{watched}}}", "--set", "operator.networkPolicy.enabled=true")
    manifest, account = operator_process.render_rbac(helm_path(), operator_ns, release_name, values)
    docs = [d for d in yaml.safe_load_all(manifest) if d]
    api = Api(cluster)
    proc = None
    try:
        kubeconfig = operator_process.install_operator_rbac(cluster, helm_path(), operator_ns, release_name, values)
        [cluster_role] = [d for d in docs if d["kind"] == "ClusterRole"]
        assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {
            "nodes", "namespaces", "customresourcedefinitions"}
        who = f"system:serviceaccount:{operator_ns}:{account}"
        assert can_i(cluster, who, "create", "pods", watched)
        assert can_i(cluster, who, "create", "networkpolicies.networking.k8s.io", watched)
        assert can_i(cluster, who, "create", "leases.coordination.k8s.io", operator_ns)
        for verb, resource, namespace in (("create", "pods", elsewhere), ("list", "pods", None),
                                          ("create", "secrets", elsewhere), ("patch", PAIRS, elsewhere),
                                          ("create", "leases.coordination.k8s.io", watched)):
            assert not can_i(cluster, who, verb, resource, namespace), (verb, resource, namespace)
        assert can_i(cluster, who, "list", "nodes", None) and can_i(cluster, who, "watch", "namespaces", None)

        proc = operator_process.OperatorProcess(kubeconfig, operator_ns, pool_of_free_ports(20),
                                                tmp_path / "operator.log", extra_env={
                                                    ENV_WATCH_NAMESPACES: watched, ENV_NETWORK_POLICY: "true",
                                                    **NO_HEALTH}).start()
        api.create_pair(watched, "served")  # hostNetwork: its pods' IP is the kwok node's, 127.0.0.1
        api.create_pair(watched, "isolated", network={"hostNetwork": False})
        pair = wait_for(lambda: (lambda p: p if (p.get("status") or {}).get("ports") else None)(
            api.pair(watched, "served")), 60, "ports leased")
        side = next(p["port"] for p in pair["status"]["ports"] if p["name"] == DECODE_SIDECHANNEL_0)
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", side))
            listener.listen(16)
            wait_for(lambda: api.pair(watched, "served").get("status", {}).get("phase") == "Ready", 60,
                     "the hostNetwork pair Ready under the namespaced RBAC")

        networking = client.NetworkingV1Api(cluster.api_client())
        isolated = api.pair(watched, "isolated")
        found = wait_for(lambda: next((p for p in networking.list_namespaced_network_policy(watched).items
                                       if p.metadata.name == "isolated"), None), 60, "the pair's NetworkPolicy")
        found = networking.api_client.sanitize_for_serialization(found)
        wanted = network_policy.pair_network_policy(isolated, operator_ns)
        assert found["spec"] == wanted["spec"], found["spec"]  # admitted as built: no defaulting to patch back
        assert network_policy.owned_by(found, isolated["metadata"]["uid"])
        assert [p.metadata.name for p in networking.list_namespaced_network_policy(watched).items] == ["isolated"]
        reasons = [e.reason for e in api.events(watched)]
        assert "NetworkPolicyCreated" in reasons and "NetworkPolicyError" not in reasons, reasons
        cleanup_pairs(api, watched)
        log = proc.log_tail(200_000)
        assert "forbidden" not in log.lower(), log[-4000:]
    finally:
        if proc is not None:
            proc.stop()
        for doc in docs:
            if doc["kind"] in CLUSTER_SCOPED:
                cluster.kubectl("delete", doc["kind"].lower(), doc["metadata"]["name"], "--wait=false", check=False)
        for namespace in (watched, elsewhere, operator_ns):
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
