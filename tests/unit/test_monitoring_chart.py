"""The chart's monitoring objects: toggles, selectors that match what they scrape, and refused values."""

from __future__ import annotations

import json

import pytest

from tests.monitoring_support import CHART, DASHBOARD, NAMESPACE, helm, one, render, render_error

MONITORING_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}


def kinds(docs):
    return [d["kind"] for d in docs]


def test_monitoring_is_off_by_default():
    docs = render(monitoring_on=False)
    assert not MONITORING_KINDS & set(kinds(docs))
    assert not [d for d in docs if d["kind"] == "ConfigMap"]


@pytest.mark.parametrize(
    "toggle, kind",
    [
        ("monitoring.podMonitor.enabled", "PodMonitor"),
        ("monitoring.serviceMonitor.enabled", "ServiceMonitor"),
        ("monitoring.prometheusRule.enabled", "PrometheusRule"),
        ("monitoring.dashboard.enabled", "ConfigMap"),
    ],
)
def test_each_piece_has_its_own_toggle(toggle, kind):
    only = render(f"{toggle}=true", monitoring_on=False)
    assert kinds(only).count(kind) == 1
    others = (MONITORING_KINDS | {"ConfigMap"}) - {kind}
    assert not others & set(kinds(only))


def test_all_on_lints_strictly():
    args = ["lint", "--strict", str(CHART)]
    for s in ("podMonitor", "serviceMonitor", "prometheusRule", "dashboard"):
        args += ["--set", f"monitoring.{s}.enabled=true"]
    proc = helm(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_labels_and_namespace():
    docs = render("monitoring.labels.release=kube-prometheus-stack")
    for kind in ("PodMonitor", "ServiceMonitor", "PrometheusRule", "ConfigMap"):
        obj = one(docs, kind)
        assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack", kind
        assert obj["metadata"]["labels"]["app.kubernetes.io/component"] == "monitoring", kind
        assert obj["metadata"]["namespace"] == NAMESPACE, kind


def test_service_monitor_selects_the_operator_metrics_service():
    docs = render()
    sm = one(docs, "ServiceMonitor")
    [service] = [d for d in docs if d["kind"] == "Service"]
    selector = sm["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [service["metadata"]["namespace"]]}
    [endpoint] = sm["spec"]["endpoints"]
    assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
    # the operator's per-pair series name the pair's namespace themselves: not overwritten by the target's
    assert endpoint["honorLabels"] is True
    # the Service points at the operator container's port of that name
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    target = [p["targetPort"] for p in service["spec"]["ports"] if p["name"] == endpoint["port"]][0]
    assert target in [p["name"] for p in container["ports"]]


def test_dashboard_configmap_carries_the_dashboard_file():
    cm = one(render("monitoring.dashboard.namespace=grafana", "monitoring.dashboard.annotations.grafana_folder=pdpair"),
             "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "grafana"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "pdpair"}
    assert json.loads(cm["data"]["pdpair.json"]) == json.loads(DASHBOARD.read_text())


def test_dashboard_json_is_a_grafana_dashboard():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "pdpair"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["description"], panel["title"]


@pytest.mark.parametrize(
    "sets, expected",
    [
        (["monitoring.podMonitor.scrapeTimeout=20s"], "must not exceed monitoring.podMonitor.interval"),
        (["monitoring.serviceMonitor.interval=5s"], "must not exceed monitoring.serviceMonitor.interval"),
        (["monitoring.podMonitor.interval=15"], "monitoring/podMonitor/interval"),
        (["monitoring.podMonitor.interval=1m30s"], "monitoring/podMonitor/interval"),
        (["monitoring.prometheusRule.alerts.signalDeficit.for=soon"], "signalDeficit/for"),
        (["monitoring.prometheusRule.alerts.notReady.severity=page"], "notReady/severity"),
        (["monitoring.prometheusRule.alerts.portPoolLow.freeRatio=2"], "portPoolLow/freeRatio"),
        (["monitoring.prometheusRule.alerts.restartLoop.restarts=0"], "restartLoop/restarts"),
        (["monitoring.prometheusRule.alerts.nodeLost.window=15"], "nodeLost/window"),
        (["monitoring.prometheusRule.additionalLabels.severity=page"], "additionalLabels"),
        (["monitoring.prometheusRule.alerts.bogus.enabled=true"], "bogus"),
        (["monitoring.podmonitor.enabled=true"], "podmonitor"),
        (["operator.service.enabled=false"], "needs operator.enabled and operator.service.enabled"),
        (["monitoring.dashboard.namespace=Bad_NS"], "dashboard/namespace"),
    ],
)
def test_bad_values_are_refused(sets, expected):
    error = render_error(*sets)
    assert expected in error, error


def test_the_restart_panel_names_every_restart_reason():
    """The reason label's words live in health.RESTART_REASONS; the dashboard's restart panel lists them for the
    reader (it once missed port_in_use)."""
    from pdpair.operator.decide.health import RESTART_REASONS

    panels = json.loads(DASHBOARD.read_text())["panels"]
    [restarts] = [p for p in panels if "pdpair_operator_pair_restarts_total" in json.dumps(p.get("targets", []))
                  and "why" in p.get("description", "")]
    named = set(restarts["description"].split("(", 1)[1].rstrip(").").split(", "))
    assert named == set(RESTART_REASONS)
