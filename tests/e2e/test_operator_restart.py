"""Hang detection and the ordered pair restart on the real control plane.

The pods are kwok pods (hostNetwork, node IP 127.0.0.1); their /metrics are real processes on the leased metrics
ports: `python -m tests.metrics_demo`, the connector's own exporter (SignalAccounts), made hung on
purpose with SIGUSR1. The decode side-channel listener is a real socket the test opens and closes.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from pdpair.contract import (
    COND_SIGNALS_HEALTHY,
    KIND,
    PURPOSE_METRICS,
    PURPOSE_SIDECHANNEL,
    ROLE_DECODE,
    ROLE_PREFILL,
    status_port_name,
)
from pdpair.operator.model.config import ENV_HEALTH_INTERVAL
from tests.e2e.crash_after_restart_write import CRASH_EXIT_CODE
from tests.e2e.ha_support import DecodeListeners, restart_generations
from tests.e2e.operator_helpers import (
    Api,
    PodRecorder,
    cleanup_pairs,
    condition,
    operator,
    pool_of_free_ports,
)
from devcluster.waiting import wait_for

pytestmark = pytest.mark.cluster

HEALTH_INTERVAL = 1.0
HANG_TIMEOUT = 5  # the CRD's minimum
MEASURING_SLACK = 1.0  # seconds: the test's own signal and watch on a stalled 2-core box (see its use)
FAST_HEALTH = {ENV_HEALTH_INTERVAL: str(HEALTH_INTERVAL)}
DECODE_SIDECHANNEL = status_port_name(ROLE_DECODE, PURPOSE_SIDECHANNEL, 0)
DECODE_METRICS = status_port_name(ROLE_DECODE, PURPOSE_METRICS, 0)
PREFILL_METRICS = status_port_name(ROLE_PREFILL, PURPOSE_METRICS, 0)


class Exporter:
    """A real pod metrics exporter on 127.0.0.1:port (the connector's metrics_demo)."""

    def __init__(self, port, role, generation, *args):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.metrics_demo", "--port", str(port), "--role", role,
             "--generation", str(generation), "--hang-timeout", str(HANG_TIMEOUT), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"metrics_demo did not start: {self.proc.stderr.read()[-2000:]}")
        assert json.loads(line)["port"] == port

    def hang(self):
        self.proc.send_signal(signal.SIGUSR1)

    def stop(self):
        # Teardown, not a finding: SIGTERM ends it within a second on a quiet box, but one took over 10 s at load 10
        # (CI, beside the engine tier) and failed a test whose assertions had all passed. Past 30 s it is killed.
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Listener:
    def __init__(self, port):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(16)

    def close(self):
        self.sock.close()


def ports_of(pair):
    return {p["name"]: p["port"] for p in pair["status"]["ports"]}


def phase_is(api, ns, name, phase, generation=None):
    def check():
        pair = api.pair(ns, name)
        status = pair.get("status") or {}
        if status.get("phase") == phase and (generation is None or status.get("pairGeneration") == generation):
            return pair
        return None
    return check


def start_pair(api, ns, name, **restart_policy):
    api.create_pair(ns, name, connector={"transport": "tcp", "hangTimeoutSeconds": HANG_TIMEOUT},
                    restartPolicy={"maxRestarts": 5, "windowSeconds": 600, "backoffSeconds": 1,
                                   "maxBackoffSeconds": 4, **restart_policy})
    pair = wait_for(lambda: (lambda p: p if (p.get("status") or {}).get("ports") else None)(api.pair(ns, name)),
                    30, "ports leased")
    return ports_of(pair)


