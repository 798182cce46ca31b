"""The operator on the real control plane (issue 2 "Done when"), under the chart's ServiceAccount and RBAC.

Every test starts its own operator subprocess (`python -m pdpair.operator`) that watches only the test's namespace
and leases from a pool of its own, on kwok nodes whose IP is 127.0.0.1, so the test can open the real decode
listener the operator probes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import socket
import threading
import time
import uuid

import pytest

from pdpair.contract import (
    API_VERSION,
    COND_DECODE_LISTENING,
    COND_PORTS_LEASED,
    ENV_GENERATION,
    ENV_LISTEN_PORT_BASE,
    ENV_PEER_HOST,
    ENV_PEER_PORT_BASE,
    GROUP,
    KIND,
    LABEL_GENERATION,
    LABEL_PAIR,
    LABEL_PAIR_NAMESPACE,
    LABEL_PAIR_UID,
    LABEL_PORT_LEASE,
    LABEL_PURPOSE,
    LABEL_ROLE,
    LEASE_NAME_PREFIX,
    PLURAL,
    PURPOSE_HTTP,
    PURPOSE_SIDECHANNEL,
    ROLE_DECODE,
    VERSION,
    status_port_name,
)
from pdpair.operator import devrun
from pdpair.operator.config import ENV_HEALTH_INTERVAL, ENV_WATCH_NAMESPACES
from tests.cluster.localcluster import helm_path

pytestmark = pytest.mark.cluster

OPERATOR_NS = "pdpair-system"
PORTS_PER_PAIR_NO_ROUTER = 6  # side channel + metrics + http, for decode and prefill (TP 1)
DECODE_SIDECHANNEL_0 = status_port_name(ROLE_DECODE, PURPOSE_SIDECHANNEL, 0)


# --- fixtures and helpers --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def platform(local_cluster):
    """CRD + chart RBAC installed, kwok nodes with IP 127.0.0.1, the operator's kubeconfig."""
    devrun.install_crd(local_cluster)
    kubeconfig = devrun.install_operator_rbac(local_cluster, helm_path(), OPERATOR_NS)
    for i in range(2):
        name = f"kwok-op-{i}"
        if local_cluster.kubectl("get", "node", name, check=False).returncode != 0:
            local_cluster.add_node(name, ip="127.0.0.1", capacity={"pods": "1000"})
    return local_cluster, kubeconfig


class Api:
    def __init__(self, cluster):
        from kubernetes import client

        api = cluster.api_client()
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.coord = client.CoordinationV1Api(api)

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

    def pods(self, ns):
        return [p.to_dict() for p in self.core.list_namespaced_pod(ns).items]

    def leases(self, pair_ns=None):
        selector = f"{LABEL_PORT_LEASE}=true" + (f",{LABEL_PAIR_NAMESPACE}={pair_ns}" if pair_ns else "")
        return self.coord.list_namespaced_lease(OPERATOR_NS, label_selector=selector).items

    def events(self, ns):
        return self.core.list_namespaced_event(ns).items


