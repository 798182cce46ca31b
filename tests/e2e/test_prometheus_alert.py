"""A real Prometheus (Debian's binary) scrapes a real process whose deficit comes from the native transport's
test-only signal drop, evaluates the alert rule rendered from the chart, and fires PdPairSignalDeficit in time.

Timeline: the stuck transfer opens at t_open (SIGUSR1 to the demo); the pod is hung from t_hung = t_open + hang
timeout. Prometheus sees it at its next scrape, the rule goes pending at the next evaluation (activeAt), and fires
at the first evaluation at least `for` later. Bounds asserted:
  - never firing before t_hung + for (the rule must not fire early);
  - firing seen within for + 2 evaluation intervals of activeAt (the issue's bound);
  - the exporter shows the deficit after t_hung, within EXPORTER_LAG_BOUND of it;
  - firing seen within scrape interval + for + 2 evaluation intervals of the exporter showing it (plus a margin
    for a starved Prometheus).
Run with -s to see the measured latencies.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from pdpair import contract
from devcluster.ports import free_port
from tests.monitoring_support import require_binary, write_rules

pytestmark = pytest.mark.prometheus

HANG_TIMEOUT = 2.0
FOR_SECONDS = 5
EVAL_SECONDS = 1
SCRAPE_SECONDS = 1
POLL_SECONDS = 0.1
# What a busy 2-core box adds, measured beside the engine tier in CI: 2026-12-06 (load 7.7, the CPU stalled 98 % of
# the test's wall time) Prometheus marked the rule pending 10.1 s after the hang, where 2 s is usual alone.
EXPORTER_LAG_BOUND = 12.0  # the demo's own verdict (its wait's deadline, then /metrics), after t_hung
PROMETHEUS_LAG_MARGIN = 5.0  # a scrape and an evaluation that a starved Prometheus runs late
POD_LABELS = {"namespace": "e2e", "pair": "demo", "pod": "demo-decode"}  # what the PodMonitor would add


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.loads(resp.read())
    assert body.get("status") == "success", body
    return body["data"]


class Prometheus:
    def __init__(self, workdir: Path, target_port: int):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {
                "scrape_interval": f"{SCRAPE_SECONDS}s",
                "scrape_timeout": f"{SCRAPE_SECONDS}s",
                "evaluation_interval": f"{EVAL_SECONDS}s",
            },
            "rule_files": ["rules.yaml"],
            "scrape_configs": [
                {
                    "job_name": "pdpair-pods",
                    "metrics_path": contract.METRICS_PATH,
                    "static_configs": [{"targets": [f"127.0.0.1:{target_port}"], "labels": POD_LABELS}],
                }
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [
                require_binary("prometheus"),
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
        )
        self.workdir = workdir

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready within {timeout}s:\n{self.log_tail()}")

    def query(self, promql: str) -> list:
        return get_json(f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))["result"]

    def alerts(self, name: str) -> list[dict]:
        return [a for a in get_json(f"{self.base}/api/v1/alerts")["alerts"] if a["labels"].get("alertname") == name]

    def rule_evaluations(self) -> list[str]:
        groups = get_json(f"{self.base}/api/v1/rules")["groups"]
        return [g.get("lastEvaluation", "") for g in groups]

    def group_evaluation(self, rule: str) -> str:
        """The lastEvaluation of the rule group holding `rule` ("" before one)."""
        groups = get_json(f"{self.base}/api/v1/rules")["groups"]
        return next((g.get("lastEvaluation", "") for g in groups
                     if any(r.get("name") == rule for r in g.get("rules", []))), "")

    def log_tail(self) -> str:
        self.log.flush()
        return (self.workdir / "prometheus.log").read_text()[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def demo():
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.metrics_demo", "--source", "native", "--deficit", "3",
         "--expected", "8", "--hang-timeout", str(HANG_TIMEOUT), "--ok-every", "0.5", "--deficit-on-sigusr1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line, f"metrics_demo printed nothing (exit {proc.poll()})"
        yield proc, json.loads(line)["port"]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def prometheus_for(tmp_path):
    started: list[Prometheus] = []

    def start(target_port: int) -> Prometheus:
        write_rules(
            tmp_path,
            f"monitoring.prometheusRule.alerts.signalDeficit.for={FOR_SECONDS}s",
            f"monitoring.prometheusRule.evaluationInterval={EVAL_SECONDS}s",
        )
        prom = Prometheus(tmp_path, target_port)
        started.append(prom)
        prom.wait_ready()
        return prom

    yield start
    for prom in started:
        prom.stop()


def _wall(ts: str) -> float:
    # Prometheus writes RFC 3339 with nanoseconds; Python wants at most microseconds.
    head, _, frac = ts.rstrip("Z").partition(".")
    frac = (frac + "000000")[:6]
    return datetime.fromisoformat(f"{head}.{frac}+00:00").timestamp()


def _exported_hung(port: int) -> bool:
    """Whether the demo's own /metrics shows what the rule's expression looks for now: a deficit, and an oldest
    wait older than the hang timeout."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()

    def total(metric: contract.Metric, pick=sum) -> float:
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.split("{", 1)[0].split(" ", 1)[0] == metric.name]
        return pick(values) if values else 0.0

    return (total(contract.SIGNAL_DEFICIT) > 0
            and total(contract.SIGNAL_WAIT_OLDEST_SECONDS, max) > total(contract.HANG_TIMEOUT_SECONDS, max))


