"""The Helm chart lints strictly, renders for every scenario, and refuses bad values with a clear error.

Uses the helm binary from hack/tools.sh (via devcluster.build.helm_path); no cluster needed.
tests/e2e/test_chart_apply.py applies the rendered chart to a real apiserver.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from pdpair import contract
from devcluster.build import helm_path

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pdpair"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
NAMESPACE = "pdpair-system"
CLUSTER_SCOPED = ("ClusterRole", "ClusterRoleBinding", "PriorityLevelConfiguration", "FlowSchema")
RELEASE = "rel"


@pytest.fixture(scope="module")
def helm(tmp_path_factory) -> "Helm":
    return Helm(helm_path(), tmp_path_factory.mktemp("helm-home"))


class Helm:
    def __init__(self, binary: Path, home: Path):
        if not binary.exists():
            raise AssertionError(f"helm not found at {binary}; run hack/tools.sh")
        self.binary = binary
        # Keep helm away from ~/.config/helm and friends: nothing outside the temp dir is read or written.
        self.env = {**os.environ, **{f"HELM_{kind}_HOME": str(home / kind.lower()) for kind in ("CACHE", "CONFIG", "DATA")}}

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.binary), *args], capture_output=True, text=True, env=self.env, timeout=120)

    def template(self, *args: str, release: str = RELEASE) -> list[dict]:
        proc = self.run("template", release, str(CHART), "--namespace", NAMESPACE, *args)
        assert proc.returncode == 0, proc.stderr
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRD alone is 7,700 lines
        return [doc for doc in yaml.load_all(proc.stdout, Loader=loader) if doc]

    def template_error(self, *args: str) -> str:
        proc = self.run("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)
        assert proc.returncode != 0, f"helm template {' '.join(args)} should have failed but rendered:\n{proc.stdout[:2000]}"
        return proc.stderr


def by_kind(docs: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for doc in docs:
        assert doc["kind"] not in out, f"two {doc['kind']} objects rendered"
        out[doc["kind"]] = doc
    return out


def container_env(deployment: dict) -> dict[str, dict]:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e for e in container["env"]}


def test_ci_scenarios_exist():
    assert len(CI_VALUES) >= 4, CI_VALUES


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: "defaults" if v is None else v.name)
def test_lint_strict(helm, values):
    args = ["lint", "--strict", str(CHART)] + (["-f", str(values)] if values else [])
    proc = helm.run(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: "defaults" if v is None else v.name)
def test_template_renders_labelled_objects(helm, values):
    docs = helm.template(*(["-f", str(values)] if values else []))
    for doc in docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/part-of"] == "pdpair"
        assert len(doc["metadata"]["name"]) <= 63
        if doc["kind"] not in CLUSTER_SCOPED:
            watched = doc["kind"] in ("Role", "RoleBinding") and doc["metadata"]["namespace"] in (
                yaml.safe_load(values.read_text()) if values else {}).get("operator", {}).get("watchNamespaces", [])
            assert doc["metadata"]["namespace"] == NAMESPACE or watched


def test_default_render_has_every_operator_object(helm):
    kinds = by_kind(helm.template())
    assert set(kinds) == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Deployment",
                          "Service", "PodDisruptionBudget", "Secret", "PriorityLevelConfiguration", "FlowSchema"}
    deployment = kinds["Deployment"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    assert "app.kubernetes.io/version" not in selector and "helm.sh/chart" not in selector
    assert kinds["Service"]["spec"]["selector"] == selector
    sa_name = kinds["ServiceAccount"]["metadata"]["name"]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == sa_name
    for binding in (kinds["ClusterRoleBinding"], kinds["RoleBinding"]):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa_name, "namespace": NAMESPACE}]


def test_operator_container(helm):
    deployment = by_kind(helm.template())["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"] == ["python", "-m", "pdpair.operator"]
    env = container_env(deployment)
    assert env["PDPAIR_OPERATOR_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["PDPAIR_PORT_POOL"]["value"] == "20000-29999"
    assert container["livenessProbe"]["httpGet"] == {"path": contract.HEALTHZ_PATH, "port": "http-healthz"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http-healthz": int(env["PDPAIR_LIVENESS_PORT"]["value"]),
                     "http-metrics": int(env["PDPAIR_OPERATOR_METRICS_PORT"]["value"])}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"


# --- high availability (docs/design.md "Operator high availability") --------------------------------------------
def test_two_replicas_with_leader_election_by_default(helm):
    kinds = by_kind(helm.template())
    deployment = kinds["Deployment"]
    env = container_env(deployment)
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert env["PDPAIR_LEADER_ELECT"]["value"] == "true"
    assert env["PDPAIR_LEADER_LEASE_NAME"]["value"] == f"{RELEASE}-pdpair-operator-leader"
    timing = [float(env[f"PDPAIR_LEADER_{k}"]["value"]) for k in ("RETRY_PERIOD_SECONDS", "RENEW_DEADLINE_SECONDS",
                                                                   "LEASE_DURATION_SECONDS")]
    assert timing == sorted(timing) and len(set(timing)) == 3
    assert env["PDPAIR_POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # The operator accepts exactly what the chart renders (the same validation the pod runs at start).
    from pdpair.operator.model.config import OperatorConfig

    cfg = OperatorConfig.from_env({k: e["value"] for k, e in env.items() if "value" in e}
                                  | {"PDPAIR_OPERATOR_NAMESPACE": NAMESPACE})
    assert cfg.leader_elect and cfg.leader_lease_name == env["PDPAIR_LEADER_LEASE_NAME"]["value"]


def test_pod_disruption_budget_selects_the_operator_pods(helm):
    kinds = by_kind(helm.template())
    pdb = kinds["PodDisruptionBudget"]
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["selector"]["matchLabels"] == kinds["Deployment"]["spec"]["selector"]["matchLabels"]


def test_operator_requests_get_a_priority_level_of_their_own(helm):
    """The FlowSchema matches the operator's ServiceAccount (and only it) and names the chart's level; the level
    queues (one queue: one flow) instead of refusing a burst. tests/e2e/test_chart_apply.py checks a real apiserver
    classifies the ServiceAccount's requests into it."""
    kinds = by_kind(helm.template("--set", "operator.apiPriority.queueLengthLimit=77"))
    level, schema = kinds["PriorityLevelConfiguration"], kinds["FlowSchema"]
    assert level["apiVersion"] == schema["apiVersion"] == "flowcontrol.apiserver.k8s.io/v1"
    assert schema["spec"]["priorityLevelConfiguration"]["name"] == level["metadata"]["name"]
    assert 900 < schema["spec"]["matchingPrecedence"] < 9000  # after the system schemas, before service-accounts
    [rule] = schema["spec"]["rules"]
    assert rule["subjects"] == [{"kind": "ServiceAccount", "serviceAccount": {
        "name": kinds["ServiceAccount"]["metadata"]["name"], "namespace": NAMESPACE}}]
    limited = level["spec"]["limited"]
    assert level["spec"]["type"] == "Limited" and limited["limitResponse"]["type"] == "Queue"
    assert limited["limitResponse"]["queuing"] == {"queues": 1, "handSize": 1, "queueLengthLimit": 77}
    off = by_kind(helm.template("--set", "operator.apiPriority.enabled=false"))
    assert "FlowSchema" not in off and "PriorityLevelConfiguration" not in off


