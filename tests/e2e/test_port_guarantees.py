"""The port guarantees on every path, on the real control plane under the chart's RBAC.

1. status.ports mirrors the leases exactly, "none" included: a pair that lost its ports to PoolExhausted lists none.
2. Leases are held until the pods that used them are gone (deleted AND terminated), on pair deletion and on a spec
   change that re-leases, also across an operator restart; the wait is bounded and told as Events.
5. A pod the API server refuses becomes a condition and an Event naming the field, retried with backoff.
Plus the invariant under churn and SIGKILLs: at every observed moment no port is listed by two pairs, and after each
step every pair's status.ports equals its leases.

A pod is kept "terminating" with a finalizer of the test's own, the way a slow kubelet or a stuck engine keeps it.
"""

from __future__ import annotations

import collections
import random
import re
import ssl
import threading
import time
import urllib.request

import pytest

from pdpair.contract import (
    COND_PORTS_LEASED,
    COND_READY,
    GROUP,
    LABEL_PAIR_UID,
    LABEL_ROLE,
    LEASE_NAME_PREFIX,
    PLURAL,
    ROLE_DECODE,
    VERSION,
)
from pdpair.operator.model.config import ENV_POD_GONE_TIMEOUT
from tests.e2e.operator_helpers import (
    NO_HEALTH,
    PORTS_PER_PAIR_NO_ROUTER,
    Api,
    cleanup_pairs,
    condition,
    operator,
    pool_of_free_ports,
)
from devcluster.waiting import wait_for

pytestmark = pytest.mark.cluster

HOLD = "pdpair.test/hold"  # a pod finalizer: the pod stays Terminating until the test lets it go


def status_ports(pair):
    return {p["port"] for p in (pair.get("status") or {}).get("ports") or []}


def lease_ports(api, ns, uid):
    return {int(l.metadata.name.removeprefix(LEASE_NAME_PREFIX)) for l in api.leases(ns)
            if l.metadata.labels[LABEL_PAIR_UID] == uid}


def pod_named(api, ns, predicate):
    return next((p for p in api.pods(ns) if predicate(p)), None)


def hold_pod(api, ns, name):
    api.core.patch_namespaced_pod(name, ns, {"metadata": {"finalizers": [HOLD]}})


def release_pod(api, ns, name):
    from kubernetes.client.exceptions import ApiException

    try:
        api.core.patch_namespaced_pod(name, ns, [{"op": "remove", "path": "/metadata/finalizers"}])
    except ApiException as exc:
        if exc.status != 404:
            raise


def decode_pod(api, ns, pair_name, generation=None):
    def match(p):
        labels = p["metadata"]["labels"] or {}
        return (p["metadata"]["name"].startswith(f"{pair_name}-decode-")
                and labels.get(LABEL_ROLE) == ROLE_DECODE
                and (generation is None or p["metadata"]["name"].endswith(f"-g{generation}")))
    return pod_named(api, ns, match)


def assert_disjoint(pairs):
    owners = collections.defaultdict(list)
    for pair in pairs:
        for port in status_ports(pair):
            owners[port].append(pair["metadata"]["name"])
    shared = {port: names for port, names in owners.items() if len(names) > 1}
    assert not shared, f"ports listed by two pairs at once: {shared}"


def assert_status_equals_leases(api, ns, tries=6):
    """Every pair's status.ports equals its leases. Pairs and leases are two lists, not one snapshot, and a starved
    pair's retry holds a partial claim for a few milliseconds, so a mismatch must persist over ~2 s to count."""
    mismatch = ""
    for _ in range(tries):
        pairs = api.pairs(ns)
        assert_disjoint(pairs)
        mismatch = ""
        for pair in pairs:
            uid = pair["metadata"]["uid"]
            if status_ports(pair) != lease_ports(api, ns, uid):
                mismatch = (f"{pair['metadata']['name']}: status.ports {sorted(status_ports(pair))} vs leases "
                            f"{sorted(lease_ports(api, ns, uid))}")
        if not mismatch:
            return
        time.sleep(0.4)
    raise AssertionError(mismatch)


