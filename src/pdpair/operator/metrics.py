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

from pdpair import contract
from pdpair.httpserver import StoppableServer
from pdpair.operator.health import RESTART_REASONS  # the `reason` label values

__all__ = ["OperatorMetrics", "OperatorMetricsServer", "serve", "RESTART_REASONS"]



class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
        made = {
            m.name: kinds[m.kind](m.base_name, m.help, labelnames=m.labels, registry=self.registry)
            for m in contract.OPERATOR_METRICS
        }
        self._pairs = made[contract.OPERATOR_PAIRS.name]
        self._pair_phase = made[contract.OPERATOR_PAIR_PHASE.name]
        self._restarts = made[contract.OPERATOR_PAIR_RESTARTS.name]
        self._replacements = made[contract.OPERATOR_INSTANCE_REPLACEMENTS.name]
        self._replaced: dict[tuple[str, str], set[tuple[str, str]]] = {}  # (ns, pair) -> {(role, reason)} counted
        self._hangs = made[contract.OPERATOR_HANG_DETECTIONS.name]
        self._pool_free = made[contract.OPERATOR_PORT_POOL_FREE.name]
        self._pool_size = made[contract.OPERATOR_PORT_POOL_SIZE.name]
        self._reconcile = made[contract.OPERATOR_RECONCILE_SECONDS.name]
        self._lock = threading.Lock()
        self._phases: dict[tuple[str, str], str] = {}
        for phase in contract.PHASES:
            self._pairs.labels(phase=phase).set(0)

    def set_pair_phase(self, namespace: str, pair: str, phase: str) -> None:
        if phase not in contract.PHASES:
            raise ValueError(f"phase must be one of {contract.PHASES}, got {phase!r}")
        _check_name("namespace", namespace)
        _check_name("pair", pair)
        with self._lock:
            previous = self._phases.get((namespace, pair))
            if previous == phase:
                return  # called after every reconcile pass: at 1000 pairs, a full recount each time cost seconds of CPU
            if previous is None:
                for reason in RESTART_REASONS:
                    self._restarts.labels(namespace=namespace, pair=pair, reason=reason)
            self._phases[(namespace, pair)] = phase
            for p in contract.PHASES:
                self._pair_phase.labels(namespace=namespace, pair=pair, phase=p).set(1 if p == phase else 0)
            self._recount()

    def forget_pair(self, namespace: str, pair: str) -> None:
        with self._lock:
            if self._phases.pop((namespace, pair), None) is None:
                return
            for p in contract.PHASES:
                self._pair_phase.remove(namespace, pair, p)
            for reason in RESTART_REASONS:
                with contextlib.suppress(KeyError):
                    self._restarts.remove(namespace, pair, reason)
            for role, reason in self._replaced.pop((namespace, pair), set()):
                with contextlib.suppress(KeyError):
                    self._replacements.remove(namespace, pair, role, reason)
            self._recount()

    def pair_restarted(self, namespace: str, pair: str, reason: str) -> None:
        if reason not in RESTART_REASONS:
            raise ValueError(f"reason must be one of {RESTART_REASONS}, got {reason!r}")
        _check_name("namespace", namespace)
        _check_name("pair", pair)
        self._restarts.labels(namespace=namespace, pair=pair, reason=reason).inc()

    def instance_replaced(self, namespace: str, pair: str, role: str, reason: str) -> None:
        """One engine instance of an xPyD pair replaced alone (operator/instances.heal)."""
        if reason not in RESTART_REASONS:
            raise ValueError(f"reason must be one of {RESTART_REASONS}, got {reason!r}")
        if role not in (contract.ROLE_PREFILL, contract.ROLE_DECODE):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        _check_name("namespace", namespace)
        _check_name("pair", pair)
        with self._lock:
            self._replaced.setdefault((namespace, pair), set()).add((role, reason))
        self._replacements.labels(namespace=namespace, pair=pair, role=role, reason=reason).inc()

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

    def _recount(self) -> None:
        counts = {p: 0 for p in contract.PHASES}
        for phase in self._phases.values():
            counts[phase] += 1
        for phase, n in counts.items():
            self._pairs.labels(phase=phase).set(n)


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
