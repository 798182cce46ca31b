"""The custom metrics pipeline on real nodes: pod metrics -> the in-cluster Prometheus ->
prometheus-adapter (a pod, with the chart's `autoscaling.prometheusAdapterRules`) -> its APIServices
`v1beta1`/`v1beta2.custom.metrics.k8s.io` -> the kube-apiserver's aggregation layer -> `kubectl get --raw`.

On the package's real-node cluster (started with the aggregation layer, devcluster/fixtures.py), in a namespace of
its own, before any engine runs (tests/e2e_realnode/conftest.py MODULE_ORDER). The adapter and its APIServices are
deleted at the module's end; test_realnode_xpyd.py deploys its own for the HPA on its 2P2D pair.

No vLLM engine runs: a stand-in pod serves fixed vLLM- and connector-shaped series on ports named `http` and
`metrics`, labelled like a pair's decode pod, so every value asserted is exact (the real engines' series go
through the same rules in test_realnode_xpyd.py's HPA test).

Cost: no cold start. Builds, first use only: the adapter binary (devcluster/build.py `build_prometheus_adapter`;
hack/test.sh builds it in the background Go job, 224 s cold at GOMAXPROCS=1, seconds once GOCACHE has it) and the
Prometheus image (3 s). Measured alone on its own cluster (2026-12-05): 4 passed in 70 s, cluster start and stop
included; on the package's cluster about 40 s (image imports into n1: Prometheus 283 MiB, the Debian base, the
adapter 60 MiB; Prometheus Ready about 2 s, the adapter's APIServices Available about 3 s, the first series through
the adapter after its first relist, 5 s).

    .venv/bin/python -m pytest tests/e2e_realnode/test_realnode_cluster.py tests/e2e_realnode/test_realnode_custom_metrics.py
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import time

import pytest
import yaml

from devcluster.build import build_prometheus_adapter
from devcluster.images import debian_base, operator_image
from devcluster.incluster_prometheus import PROMETHEUS_PORT, InClusterPrometheus, prometheus_image
from devcluster.prometheus_adapter import PrometheusAdapter, adapter_config_from_chart, prometheus_adapter_image
from devcluster.product import unique
from devcluster.waiting import wait_for

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(1800)]

NODE = "n1"
PROMETHEUS_SETS = ("monitoring.podMonitor.interval=1s", "monitoring.podMonitor.scrapeTimeout=1s",
                   "monitoring.podMonitor.engineMetrics=true")
STAND_IN = "stand-in-decode"
EDGE_A, EDGE_B = "198.18.64.10:20000", "198.18.65.10:20000"
# What the stand-in serves: vLLM's engine series on `http`, the connector's per-edge series on `metrics`.
ENGINE_PAGE = ('vllm:num_requests_waiting{engine="0",model_name="tiny"} 3\n'
               'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25\n')
# A TP = 2 prefill with one decode peer per rank: two edges, told apart by `rank` (a `peer` value, host:portBase,
# is no valid label-selector value, so the API cannot select by it).
CONNECTOR_PAGE = (f'pdpair_transport_inflight{{rank="0",peer="{EDGE_A}"}} 2\n'
                  f'pdpair_transport_inflight{{rank="1",peer="{EDGE_B}"}} 5\n'
                  f'pdpair_transport_slots{{rank="0",peer="{EDGE_A}"}} 8\n'
                  f'pdpair_transport_slots{{rank="1",peer="{EDGE_B}"}} 8\n')
_SERVE = """
import http.server, sys, threading
def handler(page):
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = page.encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    return H
servers = [http.server.ThreadingHTTPServer(("0.0.0.0", int(port)), handler(open(path).read()))
           for port, path in (a.split("=", 1) for a in sys.argv[1:])]
for s in servers[1:]:
    threading.Thread(target=s.serve_forever, daemon=True).start()