# --- finding 1: a pair that lost its ports lists none ----------------------------------------------------------
def test_pool_exhausted_pair_lists_no_ports_and_no_port_is_listed_twice(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    pool = pool_of_free_ports(2 * PORTS_PER_PAIR_NO_ROUTER)  # room for exactly two TP-1 pairs
    with operator(platform, ns, pool, tmp_path):
        for name in ("a", "b"):
            api.create_pair(ns, name)
        wait_for(lambda: all(len(status_ports(api.pair(ns, n))) == PORTS_PER_PAIR_NO_ROUTER for n in ("a", "b")),
                 60, "a and b leased")
        wait_for(lambda: decode_pod(api, ns, "a"), 60, "a's decode pod")
        # TP 2 needs more ports than the pool has left: a gives all of its ports back.
        api.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "a", {
            "spec": {"decode": {"tensorParallelSize": 2}, "prefill": {"tensorParallelSize": 2}}})
        starved = wait_for(lambda: (lambda p: p if condition(p, COND_PORTS_LEASED).get("reason") == "PoolExhausted"
                                    else None)(api.pair(ns, "a")), 60, "a to report PoolExhausted")
        uid_a = starved["metadata"]["uid"]
        wait_for(lambda: not lease_ports(api, ns, uid_a), 30, "a's leases released")
        assert status_ports(api.pair(ns, "a")) == set(), "a lists ports it no longer holds"
        assert_status_equals_leases(api, ns)

        # b goes; a newcomer c and the starved a compete for b's ports: whoever gets them, nobody lists them twice.
        api.delete_pair(ns, "b")
        api.create_pair(ns, "c")
        wait_for(lambda: len(status_ports(api.pair(ns, "c"))) == PORTS_PER_PAIR_NO_ROUTER
                 or len(status_ports(api.pair(ns, "a"))) > 0, 60, "b's ports leased again")
        wait_for(lambda: not [p for p in api.pairs(ns) if p["metadata"]["name"] == "b"], 60, "b gone")
        time.sleep(1)
        assert_status_equals_leases(api, ns)
        cleanup_pairs(api, ns)