def test_replicas_prefer_different_nodes(helm):
    deployment = by_kind(helm.template())["Deployment"]
    [term] = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in deployment["spec"]["template"]["spec"]["affinity"][
        "podAntiAffinity"]  # preferred: one node still runs both


def test_user_affinity_replaces_the_spread(helm):
    docs = helm.template("--set", "operator.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                                  ".nodeSelectorTerms[0].matchExpressions[0].key=pool",
                         "--set", "operator.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                                  ".nodeSelectorTerms[0].matchExpressions[0].operator=Exists")
    affinity = by_kind(docs)["Deployment"]["spec"]["template"]["spec"]["affinity"]
    assert set(affinity) == {"nodeAffinity"}


def test_single_replica_without_election_is_recreate_without_budget(helm):
    kinds = by_kind(helm.template("--set", "operator.replicas=1", "--set", "operator.leaderElection.enabled=false"))
    deployment = kinds["Deployment"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert container_env(deployment)["PDPAIR_LEADER_ELECT"]["value"] == "false"
    assert "PodDisruptionBudget" not in kinds  # a budget over one pod would block every drain
    assert "affinity" not in deployment["spec"]["template"]["spec"]


def test_operator_config_env_is_what_the_operator_reads(helm):
    """Every PDPAIR_* variable the chart sets is one pdpair.operator.model.config reads (a rename breaks this test)."""
    from pdpair.operator.model import config

    read = {v for k, v in vars(config).items() if k.startswith("ENV_")}
    docs = helm.template("-f", str(CHART / "ci" / "01-watch-namespaces-tuning-values.yaml"))
    env = container_env(next(d for d in docs if d["kind"] == "Deployment"))  # (a Role per watched namespace)
    assert set(env) <= read, set(env) - read
    assert env["PDPAIR_WATCH_NAMESPACES"]["value"] == "team-a,team-b"
    assert env["PDPAIR_API_THREADS"]["value"] == "8"
    assert env["PDPAIR_PROBE_INTERVAL_SECONDS"]["value"] == "0.5"


def test_tuning_left_null_sets_no_env(helm):
    env = container_env(by_kind(helm.template())["Deployment"])
    assert "PDPAIR_PROBE_INTERVAL_SECONDS" not in env and "PDPAIR_API_THREADS" not in env


def test_crd_only_scenario_renders_nothing_but_the_crd(helm):
    values = str(CHART / "ci" / "03-crd-only-values.yaml")
    assert helm.template("-f", values) == []
    crds = helm.template("-f", values, "--include-crds")
    assert {crd["kind"] for crd in crds} == {"CustomResourceDefinition"}
    assert sorted(crd["metadata"]["name"] for crd in crds) == sorted(
        [f"{contract.PLURAL}.{contract.GROUP}", f"{contract.ROLE_OBJECT_PLURAL}.{contract.GROUP}"])


def test_existing_service_account_is_bound_not_created(helm):
    kinds = by_kind(helm.template("-f", str(CHART / "ci" / "02-existing-serviceaccount-values.yaml")))
    assert "ServiceAccount" not in kinds
    assert kinds["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"] == "pdpair-operator-external"
    assert kinds["RoleBinding"]["subjects"][0]["name"] == "pdpair-operator-external"


def test_image_digest_wins_over_tag(helm):
    kinds = by_kind(helm.template("-f", str(CHART / "ci" / "04-non-defaults-values.yaml")))
    [container] = kinds["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == ("registry.example.com/serving/pdpair@sha256:"
                                  "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef")
    assert kinds["Deployment"]["metadata"]["name"] == "pdpair-prod-operator"
    assert kinds["Deployment"]["metadata"]["labels"]["team"] == "serving"


def test_long_release_name_is_truncated_to_a_dns_label(helm):
    release = "a-release-name-at-helms-limit-of-fifty-three-characte"  # helm refuses longer ones
    assert len(release) == 53
    for doc in helm.template(release=release):
        name = doc["metadata"]["name"]
        assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
        assert name.endswith("-operator")


# --- RBAC: cluster-wide by default, namespaced with operator.watchNamespaces ---------------------------------------
CLUSTER_READS = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
                 {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
                 {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
                  "verbs": ["list", "watch"]}]
LEASES = [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
           "verbs": ["get", "list", "watch", "create", "delete", "update", "patch"]}]


def rbac(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"].get("namespace", "")): d for d in docs
            if d["kind"] in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")}


def granted(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_without_watch_namespaces_the_cluster_role_holds_every_rule(helm):
    objects = rbac(helm.template())
    assert set(objects) == {("ClusterRole", ""), ("ClusterRoleBinding", ""), ("Role", NAMESPACE),
                            ("RoleBinding", NAMESPACE)}
    rights = granted(objects[("ClusterRole", "")]["rules"])
    assert {("", "pods", "create"), ("", "secrets", "create"), ("pdpair.io", "inferencepairs", "patch")} <= rights
    assert granted(CLUSTER_READS) <= rights
    assert objects[("Role", NAMESPACE)]["rules"] == LEASES
    assert not {r for r in rights if r[0] == "networking.k8s.io"}  # only with operator.networkPolicy.enabled


def test_with_watch_namespaces_the_rights_are_roles_there_and_the_cluster_role_only_reads(helm):
    """The same rights as the cluster-wide mode, narrowed: each watched namespace's Role holds what the ClusterRole
    held but the cluster-scoped reads; those stay in the ClusterRole, alone. The Leases stay in the release
    namespace."""
    everything = granted(rbac(helm.template())[("ClusterRole", "")]["rules"])
    objects = rbac(helm.template("-f", str(CHART / "ci" / "01-watch-namespaces-tuning-values.yaml")))
    assert set(objects) == {("ClusterRole", ""), ("ClusterRoleBinding", ""), ("Role", NAMESPACE),
                            ("RoleBinding", NAMESPACE), ("Role", "team-a"), ("RoleBinding", "team-a"),
                            ("Role", "team-b"), ("RoleBinding", "team-b")}
    assert objects[("ClusterRole", "")]["rules"] == CLUSTER_READS
    sa = {"kind": "ServiceAccount", "name": f"{RELEASE}-pdpair-operator", "namespace": NAMESPACE}
    for ns in ("team-a", "team-b"):
        role, binding = objects[("Role", ns)], objects[("RoleBinding", ns)]
        assert granted(role["rules"]) == everything - granted(CLUSTER_READS)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": role["metadata"]["name"]}
        assert binding["subjects"] == [sa]
    assert objects[("Role", NAMESPACE)]["rules"] == LEASES
    assert objects[("ClusterRoleBinding", "")]["subjects"] == [sa]


def test_a_watched_release_namespace_gets_the_pair_rules_beside_the_leases(helm):
    objects = rbac(helm.template("--set", f"operator.watchNamespaces={{{NAMESPACE},team-a}}"))
    assert {k for k in objects if k[0] == "Role"} == {("Role", NAMESPACE), ("Role", "team-a")}  # one Role a namespace
    assert granted(objects[("Role", NAMESPACE)]["rules"]) == granted(LEASES) | granted(objects[("Role", "team-a")][
        "rules"])


@pytest.mark.parametrize("namespaced", [False, True], ids=["cluster-wide", "namespaced"])
def test_network_policy_option_sets_the_env_and_grants_networkpolicies(helm, namespaced):
    args = ["--set", "operator.watchNamespaces={team-a}"] if namespaced else []
    off = helm.template(*args)
    on = helm.template(*args, "--set", "operator.networkPolicy.enabled=true")
    assert container_env(next(d for d in off if d["kind"] == "Deployment"))["PDPAIR_NETWORK_POLICY"]["value"] == "false"
    assert container_env(next(d for d in on if d["kind"] == "Deployment"))["PDPAIR_NETWORK_POLICY"]["value"] == "true"
    holder = ("Role", "team-a") if namespaced else ("ClusterRole", "")
    policies = {r for r in granted(rbac(on)[holder]["rules"]) if r[1] == "networkpolicies"}
    assert policies == {("networking.k8s.io", "networkpolicies", v) for v in ("get", "create", "patch")}
    assert not any(r[1] == "networkpolicies" for d in rbac(off).values() for r in granted(d.get("rules") or []))
    if namespaced:
        assert rbac(on)[("ClusterRole", "")]["rules"] == CLUSTER_READS


# name, --set arguments, a substring of helm's error
BAD_VALUES = [
    ("unknown operator key", ["--set", "operator.portpool=20000-20010"], "additional properties 'portpool'"),
    ("unknown top-level key", ["--set", "crds.enabled=true"], "additional properties 'crds'"),
    ("pool without dash", ["--set-string", "operator.portPool=20000"], "/operator/portPool"),
    ("pool reversed", ["--set-string", "operator.portPool=30000-20000"], 'operator.portPool "30000-20000"'),
    ("pool below 1024", ["--set-string", "operator.portPool=1000-2000"], 'operator.portPool "1000-2000"'),
    ("pool overlaps the ephemeral range", ["--set-string", "operator.portPool=30000-33000"],
     "overlaps the nodes' ephemeral port range"),
    ("pool inside a custom ephemeral range", ["--set-string", "operator.portPool=20000-20100",
                                              "--set-string", "operator.nodeEphemeralPortRange=20050-30000"],
     "overlaps the nodes' ephemeral port range \"20050-30000\""),
    ("bad ephemeral range", ["--set-string", "operator.nodeEphemeralPortRange=32768"],
     "/operator/nodeEphemeralPortRange"),
    ("metrics port out of range", ["--set", "operator.metricsPort=70000"], "/operator/metricsPort"),
    ("liveness equals metrics", ["--set", "operator.livenessPort=9090"], "operator.livenessPort and operator.metricsPort"),
    ("pull policy", ["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy"),
    ("bad digest", ["--set", "image.digest=sha256:xyz"], "/image/digest"),
    ("zero api threads", ["--set", "operator.tuning.apiThreads=0"], "/operator/tuning/apiThreads"),
    ("negative probe interval", ["--set", "operator.tuning.probeIntervalSeconds=-1"],
     "/operator/tuning/probeIntervalSeconds"),
    ("bad watch namespace", ["--set", "operator.watchNamespaces[0]=Team_A"], "/operator/watchNamespaces/0"),
    ("extraEnv overrides the pool", ["--set", "operator.extraEnv[0].name=PDPAIR_PORT_POOL",
                                     "--set", "operator.extraEnv[0].value=1-2"], "/operator/extraEnv/0/name"),
    ("service type", ["--set", "operator.service.type=Ingress"], "/operator/service/type"),
    ("external SA without a name", ["--set", "serviceAccount.create=false"], "serviceAccount.name is required"),
    ("replicas without leader election", ["--set", "operator.leaderElection.enabled=false"],
     "operator.replicas is 2 but operator.leaderElection.enabled is false"),
    ("renew deadline not below the lease duration", ["--set", "operator.leaderElection.renewDeadlineSeconds=15"],
     "retryPeriodSeconds (2) < renewDeadlineSeconds (15) < leaseDurationSeconds (15)"),
    ("retry period not below the renew deadline", ["--set", "operator.leaderElection.retryPeriodSeconds=10"],
     "operator.leaderElection needs retryPeriodSeconds (10)"),
    ("zero replicas", ["--set", "operator.replicas=0"], "/operator/replicas"),
    ("lendable percent above 100", ["--set", "operator.apiPriority.lendablePercent=101"],
     "/operator/apiPriority/lendablePercent"),
    ("precedence of the catch-all", ["--set", "operator.apiPriority.matchingPrecedence=10000"],
     "/operator/apiPriority/matchingPrecedence"),
    ("unknown election key", ["--set", "operator.leaderElection.leaseSeconds=3"],
     "additional properties 'leaseSeconds'"),
    ("extraEnv overrides the election", ["--set", "operator.extraEnv[0].name=PDPAIR_LEADER_ELECT",
                                         "--set", "operator.extraEnv[0].value=false"], "/operator/extraEnv/0/name"),
    ("network policy not a boolean", ["--set-string", "operator.networkPolicy.enabled=yes"],
     "/operator/networkPolicy/enabled"),
]


@pytest.mark.parametrize("args,expected", [(a, e) for _, a, e in BAD_VALUES], ids=[n for n, _, _ in BAD_VALUES])
def test_bad_values_are_refused(helm, args, expected):
    error = helm.template_error(*args)
    assert expected in error, error


def _values_keys() -> list[dict]:
    """Every key of values.yaml with its dotted path, its comment kind and whether a mapping follows.

    Convention: a comment block starting with "# --" documents a value (a scalar, or a block such as resources whose
    inner keys are its example); a plain "#" comment introduces a section whose keys carry their own comments.
    """
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str, bool]] = []  # (indent, key, documented) of the enclosing keys
    keys = []
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][A-Za-z0-9]*):(.*)$", line)
        if not match:
            continue
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3).strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#"):
            j -= 1
        comment = [line.strip() for line in lines[j + 1:i]]
        kind = None if not comment else ("doc" if comment[0].startswith("# --") else "plain")
        inside_doc = any(documented for _, _, documented in stack)
        keys.append({"path": ".".join([k for _, k, _ in stack] + [key]), "line": line.strip(), "comment": kind,
                     "inside_doc": inside_doc, "mapping": rest == "" or rest.startswith("#")})
        stack.append((indent, key, kind == "doc"))
    return keys


