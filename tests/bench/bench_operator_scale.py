#!/usr/bin/env python3
"""The operator at scale: N InferencePairs to Ready on kwok nodes, against the real local control
plane (devcluster/localcluster.py), compared with a floor measured in the same run.

One run, in order:
1. baseline: the cluster's own write rate with no operator (kwok node leases, controllers), from the apiserver's
   `apiserver_request_total`;
2. operator: create N pairs (router disabled: decode + prefill per pair) and time until every pair is phase Ready.
   Every pool port listens on 127.0.0.1 (kwok pods have IP 127.0.0.1), so the decode gate's probe passes. The
   apiserver's write counters before and after give the operator's writes by (verb, group, resource, subresource);
3. idle: the operator's RSS every few seconds and the apiserver's write rate, with nothing changing;
4. restart: SIGTERM, start a new operator, time until it has reconciled every pair (its own
   `pdpair_operator_pairs{phase="Ready"}` = N), and count its writes meanwhile (should be ~0);
5. floor: with the operator stopped, the same N pair creates plus the same number of writes of each kind the
   operator made (leases, pods built by the operator's own manifest code, status patches, metadata patches, Events),
   issued directly with the kubernetes client from as many threads as the operator run used (creator threads + the
   operator's PDPAIR_API_THREADS), into a namespace no operator watches; timed until every write returned and every
   floor pod is Running (the scheduler and kwok do the same work for both).
Prints a Markdown summary and writes JSON (--out). Not part of CI (too big); the CI-sized invariant check is
tests/e2e/test_operator_scale_idle.py.

    python tests/bench/bench_operator_scale.py --pairs 1000 --idle-seconds 180 --out /tmp/scale.json
"""
from __future__ import annotations

import argparse
import atexit
import faulthandler
import secrets
import signal
import collections
import concurrent.futures
import json
import os
import pathlib
import selectors
import socket
import sys
import threading
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "src"))

from pdpair.contract import (  # noqa: E402
    API_VERSION, GROUP, KIND, LABEL_PAIR_UID, PLURAL, ROLE_OBJECT_PLURAL, VERSION,
)
from pdpair.operator.build.disruption import pair_budget  # noqa: E402
from pdpair.operator.act.push import token_secret  # noqa: E402
from pdpair.operator.build.role_object import role_object
from pdpair.operator.decide.scale_targets import role_selector  # noqa: E402
from pdpair.operator.decide.scale_targets import status_patch as role_status_patch  # noqa: E402
from pdpair.operator.model import config as opconfig  # noqa: E402
from devcluster import operator_process as devrun  # noqa: E402
from pdpair.operator.build.pods import engine_pod  # noqa: E402
from pdpair.operator.decide.port_blocks import assign
from tests.port_blocks_support import spec_blocks
from pdpair.operator.act.port_leaser import status_ports  # noqa: E402
from devcluster.apiserver_metrics import READ_VERBS, by_kind, counts_delta, key_name, request_counts, write_counts  # noqa: E402
from devcluster.build import build, helm_path  # noqa: E402
from devcluster.localcluster import LocalCluster  # noqa: E402
import quiet  # noqa: E402  (tests/bench/quiet.py: the load guard)