def wait_for(predicate, timeout, what, interval=0.25):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def condition(pair, type_):
    return next((c for c in (pair.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def pool_of_free_ports(size):
    """A range of `size` ports where nothing listens on 127.0.0.1 now (the probe must not hit a stranger)."""
    for start in range(41000, 60000 - size, size):
        if all(_bindable(p) for p in range(start, start + size)):
            return f"{start}-{start + size - 1}"
    raise AssertionError(f"no free range of {size} ports for the pool")


def _bindable(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


# kwok pods run no engine, so nothing serves their /metrics: these tests (issue 2) keep the health watch
# (issue 5, tests/e2e/test_operator_restart.py) out of the way with a very long interval.
NO_HEALTH = {ENV_HEALTH_INTERVAL: "3600"}


@contextlib.contextmanager
def operator(platform, ns, pool, tmp_path, name="operator", env=None):
    cluster, kubeconfig = platform
    proc = devrun.OperatorProcess(kubeconfig, OPERATOR_NS, pool, tmp_path / f"{name}.log",
                                  extra_env={ENV_WATCH_NAMESPACES: ns, **(NO_HEALTH if env is None else env)})
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


# --- 1. the decode-before-prefill gate -------------------------------------------------------------------------
def test_prefill_waits_for_decode_listener(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    with operator(platform, ns, pool_of_free_ports(20), tmp_path):
        api.create_pair(ns, "gate", router={"enabled": True})
        decode = wait_for(lambda: next((p for p in api.pods(ns) if p["metadata"]["labels"][LABEL_ROLE] == "decode"
                                        and p["status"].get("pod_ip")), None), 60, "a running decode pod")
        pair = api.pair(ns, "gate")
        side = [p["port"] for p in pair["status"]["ports"] if p["role"] == ROLE_DECODE and p["purpose"] == PURPOSE_SIDECHANNEL]
        assert len(side) == 1
        env = {e["name"]: e["value"] for e in decode["spec"]["containers"][0]["env"]}
        assert env[ENV_GENERATION] == str(pair["status"]["pairGeneration"])
        assert decode["metadata"]["owner_references"][0]["uid"] == pair["metadata"]["uid"]
        assert decode["spec"]["host_network"] is True and decode["status"]["pod_ip"] == "127.0.0.1"

        # Nothing listens: prefill must not appear (watch it for several seconds).
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            roles = {p["metadata"]["labels"][LABEL_ROLE] for p in api.pods(ns)}
            assert "prefill" not in roles, "prefill was created before decode's listener accepted"
            time.sleep(0.2)
        pair = api.pair(ns, "gate")
        assert pair["status"]["phase"] == "DecodeStarting"
        assert condition(pair, COND_DECODE_LISTENING)["status"] == "False"

        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", side[0]))
            listener.listen(16)
            opened = time.monotonic()
            prefill = wait_for(lambda: next((p for p in api.pods(ns) if p["metadata"]["labels"][LABEL_ROLE] == "prefill"),
                                            None), 15, "the prefill pod after the listener opened", interval=0.05)
            latency = time.monotonic() - opened
            print(f"\nprefill pod appeared {latency:.2f}s after the decode listener opened")
            assert latency < 5.0
            penv = {e["name"]: e["value"] for e in prefill["spec"]["containers"][0]["env"]}
            assert penv[ENV_PEER_HOST] == "127.0.0.1" and penv[ENV_PEER_PORT_BASE] == str(side[0])
            ready = wait_for(lambda: (lambda p: p if p["status"].get("phase") == "Ready" else None)(api.pair(ns, "gate")),
                             30, "phase Ready")
            assert condition(ready, COND_DECODE_LISTENING)["status"] == "True"
            assert set(ready["status"]["pods"]) == {"decode", "prefill", "router"}
        reasons = [e.reason for e in api.events(ns) if e.involved_object.kind == KIND]
        for reason in ("PortsLeased", "PodCreated", "DecodeListening"):
            assert reason in reasons, f"no {reason} Event (saw {sorted(set(reasons))})"
        cleanup_pairs(api, ns)
        assert api.leases(ns) == []


# --- 2. 200 pairs at once --------------------------------------------------------------------------------------
def test_200_pairs_concurrently_no_duplicate_ports(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    n = 200
    with operator(platform, ns, "30000-31499", tmp_path):
        started = time.monotonic()
        create_many(api, ns, [f"p{i:03d}" for i in range(n)])
        created = time.monotonic() - started

        def all_leased():
            pairs = api.pairs(ns)
            done = [p for p in pairs if condition(p, COND_PORTS_LEASED).get("status") == "True"
                    and len((p.get("status") or {}).get("ports") or []) == PORTS_PER_PAIR_NO_ROUTER]
            return len(done) == n

        wait_for(all_leased, 300, f"{n} pairs leased", interval=1)
        elapsed = time.monotonic() - started
        count = check_leases_match_status(api, ns, n, PORTS_PER_PAIR_NO_ROUTER)
        print(f"\n{n} pairs created in {created:.1f}s, all leased ({count} leases, 0 duplicates) after {elapsed:.1f}s")

        # 4 at scale: deleting the pairs releases every lease
        started = time.monotonic()
        cleanup_pairs(api, ns, timeout=300)
        wait_for(lambda: api.leases(ns) == [], 60, "every lease released")
        print(f"{n} pairs deleted and their leases released in {time.monotonic() - started:.1f}s")


# --- 3. SIGKILL mid-leasing ------------------------------------------------------------------------------------
def test_sigkill_mid_leasing_leaks_nothing(platform, cluster_namespace, tmp_path):
    cluster, kubeconfig = platform
    api = Api(cluster)
    ns = cluster_namespace
    n = 200
    pool = "32000-33499"
    first = devrun.OperatorProcess(kubeconfig, OPERATOR_NS, pool, tmp_path / "first.log",
                                   extra_env={ENV_WATCH_NAMESPACES: ns, **NO_HEALTH}).start()
    try:
        creator = threading.Thread(target=create_many, args=(api, ns, [f"k{i:03d}" for i in range(n)]))
        creator.start()
        held = wait_for(lambda: (lambda k: k if k >= 150 else 0)(len(api.leases(ns))), 180, "leasing under way",
                        interval=0.1)
        first.kill()
        creator.join()
    finally:
        first.kill()
    leases_at_kill = api.leases(ns)
    pairs_at_kill = api.pairs(ns)
    with_status = {p["metadata"]["uid"] for p in pairs_at_kill if (p.get("status") or {}).get("ports")}
    holders = {l.metadata.labels[LABEL_PAIR_UID] for l in leases_at_kill}
    orphaned_by_crash = holders - with_status  # leases created, status never written: must be adopted
    print(f"\nSIGKILL with {held}+ leases held ({len(leases_at_kill)} after the kill); {len(with_status)}/{n} pairs "
          f"had status.ports, {len(orphaned_by_crash)} pairs held leases without status")
    assert len(with_status) < n, "the kill came too late to interrupt leasing"
    assert orphaned_by_crash, "the kill did not land between lease creation and status write"

    with operator(platform, ns, pool, tmp_path, name="second"):
        def all_leased():
            return all(condition(p, COND_PORTS_LEASED).get("status") == "True"
                       and len((p.get("status") or {}).get("ports") or []) == PORTS_PER_PAIR_NO_ROUTER
                       for p in api.pairs(ns))

        wait_for(all_leased, 300, "every pair leased after the restart", interval=1)
        check_leases_match_status(api, ns, n, PORTS_PER_PAIR_NO_ROUTER)
        cleanup_pairs(api, ns, timeout=300)
        wait_for(lambda: api.leases(ns) == [], 60, "every lease released")


# --- 4. deletion: pods by ownerReference GC, leases by the finalizer --------------------------------------------
def test_delete_pairs_removes_pods_and_leases(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    with operator(platform, ns, pool_of_free_ports(60), tmp_path):
        for i in range(5):
            api.create_pair(ns, f"d{i}")
        wait_for(lambda: len([p for p in api.pods(ns) if p["status"].get("phase") == "Running"]) == 5, 60,
                 "5 decode pods running")
        assert len(api.leases(ns)) == 5 * PORTS_PER_PAIR_NO_ROUTER
        for i in range(5):
            api.delete_pair(ns, f"d{i}")
        wait_for(lambda: not api.pairs(ns), 60, "the pairs gone")
        wait_for(lambda: api.leases(ns) == [], 30, "their leases gone")
        wait_for(lambda: api.pods(ns) == [], 60, "their pods gone (garbage collector)")


# --- 5. spec change: a new generation, decode first, prefill after the gate -------------------------------------
class PodRecorder:
    """Records pod creations and deletions in a namespace through a watch, in order."""

    def __init__(self, api, ns):
        from kubernetes import watch

        self.events: list[tuple[float, str, str]] = []
        self._seen_deleting: set[str] = set()
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, args=(api, ns), daemon=True)
        self._thread.start()
        time.sleep(0.5)

    def _run(self, api, ns):
        try:
            self._stream(api, ns)
        except Exception:  # the stream ends when stop() closes it
            pass

    def _stream(self, api, ns):
        for ev in self._watch.stream(api.core.list_namespaced_pod, ns, timeout_seconds=600):
            pod = ev["object"]
            name = pod.metadata.name
            if ev["type"] == "ADDED":
                self.events.append((time.monotonic(), "create", name))
            elif pod.metadata.deletion_timestamp and name not in self._seen_deleting or ev["type"] == "DELETED":
                if name not in self._seen_deleting:
                    self._seen_deleting.add(name)
                    self.events.append((time.monotonic(), "delete", name))

    def stop(self):
        self._watch.stop()

    def order(self):
        return [f"{kind} {name}" for _, kind, name in self.events]


def test_spec_change_rolls_out_decode_first(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    with operator(platform, ns, pool_of_free_ports(20), tmp_path):
        api.create_pair(ns, "roll")
        pair = wait_for(lambda: (lambda p: p if (p.get("status") or {}).get("ports") else None)(api.pair(ns, "roll")),
                        30, "ports")
        side = next(p["port"] for p in pair["status"]["ports"] if p["name"] == DECODE_SIDECHANNEL_0)
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", side))
        listener.listen(16)
        ready = wait_for(lambda: (lambda p: p if p["status"].get("phase") == "Ready" else None)(api.pair(ns, "roll")),
                         30, "generation 1 Ready")
        gen1 = ready["status"]["pairGeneration"]
        listener.close()  # the new decode "starts" without a listener: prefill must wait for it

        recorder = PodRecorder(api, ns)
        try:
            api.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "roll", {"spec": {"image": "img:2"}})
            decode2 = wait_for(lambda: next((p for p in api.pods(ns) if p["metadata"]["labels"][LABEL_ROLE] == "decode"
                                             and p["metadata"]["labels"][LABEL_GENERATION] == str(gen1 + 1)
                                             and p["status"].get("pod_ip")), None), 60, "the new decode pod running")
            assert decode2["spec"]["containers"][0]["image"] == "img:2"
            time.sleep(3)
            assert not any(p["metadata"]["labels"][LABEL_ROLE] == "prefill" for p in api.pods(ns)), \
                "the new prefill came before the new decode listened"
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", side))
            listener.listen(16)
            opened = time.monotonic()
            ready = wait_for(lambda: (lambda p: p if p["status"].get("phase") == "Ready"
                                      and p["status"]["pairGeneration"] == gen1 + 1 else None)(api.pair(ns, "roll")),
                             30, "generation 2 Ready")
            created_after = [t for t, kind, name in recorder.events if kind == "create" and "prefill" in name]
            assert created_after and created_after[-1] >= opened
        finally:
            recorder.stop()
            listener.close()
        order = recorder.order()
        print("\nrollout order: " + ", ".join(order))
        g1, g2 = gen1, gen1 + 1
        expected = [f"delete roll-prefill-g{g1}", f"delete roll-decode-g{g1}", f"create roll-decode-g{g2}",
                    f"create roll-prefill-g{g2}"]
        assert [o for o in order if o in expected] == expected
        reasons = [e.reason for e in api.events(ns) if e.involved_object.kind == KIND]
        assert "RollingOut" in reasons and "PodDeleted" in reasons
        cleanup_pairs(api, ns)


# --- 6. pool exhaustion ------------------------------------------------------------------------------------------
def test_pool_exhaustion_is_a_condition_then_recovers(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    pool = pool_of_free_ports(2 * PORTS_PER_PAIR_NO_ROUTER)  # room for exactly two pairs
    with operator(platform, ns, pool, tmp_path) as proc:
        for name in ("a", "b"):
            api.create_pair(ns, name)
        wait_for(lambda: all(condition(api.pair(ns, n), COND_PORTS_LEASED).get("status") == "True" for n in ("a", "b")),
                 30, "a and b leased")
        api.create_pair(ns, "c")
        starved = wait_for(lambda: (lambda p: p if condition(p, COND_PORTS_LEASED).get("reason") == "PoolExhausted"
                                    else None)(api.pair(ns, "c")), 30, "c to report PoolExhausted")
        cond = condition(starved, COND_PORTS_LEASED)
        assert cond["status"] == "False" and "pool" in cond["message"]
        assert starved["status"]["phase"] == "Pending"
        uid_c = starved["metadata"]["uid"]
        time.sleep(3)
        assert [l for l in api.leases(ns) if l.metadata.labels[LABEL_PAIR_UID] == uid_c] == []  # no partial claim
        assert proc.proc.poll() is None, "the operator died"
        assert "PoolExhausted" in [e.reason for e in api.events(ns) if e.involved_object.name == "c"]

        api.delete_pair(ns, "a")
        started = time.monotonic()
        wait_for(lambda: condition(api.pair(ns, "c"), COND_PORTS_LEASED).get("status") == "True", 30,
                 "c leased once a is gone")
        print(f"\nc got its ports {time.monotonic() - started:.1f}s after a was deleted")
        check_leases_match_status(api, ns, 2, PORTS_PER_PAIR_NO_ROUTER)
        cleanup_pairs(api, ns)


# --- level-triggered restarts of the operator and of the apiserver ---------------------------------------------
def test_operator_restart_causes_no_churn(platform, cluster_namespace, tmp_path):
    """A Ready pair survives an operator SIGKILL + restart untouched: same pods, generation, leases, phase."""
    cluster, kubeconfig = platform
    api = Api(cluster)
    ns = cluster_namespace
    pool = pool_of_free_ports(20)
    first = devrun.OperatorProcess(kubeconfig, OPERATOR_NS, pool, tmp_path / "first.log",
                                   extra_env={ENV_WATCH_NAMESPACES: ns, **NO_HEALTH}).start()
    try:
        api.create_pair(ns, "steady")
        pair = wait_for(lambda: (lambda p: p if (p.get("status") or {}).get("ports") else None)(api.pair(ns, "steady")),
                        30, "ports")
        side = next(p["port"] for p in pair["status"]["ports"] if p["name"] == DECODE_SIDECHANNEL_0)
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", side))
            listener.listen(16)
            before = wait_for(lambda: (lambda p: p if p["status"].get("phase") == "Ready" else None)(
                api.pair(ns, "steady")), 30, "Ready")
    finally:
        first.kill()
    pods_before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in api.pods(ns)}
    leases_before = sorted(l.metadata.uid for l in api.leases(ns))
    # The listener is closed now: a restarted operator must not re-gate a pair whose prefill already exists.
    with operator(platform, ns, pool, tmp_path, name="second"):
        time.sleep(6)
        after = api.pair(ns, "steady")
        assert after["status"]["phase"] == "Ready"
        assert after["status"]["pairGeneration"] == before["status"]["pairGeneration"]
        assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in api.pods(ns)} == pods_before
        assert sorted(l.metadata.uid for l in api.leases(ns)) == leases_before
        cleanup_pairs(api, ns)


def _restart_apiserver(cluster, down_seconds=3.0):
    """SIGKILL the kube-apiserver and start it again on the same port, etcd and certificates."""
    component = next(c for c in cluster._components if c.name == "kube-apiserver")
    component.process.kill()
    component.process.wait(10)
    cluster._components.remove(component)
    time.sleep(down_seconds)
    cluster._launch(component)
    cluster._wait_healthy(component, time.monotonic() + 60)


def test_operator_survives_apiserver_restart(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    with operator(platform, ns, pool_of_free_ports(20), tmp_path) as proc:
        api.create_pair(ns, "before")
        pair = wait_for(lambda: (lambda p: p if p.get("status", {}).get("phase") == "DecodeStarting"
                                 and p["status"].get("ports") else None)(api.pair(ns, "before")), 30, "gated")
        side = next(p["port"] for p in pair["status"]["ports"] if p["name"] == DECODE_SIDECHANNEL_0)
        _restart_apiserver(cluster)
        assert proc.proc.poll() is None, "the operator died with the apiserver"
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", side))
            listener.listen(16)
            wait_for(lambda: (api.pair(ns, "before").get("status") or {}).get("phase") == "Ready", 60,
                     "the gated pair Ready after the apiserver came back")
        api.create_pair(ns, "after")  # watches resumed: a new pair is served
        wait_for(lambda: condition(api.pair(ns, "after"), COND_PORTS_LEASED).get("status") == "True", 60,
                 "a pair created after the restart leased")
        check_leases_match_status(api, ns, 2, PORTS_PER_PAIR_NO_ROUTER)
        cleanup_pairs(api, ns)


# --- orphan sweep -------------------------------------------------------------------------------------------------
def test_orphaned_leases_are_swept(platform, cluster_namespace, tmp_path):
    """Leases whose pair uid no longer exists (a pair deleted while no operator ran) are deleted by the sweep."""
    from kubernetes import client

    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    pool = pool_of_free_ports(20)
    first_port = int(pool.split("-")[0])
    with operator(platform, ns, pool, tmp_path):
        api.create_pair(ns, "alive")
        alive = wait_for(lambda: (lambda p: p if (p.get("status") or {}).get("ports") else None)(api.pair(ns, "alive")),
                         30, "ports")
        alive_uid = alive["metadata"]["uid"]

        def orphan(port, pair_name, uid):
            labels = {LABEL_PORT_LEASE: "true", LABEL_PAIR: pair_name, LABEL_PAIR_NAMESPACE: ns,
                      LABEL_PAIR_UID: uid, LABEL_ROLE: ROLE_DECODE, LABEL_PURPOSE: PURPOSE_HTTP}
            body = client.V1Lease(metadata=client.V1ObjectMeta(name=f"{LEASE_NAME_PREFIX}{port}", labels=labels),
                                  spec=client.V1LeaseSpec(holder_identity=f"{ns}/{pair_name}/{uid}"))
            api.coord.create_namespaced_lease(OPERATOR_NS, body)

        orphan(first_port + 15, "ghost", str(uuid.uuid4()))  # the pair is gone
        orphan(first_port + 16, "alive", str(uuid.uuid4()))  # same name, an older incarnation (another uid)
        started = time.monotonic()
        wait_for(lambda: {int(l.metadata.name.removeprefix(LEASE_NAME_PREFIX)) for l in api.leases(ns)}.isdisjoint(
            {first_port + 15, first_port + 16}), 30, "the orphaned leases swept")
        print(f"\norphaned leases swept {time.monotonic() - started:.1f}s after they appeared (sweep every 10s)")
        kept = [l for l in api.leases(ns) if l.metadata.labels[LABEL_PAIR_UID] == alive_uid]
        assert len(kept) == PORTS_PER_PAIR_NO_ROUTER, "the sweep touched a live pair's leases"
        cleanup_pairs(api, ns)


# --- operator metrics ---------------------------------------------------------------------------------------------
def test_operator_metrics_endpoint(platform, cluster_namespace, tmp_path):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from pdpair.contract import OPERATOR_PAIRS, OPERATOR_PORT_POOL_FREE, OPERATOR_PORT_POOL_SIZE

    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    with operator(platform, ns, pool_of_free_ports(20), tmp_path) as proc:
        api.create_pair(ns, "metered")
        wait_for(lambda: (api.pair(ns, "metered").get("status") or {}).get("phase") == "DecodeStarting", 30, "gated")

        def scrape():
            text = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5).read().decode()
            return {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for fam in text_string_to_metric_families(text) for s in fam.samples}

        samples = wait_for(lambda: (lambda s: s if s.get((OPERATOR_PAIRS.name, (("phase", "DecodeStarting"),))) == 1
                                    else None)(scrape()), 15, "pdpair_operator_pairs{phase=DecodeStarting} 1")
        assert samples[(OPERATOR_PORT_POOL_SIZE.name, ())] == 20
        assert samples[(OPERATOR_PORT_POOL_FREE.name, ())] == 20 - PORTS_PER_PAIR_NO_ROUTER
        cleanup_pairs(api, ns)


def test_tensor_parallel_change_releases_old_ports_after_old_pods(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    with operator(platform, ns, pool_of_free_ports(30), tmp_path):
        api.create_pair(ns, "tp")
        wait_for(lambda: any(p["status"].get("phase") == "Running" for p in api.pods(ns)), 30, "decode g1 running")
        old_ports = {p["port"] for p in api.pair(ns, "tp")["status"]["ports"]}
        api.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "tp", {
            "spec": {"decode": {"tensorParallelSize": 2}, "prefill": {"tensorParallelSize": 2}}})

        def new_decode():
            return next((p for p in api.pods(ns) if p["metadata"]["labels"][LABEL_ROLE] == "decode"
                         and p["metadata"]["labels"][LABEL_GENERATION] == "2"), None)

        decode = wait_for(new_decode, 60, "decode g2")
        pair = api.pair(ns, "tp")
        side = sorted(p["port"] for p in pair["status"]["ports"]
                      if p["role"] == ROLE_DECODE and p["purpose"] == PURPOSE_SIDECHANNEL)
        assert len(side) == 2 and side[1] == side[0] + 1
        env = {e["name"]: e["value"] for e in decode["spec"]["containers"][0]["env"]}
        assert env[ENV_LISTEN_PORT_BASE] == str(side[0])
        assert [p["metadata"]["name"] for p in api.pods(ns)] == ["tp-decode-g2"]  # g1 pods gone before g2
        check_leases_match_status(api, ns, 1, PORTS_PER_PAIR_NO_ROUTER + 2)
        print(f"\nTP 1 -> 2: ports {sorted(old_ports)} -> {sorted(p['port'] for p in pair['status']['ports'])}")
        cleanup_pairs(api, ns)
