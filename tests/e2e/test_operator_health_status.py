"""KV health in status on the real control plane: the health watch writes `status.health`, the
reconciler derives SignalsHealthy and the restart from it, and a restarted operator reads the same health back.

The pods are kwok pods (hostNetwork, node IP 127.0.0.1); their /metrics are real exporters on the leased metrics
ports (`python -m tests.metrics_demo`, the connector's SignalAccounts), as in test_operator_restart.py, whose
Exporter and Listener this module reuses. The operator runs under the chart's ServiceAccount (operator_helpers).
"""

from __future__ import annotations

import calendar
import json
import signal
import time

import pytest

from pdpair.contract import COND_SIGNALS_HEALTHY, GROUP, PLURAL, VERSION
from pdpair.operator.decide.health import LISTENER_REFUSED_THRESHOLD, UNREACHABLE_THRESHOLD
from pdpair.operator.decide.health_status import HEALTH_REFRESH_INTERVALS
from devcluster.apiserver_metrics import counts_delta, write_counts
from tests.e2e.operator_helpers import (
    NO_HEALTH,
    Api,
    PodRecorder,
    cleanup_pairs,
    condition,
    operator,
    pair_diagnosis,
    pool_of_free_ports,
)
from devcluster.waiting import wait_for
from tests.e2e.test_operator_restart import (
    DECODE_METRICS,
    DECODE_SIDECHANNEL,
    FAST_HEALTH,
    HANG_TIMEOUT,
    HEALTH_INTERVAL,
    PREFILL_METRICS,
    Exporter,
    Listener,
    phase_is,
    start_pair,
)

pytestmark = pytest.mark.cluster

STATUS_PATCH = ("PATCH", GROUP, PLURAL, "status")
REFRESH_SECONDS = HEALTH_REFRESH_INTERVALS * HEALTH_INTERVAL
WINDOW = 10.0  # a steady-state observation window, well inside one refresh period
# A new pair's way to Ready (the operator's first passes, decode first, the kwok pods, the listener probe): seconds
# alone, but over 60 s once on a starved CI box (load 7.5, 43 s of 79 s stalled on CPU, 2026-12-06).
READY_TIMEOUT = 120
# The first healthy verdict after Ready (a setup wait, not a bound under test): health scrapes of the exporters miss
# their deadline while the box is starved (CI 2026-12-06, beside the engine tier: the CPU stalled 25 s of 41 s and 30 s
# did not suffice).
HEALTHY_TIMEOUT = 60


def health_of(api, ns, name):
    return (api.pair(ns, name).get("status") or {}).get("health") or {}


def healthy(api, ns, name, generation):
    def check():
        pair = api.pair(ns, name)
        h = (pair.get("status") or {}).get("health") or {}
        roles = h.get("roles") or {}
        if (h.get("pairGeneration") == generation and h.get("verdict") == "Healthy"
                and {r: (roles.get(r) or {}).get("state") for r in ("decode", "prefill")}
                == {"decode": "healthy", "prefill": "healthy"}
                and condition(pair, COND_SIGNALS_HEALTHY).get("status") == "True"):
            return pair
        return None
    return check


def status_patches(cluster, before):
    return sum(v for k, v in counts_delta(write_counts(cluster), before).items() if k[:4] == STATUS_PATCH)


