"""The harness's stand-in for prometheus-operator: the chart's PodMonitor as a Prometheus scrape job, the
PrometheusRule as a rules file, and the discovery sidecar's targets (devcluster/incluster_prometheus.py,
pod_sd_sidecar.py). Pure functions on the rendered chart; the same config run by a real Prometheus is
tests/e2e/test_podmonitor_translation.py, and in the cluster tests/e2e_realnode/test_realnode_signal_drop.py."""
from __future__ import annotations

import pytest

from pdpair import contract
from devcluster.incluster_prometheus import (
    SD_DIR, UnsupportedMonitorField, manifests, podmonitor_scrape_configs, prometheus_config,
    render_chart_monitoring, render_operator_monitor, rules_file, servicemonitor_scrape_configs, with_file_sd,
)
from devcluster.pod_sd_sidecar import parse_jobs, pod_targets, targets_for


@pytest.fixture(scope="module")
def chart():
    return render_chart_monitoring("monitoring.podMonitor.interval=2s", "monitoring.podMonitor.scrapeTimeout=1s")


def test_podmonitor_becomes_one_role_pod_job_like_prometheus_operator(chart):
    podmonitor, _ = chart
    [job] = podmonitor_scrape_configs(podmonitor)
    meta = podmonitor["metadata"]
    assert job["job_name"] == f"podMonitor/{meta['namespace']}/{meta['name']}/0"
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]  # namespaceSelector any: true -> every namespace
    assert (job["scrape_interval"], job["scrape_timeout"], job["metrics_path"]) == ("2s", "1s", contract.METRICS_PATH)
    rules = job["relabel_configs"]
    assert {"action": "keep", "source_labels": ["__meta_kubernetes_pod_labelpresent_pdpair_io_pair"],
            "regex": "true"} in rules
    assert {"action": "keep", "source_labels": ["__meta_kubernetes_pod_label_pdpair_io_role",
                                                "__meta_kubernetes_pod_labelpresent_pdpair_io_role"],
            "regex": "(prefill|decode);true"} in rules
    assert {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
            "regex": contract.METRICS_PORT_NAME} in rules
    targets = [r.get("target_label") for r in rules]
    for label in ("namespace", "pod", "container", "job", "endpoint"):
        assert label in targets, label
    # the PodMonitor's own relabelings (the `pair` and `pdpair_instance` labels the alert rules group by) come after
    # the operator's
    assert rules[-3:] == [
        {"source_labels": ["__meta_kubernetes_pod_label_pdpair_io_pair"], "target_label": "pair", "action": "replace"},
        {"target_label": "pdpair_instance", "replacement": "0", "action": "replace"},
        {"source_labels": ["__meta_kubernetes_pod_label_pdpair_io_instance"], "regex": "(.+)",
         "target_label": "pdpair_instance", "action": "replace"},
    ]


def test_servicemonitor_becomes_a_pod_job_on_the_services_ready_pods_and_target_port():
    """The operator's ServiceMonitor (the dashboard's operator panels): its Service's selector and targetPort name,
    in the release's namespace, Ready pods only (what the Service's endpoints are). Pure, under a second."""
    monitor, service = render_operator_monitor("pdpair", "monitoring.serviceMonitor.interval=1s",
                                               "monitoring.serviceMonitor.scrapeTimeout=1s")
    [job] = servicemonitor_scrape_configs(monitor, service)
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": ["pdpair-system"]}}]
    assert job["scrape_interval"] == "1s" and job["metrics_path"] == "/metrics" and job["honor_labels"] is True
    rules = job["relabel_configs"]
    assert {"action": "keep", "source_labels": ["__meta_kubernetes_pod_ready"], "regex": "true"} in rules
    assert {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
            "regex": "http-metrics"} in rules
    for key, value in service["spec"]["selector"].items():
        name = key.replace(".", "_").replace("/", "_").replace("-", "_")
        assert {"action": "keep", "source_labels": [f"__meta_kubernetes_pod_label_{name}",
                                                    f"__meta_kubernetes_pod_labelpresent_{name}"],
                "regex": f"({value});true"} in rules
    assert service["spec"]["selector"]["app.kubernetes.io/instance"] == "pdpair"  # the installed release's
    jobs, sidecar = with_file_sd([job])
    assert sidecar == ["job0.json=pdpair-system"] and "kubernetes_sd_configs" not in jobs[0]


def test_namespace_selector_match_names_and_default():
    podmonitor, _ = render_chart_monitoring("monitoring.podMonitor.namespaceSelector.any=false",
                                            "monitoring.podMonitor.namespaceSelector.matchNames={a,b}")
    [job] = podmonitor_scrape_configs(podmonitor)
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": ["a", "b"]}}]
    own = {**podmonitor, "spec": {**podmonitor["spec"], "namespaceSelector": {}}}
    [job] = podmonitor_scrape_configs(own)
    assert job["kubernetes_sd_configs"][0]["namespaces"] == {"names": [podmonitor["metadata"]["namespace"]]}


