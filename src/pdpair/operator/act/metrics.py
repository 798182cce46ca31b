"""Operator metrics (names, types, labels from `pdpair.contract.OPERATOR_METRICS`) and their HTTP server.

    metrics = OperatorMetrics()                      # private registry unless one is given
    server = serve(port, metrics)                    # prometheus-client's server, daemon thread; server.stop()
    metrics.set_pair_phase("ns", "pair-a", "Ready")  # also maintains pdpair_operator_pairs{phase}
    metrics.pair_restarted("ns", "pair-a", "hung")
    metrics.hang_detected()
    metrics.set_port_pool(free=90, size=100)
    with metrics.time_reconcile():
        ...
    metrics.forget_pair("ns", "pair-a")              # on deletion: its series disappear

`pdpair_operator_pair_phase{namespace,pair,phase}` is 1 for the pair's phase and 0 for the others, so alert rules
can name the pair; `pdpair_operator_pairs{phase}` is derived from the same per-pair table, so the two never disagree.
Restart counters of a pair are created at 0 for every reason in `RESTART_REASONS` when the pair is first seen, so
`increase()` in the alert rules sees the first restart too.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdpair import contract
from pdpair.httpserver import StoppableServer
from pdpair.operator.decide.health import RESTART_REASONS  # the `reason` label values

__all__ = ["OperatorMetrics", "OperatorMetricsServer", "serve", "RESTART_REASONS"]



class _PairRecord:
    """One pair's per-pair series: its phase, when it was first seen (the counters' `_created`), and the counts that are
    not zero."""

    __slots__ = ("phase", "first_seen", "restarts", "replacements")

    def __init__(self, phase: str, first_seen: float) -> None:
        self.phase = phase
        self.first_seen = first_seen
        self.restarts: dict[str, float] | None = None
        self.replacements: dict[tuple[str, str], tuple[float, float]] | None = None  # (role, reason) -> (n, created)


class PairSeries:
    """The per-pair families (and `pdpair_operator_pairs`, counted from them), as a custom collector over one dict.

    prometheus-client's labelled children cost ~700 bytes each, and every pair has 15 (a phase series per phase and a
    restart counter per reason, created at 0 so `increase()` in the alert rules sees the first restart): 10 MiB at
    1000 pairs (tracemalloc, docs/benchmarks.md). Here a pair is one small record, and the samples are built when
    scraped. The exposition is the same: every phase series, a zero counter per restart reason from the first
    sighting, a replacement counter once that instance was first replaced."""

    FAMILIES = frozenset(m.name for m in (contract.OPERATOR_PAIRS, contract.OPERATOR_PAIR_PHASE,
                                          contract.OPERATOR_PAIR_RESTARTS, contract.OPERATOR_INSTANCE_REPLACEMENTS))

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()  # the scrape runs in the HTTP server's thread
        self._records: dict[tuple[str, str], _PairRecord] = {}

    def set_phase(self, namespace: str, pair: str, phase: str) -> None:
        with self._lock:
            record = self._records.get((namespace, pair))
            if record is None:
                self._records[(namespace, pair)] = _PairRecord(phase, self._clock())
            else:
                record.phase = phase

    def forget(self, namespace: str, pair: str) -> None:
        with self._lock:
            self._records.pop((namespace, pair), None)

    def restarted(self, namespace: str, pair: str, reason: str) -> None:
        with self._lock:
            record = self._record(namespace, pair)
            record.restarts = record.restarts or {}
            record.restarts[reason] = record.restarts.get(reason, 0.0) + 1

    def replaced(self, namespace: str, pair: str, role: str, reason: str) -> None:
        with self._lock:
            record = self._record(namespace, pair)
            record.replacements = record.replacements or {}
            n, created = record.replacements.get((role, reason), (0.0, self._clock()))
            record.replacements[(role, reason)] = (n + 1, created)

    def _record(self, namespace: str, pair: str) -> _PairRecord:
        """The pair's record (under the lock); a pair not seen yet is first seen now, in phase Pending."""
        record = self._records.get((namespace, pair))
        if record is None:
            record = self._records[(namespace, pair)] = _PairRecord(contract.PHASE_PENDING, self._clock())
        return record

    def describe(self) -> list[Metric]:
        """The four families, without samples: the registry refuses another collector of these names."""
        return [GaugeMetricFamily(contract.OPERATOR_PAIRS.name, contract.OPERATOR_PAIRS.help),
                GaugeMetricFamily(contract.OPERATOR_PAIR_PHASE.name, contract.OPERATOR_PAIR_PHASE.help),
                CounterMetricFamily(contract.OPERATOR_PAIR_RESTARTS.base_name, contract.OPERATOR_PAIR_RESTARTS.help),
                CounterMetricFamily(contract.OPERATOR_INSTANCE_REPLACEMENTS.base_name,
                                    contract.OPERATOR_INSTANCE_REPLACEMENTS.help)]

    def collect(self) -> Iterator[Metric]:
        with self._lock:  # copy out under the lock, build the samples outside it
            rows = [(ns, pair, r.phase, r.first_seen, dict(r.restarts or {}), dict(r.replacements or {}))
                    for (ns, pair), r in self._records.items()]
        by_phase = GaugeMetricFamily(contract.OPERATOR_PAIRS.name, contract.OPERATOR_PAIRS.help,
                                     labels=contract.OPERATOR_PAIRS.labels)
        counts = dict.fromkeys(contract.PHASES, 0)
        phase = GaugeMetricFamily(contract.OPERATOR_PAIR_PHASE.name, contract.OPERATOR_PAIR_PHASE.help,
                                  labels=contract.OPERATOR_PAIR_PHASE.labels)
        restarts = CounterMetricFamily(contract.OPERATOR_PAIR_RESTARTS.base_name, contract.OPERATOR_PAIR_RESTARTS.help,
                                       labels=contract.OPERATOR_PAIR_RESTARTS.labels)
        replacements = CounterMetricFamily(contract.OPERATOR_INSTANCE_REPLACEMENTS.base_name,
                                           contract.OPERATOR_INSTANCE_REPLACEMENTS.help,
                                           labels=contract.OPERATOR_INSTANCE_REPLACEMENTS.labels)
        for ns, pair, current, first_seen, restarted, replaced in rows:
            counts[current] += 1
            for p in contract.PHASES:
                phase.add_metric((ns, pair, p), 1.0 if p == current else 0.0)
            for reason in RESTART_REASONS:
                restarts.add_metric((ns, pair, reason), restarted.get(reason, 0.0), created=first_seen)
            for (role, reason), (n, created) in sorted(replaced.items()):
                replacements.add_metric((ns, pair, role, reason), n, created=created)
        for p, n in counts.items():
            by_phase.add_metric((p,), float(n))
        yield from (by_phase, phase, restarts, replacements)


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
        made = {
            m.name: kinds[m.kind](m.base_name, m.help, labelnames=m.labels, registry=self.registry)
            for m in contract.OPERATOR_METRICS if m.name not in PairSeries.FAMILIES
        }
        self._pairs = PairSeries()
        self.registry.register(self._pairs)
        self._hangs = made[contract.OPERATOR_HANG_DETECTIONS.name]
        self._pool_free = made[contract.OPERATOR_PORT_POOL_FREE.name]
        self._pool_size = made[contract.OPERATOR_PORT_POOL_SIZE.name]
        self._reconcile = made[contract.OPERATOR_RECONCILE_SECONDS.name]

    def set_pair_phase(self, namespace: str, pair: str, phase: str) -> None:
        if phase not in contract.PHASES:
            raise ValueError(f"phase must be one of {contract.PHASES}, got {phase!r}")
        _check_name("namespace", namespace)
        _check_name("pair", pair)
        self._pairs.set_phase(namespace, pair, phase)

    def forget_pair(self, namespace: str, pair: str) -> None:
        self._pairs.forget(namespace, pair)

    def pair_restarted(self, namespace: str, pair: str, reason: str) -> None:
        if reason not in RESTART_REASONS:
            raise ValueError(f"reason must be one of {RESTART_REASONS}, got {reason!r}")
        _check_name("namespace", namespace)
        _check_name("pair", pair)
        self._pairs.restarted(namespace, pair, reason)

    def instance_replaced(self, namespace: str, pair: str, role: str, reason: str) -> None:
        """One engine instance of an xPyD pair replaced alone (operator/instances.heal)."""
        if reason not in RESTART_REASONS:
            raise ValueError(f"reason must be one of {RESTART_REASONS}, got {reason!r}")
        if role not in (contract.ROLE_PREFILL, contract.ROLE_DECODE):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        _check_name("namespace", namespace)
        _check_name("pair", pair)
        self._pairs.replaced(namespace, pair, role, reason)

    def hang_detected(self) -> None:
        self._hangs.inc()

    def set_port_pool(self, free: int, size: int) -> None:
        if isinstance(free, bool) or isinstance(size, bool) or not (0 <= free <= size):
            raise ValueError(f"need 0 <= free <= size, got free={free!r} size={size!r}")
        self._pool_free.set(free)
        self._pool_size.set(size)

    def read_port_pool(self, free: Callable[[], int], size: int) -> None:
        """The free-port gauge is computed when scraped, from `free()` (the leaser's count), not after every
        reconcile pass: at 1000 pairs that set intersection after each pass took 4.3% of the event loop (py-spy).
        `free()` runs in the scrape's thread; a count outside 0..size is clamped."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"need size >= 0, got {size!r}")
        self._pool_size.set(size)
        self._pool_free.set_function(lambda: min(size, max(0, free())))

    def observe_reconcile(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        self._reconcile.observe(seconds)

    @contextlib.contextmanager
    def time_reconcile(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self._reconcile.observe(time.perf_counter() - started)


def _check_name(what: str, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")


class OperatorMetricsServer(StoppableServer):
    """prometheus-client's own HTTP server and its thread; `stop()` frees the port and joins the thread."""


def serve(port: int, metrics: OperatorMetrics, addr: str = "0.0.0.0") -> OperatorMetricsServer:
    """prometheus-client's HTTP server for `metrics` on `port` (0 = a free one, see `.port`)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    httpd, thread = start_http_server(port, addr=addr, registry=metrics.registry)
    return OperatorMetricsServer(httpd, thread)