def test_health_in_status_column_and_operator_restart(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    exporters = []
    pool = pool_of_free_ports(20)
    listener = None
    try:
        with operator(platform, ns, pool, tmp_path, name="operator-a", env=FAST_HEALTH) as operator_a:
            ports = start_pair(api, ns, "kv")
            listener = Listener(ports[DECODE_SIDECHANNEL])
            # a busy pair: each pod finishes a transfer every 0.3 s, so its transfer count moves on every scrape
            exporters += [Exporter(ports[DECODE_METRICS], "decode", 1, "--ok-every", "0.3"),
                          Exporter(ports[PREFILL_METRICS], "prefill", 1, "--ok-every", "0.3")]
            wait_for(phase_is(api, ns, "kv", "Ready", 1), READY_TIMEOUT, "generation 1 Ready",
                     diagnose=lambda: pair_diagnosis(api, ns, "kv", operator_a))
            pair = wait_for(healthy(api, ns, "kv", 1), HEALTHY_TIMEOUT, "status.health Healthy and SignalsHealthy True")
            h = pair["status"]["health"]
            for role in ("decode", "prefill"):
                entry = h["roles"][role]
                assert entry["pod"] == f"kv-{role}-g1" and entry["unreachableStreak"] == 0 and entry["deficit"] == 0
                assert entry["lastScrapeTime"] and "oldestWaitSeconds" in entry
            assert h["reason"] == "" and h["observedAt"]

            out = cluster.kubectl("get", "ipair", "kv", "-n", ns, "-o", "wide").stdout
            header, row = out.splitlines()[:2]
            assert "KV HEALTH" in header and "DECODE DEFICIT" in header and "Healthy" in row.split(), out
            assert "KV HEALTH" not in cluster.kubectl("get", "ipair", "kv", "-n", ns).stdout  # priority 1: -o wide only

            # Steady state of a busy, healthy pair: no status writes but the periodic refresh.
            before = write_counts(cluster)
            time.sleep(WINDOW)  # an observation window, not a synchronisation
            patches = status_patches(cluster, before)
            print(f"\nbusy healthy pair, health every {HEALTH_INTERVAL:g}s: {patches} status PATCHes in "
                  f"{WINDOW:g}s (refresh every {REFRESH_SECONDS:g}s)")
            # At most the refresh, plus two missed scrapes and their recoveries (a pod's state or streak changing is
            # written at once: on the busy box a scrape can miss its 2 s deadline; CI 2026-12-06, the CPU stalled 23 s
            # of 25 s beside the engine tier, wrote 4). A write per scrape, what this guards against, would be about 10.
            assert patches <= 5, f"{patches} status writes in {WINDOW}s"

            # The transfers counted in status grow, and lastTransferTime with them (after a refresh at the latest).
            counted = h["roles"]["decode"]["transfers"]
            later = wait_for(lambda: (lambda x: x if x["roles"]["decode"]["transfers"] > counted else None)(
                health_of(api, ns, "kv")), REFRESH_SECONDS + 30, "the refreshed transfer count")
            assert later["roles"]["decode"]["lastTransferTime"] == later["observedAt"]
            before_kill = api.pair(ns, "kv")
            operator_a.kill()  # SIGKILL: nothing is handed over; B starts from what the API holds
        stopped_at = time.time()
        recorder = PodRecorder(api, ns, only_new=True)
        with operator(platform, ns, pool, tmp_path, name="operator-b", env=FAST_HEALTH):
            def refreshed_by_b():
                h = health_of(api, ns, "kv")
                at = calendar.timegm(time.strptime(h["observedAt"], "%Y-%m-%dT%H:%M:%SZ"))
                return h if at > stopped_at + 1 else None
            after = wait_for(refreshed_by_b, REFRESH_SECONDS + 60, "operator B's first health write (a refresh)")
            pair = api.pair(ns, "kv")
            old, new = before_kill["status"], pair["status"]
            assert (new["phase"], new["pairGeneration"], new.get("restarts")) == ("Ready", 1, old.get("restarts"))
            assert (after["verdict"], after["reason"], after["pairGeneration"]) == ("Healthy", "", 1)
            # The same pods, each healthy, or unreachable for fewer scrapes in a row than a verdict needs: on the
            # busy 2-core box one scrape of an exporter can miss its 2 s deadline (R8: A's last write said prefill
            # `unreachable`, streak 1, verdict Healthy; B's first said `healthy`), and the verdict above holds.
            for health in (after, old["health"]):
                assert {r: e["pod"] for r, e in health["roles"].items()} == {"decode": "kv-decode-g1",
                                                                            "prefill": "kv-prefill-g1"}
                for role, entry in health["roles"].items():
                    assert entry["state"] == "healthy" or (
                        entry["state"] == "unreachable" and entry["unreachableStreak"] < UNREACHABLE_THRESHOLD), \
                        (role, entry)
            # SignalsHealthy never flipped: same status, same lastTransitionTime as before the restart
            assert condition(pair, COND_SIGNALS_HEALTHY) == condition(before_kill, COND_SIGNALS_HEALTHY)
            recorder.stop()
            assert recorder.error is None and recorder.order() == [], f"pods touched: {recorder.order()}"
            cleanup_pairs(api, ns)
    finally:
        for x in exporters:
            x.stop()
        if listener is not None:
            listener.close()


def test_hung_pod_unhealthy_in_status_and_restart_read_back(platform, cluster_namespace, tmp_path):
    """A hung decode: the health watch writes Unhealthy, the pair restarts in order (prefill first) to generation 2;
    generation 2 hangs too and its restart is held back by the backoff with SignalsHealthy saying why; a second
    operator that never scrapes restarts it to generation 3 from status.health alone. The backoff is 150 s so that
    the verdict and the operator's kill fall inside it on a starved box; once operator A is gone the pair's
    restartPolicy is patched down to 1 s (not a pod field: it rolls nothing, and restart_policy.decide reads the
    spec on every pass), so operator B acts at once instead of waiting out the rest. Cost: about 1.5 minutes of one
    e2e worker on a loaded box (kwok pods, no engine); waiting out the whole 150 s backoff took 167-173 s in CI."""
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    exporters = []
    pool = pool_of_free_ports(20)
    listener = None
    try:
        with operator(platform, ns, pool, tmp_path, name="operator-a", env=FAST_HEALTH) as operator_a:
            # the first restart is immediate; the second waits 150 s, long enough to look at (and restart the
            # operator in) the backoff. 60 s and then 90 s were too short on a starved box: generation 2 was judged
            # hung only after the backoff had run out, and the restart to generation 3 came in the same pass (CI,
            # load 9, 82 s of 93 s stalled on CPU; again at load 13, 78 s of 105 s stalled, 2026-12-07).
            ports = start_pair(api, ns, "hung", backoffSeconds=150, maxBackoffSeconds=150)
            listener = Listener(ports[DECODE_SIDECHANNEL])
            decode_x = Exporter(ports[DECODE_METRICS], "decode", 1, "--deficit", "3", "--deficit-on-sigusr1")
            exporters += [decode_x, Exporter(ports[PREFILL_METRICS], "prefill", 1)]
            wait_for(phase_is(api, ns, "hung", "Ready", 1), READY_TIMEOUT, "generation 1 Ready",
                     diagnose=lambda: pair_diagnosis(api, ns, "hung", operator_a))
            wait_for(healthy(api, ns, "hung", 1), HEALTHY_TIMEOUT, "generation 1 healthy")
            recorder = PodRecorder(api, ns, only_new=True)
            decode_x.hang()

            # The watch writes Unhealthy; the reconciler reads it and restarts in order, prefill first.
            wait_for(lambda: (api.pair(ns, "hung").get("status") or {}).get("pairGeneration") == 2, 60,
                     "the restart to generation 2")
            h = health_of(api, ns, "hung")  # stays until generation 2 is judged: its pods are not served yet
            assert (h["pairGeneration"], h["verdict"], h["reason"]) == (1, "Unhealthy", "hung"), h
            assert h["roles"]["decode"]["state"] == "hung" and h["roles"]["decode"]["deficit"] == 3
            prefill = h["roles"]["prefill"]
            assert h["roles"]["decode"]["oldestWaitSeconds"] >= 5 and (prefill["state"] == "healthy" or (
                prefill["state"] == "unreachable" and prefill["unreachableStreak"] < UNREACHABLE_THRESHOLD)), h
            pair = api.pair(ns, "hung")
            assert "hung" in pair["status"]["lastRestart"]["reason"]
            # a verdict about generation 1 never stands for generation 2
            assert condition(pair, COND_SIGNALS_HEALTHY)["reason"] == "NotJudged"
            wait_for(lambda: [o for o in recorder.order() if o.startswith("delete")] ==
                     ["delete hung-prefill-g1", "delete hung-decode-g1"], 30, "both generation 1 pods deleted")
            assert [o for o in recorder.order() if o.startswith("delete")][0] == "delete hung-prefill-g1"

            # Generation 2's decode is hung from the start: the second restart waits out the backoff, and
            # meanwhile SignalsHealthy says why.
            for x in exporters:
                x.stop()
            exporters.clear()
            exporters += [Exporter(ports[DECODE_METRICS], "decode", 2, "--deficit", "3"),
                          Exporter(ports[PREFILL_METRICS], "prefill", 2)]
            # The exporters were just replaced: scrapes in the gap may judge a pod unreachable first (CI saw
            # Unreachable at load ~10), which is right; the hung verdict follows once both answer.
            def judged_hung():
                p = api.pair(ns, "hung")
                signals = condition(p, COND_SIGNALS_HEALTHY)
                return p if (signals.get("status"), signals.get("reason")) == ("False", "Hung") else None

            # 120 s: at load 16 (the engine tier beside it, the CPU stalled 66 s of 93 s) 80 s passed without the
            # verdict (CI, 2026-12-07); the status is printed if it does not come
            pair = wait_for(judged_hung, 120, "SignalsHealthy False (Hung) for generation 2",
                            diagnose=lambda: json.dumps(api.pair(ns, "hung").get("status"), indent=1)[:4000])
            cond = condition(pair, COND_SIGNALS_HEALTHY)
            assert cond["reason"] == "Hung" and "3 signals missing" in cond["message"], cond
            assert pair["status"]["phase"] == "Restarting" and pair["status"]["pairGeneration"] == 2
            assert pair["status"]["health"]["pairGeneration"] == 2
            assert condition(pair, "Ready")["reason"] == "RestartBackoff"
            operator_a.kill()
        # What is left of the backoff holds nothing this test asserts: shorten it for operator B (the policy is read
        # from the spec on every pass; restartPolicy is not a pod field, so the patch rolls nothing).
        api.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "hung", {
            "spec": {"restartPolicy": {"backoffSeconds": 1, "maxBackoffSeconds": 1}}})
        # Operator B never scrapes (health interval 1 h): all it knows of the verdict is status.health.
        recorder = PodRecorder(api, ns, only_new=True)
        with operator(platform, ns, pool, tmp_path, name="operator-b", env=NO_HEALTH):
            pair = wait_for(lambda: (lambda p: p if p["status"].get("pairGeneration") == 3 else None)(
                api.pair(ns, "hung")), 210, "operator B's restart to generation 3, after the (shortened) backoff")
            assert pair["status"]["restarts"] == 2 and "hung" in pair["status"]["lastRestart"]["reason"]
            wait_for(lambda: [o for o in recorder.order() if o.startswith("delete")] ==
                     ["delete hung-prefill-g2", "delete hung-decode-g2"], 30, "both generation 2 pods deleted")
            recorder.stop()
            cleanup_pairs(api, ns)
    finally:
        for x in exporters:
            x.stop()
        if listener is not None:
            listener.close()


