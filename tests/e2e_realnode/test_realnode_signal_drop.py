"""Signal drop on real nodes: a pair of real vLLM engines whose prefill drops KV signals hangs,
PdPairSignalDeficit fires in a Prometheus running in the cluster, the operator restarts the pair in order, and the
pair serves again with the same greedy outputs.

- The pair: the package's shared serving pair (serving_pair.py), Ready at whatever generation the scenarios before
  left it (generation N below); the restart makes it N + 1. Cost: one ordered restart (2 vLLM cold starts).
- The knob: prefill's template env sets TEST_ONLY_PDPAIR_DROP_SIGNALS_FILE (contract.ENV_TEST_DROP_SIGNALS_FILE) to a
  path in the container's /tmp; `kubectl exec` creates the file, so from the next request on prefill's native sender
  drops every signal. The recreated prefill pod has a fresh container filesystem, so the knob is gone after the
  restart (checked, not assumed). The pair's hang timeout is pair_manifest's 30 s.
- The Prometheus: devcluster/incluster_prometheus.py, configured from `helm template` of the chart (the PodMonitor
  translated the way prometheus-operator would, the PrometheusRule's groups as its rules file). prometheus-operator
  itself is not run. For a test, the chart values are tuned: scrape every 1 s, evaluate every 1 s, the alert's
  `for` 0 s, so it fires between the hang (oldest wait > the pod's hang timeout) and the operator's restart (same
  condition, seen by the operator's health check every 10 s, then prefill's and decode's termination). The alert is
  asserted after the fact from the TSDB (ALERTS{alertstate="firing"}), which does not depend on polling luck.
- The order: pod and pair watches record, with resourceVersions, prefill deleted, decode deleted, decode created,
  decode's listener up (the pair's DecodeListening condition True for the new generation; the operator writes it
  before it creates prefill), prefill created. Pods and the pair live in one etcd, whose revision is every object's
  resourceVersion, so the two watches' events are ordered by it.
- Hang-to-recovery numbers (knob + request -> alert, -> the operator's first deletion, -> prefill recreated, -> Ready,
  -> first token) are printed; docs/benchmarks.md records them.
- Then the chart's dashboard (charts/pdpair/dashboards/pdpair.json) against the same Prometheus, which also scrapes
  the operator through the chart's ServiceMonitor: every panel's query, Grafana's variables filled for the serving
  pair, must return data over the module's time range (the signal drop, the hang, the restart, the traffic before
  and after) and no error; DASHBOARD_EXEMPT lists the panels that cannot fill here, each with its reason.
"""
from __future__ import annotations

import json
import sys
import threading
import time

import pytest

from pdpair.contract import ALERT_SIGNAL_DEFICIT, GROUP, PLURAL, VERSION
from devcluster.incluster_prometheus import InClusterPrometheus, prometheus_image
from devcluster.product import (
    _COMPLETION_SNIPPET, CHART, ENGINE_START_TIMEOUT, PROMPTS, RELEASE, SERVED_NAME, completion, unique,
)
from devcluster.waiting import wait_for
from devcluster.realnode_watch import Recorder, listening_since, pod_steps
from tests.e2e_realnode.serving_pair import DROP_SIGNALS_KNOB

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(2400)]

# The chart's monitoring values for a test: fast scrapes and evaluations, the alert without a `for` delay.
PROMETHEUS_SETS = ("monitoring.podMonitor.interval=1s", "monitoring.podMonitor.scrapeTimeout=1s",
                   "monitoring.serviceMonitor.interval=1s", "monitoring.serviceMonitor.scrapeTimeout=1s",
                   "monitoring.prometheusRule.evaluationInterval=1s",
                   "monitoring.prometheusRule.alerts.signalDeficit.for=0s")


