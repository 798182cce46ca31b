"""Names cannot drift: every metric the rendered rules and the dashboard use is a series of pdpair.contract, with
labels that exist, and every contract alert is in the rules. PromQL is parsed with promql-parser, not by regex."""

from __future__ import annotations

import json
import re

import promql_parser
import pytest

from pdpair import contract
from pdpair.operator.decide.health import (
    RESTART_REASONS  # the `reason` label values of pdpair_operator_pair_restarts_total,
)
from tests.monitoring_support import DASHBOARD, alert_rules, one, render, rules_from_chart

# Labels Prometheus adds to every pod series: prometheus-operator (namespace, pod, ...), the scrape (job, instance)
# and the PodMonitor's relabeling (pair, and pdpair_instance: the pod's index within its role, label pdpair.io/instance).
TARGET_LABELS = {"namespace", "pod", "container", "endpoint", "service", "job", "instance", "pair", "pdpair_instance"}
SERIES = {series: metric for metric in contract.ALL_METRICS for series in metric.series_names}
LABEL_VALUES = {"phase": set(contract.PHASES), "outcome": {contract.OUTCOME_OK, contract.OUTCOME_TIMEOUT,
                                                           contract.OUTCOME_ERROR}, "role": set(contract.ROLES),
                "reason": set(RESTART_REASONS)}
# Grafana variables, replaced by a value of the same shape before parsing.
GRAFANA_VARS = {"$__rate_interval": "5m", "$__range": "1h", "$__interval": "1m", "$namespace": ".*", "$pair": ".*"}


def problems_in(expr: str) -> list[str]:
    """What in a PromQL expression is not in the contract (empty list: all good)."""
    problems: list[str] = []
    selectors: list = []
    grouping: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            selectors.append(node)
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            grouping.update(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            matching = node.modifier.matching
            if matching is not None:
                grouping.update(matching.labels)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    if not selectors:
        problems.append(f"no metric in {expr!r}")
    known_labels = set(TARGET_LABELS) | {"le"}
    for sel in selectors:
        if sel.name is None or sel.name not in SERIES:
            problems.append(f"metric {sel.name!r} is not a series of pdpair.contract")
            continue
        metric = SERIES[sel.name]
        known_labels |= set(metric.labels)
        for m in sel.matchers.matchers:
            if m.name not in set(metric.labels) | TARGET_LABELS:
                problems.append(f"{sel.name}: label {m.name!r} is not in {metric.labels}")
            if m.name in LABEL_VALUES and m.op in (promql_parser.MatchOp.Equal, promql_parser.MatchOp.NotEqual):
                if m.value not in LABEL_VALUES[m.name]:
                    problems.append(f"{sel.name}: {m.name}={m.value!r} is not one of {sorted(LABEL_VALUES[m.name])}")
    for label in grouping - known_labels:
        problems.append(f"groups by {label!r}, which none of its metrics has")
    return problems


def grafana_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = []

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for panel in panels(dashboard["panels"]):
        exprs += [t["expr"] for t in panel.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
            assert match, f"unexpected variable query {query!r}"
            exprs.append(match.group(1))
    return exprs


def substitute(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def test_the_checker_catches_drift():
    assert problems_in('sum by (pod) (pdpair_signal_deficit{role="decode"}) > 0') == []
    assert problems_in("pdpair_signal_deficits > 0")  # misspelt metric
    assert problems_in('pdpair_signal_deficit{gpu="0"}')  # label the metric does not have
    assert problems_in('pdpair_operator_pair_phase{phase="Runing"}')  # not a phase
    assert problems_in('pdpair_kv_transfers_total{outcome!="fine"}')
    assert problems_in('pdpair_operator_pair_restarts_total{reason="node_gone"}')  # not a restart reason
    assert problems_in('pdpair_operator_pair_restarts_total{reason="node_lost"}') == []
    assert problems_in("sum by (gpu) (pdpair_signal_deficit)")  # grouping by a label nobody has
    assert problems_in("pdpair_signal_deficit > on (gpu) pdpair_hang_timeout_seconds")
    assert problems_in('{__name__="pdpair_signal_deficit"}')  # a selector without a literal name


@pytest.fixture(scope="module")
def rules() -> dict:
    return rules_from_chart()


def test_every_contract_alert_is_in_the_rules_and_nothing_else(rules):
    assert sorted(alert_rules(rules)) == sorted(contract.ALERTS)


def test_rule_expressions_use_only_contract_names(rules):
    problems = {name: problems_in(rule["expr"]) for name, rule in alert_rules(rules).items()}
    assert {k: v for k, v in problems.items() if v} == {}


def test_every_alert_is_documented(rules):
    for name, rule in alert_rules(rules).items():
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"]), name
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        assert rule["annotations"]["runbook_url"].endswith("#" + name.lower())


def test_dashboard_expressions_use_only_contract_names():
    exprs = grafana_exprs()
    assert len(exprs) >= 20
    problems = {e: problems_in(substitute(e)) for e in exprs}
    assert {k: v for k, v in problems.items() if v} == {}


def test_dashboard_covers_every_pod_signal_metric():
    """The hang-related pod metrics each appear on the dashboard."""
    text = DASHBOARD.read_text()
    for metric in (contract.SIGNAL_DEFICIT, contract.SIGNAL_WAIT_OLDEST_SECONDS, contract.HANG_TIMEOUT_SECONDS,
                   contract.SIGNAL_WAIT_TIMEOUTS, contract.KV_TRANSFERS, contract.PAIR_GENERATION):
        assert metric.name in text, metric.name


def test_pod_monitor_matches_the_contract():
    pm = one(render(), "PodMonitor")
    selector = {e["key"]: e for e in pm["spec"]["selector"]["matchExpressions"]}
    assert selector[contract.LABEL_PAIR]["operator"] == "Exists"
    assert selector[contract.LABEL_ROLE] == {"key": contract.LABEL_ROLE, "operator": "In",
                                             "values": list(contract.ROLES)}
    [endpoint] = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == contract.METRICS_PORT_NAME
    assert endpoint["path"] == contract.METRICS_PATH
    # Kubernetes service discovery turns label "pdpair.io/pair" into __meta_kubernetes_pod_label_pdpair_io_pair
    sanitized = re.sub(r"[^a-zA-Z0-9_]", "_", contract.LABEL_PAIR)
    pair, default_instance, instance = endpoint["relabelings"]
    assert pair["sourceLabels"] == [f"__meta_kubernetes_pod_label_{sanitized}"]
    assert pair["targetLabel"] == "pair" and "pair" in TARGET_LABELS
    # pdpair.io/instance becomes pdpair_instance (Prometheus keeps `instance` for the target): "0" unless the pod has
    # the label (absent means instance 0, as the operator reads it), then the label's value
    assert default_instance == {"targetLabel": "pdpair_instance", "replacement": "0", "action": "replace"}
    sanitized = re.sub(r"[^a-zA-Z0-9_]", "_", contract.LABEL_INSTANCE)
    assert instance == {"sourceLabels": [f"__meta_kubernetes_pod_label_{sanitized}"], "regex": "(.+)",
                        "targetLabel": "pdpair_instance", "action": "replace"}
    assert "pdpair_instance" in TARGET_LABELS
    assert len(contract.METRICS_PORT_NAME) <= 15  # IANA_SVC_NAME limit of a containerPort name