def generation_at_least(api, ns, name, generation):
    def check():
        pair = api.pair(ns, name)
        return pair if int((pair.get("status") or {}).get("pairGeneration") or 0) >= generation else None
    return check


def test_lost_listener_is_unhealthy_with_its_cause_and_replaced_within_the_hang_timeout(platform, cluster_namespace,
                                                                                        tmp_path):
    """A Ready pair whose decode listener stops: `status.health` says Unhealthy, reason listener_lost, naming the
    decode pod (never Healthy), SignalsHealthy False ListenerLost, an Unhealthy Event, and the pair is restarted in
    order within the hang timeout, from the restart budget. Twice, once per way the watch learns it:
    1. the listener socket closes and the pod says nothing (a connector older than `pdpair_listener_failed`, or a
       listener closed some other way): the watch's TCP probe is refused LISTENER_REFUSED_THRESHOLD checks in a row;
    2. the pod reports its side-channel loop stopped (`pdpair_listener_failed` 1, the exporter's SIGUSR2) while the
       port still accepts: judged on the first check.
    Health interval 1 s (FAST_HEALTH) and the CRD's minimum hang timeout, 5 s. The design's bound from the stop to
    the restart's first delete is LISTENER_REFUSED_THRESHOLD health intervals for the probe (the first refused check
    comes within an interval) and one for the report, plus the check's own time and the pass that acts: 2 s and 1 s
    here, measured 1.5 s and 0.8 s on the shared 2-core box; the assertion is the requirement, the hang timeout (5 s,
    over 3x the measured time). Cost: 33 s for this test alone with the cluster's start, about 25 s of it the
    operator's start, two restarts and the pair's steps (kwok pods)."""
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    exporters = []
    pool = pool_of_free_ports(20)
    listener = None
    try:
        with operator(platform, ns, pool, tmp_path, name="operator-ll", env=FAST_HEALTH) as operator_ll:
            ports = start_pair(api, ns, "ll")
            listener = Listener(ports[DECODE_SIDECHANNEL])
            exporters += [Exporter(ports[DECODE_METRICS], "decode", 1),
                          Exporter(ports[PREFILL_METRICS], "prefill", 1)]
            wait_for(phase_is(api, ns, "ll", "Ready", 1), READY_TIMEOUT, "generation 1 Ready",
                     diagnose=lambda: pair_diagnosis(api, ns, "ll", operator_ll))
            wait_for(healthy(api, ns, "ll", 1), HEALTHY_TIMEOUT, "generation 1 healthy")
            recorder = PodRecorder(api, ns, only_new=True)

            # 1. the listener closes, the pod says nothing
            stopped = time.monotonic()
            listener.close()
            listener = None
            wait_for(lambda: any(k == "delete" and n == "ll-prefill-g1" for _, k, n in recorder.events), 30,
                     "the restart's first delete", interval=0.05)
            probe_detection = next(t for t, k, n in recorder.events if k == "delete" and n == "ll-prefill-g1") - stopped
            h = health_of(api, ns, "ll")
            assert (h["pairGeneration"], h["verdict"], h["reason"], h["pod"]) == (1, "Unhealthy", "listener_lost",
                                                                                 "ll-decode-g1"), h
            decode = h["roles"]["decode"]
            assert decode["state"] == "listener_lost" and decode["listenerStreak"] == LISTENER_REFUSED_THRESHOLD, h
            assert str(ports[DECODE_SIDECHANNEL]) in h["message"] and "refused" in h["message"], h
            pair = wait_for(generation_at_least(api, ns, "ll", 2), 30, "the restart to generation 2")
            assert pair["status"]["restarts"] == 1 and "listener lost" in pair["status"]["lastRestart"]["reason"]
            wait_for(lambda: any(e.reason == "Unhealthy" and e.message.startswith("listener_lost: ")
                                 for e in api.events(ns)), 30, "the Unhealthy Event naming listener_lost")

            # generation 2 comes up (decode first, the listener, then prefill), with an exporter that can report
            for x in exporters:
                x.stop()
            exporters.clear()
            wait_for(lambda: any(k == "create" and n == "ll-decode-g2" for _, k, n in recorder.events), 30,
                     "decode g2")
            decode_x = Exporter(ports[DECODE_METRICS], "decode", 2, "--listener-failed-on-sigusr2")
            exporters += [decode_x, Exporter(ports[PREFILL_METRICS], "prefill", 2)]
            listener = Listener(ports[DECODE_SIDECHANNEL])
            wait_for(phase_is(api, ns, "ll", "Ready", 2), READY_TIMEOUT, "generation 2 Ready",
                     diagnose=lambda: pair_diagnosis(api, ns, "ll", operator_ll))
            wait_for(healthy(api, ns, "ll", 2), HEALTHY_TIMEOUT, "generation 2 healthy")

            # 2. the pod reports its loop stopped (its port still accepts: only the report tells)
            stopped = time.monotonic()
            decode_x.proc.send_signal(signal.SIGUSR2)
            wait_for(lambda: any(k == "delete" and n == "ll-prefill-g2" for _, k, n in recorder.events), 30,
                     "the second restart's first delete", interval=0.05)
            report_detection = next(t for t, k, n in recorder.events
                                    if k == "delete" and n == "ll-prefill-g2") - stopped
            h = health_of(api, ns, "ll")
            assert (h["pairGeneration"], h["verdict"], h["reason"], h["pod"]) == (2, "Unhealthy", "listener_lost",
                                                                                 "ll-decode-g2"), h
            assert h["roles"]["decode"]["state"] == "listener_lost" and "listenerStreak" not in h["roles"]["decode"]
            assert "pdpair_listener_failed" in h["message"], h
            pair = wait_for(generation_at_least(api, ns, "ll", 3), 30, "the restart to generation 3")
            assert pair["status"]["restarts"] == 2 and "listener lost" in pair["status"]["lastRestart"]["reason"]
            recorder.stop()
            print(f"\nlistener lost -> restart's first delete: probe path {probe_detection:.2f}s (bound "
                  f"{LISTENER_REFUSED_THRESHOLD * HEALTH_INTERVAL:g}s + a check + the acting pass), reported "
                  f"{report_detection:.2f}s (bound {HEALTH_INTERVAL:g}s + the same); hang timeout {HANG_TIMEOUT}s")
            # Within the hang timeout, the requirement (the design's bounds are 2 s and 1 s: see the docstring).
            assert probe_detection <= HANG_TIMEOUT and report_detection <= HANG_TIMEOUT
            cleanup_pairs(api, ns)
    finally:
        for x in exporters:
            x.stop()
        if listener is not None:
            listener.close()