OPERATOR_NS = "pdpair-system"
OPERATOR_ACCOUNT = "pdpair-operator"  # the chart's ServiceAccount (devcluster.operator_process.render_rbac)
PAIR_NS = "scale"
FLOOR_NS = "scale-floor"
CREATOR_THREADS = 16
# The chart's defaults (devrun's test defaults are faster); health scraping is off: kwok pods serve no /metrics.
OPERATOR_ENV = {
    opconfig.ENV_PROBE_INTERVAL: "1",
    opconfig.ENV_RESYNC_INTERVAL: "30",
    opconfig.ENV_POOL_RETRY: "5",
    opconfig.ENV_SWEEP_INTERVAL: "60",
    opconfig.ENV_HEALTH_INTERVAL: "3600",
}
PAIR_SPEC = {"model": "m", "image": "img:1", "network": {"hostNetwork": True}, "router": {"enabled": False}}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# Writes the operator makes (and the floor replays); everything else is the cluster's own (scheduler bindings, kwok
# pod status and node leases, the scheduler's events.k8s.io Events) and happens for the floor's pods just the same.
OPERATOR_KEYS = {
    ("POST", "coordination.k8s.io", "leases", ""),
    ("DELETE", "coordination.k8s.io", "leases", ""),
    ("POST", "", "pods", ""),
    ("DELETE", "", "pods", ""),
    ("PATCH", GROUP, PLURAL, "status"),
    ("PATCH", GROUP, PLURAL, ""),
    ("POST", "", "events", ""),
    ("PATCH", "", "events", ""),
    ("POST", "", "services", ""),
    ("PATCH", "", "services", ""),
    # each pair's push-token Secret, its role objects (the per-role /scale targets) and their status, its PDB: the
    # operator's too (the floor replayed none of them until 2026-12-05, 6780 of 20943 writes at 1000 pairs)
    ("POST", "", "secrets", ""),
    ("POST", GROUP, ROLE_OBJECT_PLURAL, ""),
    ("PATCH", GROUP, ROLE_OBJECT_PLURAL, ""),
    ("PATCH", GROUP, ROLE_OBJECT_PLURAL, "status"),
    ("POST", "policy", "poddisruptionbudgets", ""),
    ("PATCH", "policy", "poddisruptionbudgets", ""),
}


# --- the pool's listeners: the decode gate's probe must find something listening -----------------------------
class PoolListeners:
    def __init__(self, size: int):
        self.sockets: list[socket.socket] = []
        self.first = self._bind_range(size)
        self.last = self.first + size - 1
        self._sel = selectors.DefaultSelector()
        for s in self.sockets:
            s.setblocking(False)
            self._sel.register(s, selectors.EVENT_READ)
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _bind_range(self, size: int) -> int:
        first_ephemeral = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
        for start in range(20000, first_ephemeral - size, 500):
            socks = []
            try:
                for port in range(start, start + size):
                    s = socket.socket()
                    socks.append(s)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("127.0.0.1", port))
                    s.listen(64)
            except OSError:
                for s in socks:
                    s.close()
                continue
            self.sockets = socks
            return start
        raise SystemExit(f"no free range of {size} ports below {first_ephemeral}")

    # What a request to a pool port gets: the kwok pods' ports are served by nothing of pdpair's, so the operator's push
    # of decode's address to a prefill's metrics port is answered as a server without that endpoint would (a refusal
    # the operator retries on events and resyncs), not left without an answer (a transport failure it retries within
    # seconds: pass_timing.push_retry_delay), which no real pod does.
    NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"

    def _accept(self):
        while not self._stop:
            for key, _ in self._sel.select(timeout=0.5):
                if key.data is not None:  # a connection: read the whole request, answer it, close
                    conn, request = key.fileobj, key.data
                    try:
                        chunk = conn.recv(65536)
                    except OSError:
                        chunk = b""
                    request += chunk
                    head, sep, body = bytes(request).partition(b"\r\n\r\n")
                    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), 0) if sep else 0
                    if chunk and not (sep and len(body) >= length):
                        continue  # more of the request to come
                    self._sel.unregister(conn)
                    if sep:
                        try:
                            conn.sendall(self.NOT_FOUND)
                        except OSError:
                            pass
                    conn.close()  # a probe's connection ends without a request: closed
                    continue
                try:
                    conn, _ = key.fileobj.accept()
                    conn.setblocking(False)
                    self._sel.register(conn, selectors.EVENT_READ, bytearray())
                except OSError:
                    pass

    def close(self):
        self._stop = True
        self._thread.join(5)
        for s in self.sockets:
            s.close()