def test_every_value_is_commented_in_values_yaml():
    problems = []
    for key in _values_keys():
        if key["inside_doc"]:
            continue
        if key["comment"] is None:
            problems.append(f"{key['path']}: no comment above it")
        elif not key["mapping"] and key["comment"] != "doc":
            problems.append(f"{key['path']}: a value needs a '# --' comment")
    assert problems == []


def test_every_value_is_documented_in_the_readme():
    readme = (CHART / "README.md").read_text()
    documented = [k["path"] for k in _values_keys() if k["comment"] == "doc" and not k["inside_doc"]]
    assert len(documented) >= 40
    missing = [path for path in documented if f"`{path}`" not in readme]
    assert missing == []


def test_pool_above_the_ephemeral_range_renders_when_the_check_is_set_or_off(helm):
    """The ephemeral-range check refuses overlaps only: a pool beside a custom range, or with the check off, renders."""
    for args in (["--set-string", "operator.portPool=40000-40100", "--set-string",
                  "operator.nodeEphemeralPortRange=50000-60000"],
                 ["--set-string", "operator.portPool=40000-40100", "--set-string", "operator.nodeEphemeralPortRange="]):
        docs = helm.template(*args)
        deployment = next(d for d in docs if d["kind"] == "Deployment")
        env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["PDPAIR_PORT_POOL"] == "40000-40100"
