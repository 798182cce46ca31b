"""The chart's prometheus-adapter rules (`autoscaling.prometheusAdapterRules`, templates/autoscaling/): rendered into a
ConfigMap, each rule a Pods metric keyed by the series' namespace/pod labels, every metricsQuery valid PromQL once
the adapter fills its template fields, every pdpair series a series of pdpair.contract, and the PodMonitor's
engineMetrics endpoint that the vllm:* rules need. No cluster; tests/e2e_realnode/test_realnode_custom_metrics.py
serves these rules through the aggregation layer, and its first test feeds them to the adapter's own loader."""
from __future__ import annotations

import re

import promql_parser
import pytest
import yaml

from pdpair import contract
from tests.monitoring_support import CHART, helm, one, render, render_error
from tests.unit.test_contract_drift import problems_in

ON = "autoscaling.prometheusAdapterRules.enabled=true"
VLLM_GAUGES = {"vllm:num_requests_waiting": "sum", "vllm:num_requests_running": "sum",
               "vllm:kv_cache_usage_perc": "max"}
PDPAIR_GAUGES = {m.name: "sum"
                 for m in (contract.TRANSPORT_INFLIGHT, contract.TRANSPORT_SLOTS, contract.SIGNAL_DEFICIT)}
PDPAIR_COUNTERS = {m.name for m in (contract.KV_TRANSFERS, contract.KV_TRANSFER_BYTES, contract.TRANSPORT_REQUEUES)}


def adapter_configmap(*sets: str) -> dict:
    docs = render(ON, *sets, monitoring_on=False)
    return one(docs, "ConfigMap")


def rules(*sets: str) -> list[dict]:
    return yaml.safe_load(adapter_configmap(*sets)["data"]["config.yaml"])["rules"]


def series_of(rule: dict) -> str:
    return promql_parser.parse(rule["seriesQuery"]).name


def filled(metrics_query: str, series: str) -> str:
    """The adapter's template fields filled as it fills them for `pods/*` in one namespace (docs/config.md)."""
    return (metrics_query.replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", 'namespace="ns",pod=~"a|b"')
            .replace("<<.GroupBy>>", "pod"))


def adapter_name(rule: dict, series: str) -> str:
    """The metric name the adapter serves: name.matches applied to the series, replaced by name.as (Go's
    regexp.ReplaceAllString, whose ${1} is Python's \\g<1>)."""
    return re.sub(rule["name"]["matches"], re.sub(r"\$\{(\d+)\}", r"\\g<\1>", rule["name"]["as"]), series)


def test_off_by_default():
    assert not [d for d in render(monitoring_on=False) if d["kind"] == "ConfigMap"]


def test_rendered_configmap_name_namespace_and_labels():
    cm = adapter_configmap()
    assert cm["metadata"]["name"] == "rel-pdpair-prometheus-adapter"
    assert cm["metadata"]["namespace"] == "pdpair-system"
    assert cm["metadata"]["labels"]["app.kubernetes.io/component"] == "autoscaling"
    assert adapter_configmap("autoscaling.prometheusAdapterRules.namespace=monitoring")["metadata"]["namespace"] == \
        "monitoring"


def test_every_rule_is_a_pods_metric_keyed_by_namespace_and_pod():
    for rule in rules():
        assert rule["resources"] == {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}}
        selector = promql_parser.parse(rule["seriesQuery"])
        matchers = sorted((m.name, m.op == promql_parser.MatchOp.NotEqual, m.value) for m in selector.matchers.matchers)
        assert matchers == [("namespace", True, ""), ("pod", True, "")], rule


def test_the_served_names_and_their_queries():
    served = {}
    for rule in rules():
        series = series_of(rule)
        expr = promql_parser.parse(filled(rule["metricsQuery"], series))
        assert isinstance(expr, promql_parser.AggregateExpr) and list(expr.modifier.labels) == ["pod"], rule
        is_rate = "rate(" in rule["metricsQuery"]
        served[adapter_name(rule, series)] = (series, str(expr.op).lower().rsplit(".", 1)[-1], is_rate)
    expected = {**{name: (name, agg, False) for name, agg in {**VLLM_GAUGES, **PDPAIR_GAUGES}.items()},
                **{name.removesuffix("_total") + "_per_second": (name, "sum", True) for name in PDPAIR_COUNTERS}}
    assert served == expected


