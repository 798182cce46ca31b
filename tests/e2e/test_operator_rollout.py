"""Surge rollouts (spec.rolloutStrategy: Surge) on the real control plane, under the chart's ServiceAccount and RBAC.

kwok makes the pods Running and Ready; the test opens the decode listeners the operator probes (each generation's
decode side-channel port, from status.ports and status.rollout.ports). Recreate stays as it was
(test_operator_lifecycle.py, test_spec_change_rolls_out_decode_first). Fixtures and helpers: operator_helpers.py.
"""

from __future__ import annotations

import collections
import socket
import time

import pytest

from pdpair.contract import (
    COND_PROGRESSING,
    GROUP,
    KIND,
    LABEL_GENERATION,
    LABEL_PAIR,
    LABEL_PAIR_UID,
    LABEL_PORT_SLOT,
    LABEL_ROLE,
    LEASE_NAME_PREFIX,
    PLURAL,
    ROLE_ROUTER,
    VERSION,
)
from tests.e2e.operator_helpers import (
    DECODE_SIDECHANNEL_0,
    ROUTER_HTTP_0,
    Api,
    PodRecorder,
    cleanup_pairs,
    condition,
    operator,
    pool_of_free_ports,
)
from devcluster.waiting import wait_for

pytestmark = pytest.mark.cluster

PORTS_PER_GENERATION = 7  # decode and prefill: side channel, metrics, http; the router's http


