"""The chart's monitoring objects (PodMonitor, ServiceMonitor, PrometheusRule, dashboard ConfigMap) applied to a
real apiserver that serves prometheus-operator's own CRDs (devcluster/monitoring_crds.py fetches them from the
Go module proxy). The apiserver validates each object against the CRD's structural schema with
fieldValidation=Strict (`kubectl --validate=strict`), so an unknown field, a wrong type or a malformed duration in a
template fails here; the last tests prove that these checks do reject such objects.
"""

from __future__ import annotations

import copy
import json
import uuid

import pytest
import yaml

from devcluster.monitoring_crds import (CRD_FILES, MONITORING_GROUP, PROMETHEUS_OPERATOR_VERSION,
                                           install_prometheus_operator_crds)
from tests.e2e.test_chart_apply import helm_template, qualified

pytestmark = pytest.mark.cluster

MONITORING_KINDS = set(CRD_FILES)  # PodMonitor, ServiceMonitor, PrometheusRule
ALL_ON = [f"--set=monitoring.{piece}.enabled=true"
          for piece in ("podMonitor", "serviceMonitor", "prometheusRule", "dashboard")]
# Every monitoring knob away from its default (each one changes what the templates write).
NON_DEFAULTS = {
    "monitoring": {
        "labels": {"release": "kube-prometheus-stack"},
        "podMonitor": {"interval": "30s", "scrapeTimeout": "20s", "namespaceSelector": {"matchNames": ["a", "b"]}},
        "serviceMonitor": {"interval": "1m", "scrapeTimeout": "500ms"},
        "prometheusRule": {"evaluationInterval": "30s", "additionalLabels": {"team": "serving"},
                           "alerts": {"transferErrors": {"window": "10m", "minErrors": 3},
                                      "notReady": {"enabled": False}}},
        "dashboard": {"annotations": {"grafana_folder": "pdpair"}},
    }
}


@pytest.fixture(scope="module")
def monitoring_crds(local_cluster) -> list[str]:
    # Left installed: the session cluster is thrown away at the end, and other modules may install them too.
    return install_prometheus_operator_crds(local_cluster)


@pytest.fixture(scope="module")
def namespace(local_cluster):
    name = f"mon-{uuid.uuid4().hex[:8]}"
    local_cluster.create_namespace(name)
    yield name
    local_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def monitoring_docs(release: str, namespace: str, *args: str) -> list[dict]:
    rendered = helm_template(release, namespace, *ALL_ON, *args)
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    return [d for d in docs if d["kind"] in MONITORING_KINDS or d["kind"] == "ConfigMap"]


def apply_strict(cluster, docs: list[dict], *extra: str, check: bool = True):
    """Server-side apply with fieldValidation=Strict: unknown or duplicate fields are errors, not dropped."""
    return cluster.kubectl("apply", "--server-side", "--validate=strict", "--field-manager=pdpair-tests",
                           *extra, "-f", "-", input=yaml.safe_dump_all(docs), check=check)


def test_upstream_crds_are_established_with_structural_schemas(local_cluster, monitoring_crds):
    assert f"{MONITORING_GROUP}/v1" in local_cluster.kubectl("api-versions").stdout.split()
    for name in monitoring_crds:
        crd = json.loads(local_cluster.kubectl("get", "crd", name, "-o", "json").stdout)
        conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
        assert conditions.get("Established") == "True", (name, conditions)
        # A non-structural schema would mean no pruning and weaker validation; upstream's must be structural.
        assert "NonStructuralSchema" not in conditions, (name, conditions)
        [v1] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        assert v1["served"] and v1["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"], name
        assert crd["metadata"]["annotations"].get("operator.prometheus.io/version") == \
            PROMETHEUS_OPERATOR_VERSION.lstrip("v"), name


@pytest.mark.parametrize("non_defaults", [False, True], ids=["all-on", "all-on-non-defaults"])
def test_monitoring_objects_are_accepted_and_stored_unchanged(local_cluster, monitoring_crds, namespace,
                                                              tmp_path, non_defaults):
    args = []
    if non_defaults:
        values = tmp_path / "values.yaml"
        values.write_text(yaml.safe_dump(NON_DEFAULTS))
        args = ["-f", str(values)]
    release = f"m{uuid.uuid4().hex[:6]}"
    docs = monitoring_docs(release, namespace, *args)
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "PodMonitor", "PrometheusRule", "ServiceMonitor"]

    proc = apply_strict(local_cluster, docs)
    for doc in docs:
        assert f"{qualified(doc)} serverside-applied" in proc.stdout, proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr  # no field was dropped or deprecated

    for doc in docs:
        stored = json.loads(local_cluster.kubectl("get", qualified(doc), "-n", namespace, "-o", "json").stdout)
        # Pruning would silently drop a field the schema does not know; everything rendered must come back.
        body = "data" if doc["kind"] == "ConfigMap" else "spec"
        assert stored[body] == doc[body], doc["kind"]
        assert stored["metadata"]["labels"] == doc["metadata"]["labels"], doc["kind"]

    if non_defaults:
        rule = next(d for d in docs if d["kind"] == "PrometheusRule")
        assert rule["spec"]["groups"][0]["interval"] == "30s"
    for doc in docs:
        local_cluster.kubectl("delete", qualified(doc), "-n", namespace)


