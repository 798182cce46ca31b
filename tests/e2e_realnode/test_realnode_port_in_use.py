"""The first seed failure on a real node: a process outside Kubernetes holds the ports decode will be
leased, on decode's node, before decode starts. The pair must recover by itself, with a clear Event.

The operator leases the lowest free ports of its pool, decode's blocks first (port_blocks.required_blocks: side channel,
metrics, http), so the test reads the port Leases and occupies the three lowest free ports on node n2 with a plain
Python listener in n2's network namespace (not a pod). Decode's port preflight (the first step of its engine
container) finds them busy and fails the pod with `pdpair: ports in use on this node: ...`; the operator quarantines them, leases others, posts
PortInUse and restarts the pair decode-first; the pair serves through its Service like a single engine, and the
foreign process still holds its ports (nothing killed it). The control-plane version of the same flow, with the
quarantine's end: tests/e2e/test_port_in_use.py.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml

from pdpair.contract import (
    ANNOTATION_RESTART_TIMES, GROUP, LABEL_PORT_LEASE, LABEL_PORT_QUARANTINE, LEASE_NAME_PREFIX, PLURAL,
    QUARANTINE_HOLDER_PREFIX,
)
from pdpair.operator.model.config import DEFAULT_PORT_POOL, PortPool
from pdpair.operator.build.pods import ENGINE_CONTAINER
from devcluster.product import (
    ENGINE_START_TIMEOUT, OPERATOR_NS, PROMPTS, completion, describe, operator_logs, pair_manifest, pod_logs,
)
from devcluster.waiting import wait_for

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(2400)]

DECODE_NODE = "n2"
BANNER = b"foreign process\n"
# Listens on every port given, answers each connection with BANNER, until killed. Prints one line once all listen.
FOREIGN_LISTENER = f"""
import socket, sys, threading
socks = []
for port in map(int, sys.argv[1:]):
    s = socket.socket()
    # Like any server (and the preflight): an earlier pair's connections on the port may sit in TIME_WAIT.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(16)
    socks.append(s)
def serve(s):
    while True:
        conn, _ = s.accept()
        conn.sendall({BANNER!r})
        conn.close()
for s in socks[1:]:
    threading.Thread(target=serve, args=(s,), daemon=True).start()