def listen(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(16)
    return sock


def port_named(ports, name):
    return next(p["port"] for p in ports if p["name"] == name)


def pair_leases(api, ns, uid):
    return [lease for lease in api.leases(ns) if lease.metadata.labels.get(LABEL_PAIR_UID) == uid]


def lease_ports(leases):
    return {int(lease.metadata.name.removeprefix(LEASE_NAME_PREFIX)) for lease in leases}


def wait_leases_equal_status_ports(api, ns, name, uid, timeout=30):
    """Wait until the pair's port Leases are exactly the ports its status.ports lists; returns them.

    What the operator guarantees: status never lists a port the pair does not hold (a port is unlisted before its
    Lease goes), and a finished rollout's other port set is released right after the status write that ends the
    rollout (reconciler.reconcile_once: status first, then Plan.release_slot). So the status that shows the rollout
    done can be read while those Leases are still being deleted; only the end state, Leases == status.ports, is
    the product's promise. A port set that leaked never gets there, and the message names its ports."""
    seen = {}

    def settled():
        listed = {p["port"] for p in (api.pair(ns, name).get("status") or {}).get("ports") or []}
        held = lease_ports(pair_leases(api, ns, uid))
        seen.update(listed=listed, held=held)
        return listed if listed and held == listed else None

    try:
        return wait_for(settled, timeout, "the pair's Leases to equal status.ports")
    except AssertionError:
        listed, held = seen.get("listed", set()), seen.get("held", set())
        raise AssertionError(
            f"{ns}/{name}: {timeout}s after the rollout ended its Leases still differ from status.ports "
            f"{sorted(listed)}: leased but not listed {sorted(held - listed)}, listed but not leased "
            f"{sorted(listed - held)}") from None


def start_surge_pair(api, ns, name, **spec):
    # One router replica: these tests count one router port per generation and follow one router pod
    api.create_pair(ns, name, router={"enabled": True, "replicas": 1}, rolloutStrategy="Surge",
                    rollout={"drainSeconds": 3, "progressDeadlineSeconds": 600}, **spec)
    pair = wait_for(lambda: (lambda p: p if (p.get("status") or {}).get("ports") else None)(api.pair(ns, name)),
                    30, "ports")
    listener = listen(port_named(pair["status"]["ports"], DECODE_SIDECHANNEL_0))
    ready = wait_for(lambda: (lambda p: p if p["status"].get("phase") == "Ready" else None)(api.pair(ns, name)),
                     60, "generation 1 Ready")
    return ready, listener


def service_of(api, ns, name):
    from kubernetes.client.exceptions import ApiException

    try:
        return api.core.read_namespaced_service(name, ns)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def test_surge_rollout_switches_the_service_then_drains_the_old_generation(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    listeners = []
    with operator(platform, ns, pool_of_free_ports(30), tmp_path):
        g1, listener = start_surge_pair(api, ns, "surge")
        listeners.append(listener)
        uid = g1["metadata"]["uid"]
        old_ports = {p["port"] for p in g1["status"]["ports"]}
        old_router_port = port_named(g1["status"]["ports"], ROUTER_HTTP_0)
        svc = wait_for(lambda: service_of(api, ns, "surge"), 30, "the router Service")
        assert [p.port for p in svc.spec.ports] == [old_router_port]
        recorder = PodRecorder(api, ns, only_new=True)
        try:
            started = time.monotonic()
            api.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "surge", {"spec": {"image": "img:2"}})
            progressing = wait_for(lambda: (lambda p: p if (p["status"].get("rollout") or {}).get("ports") else None)(
                api.pair(ns, "surge")), 30, "status.rollout with the new generation's ports")
            rollout = progressing["status"]["rollout"]
            assert (rollout["phase"], rollout["fromGeneration"], rollout["toGeneration"]) == ("Progressing", 1, 2)
            new_ports = {p["port"] for p in rollout["ports"]}
            assert len(new_ports) == PORTS_PER_GENERATION and not new_ports & old_ports
            # Both generations' ports are leased, and each lease is listed once, in status.ports or status.rollout.ports
            assert lease_ports(pair_leases(api, ns, uid)) == old_ports | new_ports
            assert {l.metadata.labels.get(LABEL_PORT_SLOT) for l in pair_leases(api, ns, uid)} == {"a", "b"}
            assert condition(progressing, COND_PROGRESSING)["status"] == "True"
            # Meanwhile the old generation serves: the Service selects generation 1's router.
            svc = wait_for(lambda: (lambda s: s if (s.spec.selector or {}).get(LABEL_GENERATION) == "1" else None)(
                service_of(api, ns, "surge")), 30, "the Service pinned to generation 1")

            # The new decode runs and the new prefill starts beside it; the switch waits for the new decode's
            # listener (on the new port set); the old pods stay meanwhile.
            wait_for(lambda: any(p["metadata"]["name"] == "surge-decode-g2" and p["status"].get("pod_ip")
                                 for p in api.pods(ns)), 60, "the new decode running")
            # status.rollout.pods is written by a later pass than the one that created the pod: wait for it. The new
            # router may be there too (it starts as soon as the new prefill runs; a loaded box looks later: the cold
            # CI saw the list only with it).
            mid = wait_for(lambda: (lambda p: p if (p["status"].get("rollout") or {}).get("pods", [])[:2]
                                    == ["surge-decode-g2", "surge-prefill-g2"] else None)(api.pair(ns, "surge")), 30,
                           "status.rollout.pods naming the new decode and the new prefill beside it")
            assert set(mid["status"]["rollout"]["pods"]) <= {"surge-decode-g2", "surge-prefill-g2", "surge-router-g2"}
            assert mid["status"]["pairGeneration"] == 1 and mid["status"]["phase"] == "Ready"
            assert {p["metadata"]["name"] for p in api.pods(ns)} >= {"surge-decode-g1", "surge-prefill-g1",
                                                                     "surge-router-g1"}
            listeners.append(listen(port_named(rollout["ports"], DECODE_SIDECHANNEL_0)))

            draining = wait_for(lambda: (lambda p: p if (p["status"].get("rollout") or {}).get("phase") == "Draining"
                                         else None)(api.pair(ns, "surge")), 60, "the switch (phase Draining)")
            switched = time.monotonic()
            status = draining["status"]
            assert status["pairGeneration"] == 2 and status["portSlot"] == "b"
            assert {p["port"] for p in status["ports"]} == new_ports
            assert {p["port"] for p in status["rollout"]["ports"]} == old_ports
            assert status["servicePort"] == old_router_port
            svc = wait_for(lambda: (lambda s: s if (s.spec.selector or {}).get(LABEL_GENERATION) == "2" else None)(
                service_of(api, ns, "surge")), 30, "the Service switched to generation 2")
            assert [(p.port, p.target_port) for p in svc.spec.ports] == [(old_router_port, "http")]
            selected = api.core.list_namespaced_pod(
                ns, label_selector=",".join(f"{k}={v}" for k, v in svc.spec.selector.items())).items
            assert [p.metadata.name for p in selected] == ["surge-router-g2"]

            done = wait_for(lambda: (lambda p: p if "rollout" not in p["status"] else None)(api.pair(ns, "surge")),
                            90, "the old generation drained and deleted")
            finished = time.monotonic()
            wait_for(lambda: not [p for p in api.pods(ns) if p["metadata"]["labels"][LABEL_GENERATION] == "1"], 60,
                     "generation 1's pods gone")
            # Its leases are released; what is left is exactly what status lists.
            wait_for(lambda: lease_ports(pair_leases(api, ns, uid)) == new_ports, 30, "generation 1's leases released")
            assert {p["port"] for p in api.pair(ns, "surge")["status"]["ports"]} == new_ports
            assert condition(done, COND_PROGRESSING)["reason"] == "RolloutComplete"
            svc = wait_for(lambda: (lambda s: s if LABEL_GENERATION not in (s.spec.selector or {}) else None)(
                service_of(api, ns, "surge")), 30, "the Service back to the generation-less selector")
            assert svc.spec.selector == {LABEL_PAIR: "surge", LABEL_ROLE: ROLE_ROUTER}
            assert [p.port for p in svc.spec.ports] == [old_router_port]
        finally:
            recorder.stop()
            for sock in listeners:
                sock.close()
        order = recorder.order()
        print(f"\nsurge rollout order: {', '.join(order)}\nswitch seen {switched - started:.1f}s after the spec "
              f"change, rollout done {finished - started:.1f}s after it")
        creates = [o for o in order if o.startswith("create ")]
        deletes = [o for o in order if o.startswith("delete ")]
        assert creates == ["create surge-decode-g2", "create surge-prefill-g2", "create surge-router-g2"]
        assert order.index(creates[-1]) < order.index(deletes[0])  # nothing old goes before the new router exists
        assert set(deletes[:2]) == {"delete surge-router-g1", "delete surge-prefill-g1"}
        assert deletes[2:] == ["delete surge-decode-g1"]
        reasons = [e.reason for e in api.events(ns) if e.involved_object.kind == KIND]
        for reason in ("RollingOut", "RolloutSwitched", "RolloutDrained"):
            assert reason in reasons, reasons
        cleanup_pairs(api, ns)
        assert pair_leases(api, ns, uid) == []


def test_a_failing_new_generation_is_rolled_back_and_the_old_one_keeps_serving(platform, cluster_namespace,
                                                                                 tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    listeners = []
    pool = pool_of_free_ports(30)
    with operator(platform, ns, pool, tmp_path):
        g1, listener = start_surge_pair(api, ns, "back")
        listeners.append(listener)
        uid = g1["metadata"]["uid"]
        old_ports = {p["port"] for p in g1["status"]["ports"]}
        recorder = PodRecorder(api, ns, only_new=True)
        try:
            api.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "back", {"spec": {"image": "img:bad"}})
            decode = wait_for(lambda: next((p for p in api.pods(ns) if p["metadata"]["name"] == "back-decode-g2"
                                            and p["status"].get("pod_ip")), None), 60, "the new decode running")
            # The new decode's container dies (what a bad image or argument does): its pod phase goes Failed.
            api.core.patch_namespaced_pod_status("back-decode-g2", ns, {"status": {"phase": "Failed"}})
            failed = wait_for(lambda: (lambda p: p if p["status"].get("failedRollout") and "rollout" not in p["status"]
                                       else None)(api.pair(ns, "back")), 60, "the rollout rolled back")
            status = failed["status"]
            assert status["failedRollout"]["generation"] == 2 and "failed" in status["failedRollout"]["reason"]
            assert status["pairGeneration"] == 1 and status["phase"] == "Ready"
            assert condition(failed, COND_PROGRESSING)["status"] == "False"
            assert condition(failed, COND_PROGRESSING)["reason"] == "RolloutFailed"
            wait_for(lambda: not [p for p in api.pods(ns) if p["metadata"]["labels"][LABEL_GENERATION] == "2"], 60,
                     "generation 2's pods gone")
            wait_for(lambda: lease_ports(pair_leases(api, ns, uid)) == old_ports, 30, "generation 2's leases released")
            assert {p["port"] for p in api.pair(ns, "back")["status"]["ports"]} == old_ports
        finally:
            recorder.stop()
            for sock in listeners:
                sock.close()
    # The same spec is not tried again, not even by a restarted operator (it reads status.failedRollout): no new pod
    # while it runs its first passes, and the pair stays Ready on generation 1 with Progressing=False.
    listeners = [listen(port_named(g1["status"]["ports"], DECODE_SIDECHANNEL_0))]
    recorder2 = PodRecorder(api, ns, only_new=True)
    with operator(platform, ns, pool, tmp_path, name="operator-2") as second:
        try:
            # its first pass over the pair logs the step it planned (reconciler: one line per step change)
            wait_for(lambda: f"pair {ns}/back: Ready" in second.log_path.read_text(errors="replace"), 30,
                     "the restarted operator's first pass", interval=0.5)
            time.sleep(3)  # a rollout started by that pass would create its decode within a second or two
            assert recorder2.order() == []
            after = api.pair(ns, "back")
            assert "rollout" not in after["status"]
            assert after["status"]["pairGeneration"] == 1 and after["status"]["phase"] == "Ready"
            assert condition(after, COND_PROGRESSING)["reason"] == "RolloutFailed"
        finally:
            recorder2.stop()
            for sock in listeners:
                sock.close()
        listeners = []
        deleted = [o for o in recorder.order() if o.startswith("delete ")]
        print(f"\nrollback order: {', '.join(recorder.order())}")
        # only the new generation's pods (its prefill, when it started beside the failing decode, and its router,
        # when it started beside that prefill; then its decode); the old generation was never touched
        assert deleted in (["delete back-decode-g2"], ["delete back-prefill-g2", "delete back-decode-g2"],
                           ["delete back-router-g2", "delete back-prefill-g2", "delete back-decode-g2"]), deleted
        events = collections.Counter(e.reason for e in api.events(ns) if e.involved_object.kind == KIND)
        assert events["RolloutFailed"] >= 1 and events["RolloutRolledBack"] >= 1
        assert decode["metadata"]["labels"][LABEL_GENERATION] == "2"

        # A new spec rolls out again, and succeeds.
        listeners = [listen(port_named(g1["status"]["ports"], DECODE_SIDECHANNEL_0))]
        try:
            api.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "back", {"spec": {"image": "img:3"}})
            again = wait_for(lambda: (lambda p: p if (p["status"].get("rollout") or {}).get("ports") else None)(
                api.pair(ns, "back")), 30, "a new rollout")
            assert again["status"]["rollout"]["toGeneration"] == 2 and "failedRollout" not in again["status"]
            listeners.append(listen(port_named(again["status"]["rollout"]["ports"], DECODE_SIDECHANNEL_0)))
            wait_for(lambda: (lambda p: p if p["status"]["pairGeneration"] == 2 and "rollout" not in p["status"]
                              else None)(api.pair(ns, "back")), 90, "generation 2 serving, the rollout done")
        finally:
            for sock in listeners:
                sock.close()
        cleanup_pairs(api, ns)