def test_pdpair_series_and_labels_are_the_contracts():
    for rule in rules():
        series = series_of(rule)
        if series.startswith("vllm:"):
            continue
        assert problems_in(filled(rule["metricsQuery"], series)) == [], rule
        metric = next(m for m in contract.POD_METRICS if series in m.series_names)
        assert metric.kind == ("counter" if series in PDPAIR_COUNTERS else "gauge")


def test_the_per_edge_transfer_metrics_are_all_served():
    """Every pod metric with a `peer` label (one series per prefill -> decode edge) has a rule, except the pairing
    state and the signal counters, which the alerts cover."""
    served = {series_of(r) for r in rules()}
    per_edge = {s for m in contract.POD_METRICS if "peer" in m.labels for s in m.series_names
                if not s.endswith("_created")}
    assert per_edge - served == {contract.PEER_PAIRED.name, contract.SIGNALS_EXPECTED.name,
                                 contract.SIGNALS_RECEIVED.name}


def test_rate_window_and_extra_rules():
    extra = ('autoscaling.prometheusAdapterRules.extraRules[0].seriesQuery=my_metric{pod!=""}',
             "autoscaling.prometheusAdapterRules.extraRules[0].metricsQuery=sum(<<.Series>>) by (<<.GroupBy>>)")
    got = rules("autoscaling.prometheusAdapterRules.rateWindow=5m", *extra)
    assert got[-1]["seriesQuery"] == 'my_metric{pod!=""}'
    counter_rules = [r for r in got if "rate(" in r["metricsQuery"]]
    assert counter_rules and all("[5m]" in r["metricsQuery"] for r in counter_rules)


@pytest.mark.parametrize("sets, expected", [
    (("autoscaling.prometheusAdapterRules.rateWindow=2 minutes",), "rateWindow"),
    (("autoscaling.prometheusAdapterRules.namespace=Not_A_Namespace",), "namespace"),
    (("autoscaling.prometheusAdapterRules.unknown=1",), "unknown"),
])
def test_bad_values_are_refused(sets, expected):
    assert expected in render_error(ON, *sets)


def test_engine_metrics_add_the_http_endpoint_with_the_same_relabelings():
    off = one(render(), "PodMonitor")["spec"]["podMetricsEndpoints"]
    on = one(render("monitoring.podMonitor.engineMetrics=true"), "PodMonitor")["spec"]["podMetricsEndpoints"]
    assert [e["port"] for e in off] == [contract.METRICS_PORT_NAME]
    assert [e["port"] for e in on] == [contract.METRICS_PORT_NAME, contract.HTTP_PORT_NAME]
    assert on[1]["relabelings"] == on[0]["relabelings"] == off[0]["relabelings"]
    assert on[1]["path"] == "/metrics"


def test_lints_strictly_with_the_rules_and_engine_metrics():
    proc = helm("lint", "--strict", str(CHART), "--set", ON, "--set", "monitoring.podMonitor.enabled=true",
                "--set", "monitoring.podMonitor.engineMetrics=true")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_harness_prometheus_scrapes_the_engine_endpoint_as_a_job_of_its_own():
    """devcluster/incluster_prometheus.py (the e2e's Prometheus) translates the second endpoint like the first."""
    from devcluster.incluster_prometheus import podmonitor_scrape_configs, render_chart_monitoring

    podmonitor, _ = render_chart_monitoring("monitoring.podMonitor.engineMetrics=true")
    keeps = [[r["regex"] for r in job["relabel_configs"]
              if r.get("source_labels") == ["__meta_kubernetes_pod_container_port_name"]]
             for job in podmonitor_scrape_configs(podmonitor)]
    assert keeps == [[contract.METRICS_PORT_NAME], [contract.HTTP_PORT_NAME]]
