"""The chart's PodMonitor, translated by the harness (devcluster/incluster_prometheus.py) and fed the discovery
sidecar's targets (pod_sd_sidecar.py), selects and labels pods in a REAL Prometheus (Debian's) exactly as the
PodMonitor says: only the pair pods' prefill/decode `metrics` ports, with namespace/pod/pair/pdpair_instance/job/endpoint labels.
Prometheus' /api/v1/targets shows the relabelled targets without scraping them (the addresses go nowhere)."""
from __future__ import annotations

import json
import subprocess
import time

import pytest
import yaml

from pdpair import contract
from devcluster.incluster_prometheus import (
    podmonitor_scrape_configs, prometheus_config, render_chart_monitoring, with_file_sd,
)
from devcluster.pod_sd_sidecar import targets_for, write_atomically
from devcluster.ports import free_port
from tests.e2e.test_prometheus_alert import Prometheus, get_json
from tests.monitoring_support import require_binary

pytestmark = pytest.mark.prometheus


def _pod(name, ns, labels, phase="Running", ports=(("metrics", 9100), ("http", 8000)), ip="127.0.0.2"):
    return {"metadata": {"name": name, "namespace": ns, "uid": name, "labels": labels},
            "spec": {"nodeName": "n1", "containers": [
                {"name": "engine", "image": "e:1", "ports": [{"name": n, "containerPort": p} for n, p in ports]}]},
            "status": {"podIP": ip, "phase": phase, "conditions": [{"type": "Ready", "status": "True"}]}}


def test_real_prometheus_selects_and_labels_the_pair_pods_like_the_podmonitor(tmp_path):
    podmonitor, _ = render_chart_monitoring("monitoring.podMonitor.interval=1s", "monitoring.podMonitor.scrapeTimeout=1s")
    jobs, sidecar_jobs = with_file_sd(podmonitor_scrape_configs(podmonitor))
    [job] = jobs
    assert sidecar_jobs == ["job0.json=*"]  # namespaceSelector any: true
    job["file_sd_configs"][0]["files"] = [str(tmp_path / "job0.json")]
    config = prometheus_config(jobs, rule_files=())
    config["rule_files"] = []
    pair = {contract.LABEL_PAIR: "tiny"}
    pods = [
        # a pod made before the instance label (instance 0) and an xPyD decode instance 1
        _pod("tiny-prefill-g1", "a", {**pair, contract.LABEL_ROLE: contract.ROLE_PREFILL}),
        _pod("tiny-decode-g1-1", "b", {**pair, contract.LABEL_ROLE: contract.ROLE_DECODE, contract.LABEL_INSTANCE: "1"},
             ip="127.0.0.3"),
        _pod("tiny-router-g1", "a", {**pair, contract.LABEL_ROLE: contract.ROLE_ROUTER}),  # role not selected
        _pod("stray", "a", {contract.LABEL_ROLE: contract.ROLE_DECODE}),  # no pair label
        _pod("tiny-decode-g0", "a", {**pair, contract.LABEL_ROLE: contract.ROLE_DECODE}, phase="Failed"),
    ]
    write_atomically(str(tmp_path / "job0.json"), targets_for(pods, None))
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prom = ConfiguredPrometheus(tmp_path)
    try:
        deadline = time.monotonic() + 60
        while True:
            data = get_json(f"{prom.base}/api/v1/targets")
            active = data["activeTargets"]
            if len(active) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        got = sorted((t["labels"]["pod"], t["scrapeUrl"]) for t in active)
        assert got == [("tiny-decode-g1-1", "http://127.0.0.3:9100/metrics"),
                       ("tiny-prefill-g1", "http://127.0.0.2:9100/metrics")], json.dumps(active, indent=1)[:3000]
        for t in active:
            labels = t["labels"]
            assert labels["pair"] == "tiny" and labels["container"] == "engine" and labels["endpoint"] == "metrics"
            assert labels["job"] == f"{podmonitor['metadata']['namespace']}/{podmonitor['metadata']['name']}"
            assert labels["namespace"] == {"tiny-prefill-g1": "a", "tiny-decode-g1-1": "b"}[labels["pod"]]
            assert labels["pdpair_instance"] == {"tiny-prefill-g1": "0", "tiny-decode-g1-1": "1"}[labels["pod"]]
            assert not any(k.startswith("__meta") for k in labels)
        # every other discovered target (http ports, the router, the unpaired pod, the Failed pod) is dropped
        assert len(data["droppedTargets"]) == 2 * len(pods) - 2
    finally:
        prom.stop()


class ConfiguredPrometheus(Prometheus):
    """tests/e2e/test_prometheus_alert.Prometheus (ready wait, stop), started on the prometheus.yml in `workdir`."""

    def __init__(self, workdir):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [require_binary("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=workdir)
        self.wait_ready()