def rendered(namespace: str, kind: str) -> dict:
    [doc] = [d for d in monitoring_docs("bad", namespace) if d["kind"] == kind]
    return doc


def with_change(doc: dict, change) -> dict:
    broken = copy.deepcopy(doc)
    change(broken["spec"])
    return broken


def set_in(path: list, value):
    def change(spec):
        node = spec
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return change


# (id, kind, change to spec, the field path the apiserver's error must name). Server-side apply names a list
# keyed by `name` as groups[name="..."], a create names it groups[0]; the paths below avoid that part.
BROKEN = [
    ("podmonitor-unknown-endpoint-field", "PodMonitor", set_in(["podMetricsEndpoints", 0, "scrapeEvery"], "15s"),
     "spec.podMetricsEndpoints[0].scrapeEvery"),
    ("podmonitor-relabelings-not-a-list", "PodMonitor",
     set_in(["podMetricsEndpoints", 0, "relabelings"], {"sourceLabels": ["a"]}),
     "spec.podMetricsEndpoints[0].relabelings"),
    ("podmonitor-bad-interval", "PodMonitor", set_in(["podMetricsEndpoints", 0, "interval"], "15 seconds"),
     "spec.podMetricsEndpoints[0].interval"),
    ("podmonitor-any-not-bool", "PodMonitor", set_in(["namespaceSelector", "any"], "yes"),
     "spec.namespaceSelector.any"),
    ("servicemonitor-targetport-wrong-type", "ServiceMonitor", set_in(["endpoints", 0, "targetPort"], [9090]),
     "spec.endpoints[0].targetPort"),
    ("servicemonitor-unknown-spec-field", "ServiceMonitor", set_in(["endpoint"], []), "spec.endpoint"),
    ("prometheusrule-bad-for", "PrometheusRule", set_in(["groups", 0, "rules", 0, "for"], "1 minute"),
     "].rules[0].for"),
    ("prometheusrule-unknown-rule-field", "PrometheusRule",
     set_in(["groups", 0, "rules", 0, "severity"], "critical"), "].rules[0].severity"),
]
# Both ways an object reaches the apiserver: server-side apply (this suite, helm 4) and create (POST), each with
# fieldValidation=Strict.
WRITES = {
    "apply": ["apply", "--server-side", "--validate=strict", "--field-manager=pdpair-tests"],
    "create": ["create", "--validate=strict"],
}


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("kind, change, field", [c[1:] for c in BROKEN], ids=[c[0] for c in BROKEN])
def test_a_wrong_field_is_rejected(local_cluster, monitoring_crds, namespace, kind, change, field, write):
    """The same object with one mistake is refused by the apiserver: the checks above can fail."""
    good = rendered(namespace, kind)
    local_cluster.kubectl(*WRITES[write], "--dry-run=server", "-f", "-", input=json.dumps(good))  # good passes
    proc = local_cluster.kubectl(*WRITES[write], "--dry-run=server", "-f", "-",
                                 input=json.dumps(with_change(good, change)), check=False)
    assert proc.returncode != 0, f"accepted: {proc.stdout}"
    # "Error from server: ..." (a typed-patch error) or "The PodMonitor "x" is invalid: ..." (schema validation)
    assert field in proc.stderr and ("Error from server" in proc.stderr or " is invalid: " in proc.stderr), \
        proc.stderr


def test_without_strict_validation_a_create_drops_an_unknown_field(local_cluster, monitoring_crds, namespace):
    """Why the checks use Strict: a create with fieldValidation=Ignore prunes the typo'd field and succeeds."""
    broken = with_change(rendered(namespace, "PodMonitor"), set_in(["podMetricsEndpoints", 0, "scrapeEvery"], "15s"))
    proc = local_cluster.kubectl("create", "--validate=false", "--dry-run=server", "-o", "json", "-f", "-",
                                 input=json.dumps(broken))
    stored = json.loads(proc.stdout)
    assert "scrapeEvery" not in stored["spec"]["podMetricsEndpoints"][0]
    assert stored["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