def test_hang_detected_and_pair_restarted_in_order(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    exporters = []
    with operator(platform, ns, pool_of_free_ports(20), tmp_path, env=FAST_HEALTH):
        ports = start_pair(api, ns, "hang")
        listener = Listener(ports[DECODE_SIDECHANNEL])
        try:
            decode_x = Exporter(ports[DECODE_METRICS], "decode", 1, "--deficit", "3", "--deficit-on-sigusr1")
            prefill_x = Exporter(ports[PREFILL_METRICS], "prefill", 1)
            exporters += [decode_x, prefill_x]
            wait_for(phase_is(api, ns, "hang", "Ready", 1), 30, "generation 1 Ready")
            wait_for(lambda: condition(api.pair(ns, "hang"), COND_SIGNALS_HEALTHY).get("status") == "True", 30,
                     "SignalsHealthy True")
            recorder = PodRecorder(api, ns)
            hung_at = time.monotonic()
            decode_x.hang()  # the stuck transfer opens now; it is hung HANG_TIMEOUT seconds later

            # Detection: the first step of the restart (the prefill pod's deletion) shows up in the watch.
            wait_for(lambda: any(k == "delete" and "prefill" in n for _, k, n in recorder.events), 30,
                     "the restart to begin", interval=0.05)
            detected_at = next(t for t, k, n in recorder.events if k == "delete" and "prefill" in n)
            detection = detected_at - hung_at
            budget = HANG_TIMEOUT + 2 * HEALTH_INTERVAL
            # hung_at is taken before the signal, so the pod's wait starts after it and the watch reports the
            # deletion after it happened: both make `detection` an upper bound of the true delay. That measuring path
            # (the exporter's signal, the test's own watch) gets MEASURING_SLACK on top of the design's bound: CI saw
            # 7.22 s against 7.0 with the box stalled 13.6 s of 15 by the engine tier beside it (load 10.9).
            print(f"\nhang detected and restart begun {detection:.2f}s after the transfer got stuck "
                  f"(hang timeout {HANG_TIMEOUT}s, bound hangTimeout + 2 x health interval = {budget:.1f}s, "
                  f"+ {MEASURING_SLACK}s for the measurement on a busy box)")
            assert detection <= budget + MEASURING_SLACK

            # The old "engines" go away with their pods; the new decode starts without a listener.
            listener.close()
            for x in exporters:
                x.stop()
            exporters.clear()
            wait_for(lambda: any(k == "create" and n == "hang-decode-g2" for _, k, n in recorder.events), 30,
                     "the new decode pod")
            # Parallel start: prefill g2 comes beside decode g2, before its listener opens...
            wait_for(lambda: any(k == "create" and n == "hang-prefill-g2" for _, k, n in recorder.events), 30,
                     "prefill g2 beside the not yet listening decode g2")
            time.sleep(2.5)  # ...and generation 2 is not Ready while decode g2 does not listen
            assert (api.pair(ns, "hang").get("status") or {}).get("phase") != "Ready", \
                "generation 2 Ready before decode g2 listened"
            exporters += [Exporter(ports[DECODE_METRICS], "decode", 2),
                          Exporter(ports[PREFILL_METRICS], "prefill", 2)]
            listener = Listener(ports[DECODE_SIDECHANNEL])
            opened = time.monotonic()
            recovered = wait_for(phase_is(api, ns, "hang", "Ready", 2), 30, "generation 2 Ready")
            print(f"recovered (generation 2 Ready) {time.monotonic() - detected_at:.2f}s after the restart began, "
                  f"of which the test held the listener closed for {opened - detected_at:.2f}s")
            recorder.stop()
            order = recorder.order()
            print("restart order: " + ", ".join(order))
            assert [o for o in order if not o.startswith("create hang-") or o.endswith("-g2")][:4] == [
                "delete hang-prefill-g1", "delete hang-decode-g1", "create hang-decode-g2", "create hang-prefill-g2"]
            prefill_created = next(t for t, k, n in recorder.events if k == "create" and n == "hang-prefill-g2")
            assert prefill_created <= opened, "prefill g2 waited for decode g2's listener (no parallel start)"
            status = recovered["status"]
            assert status["restarts"] == 1 and "hung" in status["lastRestart"]["reason"]
            events = [e for e in api.events(ns) if e.involved_object.kind == KIND]
            reasons = [e.reason for e in events]
            assert "Unhealthy" in reasons and "Restarting" in reasons and "PodDeleted" in reasons
            # The Restarting Event is posted and acknowledged before status records the restart, not queued by kopf
            # (kopf's queue lost it when a leader was SIGKILLed right after the status write).
            restarting = [(e.source.component if e.source else None, e.message) for e in events
                          if e.reason == "Restarting"]
            assert [c for c, _ in restarting] == ["pdpair-operator"], restarting
            assert restarting[0][1].startswith("ordered restart to generation 2: "), restarting
            # One delete (and one Event) per pod, even when the next pass runs before the index shows it terminating.
            deleted = [e.message for e in events if e.reason == "PodDeleted" for _ in range(max(1, e.count or 1))]
            assert len(deleted) == len(set(deleted)), deleted
        finally:
            for x in exporters:
                x.stop()
            listener.close()
        cleanup_pairs(api, ns)


def test_stale_generation_leads_to_restart(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    with operator(platform, ns, pool_of_free_ports(20), tmp_path, env=FAST_HEALTH):
        ports = start_pair(api, ns, "stale")
        listener = Listener(ports[DECODE_SIDECHANNEL])
        exporters = [Exporter(ports[DECODE_METRICS], "decode", 7),  # a pod of another generation
                     Exporter(ports[PREFILL_METRICS], "prefill", 1)]
        try:
            restarted = wait_for(lambda: (lambda p: p if (p.get("status") or {}).get("restarts") else None)(
                api.pair(ns, "stale")), 30, "a restart")
            assert restarted["status"]["pairGeneration"] >= 2
            assert "generation" in restarted["status"]["lastRestart"]["reason"]
        finally:
            for x in exporters:
                x.stop()
            listener.close()
        cleanup_pairs(api, ns)


def test_budget_exhaustion_fails_the_pair_and_stops(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    with operator(platform, ns, pool_of_free_ports(20), tmp_path, env=FAST_HEALTH):
        # Nothing serves the pods' /metrics: after 3 unreachable scrapes the pair is restarted, again and again.
        ports = start_pair(api, ns, "budget", maxRestarts=1)
        listener = Listener(ports[DECODE_SIDECHANNEL])
        try:
            failed = wait_for(phase_is(api, ns, "budget", "Failed"), 60, "phase Failed")
            generation = failed["status"]["pairGeneration"]
            assert failed["status"]["restarts"] == 1
            assert "budget" in failed["status"]["message"]
            # the verdict that spent the budget, read from status.health, stays on the Failed pair
            signals = condition(failed, COND_SIGNALS_HEALTHY)
            assert (signals["status"], signals["reason"]) == ("False", "Unreachable"), signals
            assert failed["status"]["health"]["pairGeneration"] == generation
            recorder = PodRecorder(api, ns, only_new=True)
            time.sleep(6 * HEALTH_INTERVAL)
            quiet_creations = recorder.created()
            # Prove the watch was live through the quiet period: a pod made now must be seen.
            api.core.create_namespaced_pod(ns, {"metadata": {"name": "recorder-probe"},
                                                "spec": {"containers": [{"name": "c", "image": "none"}]}})
            wait_for(lambda: "recorder-probe" in recorder.created(), 10, "the recorder to see its probe pod")
            recorder.stop()
            assert recorder.error is None, f"the pod watch failed: {recorder.error!r}"
            assert quiet_creations == [], f"pods created after the pair Failed: {quiet_creations}"
            later = api.pair(ns, "budget")["status"]
            assert later["phase"] == "Failed" and later["pairGeneration"] == generation and later["restarts"] == 1
            reasons = [e.reason for e in api.events(ns) if e.involved_object.name == "budget"]
            assert "RestartBudgetExhausted" in reasons
        finally:
            listener.close()
        cleanup_pairs(api, ns)


def test_healthy_pair_is_never_restarted(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    with operator(platform, ns, pool_of_free_ports(20), tmp_path, env=FAST_HEALTH):
        ports = start_pair(api, ns, "calm")
        listener = Listener(ports[DECODE_SIDECHANNEL])
        exporters = [Exporter(ports[DECODE_METRICS], "decode", 1, "--ok-every", "0.3"),
                     Exporter(ports[PREFILL_METRICS], "prefill", 1, "--ok-every", "0.3")]
        try:
            wait_for(phase_is(api, ns, "calm", "Ready", 1), 30, "Ready")
            time.sleep(8 * HEALTH_INTERVAL)
            status = api.pair(ns, "calm")["status"]
            assert status["phase"] == "Ready" and status["pairGeneration"] == 1 and not status.get("restarts")
            assert condition(api.pair(ns, "calm"), COND_SIGNALS_HEALTHY)["status"] == "True"
        finally:
            for x in exporters:
                x.stop()
            listener.close()
        cleanup_pairs(api, ns)


def test_an_operator_dying_right_after_recording_a_restart_loses_no_event_and_restarts_once(platform,
                                                                                            cluster_namespace,
                                                                                            tmp_path):
    """The operator dies like a SIGKILL the instant the status write recording a restart returns
    (tests/e2e/crash_after_restart_write.py). The Restarting Event must already be on the API server, and the
    operator that follows must finish that same restart: one restart, one announced generation, no second one."""
    api = Api(platform[0])
    ns = cluster_namespace
    pool = pool_of_free_ports(20)
    listeners = DecodeListeners(api, ns)  # the "engines": decode listens on its leased side-channel port
    try:
        with operator(platform, ns, pool, tmp_path, name="crashing",
                      module="tests.e2e.crash_after_restart_write") as crashing:
            api.create_pair(ns, "crash")
            wait_for(phase_is(api, ns, "crash", "Ready", 1), 60, "generation 1 Ready")
            api.core.delete_namespaced_pod("crash-decode-g1", ns)  # decode vanished: an ordered restart is due
            wait_for(lambda: crashing.proc.poll() is not None, 60, "the operator's death after recording the restart")
            assert crashing.proc.returncode == CRASH_EXIT_CODE, crashing.log_tail()
        status = api.pair(ns, "crash")["status"]
        assert status["restarts"] == 1 and status["pairGeneration"] == 2, status
        assert restart_generations(api, ns) == {"crash": {2}}, "the Restarting Event died with the operator"

        with operator(platform, ns, pool, tmp_path, name="successor"):
            ready = wait_for(phase_is(api, ns, "crash", "Ready", 2), 60, "generation 2 Ready under the successor")
            assert ready["status"]["restarts"] == 1, ready["status"]
            assert restart_generations(api, ns) == {"crash": {2}}
            pods = sorted(p["metadata"]["name"] for p in api.pods(ns))
            assert pods == ["crash-decode-g2", "crash-prefill-g2"], pods
            cleanup_pairs(api, ns)
    finally:
        listeners.stop()
