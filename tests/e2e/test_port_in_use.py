"""A leased port that a process outside Kubernetes holds on the node, on the real control plane.

kwok runs no containers, so the test does the kubelet's part with the real pieces: a foreign listener holds the
decode pod's side-channel port on this machine (the kwok nodes are 127.0.0.1, and so is the hostNetwork pod), the
real preflight runs with the exact command in front of the decode pod's engine command (up to `--`: the check, without
starting an engine), and its termination message goes into the pod's status the way the kubelet puts it there
(containerStatuses of the engine container, phase Failed). The
operator is the real one under the chart's RBAC. What must follow: the port is quarantined (a node-busy Lease with a
TTL), the pair gets other ports, a PortInUse Event names port, node and replacement, the pair restarts decode-first
outside its restart budget and goes Ready, the foreign listener is untouched, and the quarantine ends after its TTL.
The same scenario with real engines on a real node: the first test of tests/e2e_realnode/test_realnode_node_lost.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from pdpair.contract import (
    ANNOTATION_QUARANTINE_NODE,
    ANNOTATION_RESTART_TIMES,
    KIND,
    LABEL_GENERATION,
    LABEL_PORT_QUARANTINE,
    LABEL_ROLE,
    LEASE_NAME_PREFIX,
    QUARANTINE_HOLDER_PREFIX,
    ROLE_DECODE,
    parse_ports_in_use,
)
from pdpair.operator.model.config import ENV_BUSY_PORT_QUARANTINE, ENV_SWEEP_INTERVAL
from pdpair.operator.build.pod_defaults import PREFLIGHT_COMMAND, PREFLIGHT_SEPARATOR
from pdpair.operator.build.pods import ENGINE_CONTAINER
from tests.e2e.operator_helpers import (
    NO_HEALTH,
    OPERATOR_NS,
    Api,
    PodRecorder,
    cleanup_pairs,
    operator,
    pool_of_free_ports,
)
from devcluster.waiting import wait_for

pytestmark = pytest.mark.cluster

QUARANTINE_SECONDS = 8
FOREIGN_HOST = "127.0.0.2"


def decode_pod(api, ns, generation):
    """Generation `generation`'s decode pod once the scheduler has bound it (the tests need its node: an unbound pod
    read on a loaded box made the quarantine's holder `node-busy/None`), or None."""
    for pod in api.pods(ns):
        labels = pod["metadata"]["labels"]
        if labels[LABEL_ROLE] == ROLE_DECODE and labels[LABEL_GENERATION] == str(generation) \
                and not pod["metadata"].get("deletion_timestamp") and pod["spec"].get("node_name"):
            return pod
    return None


def side_port(pod):
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    return int(env["PDPAIR_LISTEN_PORT_BASE"])


def run_preflight_like_the_container(pod, tmp_path):
    """The preflight in front of the pod's engine command, run here (the node) up to its `--` (the check alone: no
    engine is started), with the termination message file the kubelet provides."""
    [engine] = [c for c in pod["spec"]["containers"] if c["name"] == ENGINE_CONTAINER]
    command = engine["command"]
    assert command[:len(PREFLIGHT_COMMAND)] == PREFLIGHT_COMMAND and PREFLIGHT_SEPARATOR in command, command
    check = command[:command.index(PREFLIGHT_SEPARATOR)]
    log = tmp_path / f"termination-log-{pod['metadata']['name']}"
    log.write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PDPAIR_TERMINATION_LOG": str(log)}
    proc = subprocess.run([sys.executable, *check[1:]], capture_output=True, text=True, timeout=60, env=env)
    return engine, proc, log.read_text()


