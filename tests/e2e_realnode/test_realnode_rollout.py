"""A spec rollout under load on real nodes: Surge drops no request, Recreate is an outage (issue 11, item 4).

Four clients inside node n1's network namespace send greedy completions through the pair's Service, one after the
other each, while the spec changes (a harmless engine argument is added to decode and prefill: same greedy
outputs). Every request is counted: a refused connection, an HTTP error or a timeout is a failure, and every
successful output must equal the single engine's (the session's baseline). Surge must fail none; Recreate's failures
are counted and reported for contrast (the Service has no router while the old generation is gone and the new one
starts). One pair per scenario, deleted at the end.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import yaml

from pdpair.contract import GROUP, PLURAL
from tests.cluster.realnode_product import (
    ENGINE_START_TIMEOUT, PROMPTS, SERVED_NAME, completion, describe, operator_logs, pair_manifest, wait_for,
)

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(2400)]

CLIENTS = 4
HARMLESS_ARGS = ["--max-num-seqs", "32"]  # a scheduler bound; greedy outputs do not depend on it
DRAIN_SECONDS = 20

# Runs inside node n1's namespaces: CLIENTS threads, each sending one greedy completion after the other until stdin
# closes; one JSON line per request: {"t", "dur", "prompt", "ok", "text" | "error"}. A failed request is retried
# after 0.2 s (no tight loop while a Service has no endpoint), and each retry counts as one more request.
_LOAD_SNIPPET = r"""
import json, sys, threading, time, urllib.request
url, model, clients, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
stop = threading.Event()
lock = threading.Lock()
def out(rec):
    with lock:
        sys.stdout.write(json.dumps(rec) + "\n"); sys.stdout.flush()
def client(i):
    n = i
    while not stop.is_set():
        prompt = prompts[n % len(prompts)]; n += 1
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}).encode()
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        t = time.time()
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                text = json.load(resp)["choices"][0]["text"]
            out({"t": t, "dur": time.time() - t, "prompt": prompt, "ok": True, "text": text})
        except Exception as exc:
            out({"t": t, "dur": time.time() - t, "prompt": prompt, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]})
            time.sleep(0.2)
threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
for th in threads: th.start()
sys.stdin.read()
stop.set()
for th in threads: th.join()
"""


class Load:
    """The load generator in n1's namespaces (nsenter, like RealNodeCluster.node_exec, but running meanwhile)."""

    def __init__(self, cluster, ip: str, port: int):
        pid = cluster.node("n1").pid("kubelet")
        self.proc = subprocess.Popen(
            ["nsenter", "-t", str(pid), "-m", "-n", sys.executable, "-c", _LOAD_SNIPPET,
             f"http://{ip}:{port}/v1/completions", SERVED_NAME, str(CLIENTS), json.dumps(PROMPTS)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.records: list[dict] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.records.append(json.loads(line))

    def ok_since(self, t: float) -> int:
        return sum(1 for r in list(self.records) if r["ok"] and r["t"] >= t)

    def stop(self) -> list[dict]:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=180)  # the requests in flight finish (urlopen's own timeout is 120 s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._reader.join(timeout=30)
        assert self.proc.returncode == 0, self.proc.stderr.read()[-2000:]
        return self.records


def _rollout_under_load(real_cluster, namespace, images, model_dir, baseline_outputs, name, strategy):
    body = pair_manifest(name, namespace, images["engine"].ref, model_dir, prefill_node="n1", decode_node="n2")
    body["spec"]["rolloutStrategy"] = strategy
    body["spec"]["rollout"] = {"drainSeconds": DRAIN_SECONDS, "progressDeadlineSeconds": 1800}
    real_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))

    def pair():
        return json.loads(real_cluster.kubectl("get", f"{PLURAL}.{GROUP}", name, "-n", namespace, "-o", "json").stdout)

    def diagnose() -> str:
        return "\n".join([describe(real_cluster, namespace), json.dumps(pair().get("status"), indent=1)[-4000:],
                          "--- operator:\n" + operator_logs(real_cluster)])

    wait_for(lambda: pair().get("status", {}).get("phase") == "Ready", ENGINE_START_TIMEOUT + 120,
             "generation 1 Ready", diagnose)
    svc = json.loads(real_cluster.kubectl("get", "service", name, "-n", namespace, "-o", "json").stdout)
    ip, port = svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["port"]
    assert completion(real_cluster, "n1", ip, port, PROMPTS[0]) == baseline_outputs[PROMPTS[0]]  # Service programmed

    load = Load(real_cluster, ip, port)
    try:
        t_load = time.time()
        wait_for(lambda: load.ok_since(t_load) >= 2 * CLIENTS, 300, "requests served before the rollout",
                 lambda: json.dumps(load.records[-5:]))
        t_change = time.time()
        patch = {"spec": {role: {"args": body["spec"][role]["args"] + HARMLESS_ARGS} for role in ("prefill", "decode")}}
        real_cluster.kubectl("patch", f"{PLURAL}.{GROUP}", name, "-n", namespace, "--type=merge", "-p",
                             json.dumps(patch))
        switched: list[float] = []

        def rolled_out() -> bool:
            status = pair().get("status", {})
            if not switched and status.get("pairGeneration") == 2 and status.get("phase") == "Ready":
                switched.append(time.time())  # Recreate: the new generation is Ready; Surge: the Service switched
            pods = json.loads(real_cluster.kubectl("get", "pods", "-n", namespace, "-l", f"pdpair.io/pair={name}",
                                                   "-o", "json").stdout)["items"]
            return bool(switched) and "rollout" not in status and bool(pods) and all(
                p["metadata"]["labels"]["pdpair.io/generation"] == "2" for p in pods)

        wait_for(rolled_out, 2 * ENGINE_START_TIMEOUT + 300, "generation 2 serving and generation 1 gone", diagnose)
        t_done = time.time()
        wait_for(lambda: load.ok_since(t_done) >= 2 * CLIENTS, 300, "requests served after the rollout",
                 lambda: json.dumps(load.records[-5:]))
    finally:
        records = load.stop()
    failed = [r for r in records if not r["ok"]]
    during = [r for r in records if t_change <= r["t"] <= t_done]
    wrong = [r for r in records if r["ok"] and r["text"] != baseline_outputs[r["prompt"]]]
    ok_times = sorted(r["t"] + r["dur"] for r in records if r["ok"])
    longest_gap = max((b - a for a, b in zip(ok_times, ok_times[1:])), default=0.0)
    status = pair()["status"]
    print(f"\n[realnode-rollout] {strategy}: {len(failed)} failed of {len(records)} requests "
          f"({len(during)} sent during the rollout), {len(wrong)} outputs differ from the baseline; "
          f"spec change -> generation 2 serving {switched[0] - t_change:.1f}s, -> generation 1 gone "
          f"{t_done - t_change:.1f}s; longest time without a completed request {longest_gap:.1f}s; "
          f"first failures: {[r['error'] for r in failed[:3]]}")
    real_cluster.kubectl("delete", f"{PLURAL}.{GROUP}", name, "-n", namespace, "--wait=true", "--timeout=120s",
                         timeout=150)
    wait_for(lambda: not json.loads(real_cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"],
             180, "the pair's pods to go", lambda: describe(real_cluster, namespace))
    return records, failed, wrong, status


def test_surge_rollout_under_load_fails_no_request(real_cluster, operator_release, baseline_outputs, images,
                                                   model_dir, namespace):
    records, failed, wrong, status = _rollout_under_load(real_cluster, namespace, images, model_dir,
                                                         baseline_outputs, "surge", "Surge")
    assert failed == [], failed[:5]
    assert wrong == [], wrong[:5]
    assert status["pairGeneration"] == 2 and status.get("servicePort")


def test_recreate_rollout_under_load_is_an_outage(real_cluster, operator_release, baseline_outputs, images,
                                                  model_dir, namespace):
    records, failed, wrong, _ = _rollout_under_load(real_cluster, namespace, images, model_dir, baseline_outputs,
                                                    "recreate", "Recreate")
    assert wrong == [], wrong[:5]
    assert failed, "Recreate deletes every old pod before the new generation starts: some request must fail"