def test_an_operator_restarted_mid_rollout_carries_it_on(platform, cluster_namespace, tmp_path):
    """status.rollout is the rollout's memory: a new operator process adopts the second port set and the new
    generation's pods, creates nothing twice, and finishes the rollout."""
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    pool = pool_of_free_ports(30)
    listeners = []
    recorder = PodRecorder(api, ns, only_new=True)
    try:
        with operator(platform, ns, pool, tmp_path):
            g1, listener = start_surge_pair(api, ns, "mid")
            listeners.append(listener)
            uid = g1["metadata"]["uid"]
            api.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "mid", {"spec": {"image": "img:2"}})
            wait_for(lambda: any(p["metadata"]["name"] == "mid-decode-g2" and p["status"].get("pod_ip")
                                 for p in api.pods(ns)), 60, "the new decode running (its listener still closed)")
            before = api.pair(ns, "mid")["status"]["rollout"]
            assert before["phase"] == "Progressing"
        # (the operator is stopped here, mid-rollout)
        with operator(platform, ns, pool, tmp_path, name="operator-2"):
            listeners.append(listen(port_named(before["ports"], DECODE_SIDECHANNEL_0)))
            done = wait_for(lambda: (lambda p: p if p["status"]["pairGeneration"] == 2 and "rollout" not in p["status"]
                                     else None)(api.pair(ns, "mid")), 90, "the rollout finished by the new operator")
            assert {p["port"] for p in done["status"]["ports"]} == {p["port"] for p in before["ports"]}
            wait_for(lambda: lease_ports(pair_leases(api, ns, uid)) == {p["port"] for p in before["ports"]}, 30,
                     "only the new generation's leases left")
            cleanup_pairs(api, ns)
    finally:
        recorder.stop()
        for sock in listeners:
            sock.close()
    created = recorder.created()
    print(f"\nmid-rollout restart order: {', '.join(recorder.order())}")
    assert created == ["mid-decode-g1", "mid-prefill-g1", "mid-router-g1",  # each pod once, decode first
                       "mid-decode-g2", "mid-prefill-g2", "mid-router-g2"], created