def kubelet_reports_failure(api, ns, pod, container, exit_code, message):
    """What the kubelet writes when the container of a restartPolicy Never pod fails: the pod is Failed."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    api.core.patch_namespaced_pod_status(pod["metadata"]["name"], ns, {"status": {
        "phase": "Failed",
        "containerStatuses": [{
            "name": container["name"], "image": container["image"], "imageID": "", "ready": False, "restartCount": 0,
            "state": {"terminated": {"exitCode": exit_code, "reason": "Error", "message": message,
                                     "startedAt": now, "finishedAt": now}},
        }],
    }})


def quarantine_lease(api, port):
    from kubernetes.client.exceptions import ApiException

    try:
        lease = api.coord.read_namespaced_lease(f"{LEASE_NAME_PREFIX}{port}", OPERATOR_NS)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return lease if (lease.metadata.labels or {}).get(LABEL_PORT_QUARANTINE) == "true" else None


@pytest.fixture
def no_quarantine_left(platform):
    """Quarantine Leases outlive the test's operator (they belong to no pair); later tests' pools must not meet them."""
    yield
    api = Api(platform[0])
    for lease in api.coord.list_namespaced_lease(OPERATOR_NS, label_selector=f"{LABEL_PORT_QUARANTINE}=true").items:
        api.coord.delete_namespaced_lease(lease.metadata.name, OPERATOR_NS)


def test_a_port_busy_on_the_node_is_quarantined_and_the_pair_restarts_on_others(
        platform, cluster_namespace, tmp_path, no_quarantine_left):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    env = {**NO_HEALTH, ENV_BUSY_PORT_QUARANTINE: str(QUARANTINE_SECONDS), ENV_SWEEP_INTERVAL: "1"}
    with operator(platform, ns, pool_of_free_ports(16), tmp_path, env=env):
        recorder = PodRecorder(api, ns)
        api.create_pair(ns, "busy")
        first = wait_for(lambda: decode_pod(api, ns, 1), 60, "the first decode pod, bound to a node")
        node, busy = first["spec"]["node_name"], side_port(first)

        # "A debugger" on the node holds the leased side-channel port, on another loopback address: the preflight's
        # 0.0.0.0 bind clashes with it, while the operator's probe of the pod IP (127.0.0.1, kwok marks the pod
        # Running at once, before any engine could listen) finds nothing there.
        with socket.socket() as foreign:
            foreign.bind((FOREIGN_HOST, busy))
            foreign.listen(4)
            init, proc, message = run_preflight_like_the_container(first, tmp_path)
            assert proc.returncode == 1, proc.stdout + proc.stderr
            assert parse_ports_in_use(message) == (busy,), message
            kubelet_reports_failure(api, ns, first, init, proc.returncode, message)

            lease = wait_for(lambda: quarantine_lease(api, busy), 60, f"a quarantine lease on port {busy}")
            assert lease.spec.holder_identity == f"{QUARANTINE_HOLDER_PREFIX}{node}"
            assert lease.spec.lease_duration_seconds == QUARANTINE_SECONDS
            assert lease.metadata.annotations[ANNOTATION_QUARANTINE_NODE] == node

            second = wait_for(lambda: decode_pod(api, ns, 2), 60, "the decode pod of generation 2")
            moved = side_port(second)
            assert moved != busy
            pair = api.pair(ns, "busy")
            listed = {p["port"] for p in pair["status"]["ports"]}
            assert busy not in listed and moved in listed
            events = [e for e in api.events(ns) if e.involved_object.kind == KIND and e.reason == "PortInUse"]
            assert events, "no PortInUse Event"
            text = events[0].message
            assert str(busy) in text and node in text and str(moved) in text, text
            # outside the restart budget: no restart time recorded; the status says why it restarted
            annotations = pair["metadata"].get("annotations") or {}
            assert json.loads(annotations.get(ANNOTATION_RESTART_TIMES, "[]")) == []
            assert str(busy) in pair["status"]["lastRestart"]["reason"]
            # the operator left the foreign process alone: its port still answers
            with socket.create_connection((FOREIGN_HOST, busy), timeout=5):
                pass

        # The new decode's preflight passes on the new ports, and its listener opens: the pair goes Ready.
        init, proc, message = run_preflight_like_the_container(second, tmp_path)
        assert proc.returncode == 0 and message == "", proc.stdout + proc.stderr
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", moved))
            listener.listen(16)
            wait_for(lambda: api.pair(ns, "busy")["status"].get("phase") == "Ready", 60, "phase Ready")
        # decode-first: the new decode came after the failed one was gone, the prefill after the new decode
        order = recorder.order()
        recorder.stop()
        created = recorder.created()
        # prefill g1 exists only if decode g1 ran before its port check failed it (parallel start); it went first
        assert created[0] == "busy-decode-g1" and created[-2:] == ["busy-decode-g2", "busy-prefill-g2"], order
        assert set(created) <= {"busy-decode-g1", "busy-prefill-g1", "busy-decode-g2", "busy-prefill-g2"}, order
        if "busy-prefill-g1" in created:
            assert order.index("delete busy-prefill-g1") < order.index("delete busy-decode-g1"), order
        assert order.index("delete busy-decode-g1") < order.index("create busy-decode-g2"), order
        assert all(p["metadata"]["labels"][LABEL_GENERATION] == "2" for p in api.pods(ns))

        # The quarantine ends after its TTL (the orphan sweep, every second here, does not end it early).
        acquired = lease.spec.acquire_time.timestamp()
        wait_for(lambda: quarantine_lease(api, busy) is None, 120, "the quarantine to end")
        assert time.time() >= acquired + QUARANTINE_SECONDS - 1  # 1 s of timestamp rounding (MicroTime vs RFC3339)
        assert side_port(decode_pod(api, ns, 2)) == moved  # the running pair keeps its new ports
        cleanup_pairs(api, ns)
        assert api.leases(ns) == []


def test_an_operator_that_died_after_the_quarantine_finishes_the_move(
        platform, cluster_namespace, tmp_path, no_quarantine_left):
    """Level-triggered: the operator quarantined the port and died before leasing a replacement and restarting. The
    next operator reads the same facts (the Failed pod's message, the quarantine Lease) and finishes: replacement
    ports, generation 2 decode-first, Ready; the quarantine stays."""
    import asyncio

    from pdpair.operator.model.config import PortPool
    from pdpair.operator.act.port_leaser import PairRef, PortLeaser

    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    pool = pool_of_free_ports(16)
    with operator(platform, ns, pool, tmp_path, name="operator-1"):
        api.create_pair(ns, "again")
        first = wait_for(lambda: decode_pod(api, ns, 1), 60, "the first decode pod, bound to a node")
    node, busy = first["spec"]["node_name"], side_port(first)
    with socket.socket() as foreign:
        foreign.bind((FOREIGN_HOST, busy))
        foreign.listen(4)
        init, proc, message = run_preflight_like_the_container(first, tmp_path)
    assert proc.returncode == 1 and parse_ports_in_use(message) == (busy,), message
    kubelet_reports_failure(api, ns, first, init, proc.returncode, message)
    # The step the first operator finished before it died (its own code, against the same API server).
    pair = api.pair(ns, "again")
    ref = PairRef(ns, "again", pair["metadata"]["uid"])
    leaser = PortLeaser(api.coord, OPERATOR_NS, PortPool.parse(pool))
    assert asyncio.run(leaser.quarantine(ref, busy, node, 600, "test: done before the crash")) is True
    assert quarantine_lease(api, busy) is not None

    with operator(platform, ns, pool, tmp_path, name="operator-2"):
        second = wait_for(lambda: decode_pod(api, ns, 2), 60, "the decode pod of generation 2")
        moved = side_port(second)
        assert moved != busy
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", moved))
            listener.listen(16)
            ready = wait_for(lambda: (lambda p: p if p["status"].get("phase") == "Ready" else None)(
                api.pair(ns, "again")), 60, "phase Ready")
        assert str(busy) in ready["status"]["lastRestart"]["reason"] and ready["status"]["pairGeneration"] == 2
        assert busy not in {p["port"] for p in ready["status"]["ports"]}
        assert json.loads((ready["metadata"].get("annotations") or {}).get(ANNOTATION_RESTART_TIMES, "[]")) == []
        lease = quarantine_lease(api, busy)
        assert lease is not None and lease.spec.holder_identity == f"{QUARANTINE_HOLDER_PREFIX}{node}"
        cleanup_pairs(api, ns)
        assert api.leases(ns) == []
