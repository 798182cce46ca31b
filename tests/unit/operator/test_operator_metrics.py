"""pdpair.operator.act.metrics served by prometheus-client, read back with its parser."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdpair import contract
from pdpair.operator.decide.health import RESTART_REASONS
from pdpair.operator.act.metrics import OperatorMetrics, serve


def scrape(port: int) -> tuple[dict, dict]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    families, values = {}, {}
    for family in text_string_to_metric_families(text):
        families[family.name] = family
        for s in family.samples:
            values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return families, values


@pytest.fixture
def served():
    metrics = OperatorMetrics()
    server = serve(0, metrics, addr="127.0.0.1")
    yield metrics, server.port
    server.stop()


def test_every_operator_metric_is_exported_with_its_type_and_labels(served):
    metrics, port = served
    metrics.set_pair_phase("ns", "a", "Ready")
    metrics.pair_restarted("ns", "a", "hung")
    metrics.instance_replaced("ns", "a", "decode", "hung")
    metrics.hang_detected()
    metrics.set_port_pool(free=7, size=10)
    with metrics.time_reconcile():
        pass
    families, _ = scrape(port)
    for metric in contract.OPERATOR_METRICS:
        family = families.get(metric.base_name)
        assert family is not None, f"{metric.name} missing"
        assert family.type == metric.kind and family.documentation == metric.help
        assert family.samples, metric.name
        for s in family.samples:
            assert s.name in metric.series_names, s.name
            extra = {"le"} if s.name.endswith("_bucket") else set()
            assert set(s.labels) == set(metric.labels) | extra, (s.name, s.labels)


def test_phases_per_pair_and_by_phase_agree(served):
    metrics, port = served
    metrics.set_pair_phase("ns", "a", "DecodeStarting")
    metrics.set_pair_phase("ns", "b", "Ready")
    metrics.set_pair_phase("other", "a", "Ready")
    metrics.set_pair_phase("ns", "a", "Ready")
    metrics.set_pair_phase("ns", "b", "Failed")
    _, v = scrape(port)
    by_phase = {p: v[("pdpair_operator_pairs", (("phase", p),))] for p in contract.PHASES}
    assert by_phase == {**{p: 0.0 for p in contract.PHASES}, "Ready": 2.0, "Failed": 1.0}
    phase_of = lambda ns, pair: [  # noqa: E731
        p for p in contract.PHASES if v[("pdpair_operator_pair_phase", (("namespace", ns), ("pair", pair), ("phase", p)))] == 1
    ]
    assert phase_of("ns", "a") == ["Ready"] and phase_of("ns", "b") == ["Failed"]
    # restart counters exist at 0 from the first sighting, for every reason
    for reason in RESTART_REASONS:
        assert v[("pdpair_operator_pair_restarts_total", (("namespace", "ns"), ("pair", "b"), ("reason", reason)))] == 0

    metrics.pair_restarted("ns", "b", "stale_generation")
    metrics.instance_replaced("ns", "b", "prefill", "pod_failed")
    _, v = scrape(port)
    assert v[("pdpair_operator_instance_replacements_total", (("namespace", "ns"), ("pair", "b"), ("reason", "pod_failed"),
                                                              ("role", "prefill")))] == 1
    metrics.forget_pair("ns", "b")
    metrics.forget_pair("ns", "never-seen")
    _, v = scrape(port)
    assert v[("pdpair_operator_pairs", (("phase", "Failed"),))] == 0
    assert not [k for k in v if ("pair", "b") in k[1]]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: m.set_pair_phase("ns", "a", "Running"), "phase"),
        (lambda m: m.set_pair_phase("", "a", "Ready"), "namespace"),
        (lambda m: m.pair_restarted("ns", "a", "bored"), "reason"),
        (lambda m: m.instance_replaced("ns", "a", "decode", "bored"), "reason"),
        (lambda m: m.instance_replaced("ns", "a", "router", "hung"), "role"),
        (lambda m: m.set_port_pool(free=11, size=10), "free <= size"),
        (lambda m: m.observe_reconcile(-1), "seconds"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call(OperatorMetrics())


def test_serve_three_times_on_one_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for n in range(3):
        metrics = OperatorMetrics()
        metrics.set_port_pool(free=n, size=10)
        server = serve(port, metrics, addr="127.0.0.1")
        _, v = scrape(port)
        assert v[("pdpair_operator_port_pool_free", ())] == n
        server.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_per_pair_series_cost_a_small_record_per_pair():
    """1000 pairs' 15 series each (a phase series per phase, a zero restart counter per reason) held as one record per
    pair, built when scraped: prometheus-client's labelled children took 8.9 MiB for these (~700 bytes a child), this
    0.23 MiB (measured); the bound leaves 6x that. Well under a second."""
    import gc
    import tracemalloc

    metrics = OperatorMetrics()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(1000):
            metrics.set_pair_phase("bench-ns", f"pair-{i:04d}", "Pending")
            metrics.set_pair_phase("bench-ns", f"pair-{i:04d}", "Ready")
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 1.5 * 2**20, held
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    assert text.count('pdpair_operator_pair_phase{namespace="bench-ns"') == 1000 * len(contract.PHASES)
    assert text.count('pdpair_operator_pair_restarts_total{namespace="bench-ns"') == 1000 * len(RESTART_REASONS)
    assert 'pdpair_operator_pairs{phase="Ready"} 1000.0' in text


def test_a_second_collector_of_the_per_pair_names_is_refused():
    from prometheus_client import CollectorRegistry, Gauge

    registry = CollectorRegistry()
    OperatorMetrics(registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Gauge(contract.OPERATOR_PAIR_PHASE.name, "again", labelnames=("namespace",), registry=registry)