# --- watching phases without polling the apiserver with big lists ---------------------------------------------
class Watcher:
    """Counts objects in a namespace that satisfy `done(obj)`, via one watch (re-listed if the watch ends)."""

    def __init__(self, list_fn, args: tuple, done):
        self.list_fn, self.args, self.done = list_fn, args, done
        self.state: dict[str, bool] = {}
        self.cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        from kubernetes import watch

        while not self._stop:
            try:
                w = watch.Watch()
                # plain JSON, no client models: the floor's pod watch (6000 events) would otherwise spend seconds of
                # the floor's CPU building V1Pod objects that the operator's phase (a watch of pair dicts) does not
                for ev in w.stream(self.list_fn, *self.args, timeout_seconds=120, deserialize=False):
                    obj = ev["object"]
                    name = obj["metadata"]["name"]
                    with self.cond:
                        if ev["type"] == "DELETED":
                            self.state.pop(name, None)
                        else:
                            self.state[name] = bool(self.done(obj))
                        self.cond.notify_all()
                    if self._stop:
                        w.stop()
            except Exception as exc:  # the stream broke: watch again (the state is re-filled by the initial list)
                log(f"watch restarted: {type(exc).__name__}: {exc}")
                time.sleep(1)

    def count(self) -> int:
        with self.cond:
            return sum(self.state.values())

    def wait(self, n: int, timeout: float, what: str) -> float:
        started = time.monotonic()
        deadline = started + timeout
        last_report = started
        with self.cond:
            while sum(self.state.values()) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SystemExit(f"timed out after {timeout:.0f}s: {sum(self.state.values())}/{n} {what}")
                self.cond.wait(min(left, 5))
                if time.monotonic() - last_report > 30:
                    last_report = time.monotonic()
                    log(f"  {sum(self.state.values())}/{n} {what}")
        return time.monotonic() - started

    def stop(self):
        self._stop = True


def rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def operator_metric(proc: devrun.OperatorProcess, name: str, labels: str = "") -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + (("{" + labels + "}") if labels else " ")):
            return float(line.rsplit(" ", 1)[1])
    return None


def cluster_cpu(cluster: LocalCluster) -> dict[str, float]:
    """CPU seconds used so far by each control-plane process (apiserver, etcd, scheduler, controller-manager, kwok):
    compared between the operator's phase and the floor's, it says where the box's two cores went."""
    out = {}
    for component in cluster._components:
        if component.process is not None and component.process.poll() is None:
            out[component.name] = round(cpu_seconds(component.process.pid), 2)
    return out


def box_cpu() -> dict[str, float]:
    """The box's CPU seconds so far from /proc/stat: busy (user, nice, system, irq, softirq) and steal (time the
    hypervisor gave to someone else: a phase with steal ran on less than the box's cores)."""
    fields = [int(v) for v in pathlib.Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = fields[:8]
    return {"busy": (user + nice + system + irq + softirq) / tick, "idle": (idle + iowait) / tick, "steal": steal / tick}


def box_cpu_delta(before: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before[k], 2) for k, v in box_cpu().items()}


def wait_cluster_quiet(cluster: LocalCluster, cores: float = 0.25, window: float = 5.0, timeout: float = 180.0
                       ) -> dict[str, float]:
    """Wait until the control plane used less than `cores` of CPU over `window` seconds (the garbage collector and the
    disruption controller work through the last phase's objects for a while), so that the operator's phase and the
    floor each start from a quiet control plane. Returns how long it waited and the last rate."""
    started = time.monotonic()
    while True:
        before = sum(cluster_cpu(cluster).values())
        time.sleep(window)
        rate = (sum(cluster_cpu(cluster).values()) - before) / window
        waited = time.monotonic() - started
        if rate < cores or waited > timeout:
            return {"waited_seconds": round(waited, 1), "control_plane_cores": round(rate, 2)}


def thread_cpu(pid: int) -> dict[str, float]:
    """The operator's CPU seconds by thread: the main thread (kopf's event loop and every pass) apart from the rest
    (the API client threads, the watch streams' reads, the metrics server)."""
    main, others = 0.0, 0.0
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            seconds = cpu_seconds_of(task / "stat")
        except OSError:
            continue
        if task.name == str(pid):
            main += seconds
        else:
            others += seconds
    return {"main_thread": round(main, 2), "other_threads": round(others, 2)}