# --- finding 2: leases outlive the pods that used them --------------------------------------------------------
def test_deleted_pair_keeps_its_leases_until_its_pods_are_gone(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    with operator(platform, ns, pool_of_free_ports(20), tmp_path):
        pair = api.create_pair(ns, "held")
        uid = pair["metadata"]["uid"]
        decode = wait_for(lambda: decode_pod(api, ns, "held"), 60, "decode pod")
        name = decode["metadata"]["name"]
        ports = wait_for(lambda: status_ports(api.pair(ns, "held")), 30, "status.ports")
        hold_pod(api, ns, name)
        try:
            api.delete_pair(ns, "held")
            wait_for(lambda: (decode_pod(api, ns, "held") or {}).get("metadata", {}).get("deletion_timestamp"),
                     30, "the operator deleting the decode pod")
            # The pod is Terminating: for as long as it stays, the pair, its leases and its status stay.
            for _ in range(8):
                time.sleep(0.5)
                assert lease_ports(api, ns, uid) == ports, "a lease was released while its pod still exists"
                assert status_ports(api.pair(ns, "held")) == ports
        finally:
            release_pod(api, ns, name)
        started = time.monotonic()
        wait_for(lambda: not api.pairs(ns), 60, "the pair gone once its pod is")
        assert lease_ports(api, ns, uid) == set()
        assert not api.pods(ns)
        print(f"\nleases released {time.monotonic() - started:.1f}s after the last pod went")
        reasons = [e.reason for e in api.events(ns) if e.involved_object.name == "held"]
        assert "PortsReleased" in reasons


def test_pod_gone_wait_is_bounded_and_told(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    timeout = 8
    with operator(platform, ns, pool_of_free_ports(20), tmp_path, env={**NO_HEALTH, ENV_POD_GONE_TIMEOUT: str(timeout)}):
        uid = api.create_pair(ns, "stuck")["metadata"]["uid"]
        name = wait_for(lambda: decode_pod(api, ns, "stuck"), 60, "decode pod")["metadata"]["name"]
        wait_for(lambda: status_ports(api.pair(ns, "stuck")), 30, "status.ports")
        hold_pod(api, ns, name)
        try:
            deleted_at = time.monotonic()
            api.delete_pair(ns, "stuck")
            wait_for(lambda: not api.pairs(ns), timeout + 60, "the pair gone after the bounded wait")
            waited = time.monotonic() - deleted_at
            assert waited >= timeout - 1, f"leases released after {waited:.1f}s, before the {timeout}s bound"
            assert lease_ports(api, ns, uid) == set()
            events = {e.reason: e.message for e in api.events(ns) if e.involved_object.name == "stuck"}
            assert "WaitingForPods" in events and name in events["WaitingForPods"]
            assert "PortsFencedWithPodsLeft" in events and name in events["PortsFencedWithPodsLeft"]
            # The pod still exists, so the ports it declares stay fenced to it (no pair can be leased them), past
            # more than one sweep of the operator (every 10 s here).
            declared = {int(p.container_port) for c in api.core.read_namespaced_pod(name, ns).spec.containers
                        for p in c.ports or []}
            assert declared and declared <= set(api.fences(f"{ns}/{name}/")), api.fences("")
            time.sleep(12)
            assert declared <= set(api.fences(f"{ns}/{name}/")), "a fence ended while its pod still exists"
            print(f"\npair with a stuck pod gone after {waited:.1f}s (bound {timeout}s); ports {sorted(declared)} "
                  f"fenced to the pod")
        finally:
            release_pod(api, ns, name)
        freed_from = time.monotonic()
        wait_for(lambda: not declared & set(api.fences("")), 60, "the fences released once the pod is gone")
        print(f"fences released {time.monotonic() - freed_from:.1f}s after the pod's finalizer was removed")


def test_spec_change_keeps_old_ports_until_old_pods_are_gone_across_operator_restart(
        platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    pool = pool_of_free_ports(30)
    with operator(platform, ns, pool, tmp_path, name="first"):
        uid = api.create_pair(ns, "tp")["metadata"]["uid"]
        old_pod = wait_for(lambda: decode_pod(api, ns, "tp", 1), 60, "decode g1")["metadata"]
        old, old_uid = old_pod["name"], old_pod["uid"]
        old_ports = wait_for(lambda: status_ports(api.pair(ns, "tp")), 30, "status.ports")
        hold_pod(api, ns, old)
    try:
        # The operator is down: the spec changes and the old decode is already terminating when it comes back,
        # so the new operator starts with no memory of the old blocks.
        api.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "tp", {
            "spec": {"decode": {"tensorParallelSize": 2}, "prefill": {"tensorParallelSize": 2}}})
        api.core.delete_namespaced_pod(old, ns)
        with operator(platform, ns, pool, tmp_path, name="second"):
            time.sleep(4)  # several passes (probe interval 0.5s)
            assert [p["metadata"]["uid"] for p in api.pods(ns)] == [old_uid], "a new pod came while the old one exists"
            assert lease_ports(api, ns, uid) == old_ports, "the old pod's ports were released while it exists"
            assert status_ports(api.pair(ns, "tp")) == old_ports
            release_pod(api, ns, old)
            wait_for(lambda: (lambda p: p and p["metadata"]["uid"] != old_uid)(decode_pod(api, ns, "tp")), 60,
                     "a new decode after the old pod is gone")
            new_ports = lease_ports(api, ns, uid)
            assert len(new_ports) == PORTS_PER_PAIR_NO_ROUTER + 2
            assert status_ports(api.pair(ns, "tp")) == new_ports
            cleanup_pairs(api, ns)
    finally:
        release_pod(api, ns, old)


# --- finding 5: specs the API server refuses as pods -----------------------------------------------------------
# Specs the CRD admits and pod validation refuses (422). Negative quantities, requests above limits and
# tolerationSeconds without NoExecute used to be the examples; the CRD refuses those itself now
# (tests/e2e/test_crd_validation.py), so these are what is left to a pod's own validation: a resource name that is
# neither standard nor domain-qualified, and an extended resource requested without a limit.
REFUSED_SPECS = [
    ("unqualified-resource-name", {"resources": {"requests": {"widgets": "1"}}}, "widgets"),
    ("extended-resource-without-limit", {"resources": {"requests": {"example.com/widget": "1"}}}, "limits"),
]


def _pod_create_rejections(cluster) -> float:
    """The apiserver's own count of refused pod creations (apiserver_request_total, POST pods, 4xx)."""
    ctx = ssl.create_default_context(cafile=str(cluster.ca_file))
    request = urllib.request.Request(cluster.server + "/metrics",
                                     headers={"Authorization": f"Bearer {cluster.admin_token}"})
    with urllib.request.urlopen(request, timeout=10, context=ctx) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("apiserver_request_total{") and 'resource="pods"' in line and 'verb="POST"' in line \
                and 'subresource=""' in line and re.search(r'code="4(00|03|22)"', line):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("name,decode,field", REFUSED_SPECS, ids=[n for n, _, _ in REFUSED_SPECS])
def test_a_refused_pod_is_a_condition_and_an_event_with_backoff(platform, cluster_namespace, tmp_path,
                                                                  name, decode, field):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    with operator(platform, ns, pool_of_free_ports(20), tmp_path):
        before = _pod_create_rejections(cluster)
        api.create_pair(ns, name, decode=decode)
        pair = wait_for(lambda: (lambda p: p if condition(p, COND_READY).get("reason") == "PodRejected" else None)(
            api.pair(ns, name)), 60, "Ready=False reason PodRejected")
        ready = condition(pair, COND_READY)
        assert ready["status"] == "False" and field in ready["message"], ready
        assert field in pair["status"]["message"] and "decode pod" in pair["status"]["message"]
        event = wait_for(lambda: next((e for e in api.events(ns) if e.reason == "PodRejected"), None), 30,
                         "a PodRejected Event")
        assert event.type == "Warning" and field in event.message, event.message
        started = time.monotonic()
        time.sleep(20)
        attempts = _pod_create_rejections(cluster) - before
        elapsed = time.monotonic() - started + 2  # attempts before `started` count too
        # Backoff 2, 4, 8, 16 s: at most 5 tries in the first ~22 s (+1 for a wakeup race); a hot loop makes dozens.
        assert 1 <= attempts <= 6, f"{attempts} refused creates in {elapsed:.0f}s"
        assert not api.pods(ns)
        assert len([e for e in api.events(ns) if e.reason == "PodRejected"]) == 1, "one Event, not one per retry"
        print(f"\n{name}: {attempts:.0f} refused creates in ~{elapsed:.0f}s; condition: {ready['message'][:160]}")
        # Fixing the spec recovers at once, without waiting out the backoff.
        api.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, {"spec": {"decode": {
            "resources": None, "tolerations": None}}})
        wait_for(lambda: decode_pod(api, ns, name), 20, "decode created after the fix")
        cleanup_pairs(api, ns)


# --- the invariant under churn and crashes ---------------------------------------------------------------------
class DisjointWatcher:
    """Lists every pair again and again (one list is one consistent snapshot) and records any port listed twice."""

    def __init__(self, api, ns):
        self.api, self.ns = api, ns
        self.snapshots = 0
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                assert_disjoint(self.api.pairs(self.ns))
                self.snapshots += 1
            except AssertionError as exc:
                self.violations.append(str(exc))
            except Exception:
                pass  # an apiserver hiccup is not a violation
            time.sleep(0.05)

    def stop(self):
        self._stop.set()
        self._thread.join(10)


def test_status_ports_disjoint_and_equal_to_leases_under_churn_and_sigkills(platform, cluster_namespace, tmp_path):
    cluster, kubeconfig = platform
    api = Api(cluster)
    ns = cluster_namespace
    rng = random.Random(8)
    pool = pool_of_free_ports(3 * PORTS_PER_PAIR_NO_ROUTER + 1)  # tight: a TP change or a 4th pair must wait
    names = [f"p{i}" for i in range(4)]
    watcher = DisjointWatcher(api, ns)
    steps = []
    try:
        # Every round: three actions, the operator SIGKILLed at a random moment after the third.
        script = [["create", "create", "create"], ["tp", "delete", "create"], ["tp", "create", "delete"],
                  ["create", "tp", "tp"]]
        for round_, actions in enumerate(script):
            with operator(platform, ns, pool, tmp_path, name=f"op{round_}") as proc:
                for step, action in enumerate(actions):
                    existing = {p["metadata"]["name"]: p for p in api.pairs(ns)}
                    missing = [n for n in names if n not in existing]
                    if action == "create" and missing:
                        target = rng.choice(missing)
                        api.create_pair(ns, target)
                    elif action == "tp" and existing:
                        target = rng.choice(sorted(existing))
                        tp = 1 if (existing[target]["spec"].get("decode") or {}).get("tensorParallelSize", 1) == 2 else 2
                        api.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, target, {
                            "spec": {"decode": {"tensorParallelSize": tp}, "prefill": {"tensorParallelSize": tp}}})
                        action = f"tp{tp}"
                    elif action == "delete" and existing:
                        target = rng.choice(sorted(existing))
                        api.delete_pair(ns, target)
                    else:
                        continue
                    steps.append(f"{action} {target}")
                    if step == len(actions) - 1:
                        time.sleep(rng.uniform(0.2, 1.5))
                        proc.kill()  # SIGKILL mid-flight; the next round's operator picks up
                        break
                    # Settle: every pair leased or PoolExhausted, no pair mid-deletion.
                    wait_for(lambda: all(condition(p, COND_PORTS_LEASED).get("reason") in ("Leased", "PoolExhausted")
                                         and not p["metadata"].get("deletionTimestamp") for p in api.pairs(ns)),
                             90, f"round {round_} step {step} settled")
                    time.sleep(0.5)
                    assert_status_equals_leases(api, ns)
        with operator(platform, ns, pool, tmp_path, name="final"):
            wait_for(lambda: all(condition(p, COND_PORTS_LEASED).get("reason") in ("Leased", "PoolExhausted")
                                 for p in api.pairs(ns)), 90, "settled after the last crash")
            time.sleep(0.5)
            assert_status_equals_leases(api, ns)
            cleanup_pairs(api, ns)
            wait_for(lambda: api.leases(ns) == [], 30, "every lease released")
    finally:
        watcher.stop()
    print(f"\nsteps {steps}; {watcher.snapshots} snapshots of every pair's status.ports checked for overlaps")
    assert watcher.snapshots > 50
    assert watcher.violations == []