@pytest.mark.parametrize("where, patch, message", [
    ("spec", {"sampleLimit": 5}, "sampleLimit"),
    ("endpoint", {"tlsConfig": {}}, "tlsConfig"),
    ("endpoint", {"relabelings": [{"sourceLabels": ["a"], "bogus": 1}]}, "bogus"),
    ("selector", {"matchExpressions": [{"key": "k", "operator": "Near"}]}, "Near"),
])
def test_what_the_translation_does_not_know_is_refused(chart, where, patch, message):
    podmonitor, _ = chart
    spec = dict(podmonitor["spec"])
    if where == "spec":
        spec.update(patch)
    elif where == "endpoint":
        spec["podMetricsEndpoints"] = [{**spec["podMetricsEndpoints"][0], **patch}]
    else:
        spec["selector"] = patch
    with pytest.raises(UnsupportedMonitorField, match=message):
        podmonitor_scrape_configs({**podmonitor, "spec": spec})


def test_file_sd_replaces_kubernetes_sd_and_tells_the_sidecar_the_namespaces(chart):
    podmonitor, rule = chart
    [job] = podmonitor_scrape_configs(podmonitor)
    [swapped], sidecar_jobs = with_file_sd([job, ])
    assert "kubernetes_sd_configs" not in swapped and swapped["relabel_configs"] == job["relabel_configs"]
    assert swapped["file_sd_configs"][0]["files"] == [f"{SD_DIR}/job0.json"]
    assert sidecar_jobs == ["job0.json=*"] and parse_jobs(sidecar_jobs) == {"job0.json": None}
    named = {**job, "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": ["a", "b"]}}]}
    assert parse_jobs(with_file_sd([named])[1]) == {"job0.json": {"a", "b"}}
    with pytest.raises(UnsupportedMonitorField, match="role-pod"):
        with_file_sd([{**job, "kubernetes_sd_configs": [{"role": "endpoints"}]}])
    config = prometheus_config([swapped])
    objects = manifests("mon", "prom:1", "op:1", config, sidecar_jobs, rules_file(rule))
    kinds = [o["kind"] for o in objects]
    assert kinds == ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "Pod"]
    assert objects[1]["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    pod = objects[-1]["spec"]
    assert pod["serviceAccountName"] == objects[0]["metadata"]["name"]
    assert [c["name"] for c in pod["containers"]] == ["prometheus", "pod-sd"]


def test_rules_file_is_the_prometheus_rule_groups(chart):
    _, rule = chart
    groups = rules_file(rule)["groups"]
    alerts = {r["alert"] for g in groups for r in g["rules"]}
    assert set(contract.ALERTS) <= alerts


def _pod(name, ns="n", labels=None, ip="198.18.0.2", phase="Running", containers=None):
    return {"metadata": {"name": name, "namespace": ns, "uid": f"u-{name}", "labels": labels or {}},
            "spec": {"nodeName": "n1", "containers": containers or [
                {"name": "engine", "image": "e:1", "ports": [{"name": "metrics", "containerPort": 9100},
                                                              {"name": "http", "containerPort": 8000}]}]},
            "status": {"podIP": ip, "hostIP": ip, "phase": phase,
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def test_sidecar_targets_are_per_container_port_with_the_pod_role_meta_labels():
    groups = pod_targets(_pod("p", labels={"pdpair.io/pair": "x", "pdpair.io/role": "prefill"}))
    assert [g["targets"] for g in groups] == [["198.18.0.2:9100"], ["198.18.0.2:8000"]]
    labels = groups[0]["labels"]
    assert labels["__meta_kubernetes_pod_label_pdpair_io_pair"] == "x"
    assert labels["__meta_kubernetes_pod_labelpresent_pdpair_io_role"] == "true"
    assert labels["__meta_kubernetes_pod_container_port_name"] == "metrics"
    assert labels["__meta_kubernetes_pod_container_port_number"] == "9100"
    assert labels["__meta_kubernetes_pod_container_name"] == "engine"
    assert labels["__meta_kubernetes_namespace"] == "n" and labels["__meta_kubernetes_pod_name"] == "p"
    assert labels["__meta_kubernetes_pod_ready"] == "true" and labels["__meta_kubernetes_pod_phase"] == "Running"
    # no IP yet: nothing to scrape; a container without ports: one port-less target
    assert pod_targets(_pod("q", ip="")) == []
    bare = pod_targets(_pod("r", containers=[{"name": "c", "image": "i"}]))
    assert [g["targets"] for g in bare] == [["198.18.0.2"]]
    assert [g["labels"]["__meta_kubernetes_pod_name"] for g in
            targets_for([_pod("b", ns="n2"), _pod("a")], {"n"})] == ["a", "a"]