print("listening", flush=True)
serve(socks[0])
"""
BANNER_CHECK = ("import socket, sys\n"
                "with socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=10) as c:\n"
                "    sys.stdout.write(c.recv(64).decode())\n")


def leased_ports(cluster) -> set[int]:
    leases = json.loads(cluster.kubectl("get", "leases", "-n", OPERATOR_NS, "-l", f"{LABEL_PORT_LEASE}=true",
                                        "-o", "json").stdout)["items"]
    return {int(l["metadata"]["name"].removeprefix(LEASE_NAME_PREFIX)) for l in leases}


def next_free(pool: PortPool, taken: set[int], count: int) -> list[int]:
    return [p for p in pool if p not in taken][:count]


def start_foreign_listener(cluster, node: str, ports: list[int]) -> subprocess.Popen:
    """A plain process in the node's network namespace (what hostNetwork pods share), holding `ports`."""
    pid = cluster.node(node).pid("kubelet")
    proc = subprocess.Popen(["nsenter", "-t", str(pid), "-n", sys.executable, "-c", FOREIGN_LISTENER,
                             *map(str, ports)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # returns at "listening", or at EOF when it failed to bind
    if line.strip() != "listening":
        proc.kill()
        raise AssertionError(f"the foreign listener did not start on {ports}: {proc.stderr.read()}")
    return proc


def test_ports_held_by_a_foreign_process_on_decodes_node_are_replaced_and_the_pair_serves(
        real_cluster, operator_release, baseline_outputs, images, model_dir, namespace):
    name = "busy-ports"
    # The release uses the chart's default pool (devcluster/product.install_operator sets none).
    busy = next_free(PortPool.parse(DEFAULT_PORT_POOL), leased_ports(real_cluster), 3)
    foreign = start_foreign_listener(real_cluster, DECODE_NODE, busy)
    try:
        body = pair_manifest(name, namespace, images["engine"].ref, model_dir, prefill_node="n1",
                             decode_node=DECODE_NODE)
        real_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))

        def pair():
            return json.loads(real_cluster.kubectl("get", f"{PLURAL}.{GROUP}", name, "-n", namespace,
                                                   "-o", "json").stdout)

        def events(reason):
            return json.loads(real_cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                                                   f"reason={reason}", "-o", "json").stdout)["items"]

        def diagnose() -> str:
            out = [describe(real_cluster, namespace), json.dumps(pair().get("status"), indent=1)[-3000:]]
            pods = json.loads(real_cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
            for p in pods:
                out.append(f"--- {p['metadata']['name']}:\n{pod_logs(real_cluster, namespace, p['metadata']['name'])}")
            out.append("--- operator:\n" + operator_logs(real_cluster))
            return "\n".join(out)

        # The first decode fails in its preflight, seconds after it is scheduled: a PortInUse Event names the ports.
        t0 = time.monotonic()
        [event] = wait_for(lambda: events("PortInUse"), 300, "a PortInUse Event", diagnose=diagnose, interval=1.0)
        print(f"[realnode-e2e] PortInUse {time.monotonic() - t0:.1f}s after apply: {event['message']}")
        message = event["message"]
        assert f"ports {' '.join(map(str, busy))} in use on node {DECODE_NODE}" in message, (busy, message)
        assert f"container {ENGINE_CONTAINER}" in message and "decode pod" in message, message
        for port in busy:
            lease = json.loads(real_cluster.kubectl("get", "lease", f"{LEASE_NAME_PREFIX}{port}", "-n", OPERATOR_NS,
                                                    "-o", "json").stdout)
            assert lease["metadata"]["labels"].get(LABEL_PORT_QUARANTINE) == "true", lease
            assert lease["spec"]["holderIdentity"] == f"{QUARANTINE_HOLDER_PREFIX}{DECODE_NODE}", lease

        # Two engine starts, together now (prefill beside decode), but on a loaded box each may take up to
        # ENGINE_START_TIMEOUT (a first run here, one after the other, saw decode listen after 8.5 min at load 25).
        wait_for(lambda: pair().get("status", {}).get("phase") == "Ready", 2 * ENGINE_START_TIMEOUT,
                 "pair phase Ready on the replacement ports", diagnose=diagnose, interval=1.0)
        print(f"[realnode-e2e] apply -> Ready on replacement ports {time.monotonic() - t0:.1f}s")
        status = pair()["status"]
        decode_ports = {p["port"] for p in status["ports"] if p["role"] == "decode"}
        assert len(decode_ports) == 3 and not decode_ports & set(busy), (busy, status["ports"])
        assert all(str(p) in message for p in decode_ports), ("the Event names the replacement", message)
        assert status["pairGeneration"] == 2 and str(busy[0]) in status["lastRestart"]["reason"], status
        annotations = pair()["metadata"].get("annotations") or {}
        assert json.loads(annotations.get(ANNOTATION_RESTART_TIMES, "[]")) == [], "counted against the budget"

        pods = json.loads(real_cluster.kubectl("get", "pods", "-n", namespace, "-l", f"pdpair.io/pair={name}",
                                               "-o", "json").stdout)["items"]
        by_role = {p["metadata"]["labels"]["pdpair.io/role"]: p for p in pods}
        assert by_role["decode"]["spec"]["nodeName"] == DECODE_NODE
        assert by_role["decode"]["metadata"]["labels"]["pdpair.io/generation"] == "2"
        # The replacement's preflight passed and became the engine: no init container of ours, the engine runs.
        assert not by_role["decode"]["status"].get("initContainerStatuses"), by_role["decode"]["status"]
        [engine] = [s for s in by_role["decode"]["status"]["containerStatuses"] if s["name"] == ENGINE_CONTAINER]
        assert engine["state"].get("running") and engine["restartCount"] == 0, engine

        svc = json.loads(real_cluster.kubectl("get", "service", name, "-n", namespace, "-o", "json").stdout)
        ip, port = svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["port"]
        outputs = {p: completion(real_cluster, "n1", ip, port, p) for p in PROMPTS}
        expected = {p: baseline_outputs[p] for p in PROMPTS}
        assert outputs == expected, f"pair outputs differ from the single engine:\npair: {outputs}\nbaseline: {expected}"

        # Nothing killed or took over the foreign process: it still runs and answers on every one of its ports.
        assert foreign.poll() is None, foreign.stderr.read()
        for busy_port in busy:
            answer = real_cluster.node_exec(DECODE_NODE, [sys.executable, "-c", BANNER_CHECK, str(busy_port)]).stdout
            assert answer == BANNER.decode(), (busy_port, answer)

        real_cluster.kubectl("delete", f"{PLURAL}.{GROUP}", name, "-n", namespace, "--wait=true", "--timeout=120s",
                             timeout=150)
        wait_for(lambda: not json.loads(real_cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)
                 ["items"], 120, "the pair's pods to go", diagnose=lambda: describe(real_cluster, namespace),
                 interval=1.0)
    finally:
        foreign.kill()
        foreign.wait(timeout=30)