def test_a_new_pod_the_api_server_refuses_rolls_the_rollout_back(platform, cluster_namespace, tmp_path):
    """A resource name neither standard nor domain-qualified passes the CRD but not pod validation (422): the rollout
    fails at once, and the serving generation keeps Ready=True (the refusal is reported on Progressing)."""
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    listeners = []
    with operator(platform, ns, pool_of_free_ports(30), tmp_path):
        try:
            g1, listener = start_surge_pair(api, ns, "refused")
            listeners.append(listener)
            bad = {"resources": {"requests": {"widgets": "1"}}}
            api.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "refused", {"spec": {"decode": bad}})
            failed = wait_for(lambda: (lambda p: p if p["status"].get("failedRollout") and "rollout" not in p["status"]
                                       else None)(api.pair(ns, "refused")), 60, "the rollout rolled back")
            assert "refused decode pod" in failed["status"]["failedRollout"]["reason"]
            assert condition(failed, "Ready")["status"] == "True" and failed["status"]["pairGeneration"] == 1
            assert condition(failed, COND_PROGRESSING)["reason"] == "RolloutFailed"
            assert not [p for p in api.pods(ns) if p["metadata"]["labels"][LABEL_GENERATION] != "1"]
            # The status above is written before the rollout's port set is released (in the same pass): at this
            # instant its Leases may still exist, but every port status lists is leased.
            uid, g1_ports = g1["metadata"]["uid"], {p["port"] for p in g1["status"]["ports"]}
            assert {p["port"] for p in failed["status"]["ports"]} == g1_ports
            assert g1_ports <= lease_ports(pair_leases(api, ns, uid))
            assert wait_leases_equal_status_ports(api, ns, "refused", uid) == g1_ports
        finally:
            for sock in listeners:
                sock.close()
        cleanup_pairs(api, ns)