def test_signal_deficit_alert_fires_within_for_plus_two_evaluations(demo, prometheus_for):
    proc, port = demo
    prom = prometheus_for(port)

    # Healthy first: the target is scraped and the rules evaluated a few times with no alert.
    deadline = time.monotonic() + 30
    evaluations: set[str] = set()
    while time.monotonic() < deadline:
        up = prom.query('up{job="pdpair-pods"}')
        evaluations.update(e for e in prom.rule_evaluations() if e and not e.startswith("0001"))
        if up and up[0]["value"][1] == "1" and len(evaluations) >= 3:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"target never up / rules never evaluated:\n{prom.log_tail()}")
    assert prom.alerts(contract.ALERT_SIGNAL_DEFICIT) == []
    assert prom.query(f"{contract.PAIR_GENERATION.name}")[0]["value"][1] == "1"

    # Open the stuck transfer (3 of 8 signals dropped by the transport) and watch the alert.
    t_open = time.monotonic()
    wall_open = time.time()
    proc.send_signal(signal.SIGUSR1)
    t_hung = t_open + HANG_TIMEOUT
    pending_seen = firing_seen = exported_seen = None
    firing: dict = {}
    limit = t_hung + EXPORTER_LAG_BOUND + SCRAPE_SECONDS + FOR_SECONDS + 2 * EVAL_SECONDS + PROMETHEUS_LAG_MARGIN + 5
    group_evaluations: set[str] = set()  # of the alert's rule group, as seen while waiting
    while time.monotonic() < limit:
        group_evaluations.add(prom.group_evaluation(contract.ALERT_SIGNAL_DEFICIT))
        if exported_seen is None and _exported_hung(port):
            exported_seen = time.monotonic()
        alerts = prom.alerts(contract.ALERT_SIGNAL_DEFICIT)
        now = time.monotonic()
        states = {a["state"] for a in alerts}
        if "pending" in states and pending_seen is None:
            pending_seen = now
        if "firing" in states:
            firing_seen = now
            firing = next(a for a in alerts if a["state"] == "firing")
            break
        time.sleep(POLL_SECONDS)
    assert firing_seen is not None, f"{contract.ALERT_SIGNAL_DEFICIT} never fired:\n{prom.log_tail()}"
    if exported_seen is None:  # the alert fired between two polls of the exporter
        exported_seen = firing_seen

    active_at = _wall(firing["activeAt"]) - wall_open + t_open  # on the monotonic clock
    measured = {
        "open_to_firing_s": round(firing_seen - t_open, 2),
        "hung_to_exported_s": round(exported_seen - t_hung, 2),
        "exported_to_firing_s": round(firing_seen - exported_seen, 2),
        "hung_to_pending_active_at_s": round(active_at - t_hung, 2),
        "hung_to_firing_s": round(firing_seen - t_hung, 2),
        "active_at_to_firing_s": round(firing_seen - active_at, 2),
        "bound_active_at_to_firing_s": FOR_SECONDS + 2 * EVAL_SECONDS,
        "hang_timeout_s": HANG_TIMEOUT,
        "for_s": FOR_SECONDS,
        "eval_interval_s": EVAL_SECONDS,
        "scrape_interval_s": SCRAPE_SECONDS,
    }
    due = _wall(firing["activeAt"]) + FOR_SECONDS
    evaluations_after_due = sorted(e for e in group_evaluations if e and not e.startswith("0001")
                                   and _wall(e) >= due - 0.05)
    measured["evaluations_after_due"] = len(evaluations_after_due)
    print("\nPROMETHEUS_ALERT_LATENCY " + json.dumps(measured))

    assert firing_seen - t_hung >= FOR_SECONDS - 0.05, f"fired before the rule allows: {measured}"
    assert active_at >= t_hung - 0.05, f"pending before the pod was hung: {measured}"
    # The rule's latency: it fires within two evaluations once its `for` has run from activeAt. In seconds that is
    # for + 2 evaluation intervals, while Prometheus evaluates on time; on a box stalled on CPU its evaluations run
    # late (CI 2026-12-07: load 17, 21.7 s of 22.2 s stalled, firing 11.5 s after activeAt), so then the bound is
    # counted in the evaluations it ran after the alert was due (seen by polling its rule group's lastEvaluation).
    assert firing_seen - active_at <= FOR_SECONDS + 2 * EVAL_SECONDS + POLL_SECONDS + 0.3 or \
        len(evaluations_after_due) <= 2, measured
    # End to end, in two legs, each with its own bound: the exporter's verdict (the demo's wait deadline, then its
    # /metrics), then Prometheus (a scrape, an evaluation, the rule's `for`). The rule's own latency is asserted
    # strictly above on activeAt; the margins hold what a starved box adds (measured, see EXPORTER_LAG_BOUND).
    assert exported_seen >= t_hung - 0.05, f"deficit exported before the wait's deadline: {measured}"
    assert exported_seen - t_hung <= EXPORTER_LAG_BOUND, measured
    assert firing_seen - exported_seen <= (SCRAPE_SECONDS + FOR_SECONDS + 2 * EVAL_SECONDS + POLL_SECONDS
                                          + PROMETHEUS_LAG_MARGIN), measured

    assert {k: firing["labels"][k] for k in (*POD_LABELS, "role", "severity")} == {
        **POD_LABELS, "role": "decode", "severity": "critical"}
    assert float(firing["value"]) == 3.0
    assert "demo-decode" in firing["annotations"]["summary"]
    assert firing["annotations"]["runbook_url"].endswith("#pdpairsignaldeficit")
    # The series as Prometheus holds it now: the stuck transfer's 3 missing signals, plus those of an OK transfer
    # the demo has in flight at that scrape (every 0.5 s; a starved demo showed 7 = 3 + 4 of 8, CI 2026-12-07)
    deficit = prom.query(contract.SIGNAL_DEFICIT.name)
    assert len(deficit) == 1 and 3.0 <= float(deficit[0]["value"][1]) <= 3.0 + 8, deficit
    timeouts = prom.query(contract.SIGNAL_WAIT_TIMEOUTS.name)
    assert float(timeouts[0]["value"][1]) >= 1.0