@pytest.fixture(scope="module")
def prometheus(real_cluster, images):
    image = prometheus_image()
    real_cluster.import_image(image.archive, nodes=["n1"])
    namespace = unique("rn-prom")
    real_cluster.create_namespace(namespace)
    prom = InClusterPrometheus(real_cluster, namespace, image.ref, images["operator"].ref, PROMETHEUS_SETS, node="n1",
                               operator_release=RELEASE)
    t0 = time.monotonic()
    prom.deploy()
    prom.deployed_at = time.time()  # the dashboard test's time range starts here
    print(f"[realnode-e2e] in-cluster Prometheus Ready in {time.monotonic() - t0:.1f}s")
    yield prom
    prom.delete()
    real_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_signal_drop_fires_the_alert_and_the_operator_restarts_the_pair_in_order(
        real_cluster, baseline_outputs, serving_pair, prometheus):
    from kubernetes import client

    api = real_cluster.api_client()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    PAIR, namespace = serving_pair.name, serving_pair.namespace
    before = serving_pair.ready()
    g1, restarts_before = int(before["pairGeneration"]), int(before.get("restarts") or 0)
    hang_timeout = serving_pair.get()["spec"]["connector"]["hangTimeoutSeconds"]

    def pair() -> dict:
        return serving_pair.get() or {}

    def diagnose() -> str:
        return f"{serving_pair.diagnose()}\n--- prometheus:\n{prometheus.logs()}"

    def ready(generation: int):
        return lambda: (lambda s: s.get("phase") == "Ready" and s.get("pairGeneration") == generation)(
            pair().get("status") or {})

    ip, port = serving_pair.service()
    outputs = {p: completion(real_cluster, "n1", ip, port, p) for p in PROMPTS}
    expected = {p: baseline_outputs[p] for p in PROMPTS}
    assert outputs == expected, f"pair outputs differ from the single engine before the fault:\n{outputs}\n{expected}"

    prefill_g1, decode_g1 = f"{PAIR}-prefill-g{g1}", f"{PAIR}-decode-g{g1}"
    prefill_g2, decode_g2 = f"{PAIR}-prefill-g{g1 + 1}", f"{PAIR}-decode-g{g1 + 1}"
    # Prometheus scrapes both engines through the translated PodMonitor, with the labels the rules group by.
    up_query = f'up{{namespace="{namespace}",pair="{PAIR}"}}'
    wait_for(lambda: sorted(r["metric"]["pod"] for r in prometheus.query(up_query) if r["value"][1] == "1")
             == [decode_g1, prefill_g1], 120, "Prometheus scraping prefill and decode (up == 1)",
             diagnose=lambda: json.dumps(prometheus.targets(), indent=1)[-3000:] + prometheus.logs(), interval=1.0)
    firing_query = (f'ALERTS{{alertname="{ALERT_SIGNAL_DEFICIT}",alertstate="firing",namespace="{namespace}"}}')
    assert prometheus.query(firing_query) == [], "the alert fires on a healthy pair"

    pods = Recorder(api, core.list_namespaced_pod, namespace)
    pairs = Recorder(api, custom.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL)
    firing_seen: list[tuple[float, dict]] = []
    polling = threading.Event()

    def poll_alerts() -> None:  # for the numbers only; the assertion reads the TSDB afterwards
        while not polling.is_set():
            try:
                for alert in prometheus.alerts():
                    labels = alert["labels"]
                    if (labels.get("alertname") == ALERT_SIGNAL_DEFICIT and labels.get("namespace") == namespace
                            and alert["state"] == "firing"):
                        firing_seen.append((time.monotonic(), alert))
                        return
            except Exception:  # Prometheus busy for a moment: the TSDB check below is what counts
                pass
            polling.wait(1.0)

    real_cluster.kubectl("exec", "-n", namespace, prefill_g1, "-c", "engine", "--", "sh", "-c",
                         f"echo 1 > {DROP_SIGNALS_KNOB}")
    t_knob = time.monotonic()
    poller = threading.Thread(target=poll_alerts, daemon=True)
    poller.start()
    stuck: dict = {}

    def stuck_request() -> None:  # fails or hangs until the restart cuts it: bounded, outcome only reported
        t0 = time.monotonic()
        proc = real_cluster.node_exec("n1", [sys.executable, "-c", _COMPLETION_SNIPPET,
                                             f"http://{ip}:{port}/v1/completions", SERVED_NAME, PROMPTS[1], "16", "0"],
                                      timeout=300, check=False)
        stuck.update(rc=proc.returncode, seconds=time.monotonic() - t0, tail=(proc.stdout + proc.stderr)[-300:])

    requester = threading.Thread(target=stuck_request, daemon=True)
    requester.start()
    try:
        wait_for(ready(g1 + 1), ENGINE_START_TIMEOUT + 240, f"the restarted pair (generation {g1 + 1}) Ready",
                 diagnose=diagnose, interval=1.0)
        t_ready = time.monotonic()
        again = completion(real_cluster, "n1", ip, port, PROMPTS[0])
        t_first_token = time.monotonic()
    finally:
        polling.set()
        pods.stop()
        pairs.stop()
    assert pods.error is None and pairs.error is None, (pods.error, pairs.error)

    # The alert fired, for decode g1 (the side waiting for the dropped signals): the TSDB keeps ALERTS samples.
    fired = prometheus.query(f"max_over_time({firing_query}[30m])")
    assert fired, f"{ALERT_SIGNAL_DEFICIT} never fired in the in-cluster Prometheus:\n" \
                  f"{json.dumps(prometheus.rule_groups(), indent=1)[-3000:]}\n{prometheus.logs()}"
    fired_on = {(r["metric"]["pod"], r["metric"].get("role"), r["metric"].get("pair")) for r in fired}
    assert (decode_g1, "decode", PAIR) in fired_on, fired_on

    # The ordered restart, as the watches saw it.
    steps = pod_steps(pods.events)
    order = [s for _, _, s in steps if s.split()[1] in (prefill_g1, decode_g1, decode_g2, prefill_g2)]
    print("[realnode-e2e] restart order: " + ", ".join(s for _, _, s in steps))
    assert order == [f"delete {prefill_g1}", f"delete {decode_g1}", f"create {decode_g2}", f"create {prefill_g2}"], \
        order
    when = {s: (t, rv) for t, rv, s in steps}
    listening = listening_since(pairs.events, g1 + 1)
    assert listening is not None, f"no pair status with DecodeListening True for generation {g1 + 1}"
    # Parallel start: prefill g2 is created once decode g2 runs (beside it, while it loads); generation g1 + 1 was
    # Ready only after the operator saw decode g2 listen.
    ready_rv = next(rv for _, rv, _, p in pairs.events if (p.get("status") or {}).get("phase") == "Ready"
                    and int(p["status"].get("pairGeneration") or 0) == g1 + 1)
    assert when[f"create {decode_g2}"][1] < when[f"create {prefill_g2}"][1], when
    assert when[f"create {decode_g2}"][1] < listening[1] <= ready_rv, (when, listening, ready_rv)

    status = pair()["status"]
    assert status["restarts"] == restarts_before + 1 and "hung" in status["lastRestart"]["reason"], status
    # The recreated prefill has a fresh filesystem: the knob is gone, so the pair serves as before.
    gone = real_cluster.kubectl("exec", "-n", namespace, prefill_g2, "-c", "engine", "--", "sh", "-c",
                                f"test ! -e {DROP_SIGNALS_KNOB}", check=False)
    assert gone.returncode == 0, f"the knob survived the restart: {gone.stdout}{gone.stderr}"
    outputs = {PROMPTS[0]: again, **{p: completion(real_cluster, "n2", ip, port, p) for p in PROMPTS[1:]}}
    assert outputs == expected, f"pair outputs differ after the restart:\n{outputs}\n{expected}"

    t_delete = when[f"delete {prefill_g1}"][0]
    t_alert = firing_seen[0][0] if firing_seen else None
    requester.join(timeout=1)
    print(f"[realnode-e2e] hang to recovery (hang timeout {hang_timeout}s, operator health interval 10s): "
          f"knob+request -> alert firing seen {('%.1fs' % (t_alert - t_knob)) if t_alert else 'n/a (poll missed it)'}, "
          f"-> operator's first deletion (restart decision) {t_delete - t_knob:.1f}s; "
          f"restart: first deletion -> decode g1 deleted {when[f'delete {decode_g1}'][0] - t_delete:.1f}s, "
          f"-> decode g2 created {when[f'create {decode_g2}'][0] - t_delete:.1f}s, "
          f"-> prefill g2 created {when[f'create {prefill_g2}'][0] - t_delete:.1f}s, "
          f"-> decode g2 listening {listening[0] - t_delete:.1f}s; "
          f"-> Ready again {t_ready - t_knob:.1f}s; -> first token again {t_first_token - t_knob:.1f}s; "
          f"the stuck request: {stuck or 'still open'}")


