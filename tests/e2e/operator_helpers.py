"""Shared by the operator e2e tests (test_operator_lifecycle.py, test_operator_restart.py): an API wrapper,
the operator subprocess and a pod-event recorder (the `platform` fixture is in conftest.py). Not a test module.

The operator runs as `python -m pdpair.operator` under the chart's ServiceAccount and RBAC, watches only the test's
namespace and leases from a pool of its own; the kwok nodes have IP 127.0.0.1, so a test can open the real decode
listener the operator probes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pdpair.contract import (
    API_VERSION,
    GROUP,
    KIND,
    LABEL_PAIR_NAMESPACE,
    LABEL_PAIR_UID,
    LABEL_PORT_LEASE,
    LABEL_PORT_QUARANTINE,
    LEASE_NAME_PREFIX,
    PLURAL,
    PURPOSE_HTTP,
    PURPOSE_SIDECHANNEL,
    ROLE_DECODE,
    ROLE_ROUTER,
    VERSION,
    status_port_name,
)
from devcluster import operator_process
from devcluster.fixtures import OPERATOR_NAMESPACE
from devcluster.ports import free_port_range
from pdpair.operator.model.config import ENV_HEALTH_INTERVAL, ENV_WATCH_NAMESPACES
from devcluster.waiting import wait_for

OPERATOR_NS = OPERATOR_NAMESPACE  # one name: cluster_namespace cleans the port leases it holds
PORTS_PER_PAIR_NO_ROUTER = 6  # side channel + metrics + http, for decode and prefill (TP 1)
DECODE_SIDECHANNEL_0 = status_port_name(ROLE_DECODE, PURPOSE_SIDECHANNEL, 0)
ROUTER_HTTP_0 = status_port_name(ROLE_ROUTER, PURPOSE_HTTP, 0)


def own_nodes(cluster, api, label: str, pool: str, names, cordoned=()) -> dict:
    """kwok nodes of the test's own (`names`, labelled `label=pool`, `cordoned` ones unschedulable), tainted so that
    no other test's pod lands there; returns the placement (nodeSelector and toleration) that puts a role there."""
    for name in names:
        cluster.add_node(name, ip="127.0.0.1", labels={label: pool}, capacity={"pods": "100"})
        api.core.patch_node(name, {"spec": {"taints": [{"key": label, "value": pool, "effect": "NoSchedule"}],
                                            "unschedulable": name in cordoned}})
    return {"nodeSelector": {label: pool},
            "tolerations": [{"key": label, "operator": "Equal", "value": pool, "effect": "NoSchedule"}]}


class Api:
    def __init__(self, cluster):
        from kubernetes import client

        api = cluster.api_client()
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.coord = client.CoordinationV1Api(api)
        self.policy = client.PolicyV1Api(api)

    def create_pair(self, ns, name, **spec_overrides):
        spec = {"model": "m", "image": "img:1", "network": {"hostNetwork": True}, "router": {"enabled": False}}
        spec.update(spec_overrides)
        body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": spec}
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)

    def pairs(self, ns):
        return self.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]

    def pair(self, ns, name):
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)

    def delete_pair(self, ns, name):
        from kubernetes.client.exceptions import ApiException

        try:
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def fences(self, pod_prefix=""):
        """Port -> fenced pod of the operator's fence Leases (devcluster.product.fenced_ports)."""
        from devcluster.product import fenced_ports

        leases = self.coord.list_namespaced_lease(OPERATOR_NS, label_selector=f"{LABEL_PORT_QUARANTINE}=true").items
        return fenced_ports([self.coord.api_client.sanitize_for_serialization(l) for l in leases], pod_prefix)

    def pods(self, ns):
        return [p.to_dict() for p in self.core.list_namespaced_pod(ns).items]

    def leases(self, pair_ns=None):
        selector = f"{LABEL_PORT_LEASE}=true" + (f",{LABEL_PAIR_NAMESPACE}={pair_ns}" if pair_ns else "")
        return self.coord.list_namespaced_lease(OPERATOR_NS, label_selector=selector).items

    def events(self, ns):
        return self.core.list_namespaced_event(ns).items