def cpu_seconds_of(stat: pathlib.Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    return cpu_seconds_of(pathlib.Path(f"/proc/{pid}/stat"))


def load_avg() -> str:
    return " / ".join(open("/proc/loadavg").read().split()[:3])


def operator_flow_schema(level: str) -> dict:
    """A FlowSchema that puts every request of the operator's ServiceAccount in priority level `level`, ahead of the
    built-in `service-accounts` schema (9000) and the chart's (operator.apiPriority.matchingPrecedence, 1000)."""
    return {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema",
            "metadata": {"name": "bench-pdpair-operator"},
            "spec": {"priorityLevelConfiguration": {"name": level}, "matchingPrecedence": 500,
                     "distinguisherMethod": {"type": "ByUser"},
                     "rules": [{"subjects": [{"kind": "ServiceAccount", "serviceAccount": {
                                    "name": OPERATOR_ACCOUNT, "namespace": OPERATOR_NS}}],
                                "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                                   "namespaces": ["*"], "clusterScope": True}],
                                "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}]}]}}


# --- the floor: the same writes, issued directly -----------------------------------------------------------
def floor_plan(op_writes: collections.Counter, n: int) -> list[list[tuple]]:
    """Per pair, the list of writes to replay: the operator's totals of each kind spread evenly over the pairs."""
    per_pair: list[list[tuple]] = [[] for _ in range(n)]
    order = [("POST", "coordination.k8s.io", "leases", ""), ("PATCH", GROUP, PLURAL, ""),
             ("PATCH", GROUP, PLURAL, "status"), ("POST", "", "secrets", ""), ("POST", GROUP, ROLE_OBJECT_PLURAL, ""),
             ("PATCH", GROUP, ROLE_OBJECT_PLURAL, "status"), ("POST", "policy", "poddisruptionbudgets", ""),
             ("POST", "", "pods", ""), ("POST", "", "events", "")]
    keys = order + sorted(k for k in op_writes if k not in order)
    for key in keys:
        total = op_writes.get(key, 0)
        for i in range(total):
            per_pair[i % n].append(key)
    return per_pair


def fake_ports(base: int) -> list[dict]:
    assignments = []
    for block in spec_blocks(PAIR_SPEC):
        assignments += assign(block, base)
        base += block.count
    return status_ports(assignments)


def run_floor(cluster: LocalCluster, op_writes: collections.Counter, n: int, threads: int, timeout: float) -> dict:
    from kubernetes import client

    api = cluster.api_client()
    core, custom, coord = client.CoreV1Api(api), client.CustomObjectsApi(api), client.CoordinationV1Api(api)
    policy = client.PolicyV1Api(api)
    api.configuration.connection_pool_maxsize = threads
    plan = floor_plan(op_writes, n)
    skipped: collections.Counter = collections.Counter()
    pods_expected = op_writes.get(("POST", "", "pods", ""), 0)
    running = Watcher(core.list_namespaced_pod, (FLOOR_NS,), lambda p: (p.get("status") or {}).get("phase") == "Running")
    counter = iter(range(10**9))
    lock = threading.Lock()

    def next_id() -> int:
        with lock:
            return next(counter)

    def one_pair(i: int) -> None:
        name = f"f{i:04d}"
        pair = custom.create_namespaced_custom_object(GROUP, VERSION, FLOOR_NS, PLURAL, {
            "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": PAIR_SPEC})
        uid = pair["metadata"]["uid"]
        leases = 0
        pods = 0
        roles: list[str] = []  # the role objects made for this pair (the status patches go to them in turn)
        ports = fake_ports(40000 + 8 * i)  # for the pod manifests; nothing binds them
        for step, key in enumerate(plan[i]):
            verb, group, resource, sub = key
            if key == ("POST", "coordination.k8s.io", "leases", ""):
                coord.create_namespaced_lease(FLOOR_NS, client.V1Lease(
                    metadata=client.V1ObjectMeta(name=f"floor-{name}-{leases}", labels={
                        "pdpair.io/port-lease": "true", LABEL_PAIR_UID: uid, "pdpair.io/pair": name}),
                    spec=client.V1LeaseSpec(holder_identity=f"{FLOOR_NS}/{name}/{uid}")))
                leases += 1
            elif key == ("POST", "", "pods", ""):
                role = "decode" if pods % 2 == 0 else "prefill"
                manifest = engine_pod(pair, role, 1, ports, "floor", peer_host="127.0.0.1" if role == "prefill" else None)
                manifest["metadata"]["name"] = f"{manifest['metadata']['name']}-{pods}"
                core.create_namespaced_pod(FLOOR_NS, manifest)
                pods += 1
            elif key == ("PATCH", GROUP, PLURAL, "status"):
                custom.patch_namespaced_custom_object_status(GROUP, VERSION, FLOOR_NS, PLURAL, name, {"status": {
                    "phase": "Pending", "message": f"floor write {step}", "pairGeneration": 1}})
            elif key == ("PATCH", GROUP, PLURAL, ""):
                custom.patch_namespaced_custom_object(GROUP, VERSION, FLOOR_NS, PLURAL, name, {
                    "metadata": {"annotations": {"bench.pdpair.io/floor": str(step)}}})
            elif key == ("POST", "", "secrets", ""):
                core.create_namespaced_secret(FLOOR_NS, token_secret(pair, f"{name}-token-{step}", secrets.token_urlsafe(32)))
            elif key == ("POST", GROUP, ROLE_OBJECT_PLURAL, ""):
                role = ("decode", "prefill")[len(roles) % 2]
                manifest = role_object(pair, role, 1)
                manifest["metadata"]["name"] += "" if len(roles) < 2 else f"-{len(roles)}"
                custom.create_namespaced_custom_object(GROUP, VERSION, FLOOR_NS, ROLE_OBJECT_PLURAL, manifest)
                roles.append(manifest["metadata"]["name"])
            elif key == ("PATCH", GROUP, ROLE_OBJECT_PLURAL, "status") and roles:
                custom.patch_namespaced_custom_object_status(
                    GROUP, VERSION, FLOOR_NS, ROLE_OBJECT_PLURAL, roles[step % len(roles)],
                    role_status_patch(1, step % 2, role_selector(uid, "decode")))
            elif key == ("POST", "policy", "poddisruptionbudgets", ""):
                manifest = pair_budget(pair)
                manifest["metadata"]["name"] += f"-{step}"
                policy.create_namespaced_pod_disruption_budget(FLOOR_NS, manifest)
            elif key == ("POST", "", "events", ""):
                core.create_namespaced_event(FLOOR_NS, client.CoreV1Event(
                    metadata=client.V1ObjectMeta(generate_name=f"{name}."),
                    involved_object=client.V1ObjectReference(api_version=API_VERSION, kind=KIND, name=name,
                                                             namespace=FLOOR_NS, uid=uid),
                    reason="FloorWrite", message=f"floor write {step}", type="Normal", count=1,
                    source=client.V1EventSource(component="bench"),
                    first_timestamp=None, last_timestamp=None))
            else:
                with lock:
                    skipped[key] += 1

    before = write_counts(cluster)
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(one_pair, i) for i in range(n)]:
            f.result()
    writes_done = time.monotonic() - started
    log(f"floor: every write returned after {writes_done:.1f}s; waiting for {pods_expected} pods Running"
        + (f"; not replayed (no replay for these kinds): {dict(skipped)}" if skipped else ""))
    running.wait(pods_expected, timeout, "floor pods Running")
    total = time.monotonic() - started
    running.stop()
    writes = counts_delta(write_counts(cluster), before)
    return {"writes_seconds": writes_done, "seconds": total, "skipped": {key_name(k): v for k, v in skipped.items()},
            "writes": {key_name(k): v for k, v in sorted(writes.items())}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--idle-seconds", type=float, default=180, help="RSS and write-rate sampling with nothing changing")
    parser.add_argument("--baseline-seconds", type=float, default=30)
    parser.add_argument("--timeout", type=float, default=3600, help="for each wait")
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--workdir", type=pathlib.Path, help="keep the cluster's and operator's files here")
    parser.add_argument("--operator-priority-level", default=None, metavar="LEVEL",
                        help="a FlowSchema ahead of the chart's puts the operator's ServiceAccount in this API Priority "
                             "and Fairness level (e.g. exempt, or workload-low: where it falls without the chart's "
                             "objects). Default: the chart's own level (operator.apiPriority, installed with the "
                             "RBAC). The floor always runs as cluster admin (exempt)")
    args = parser.parse_args()
    result_box = {"box_before": quiet.require_quiet("bench_operator_scale")}  # exits when the box is too busy to measure
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the cluster stops, the operators are killed
    started_operators: list[devrun.OperatorProcess] = []
    atexit.register(lambda: [o.kill() for o in started_operators])
    n = args.pairs
    api_threads = int(os.environ.get(opconfig.ENV_API_THREADS, "32"))
    result: dict = {"pairs": n, "load_before": load_avg(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    log(f"{n} pairs; load average {result['load_before']}")

    build()
    workdir = args.workdir or pathlib.Path(f"/tmp/pdpair-scale-{os.getpid()}")
    workdir.mkdir(parents=True, exist_ok=True)
    listeners = PoolListeners(6 * n + 60)
    pool = f"{listeners.first}-{listeners.last}"
    log(f"port pool {pool}: every port listens on 127.0.0.1")
    from kubernetes import client

    with LocalCluster(workdir / "cluster") as cluster:
        devrun.install_crd(cluster)
        kubeconfig = devrun.install_operator_rbac(cluster, helm_path(), OPERATOR_NS)
        if args.operator_priority_level:
            cluster.kubectl("apply", "-f", "-", input=json.dumps(operator_flow_schema(args.operator_priority_level)))
            log(f"the operator's requests: priority level {args.operator_priority_level} (FlowSchema)")
        result["operator_priority_level"] = args.operator_priority_level or "the chart's (operator.apiPriority)"
        for ns in (PAIR_NS, FLOOR_NS):
            cluster.create_namespace(ns)
        for i in range(2):
            cluster.add_node(f"kwok-scale-{i}", ip="127.0.0.1", capacity={"pods": str(2 * n + 100), "cpu": "10000",
                                                                          "memory": "100Ti"})
        api = cluster.api_client()
        api.configuration.connection_pool_maxsize = CREATOR_THREADS
        custom = client.CustomObjectsApi(api)

        # 1. baseline
        before = write_counts(cluster)
        time.sleep(args.baseline_seconds)
        base = counts_delta(write_counts(cluster), before)
        base_rate = sum(base.values()) / args.baseline_seconds
        result["baseline_writes_per_s"] = base_rate
        log(f"baseline (no operator): {base_rate:.2f} writes/s: " + ", ".join(f"{key_name(k)} {v}" for k, v in base.items()))

        # 2. operator: N pairs to Ready
        result["quiet_before_operator"] = wait_cluster_quiet(cluster)
        log(f"control plane quiet before the operator: {result['quiet_before_operator']}")
        ready = Watcher(custom.list_namespaced_custom_object, (GROUP, VERSION, PAIR_NS, PLURAL),
                        lambda p: (p.get("status") or {}).get("phase") == "Ready")
        op = devrun.OperatorProcess(kubeconfig, OPERATOR_NS, pool, workdir / "operator-1.log",
                                    extra_env={opconfig.ENV_WATCH_NAMESPACES: PAIR_NS, **OPERATOR_ENV})
        started_operators.append(op)
        op.start()
        rss_start = rss_mib(op.proc.pid)
        before = write_counts(cluster)
        cluster_cpu_before = cluster_cpu(cluster)
        box_before = box_cpu()
        reads_before = request_counts(cluster, READ_VERBS)
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(CREATOR_THREADS) as tp:
            list(tp.map(lambda i: custom.create_namespaced_custom_object(GROUP, VERSION, PAIR_NS, PLURAL, {
                "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": f"p{i:04d}"}, "spec": PAIR_SPEC}),
                range(n)))
        created = time.monotonic() - started
        log(f"{n} pairs created in {created:.1f}s; waiting for Ready")
        ready.wait(n, args.timeout, "pairs Ready")
        op_seconds = time.monotonic() - started
        write_counts_at_ready = write_counts(cluster)
        op_all = counts_delta(write_counts_at_ready, before)
        op_writes = collections.Counter({k: v for k, v in by_kind(op_all, ok_only=True).items() if k in OPERATOR_KEYS})
        op_refused = {key_name(k): v for k, v in sorted(op_all.items()) if k[:4] in OPERATOR_KEYS and not k[4].startswith("2")}
        result.update(operator_seconds=op_seconds, create_seconds=created, rss_start_mib=rss_start,
                      rss_ready_mib=rss_mib(op.proc.pid), load_after_create=load_avg(),
                      operator_writes={key_name(k): v for k, v in sorted(op_writes.items())},
                      operator_writes_per_pair=sum(op_writes.values()) / n,
                      operator_refused_writes=op_refused,
                      cluster_writes={key_name(k): v for k, v in sorted(op_all.items()) if k[:4] not in OPERATOR_KEYS})
        log(f"operator: {n} pairs Ready after {op_seconds:.1f}s; {sum(op_writes.values())} operator writes "
            f"({sum(op_writes.values()) / n:.1f}/pair; refused {op_refused}); RSS {result['rss_ready_mib']:.0f} MiB; load {load_avg()}")

        result["operator_cpu_seconds_to_ready"] = cpu_seconds(op.proc.pid)
        result["operator_thread_cpu_to_ready"] = thread_cpu(op.proc.pid)
        passes = operator_metric(op, "pdpair_operator_reconcile_seconds_count")
        result["passes_per_pair_to_ready"] = passes / n if passes is not None else None
        result["cluster_cpu_operator_phase"] = {k: round(v - cluster_cpu_before.get(k, 0.0), 2)
                                                for k, v in cluster_cpu(cluster).items()}
        result["box_cpu_operator_phase"] = box_cpu_delta(box_before)
        result["reads_operator_phase"] = {key_name(k): v for k, v in sorted(
            counts_delta(request_counts(cluster, READ_VERBS), reads_before).items())}
        log(f"reads meanwhile (everyone's): {result['reads_operator_phase']}")
        log(f"operator CPU to Ready {result['operator_cpu_seconds_to_ready']:.1f}s "
            f"({result['operator_thread_cpu_to_ready']}); passes/pair {result['passes_per_pair_to_ready']}; "
            f"control plane CPU meanwhile {result['cluster_cpu_operator_phase']}; box {result['box_cpu_operator_phase']}")

        # 3. settle (kopf posts Events from a queue, after the step that emitted them), then idle: RSS and write rate
        t0 = time.monotonic()
        last = write_counts(cluster)
        while time.monotonic() - t0 < args.timeout:
            time.sleep(10)
            now = write_counts(cluster)
            recent = sum(v for k, v in counts_delta(now, last).items() if k[:4] in OPERATOR_KEYS)
            last = now
            if recent == 0:
                break
        settle = counts_delta(last, write_counts_at_ready)
        result.update(settle_seconds=time.monotonic() - t0, rss_settled_mib=rss_mib(op.proc.pid),
                      settle_writes={key_name(k): v for k, v in sorted(settle.items()) if k[:4] in OPERATOR_KEYS})
        log(f"settled {result['settle_seconds']:.0f}s after Ready (no operator writes for 10 s); writes after Ready: "
            f"{result['settle_writes']}")
        cpu_idle_start = cpu_seconds(op.proc.pid)
        samples = []
        before = write_counts(cluster)
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.idle_seconds:
            samples.append((round(time.monotonic() - t0, 1), round(rss_mib(op.proc.pid), 1)))
            time.sleep(min(10.0, args.idle_seconds / 12))
        idle_seconds = time.monotonic() - t0
        samples.append((round(idle_seconds, 1), round(rss_mib(op.proc.pid), 1)))
        idle = counts_delta(write_counts(cluster), before)
        idle_rate = sum(idle.values()) / idle_seconds
        idle_op = sum(v for k, v in idle.items() if k[:4] in OPERATOR_KEYS)
        result.update(idle_seconds=idle_seconds, idle_cpu_fraction=(cpu_seconds(op.proc.pid) - cpu_idle_start) / idle_seconds, idle_rss_samples=samples, idle_writes_per_s=idle_rate,
                      idle_operator_writes=idle_op, idle_writes={key_name(k): v for k, v in sorted(idle.items())},
                      idle_writes_per_s_above_baseline=idle_rate - base_rate,
                      ready_after_idle=ready.count())
        log(f"idle {idle_seconds:.0f}s: {idle_rate:.2f} writes/s (baseline {base_rate:.2f}), operator kinds {idle_op}; "
            f"RSS {samples[0][1]} -> {samples[-1][1]} MiB; operator CPU {100 * result['idle_cpu_fraction']:.1f}%")

        # 4. restart
        op.stop()
        before = write_counts(cluster)
        op2 = devrun.OperatorProcess(kubeconfig, OPERATOR_NS, pool, workdir / "operator-2.log",
                                     extra_env={opconfig.ENV_WATCH_NAMESPACES: PAIR_NS, **OPERATOR_ENV})
        started_operators.append(op2)
        started = time.monotonic()
        op2.start(ready_timeout=300)
        deadline = started + args.timeout
        while (operator_metric(op2, "pdpair_operator_pairs", 'phase="Ready"') or 0) < n:
            if time.monotonic() > deadline:
                raise SystemExit("the restarted operator did not converge")
            time.sleep(0.5)
        restart_seconds = time.monotonic() - started
        restart = counts_delta(write_counts(cluster), before)
        result.update(restart_seconds=restart_seconds, restart_rss_mib=rss_mib(op2.proc.pid),
                      restart_writes={key_name(k): v for k, v in sorted(restart.items()) if k[:4] in OPERATOR_KEYS},
                      ready_after_restart=ready.count())
        log(f"restart: converged ({n} pairs reconciled, Ready) {restart_seconds:.1f}s after start; "
            f"operator writes meanwhile {result['restart_writes']}")
        op2.stop()
        ready.stop()

        # 5. floor
        threads = CREATOR_THREADS + api_threads
        result["quiet_before_floor"] = wait_cluster_quiet(cluster)
        log(f"control plane quiet before the floor: {result['quiet_before_floor']}")
        cluster_cpu_before = cluster_cpu(cluster)
        bench_cpu_before = cpu_seconds(os.getpid())
        box_before = box_cpu()
        reads_before = request_counts(cluster, READ_VERBS)
        floor = run_floor(cluster, op_writes, n, threads, args.timeout)
        floor["box_cpu"] = box_cpu_delta(box_before)
        floor["reads"] = {key_name(k): v for k, v in sorted(
            counts_delta(request_counts(cluster, READ_VERBS), reads_before).items())}
        log(f"floor reads (everyone's): {floor['reads']}")
        floor["cluster_cpu"] = {k: round(v - cluster_cpu_before.get(k, 0.0), 2) for k, v in cluster_cpu(cluster).items()}
        floor["client_cpu"] = round(cpu_seconds(os.getpid()) - bench_cpu_before, 2)
        result.update(floor=floor, floor_threads=threads, load_after=load_avg())
        result["ratio_to_floor"] = op_seconds / floor["seconds"]
        result["ratio_to_floor_writes_only"] = op_seconds / floor["writes_seconds"]
        log(f"floor: {floor['writes_seconds']:.1f}s writes, {floor['seconds']:.1f}s with pods Running; control plane "
            f"CPU {floor['cluster_cpu']}, the floor's client {floor['client_cpu']}s; box {floor['box_cpu']}")

    listeners.close()
    print()
    print("| pairs | operator to Ready | floor (writes + pods Running) | ratio | floor writes only | ratio | "
          "operator writes/pair | RSS Ready / idle start / idle end / restarted | settle | idle writes/s, operator's "
          "(all; baseline) | idle CPU | restart converge |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {n} | {op_seconds:.1f} s | {floor['seconds']:.1f} s | **{result['ratio_to_floor']:.2f}** | "
          f"{floor['writes_seconds']:.1f} s | {result['ratio_to_floor_writes_only']:.2f} | "
          f"{result['operator_writes_per_pair']:.1f} | {result['rss_ready_mib']:.0f} / {samples[0][1]:.0f} / "
          f"{samples[-1][1]:.0f} / {result['restart_rss_mib']:.0f} MiB | {result['settle_seconds']:.0f} s | "
          f"{idle_op / idle_seconds:.2f} ({idle_rate:.2f}; {base_rate:.2f}) | {100 * result['idle_cpu_fraction']:.1f}% | "
          f"{restart_seconds:.1f} s |")
    result.update(result_box, box_after=quiet.report_after("bench_operator_scale"))
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
