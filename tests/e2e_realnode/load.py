"""A steady load on a pair's Service from inside a real node: the rollout (test_realnode_rollout.py) and the
partition (test_realnode_node_lost.py) count every request a client sent, failed ones included."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

from devcluster.product import PROMPTS, SERVED_NAME

# Runs inside a node's namespaces: `clients` threads, each sending one greedy completion after the other until stdin
# closes; one JSON line per request: {"t", "dur", "prompt", "ok", "rid", "text" | "error"} ("rid": the X-Request-Id
# the router answered with, "" when none came back; extra request headers, e.g. X-Pdpair-Route, from argv[6]). A
# failed request is not retried: it is counted, and the client sends the next one after 0.2 s (no tight loop while a
# Service has no endpoint).
_LOAD_SNIPPET = r"""
import json, sys, threading, time, urllib.request
url, model, clients, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
timeout = float(sys.argv[5])
extra = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
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
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **extra})
        t = time.time()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                rid = resp.headers.get("X-Request-Id") or ""
                text = json.load(resp)["choices"][0]["text"]
            out({"t": t, "dur": time.time() - t, "prompt": prompt, "ok": True, "rid": rid, "text": text})
        except Exception as exc:
            body = ""
            try:
                body = exc.read().decode(errors="replace") if hasattr(exc, "read") else ""  # the router's JSON error
            except Exception:
                pass
            rid = (getattr(exc, "headers", None) or {}).get("X-Request-Id") or ""
            out({"t": t, "dur": time.time() - t, "prompt": prompt, "ok": False, "rid": rid,
                 "error": f"{type(exc).__name__}: {exc} {body}"[:1000]})
            time.sleep(0.2)
threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
for th in threads: th.start()
sys.stdin.read()
stop.set()
for th in threads: th.join()
"""


class Load:
    """The load generator in a node's namespaces (nsenter, like RealNodeCluster.node_exec, but running meanwhile):
    `clients` clients on the Service `ip:port`, each request with a deadline of `timeout` seconds and `headers`
    added (e.g. X-Pdpair-Route to force a (prefill, decode) pair)."""

    def __init__(self, cluster, ip: str, port: int, clients: int, timeout: float = 120.0, node: str = "n1",
                 headers: dict[str, str] | None = None):
        self.timeout = timeout
        pid = cluster.node(node).pid("kubelet")
        self.proc = subprocess.Popen(
            ["nsenter", "-t", str(pid), "-m", "-n", sys.executable, "-c", _LOAD_SNIPPET,
             f"http://{ip}:{port}/v1/completions", SERVED_NAME, str(clients), json.dumps(PROMPTS), str(timeout),
             json.dumps(headers or {})],
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
            self.proc.wait(timeout=self.timeout + 60)  # the requests in flight finish (or time out)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._reader.join(timeout=30)
        assert self.proc.returncode == 0, self.proc.stderr.read()[-2000:]
        return self.records