# Panels of the chart's dashboard that cannot show data on this cluster, by title, each with its reason. Every entry
# must still name a panel (a renamed or removed panel fails the test, so the list cannot rot).
DASHBOARD_EXEMPT: dict[str, str] = {}
# Grafana's $__rate_interval for a 1 s scrape is a few seconds; a wider window is as valid a view and steadier here.
RATE_INTERVAL = "30s"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, query) of every target of every panel, rows' panels included."""
    board = json.loads((CHART / "dashboards" / "pdpair.json").read_text())

    def panels(items):
        for panel in items:
            yield panel
            yield from panels(panel.get("panels") or [])

    return [(panel.get("title", ""), target["expr"]) for panel in panels(board["panels"])
            for target in panel.get("targets") or [] if target.get("expr")]


def test_every_dashboard_panel_shows_data_for_the_serving_pair(real_cluster, serving_pair, prometheus):
    """Each query of the chart's dashboard, its variables filled for the serving pair ($namespace, $pair) and
    $__rate_interval as RATE_INTERVAL, evaluated as Grafana does (a range query, step 5 s) over this module's time:
    an error or no sample at all fails, unless the panel is in DASHBOARD_EXEMPT. A few completions first, so the
    rates have traffic. Cost: no cold start (the serving pair the signal test left Ready), about 10 s."""
    queries = dashboard_queries()
    titles = {title for title, _ in queries}
    assert queries and not set(DASHBOARD_EXEMPT) - titles, f"exempt panels that do not exist: " \
        f"{sorted(set(DASHBOARD_EXEMPT) - titles)}"
    serving_pair.ready()
    ip, port = serving_pair.service()
    for prompt in PROMPTS:
        completion(real_cluster, "n1", ip, port, prompt)
    time.sleep(3)  # three scrapes at 1 s: the completions' counters are in the TSDB
    start, end = prometheus.deployed_at, time.time()
    empty, errors, filled = [], [], 0
    for title, expr in queries:
        if title in DASHBOARD_EXEMPT:
            continue
        query = (expr.replace("$namespace", serving_pair.namespace).replace("$pair", serving_pair.name)
                 .replace("$__rate_interval", RATE_INTERVAL))
        try:
            result = prometheus.api("query_range", query=query, start=f"{start:.3f}", end=f"{end:.3f}",
                                    step="5")["result"]
        except AssertionError as exc:  # Prometheus answered an error (a bad query)
            errors.append(f"{title}: {query}: {exc}")
            continue
        if any(series.get("values") for series in result):
            filled += 1
        else:
            empty.append(f"{title}: {query}")
    print(f"[realnode-e2e] dashboard: {filled} queries with data, {len(empty)} empty, {len(errors)} errors, "
          f"{len(DASHBOARD_EXEMPT)} panels exempt, over {end - start:.0f}s")
    assert not errors and not empty, "dashboard queries without data or with errors:\n" + "\n".join(errors + empty)