servers[0].serve_forever()
"""


def test_the_adapter_loads_the_charts_rules(tmp_path: pathlib.Path):
    """No cluster: the adapter's own config loader accepts the chart's rules (it stops later, at its RESTMapper,
    for want of an apiserver on 127.0.0.1:1), and refuses a broken file at the load step (the check can fail)."""
    binary = build_prometheus_adapter()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "x"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))

    def run(config: str) -> str:
        path = tmp_path / "config.yaml"
        path.write_text(config)
        proc = subprocess.run([str(binary), f"--config={path}", "--prometheus-url=http://127.0.0.1:9/",
                               f"--lister-kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
                               f"--authorization-kubeconfig={kubeconfig}", f"--cert-dir={tmp_path / 'certs'}",
                               "--metrics-relist-interval=5s"], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0
        return proc.stderr

    chart_run = run(adapter_config_from_chart())
    assert "unable to load metrics discovery config" not in chart_run and "RESTMapper" in chart_run, chart_run[-2000:]
    assert "unable to load metrics discovery config" in run("rules: [{seriesQuery: [}\n")


@pytest.fixture(scope="module")
def namespace(real_cluster):
    name = unique("rn-cm")
    real_cluster.create_namespace(name)
    yield name
    real_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def stand_in(real_cluster, namespace):
    base = debian_base()
    real_cluster.import_image(base.archive, nodes=[NODE])
    pages = {"engine.prom": ENGINE_PAGE, "connector.prom": CONNECTOR_PAGE, "serve.py": _SERVE}
    objects = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": STAND_IN, "namespace": namespace},
         "data": pages},
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": STAND_IN, "namespace": namespace,
                      "labels": {"pdpair.io/pair": "stand-in", "pdpair.io/role": "decode", "pdpair.io/instance": "0"}},
         "spec": {"nodeSelector": {"kubernetes.io/hostname": NODE}, "containers": [{
             "name": "exporter", "image": base.ref, "imagePullPolicy": "Never",
             "command": ["python3", "/pages/serve.py", "8000=/pages/engine.prom", "9400=/pages/connector.prom"],
             "ports": [{"name": "http", "containerPort": 8000}, {"name": "metrics", "containerPort": 9400}],
             "readinessProbe": {"httpGet": {"path": "/metrics", "port": "http"}, "periodSeconds": 1},
             "volumeMounts": [{"name": "pages", "mountPath": "/pages"}]}],
             "volumes": [{"name": "pages", "configMap": {"name": STAND_IN}}]}},
    ]
    real_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))
    real_cluster.kubectl("wait", "-n", namespace, "--for=condition=Ready", f"pod/{STAND_IN}", "--timeout=120s",
                               timeout=150)
    return STAND_IN


@pytest.fixture(scope="module")
def prometheus(real_cluster, namespace):
    image = prometheus_image()
    sidecar = operator_image()
    for archive in (image.archive, sidecar.archive):
        real_cluster.import_image(archive, nodes=[NODE])
    prom = InClusterPrometheus(real_cluster, namespace, image.ref, sidecar.ref, PROMETHEUS_SETS, node=NODE)
    t0 = time.monotonic()
    prom.deploy()
    print(f"[custom-metrics] in-cluster Prometheus Ready in {time.monotonic() - t0:.1f}s")
    yield prom
    prom.delete()


@pytest.fixture(scope="module")
def adapter(real_cluster, namespace, prometheus):
    image = prometheus_adapter_image()
    real_cluster.import_image(image.archive, nodes=[NODE])
    adapter = PrometheusAdapter(real_cluster, namespace, image.ref,
                                f"http://{prometheus.pod_ip}:{PROMETHEUS_PORT}/", adapter_config_from_chart(),
                                node=NODE)
    adapter.deploy()
    print(f"[custom-metrics] adapter: {adapter.timings}")
    yield adapter
    adapter.delete()


def _items(adapter: PrometheusAdapter, namespace: str, metric: str, **kw) -> dict[str, str]:
    """{pod name: value} of a Pods metric, or {} while the adapter does not serve it yet."""
    try:
        answer = adapter.pods_metric(namespace, metric, **kw)
    except Exception as exc:  # noqa: BLE001 - "not found" until the relist has seen the series
        print(f"[custom-metrics] {metric}: {exc}")
        return {}
    return {i["describedObject"]["name"]: i["value"] for i in answer.get("items", [])}


def test_the_apiservices_are_available_through_the_aggregator(real_cluster, adapter):
    for name in adapter.apiservices:
        obj = json.loads(real_cluster.kubectl("get", "apiservice", name, "-o", "json").stdout)
        conditions = {c["type"]: c for c in obj["status"]["conditions"]}
        assert conditions["Available"]["status"] == "True", conditions
        assert obj["spec"]["service"]["name"] == "prometheus-adapter"  # served by the pod, not local
    discovery = adapter.get_raw("/apis/custom.metrics.k8s.io/v1beta1")
    assert discovery["groupVersion"] == "custom.metrics.k8s.io/v1beta1"


def test_vllm_num_requests_waiting_per_pod(real_cluster, namespace, stand_in, prometheus, adapter):
    path = f"/apis/custom.metrics.k8s.io/v1beta1/namespaces/{namespace}/pods/*/vllm:num_requests_waiting"
    values = wait_for(lambda: _items(adapter, namespace, "vllm:num_requests_waiting"), 120,
                      f"`kubectl get --raw {path}` to list {stand_in}",
                      diagnose=lambda: json.dumps(prometheus.targets(), indent=1)[-3000:] + adapter.diagnose(),
                      interval=2.0)
    assert values == {stand_in: "3"}
    raw = json.loads(real_cluster.kubectl("get", "--raw", path).stdout)  # the literal command of the issue
    [item] = raw["items"]
    assert item["metricName"] == "vllm:num_requests_waiting"
    described = item["describedObject"]
    assert (described["kind"], described["namespace"], described["name"]) == ("Pod", namespace, stand_in)
    # v1beta2, the HPA controller's version, serves the same value.
    assert _items(adapter, namespace, "vllm:num_requests_waiting", version="v1beta2") == {stand_in: "3"}


def test_kv_cache_usage_and_the_per_edge_transfer_metrics(namespace, stand_in, adapter):
    assert wait_for(lambda: _items(adapter, namespace, "vllm:kv_cache_usage_perc"), 60,
                    "vllm:kv_cache_usage_perc") == {stand_in: "250m"}
    assert wait_for(lambda: _items(adapter, namespace, "pdpair_transport_inflight"), 60,
                    "pdpair_transport_inflight") == {stand_in: "7"}  # both edges summed per pod
    # One edge: the API's metricLabelSelector becomes a label matcher in the adapter's query.
    assert _items(adapter, namespace, "pdpair_transport_inflight",
                  metric_label_selector="rank=0") == {stand_in: "2"}
    assert _items(adapter, namespace, "pdpair_transport_slots") == {stand_in: "16"}