def condition(pair, type_):
    return next((c for c in (pair.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def pool_of_free_ports(size):
    """A range of `size` ports where nothing listens now (the probe must not hit a stranger), below the ephemeral
    range, as the chart demands of a real pool: there an unused port can be taken by an outgoing connection, and a
    probe of it can connect to itself. Claimed machine-wide (devcluster/ports.py): another xdist worker's
    operator, or an engine of the tier beside this one, is never given a port of it."""
    return free_port_range(size)


# kwok pods run no engine, so nothing serves their /metrics: these tests keep the health watch
# (tests/e2e/test_operator_restart.py) out of the way with a very long interval.
NO_HEALTH = {ENV_HEALTH_INTERVAL: "3600"}


@contextlib.contextmanager
def operator(platform, ns, pool, tmp_path, name="operator", env=None, module="pdpair.operator"):
    cluster, kubeconfig = platform
    proc = operator_process.OperatorProcess(kubeconfig, OPERATOR_NS, pool, tmp_path / f"{name}.log",
                                  extra_env={ENV_WATCH_NAMESPACES: ns, **(NO_HEALTH if env is None else env)},
                                  module=module)
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def cleanup_pairs(api, ns, timeout=120):
    """Delete every pair (while the operator runs, so its finalizer releases the leases) and wait until gone."""
    for pair in api.pairs(ns):
        api.delete_pair(ns, pair["metadata"]["name"])
    wait_for(lambda: not api.pairs(ns), timeout, f"pairs in {ns} to be gone")


def create_many(api, ns, names, threads=16):
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda n: api.create_pair(ns, n), names))


def check_leases_match_status(api, ns, expected_pairs, ports_per_pair):
    """Every lease's pair exists and lists the port; every pair's status ports are exactly its leases."""
    pairs = {p["metadata"]["uid"]: p for p in api.pairs(ns)}
    assert len(pairs) == expected_pairs
    leases = api.leases(ns)
    lease_ports = collections.defaultdict(set)
    for lease in leases:
        port = int(lease.metadata.name.removeprefix(LEASE_NAME_PREFIX))
        uid = lease.metadata.labels[LABEL_PAIR_UID]
        assert uid in pairs, f"lease {lease.metadata.name} belongs to a pair that does not exist ({uid})"
        pair = pairs[uid]
        assert lease.spec.holder_identity.endswith(uid)
        lease_ports[uid].add(port)
    all_status_ports = []
    for uid, pair in pairs.items():
        status_ports = {p["port"] for p in (pair.get("status") or {}).get("ports") or []}
        assert status_ports == lease_ports[uid], f"{pair['metadata']['name']}: status {status_ports} vs leases {lease_ports[uid]}"
        assert len(status_ports) == ports_per_pair
        all_status_ports += list(status_ports)
    duplicates = [p for p, n in collections.Counter(all_status_ports).items() if n > 1]
    assert duplicates == [], f"duplicate ports: {duplicates}"
    assert len(leases) == expected_pairs * ports_per_pair
    return len(leases)


class PodRecorder:
    """Records pod creations and deletions in a namespace through a watch, in order.

    only_new: start the watch at the current resourceVersion, so pods that already exist are not reported as
    created (otherwise the watch's initial list shows up as "create" events).
    """

    def __init__(self, api, ns, only_new=False):
        from kubernetes import watch

        self.events: list[tuple[float, str, str]] = []
        self.error: BaseException | None = None
        self._seen_deleting: set[str] = set()
        self._watch = watch.Watch()
        self._stopping = False
        since = api.core.list_namespaced_pod(ns).metadata.resource_version if only_new else None
        self._thread = threading.Thread(target=self._run, args=(api, ns, since), daemon=True)
        self._thread.start()
        time.sleep(0.5)

    def _run(self, api, ns, since):
        try:
            self._stream(api, ns, since)
        except Exception as exc:  # the stream ends when stop() closes it; anything else is kept for the test
            if not self._stopping:
                self.error = exc

    def _stream(self, api, ns, since):
        extra = {"resource_version": since} if since else {}
        for ev in self._watch.stream(api.core.list_namespaced_pod, ns, timeout_seconds=600, **extra):
            pod = ev["object"]
            name = pod.metadata.name
            if ev["type"] == "ADDED":
                self.events.append((time.monotonic(), "create", name))
            elif pod.metadata.deletion_timestamp and name not in self._seen_deleting or ev["type"] == "DELETED":
                if name not in self._seen_deleting:
                    self._seen_deleting.add(name)
                    self.events.append((time.monotonic(), "delete", name))

    def stop(self):
        self._stopping = True
        self._watch.stop()

    def created(self):
        return [name for _, kind, name in self.events if kind == "create"]

    def order(self):
        return [f"{kind} {name}" for _, kind, name in self.events]


def router_answer(body: dict) -> dict:
    """The router's answer to a pushed set (router/app.py): its members, no request in flight (an idle router)."""
    def members(role: str) -> list[dict]:
        return [{"index": m["index"], "url": m["url"], "outstanding": 0, "involved": 0,
                 "draining": bool(m.get("draining"))} for m in body.get(role) or []]

    return {"epoch": body.get("epoch"), "generation": body.get("generation"), "prefills": members("prefills"),
            "decodes": members("decodes"), "leaving": [], "warnings": []}


class PushReceiver:
    """Serves PUT /pdpair/v1/peers on one port, as a prefill's connector (metrics port) or the router (http port)
    would, recording each body with its Authorization header; as the router (`router`), it answers the router's
    shape, to GET too (recorded in `reads`)."""

    def __init__(self, port: int, router: bool = False):
        received = self.received = []
        put_times = self.put_times = []  # time.monotonic() of each entry of `received`
        reads = self.reads = []

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self):  # noqa: N802 (http.server's name)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                received.append((self.path, self.headers.get("Authorization"), body))
                put_times.append(time.monotonic())
                self.answer(router_answer(body) if router else
                            {"epoch": body.get("epoch"), "generation": body.get("generation"), "paired": True})

            def do_GET(self):  # noqa: N802
                if not router:
                    self.send_error(405)
                    return
                reads.append((self.path, self.headers.get("Authorization")))
                last = received[-1][2] if received else {"epoch": None, "generation": None}
                self.answer(router_answer(last))

            def answer(self, doc: dict) -> None:
                answer = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def last(self):
        return self.received[-1] if self.received else None

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def pair_diagnosis(api, ns, name, proc) -> str:
    """What a failed wait on a pair prints: its status (less the port list), its pods' phases and IPs, and the
    operator's log tail."""
    pair = api.pair(ns, name)
    status = {k: v for k, v in (pair.get("status") or {}).items() if k != "ports"}
    pods = [(p["metadata"]["name"], p["status"].get("phase"), p["status"].get("pod_ip")) for p in api.pods(ns)]
    return f"status: {json.dumps(status, default=str)[:3000]}\npods: {pods}\noperator log:\n{proc.log_tail(4000)}"
