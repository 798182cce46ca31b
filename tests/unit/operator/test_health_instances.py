"""The health watch over every engine instance of an xPyD pair (docs/xpyd.md section 7, the health side): which pods
it judges (health.watched_pods, scrape_due), the targets and pod objects it builds (health_watch.scrape_pair, run on
real exporters: the connector's SignalAccounts on real local HTTP servers), `status.health.instances`, the verdict
naming its pod (`status.health.pod`, `Finding.pod`), carry-over per instance, and a 1P1D pair's status and writes
compared with what the code wrote before instances (a fixture recorded from that code)."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from pdpair import contract
from pdpair.contract import LABEL_GENERATION, LABEL_INSTANCE, LABEL_PAIR_UID, LABEL_ROLE, PURPOSE_METRICS
from pdpair.operator.decide import health
from pdpair.operator.decide import health_status
from pdpair.operator.build import pods as pod_manifests
from pdpair.operator.act import health_watch
from pdpair.operator.decide.health import (
    REASON_HUNG,
    REASON_POD_FAILED,
    REASON_UNREACHABLE,
    UNREACHABLE_THRESHOLD,
    instance_key,
    pair_verdict,
    scrape_due,
    watched_pods,
)
from pdpair.operator.decide.health_status import (
    HEALTH_REFRESH_INTERVALS,
    VERDICT_HEALTHY,
    VERDICT_PENDING,
    VERDICT_UNHEALTHY,
    health_patch,
    observe,
    restart_finding,
    signals_condition,
)
from pdpair.operator.model.observed import Finding, PodView

T0 = datetime(2026, 12, 1, 8, 0, 0, tzinfo=timezone.utc)
REFRESH = HEALTH_REFRESH_INTERVALS * 10.0
PAIR = "chat"
FIXTURE = Path(__file__).parent / "data" / "health_1p1d_before_instances.json"


def name(role, instance=0, generation=1):
    return pod_manifests.pod_name(PAIR, role, generation, instance)


def pod_json(role, instance=0, generation=1, *, ip="127.0.0.1", phase="Running", ready=True, started=True,
             draining=False, deleting=False, scheduled=True, restarts=0):
    """An engine pod as the API returns it (the fields PodView and pod_fact read)."""
    meta = {"name": name(role, instance, generation), "namespace": "ml", "uid": f"uid-{role}-{instance}",
            "labels": {LABEL_PAIR_UID: "pair-uid", LABEL_ROLE: role, LABEL_GENERATION: str(generation),
                       LABEL_INSTANCE: str(instance)},
            "annotations": {contract.ANNOTATION_DRAINING_SINCE: "1700000000"} if draining else {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T07:59:00Z"
    status = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
              "containerStatuses": [{"name": "engine", "started": started, "ready": ready,
                                     "restartCount": restarts}]}
    if scheduled:
        status["conditions"].append({"type": "PodScheduled", "status": "True"})
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "spec": {"nodeName": "n1" if scheduled else None}, "status": status}


def view(role, instance=0, generation=1, **kw):
    return PodView.from_pod(pod_json(role, instance, generation, **kw))


def metrics_port(role, instance, port):
    entry = {"name": f"{role}-metrics-0" + (f"-i{instance}" if instance else ""), "role": role,
             "purpose": PURPOSE_METRICS, "rank": 0, "port": port}
    if instance:
        entry["instance"] = instance
    return entry


@pytest.fixture
def xpyd(exporter_pods):
    """start(prefills, decodes, hang_timeout) -> (accounts by key, PodViews, the pair body): one real exporter per
    instance, its pod named as the operator names it, its metrics port in status.ports."""
    def start(prefills, decodes, hang_timeout=30.0, **pod_kw):
        accounts, views, ports = {}, [], []
        for role, count in ((contract.ROLE_PREFILL, prefills), (contract.ROLE_DECODE, decodes)):
            for i in range(count):
                acc, target = exporter_pods(role, 1, hang_timeout, pod=name(role, i))
                accounts[instance_key(role, i)] = acc
                views.append(view(role, i, **pod_kw.get(instance_key(role, i), {})))
                ports.append(metrics_port(role, i, target.port))
        body = {"metadata": {"name": PAIR, "namespace": "ml", "uid": "pair-uid"},
                "spec": {"connector": {"hangTimeoutSeconds": hang_timeout}},
                "status": {"phase": contract.PHASE_READY, "pairGeneration": 1, "ports": ports}}
        return accounts, views, body

    return start


def hang(accounts, wait=0.35):
    accounts.open_wait("stuck", "peer", 5, time.monotonic() + 0.2)
    accounts.on_signals("stuck", 2)
    time.sleep(wait)


def scrape_pair(body, views):
    return asyncio.run(health_watch.scrape_pair(body, 1, views, 10.0))


# --- the 2P3D pair ----------------------------------------------------------------------------------------------
def test_2p3d_scrapes_every_instance_and_names_the_hung_decode(xpyd):
    accounts, views, body = xpyd(2, 3, hang_timeout=0.2)
    hang(accounts["decode-2"])
    scrapes, objects = scrape_pair(body, views)
    assert sorted(s.target.pod for s in scrapes) == sorted(v.name for v in views)  # all five, once each
    assert list(objects) == ["prefill", "decode", "prefill-1", "decode-1", "decode-2"]
    new, verdict = observe(None, 1, scrapes, objects, now=T0)
    hung = name("decode", 2)
    assert (verdict.restart, verdict.reason, verdict.pod) == (True, REASON_HUNG, hung)
    assert (new["verdict"], new["reason"], new["pod"]) == (VERDICT_UNHEALTHY, REASON_HUNG, hung)
    assert new["podUid"] == "uid-decode-2"  # the same name comes back on a replacement; the uid does not
    assert hung in new["message"] and "stuck" in new["message"]  # /healthz named the transfer
    assert set(new["roles"]) == {"prefill", "decode"}  # instance 0 keeps its place
    assert {k: e["pod"] for k, e in new["roles"].items()} == {"prefill": name("prefill"), "decode": name("decode")}
    assert set(new["instances"]) == {"prefill-1", "decode-1", "decode-2"}
    entry = new["instances"]["decode-2"]
    assert (entry["pod"], entry["state"], entry["deficit"]) == (hung, "hung", 3)
    assert entry["oldestWaitSeconds"] >= 0.3
    assert all(e["state"] == "healthy" for k, e in {**new["roles"], **new["instances"]}.items() if k != "decode-2")
    assert set(entry) == set(new["roles"]["decode"])  # one entry shape
    assert restart_finding(new, 1) == Finding(REASON_HUNG, new["message"], 1, pod=hung, pod_uid="uid-decode-2")
    cond = signals_condition(new, 1)
    assert (cond.status, cond.reason) == ("False", "Hung")


def test_an_instance_still_loading_is_not_scraped_and_a_draining_one_not_judged(xpyd, closed_port):
    """A scale-up's new decode (not started: its startup probe has not passed) and a scale-down's draining prefill
    are left out; their pod objects do not make the pair unhealthy either."""
    accounts, views, body = xpyd(2, 2, **{"decode-1": {"ready": False, "started": False},
                                          "prefill-1": {"draining": True, "phase": "Succeeded"}})
    scrapes, objects = scrape_pair(body, views)
    assert sorted(s.target.pod for s in scrapes) == sorted([name("prefill"), name("decode")])
    assert list(objects) == ["prefill", "decode", "decode-1"]
    new, verdict = observe(None, 1, scrapes, objects, now=T0)
    assert new["verdict"] == VERDICT_HEALTHY and "instances" not in new and "pod" not in new
    # once its engine started it is scraped (Ready or not: a hung decode may fail its readiness)
    views = [view("decode", 1, ready=False, started=True) if v.name == name("decode", 1) else v for v in views]
    scrapes, _ = scrape_pair(body, views)
    assert name("decode", 1) in {s.target.pod for s in scrapes}


def test_watched_pods_and_scrape_due():
    pods = [view("decode", 2), view("prefill", 0), view("decode", 1, deleting=True), view("prefill", 1, draining=True),
            view("decode", 0, generation=2), view("prefill", 3), view("decode", 1, generation=2)]
    # generation 1 has no decode 0: None (a pod fact: gone); decode 1 being deleted and prefill 1 draining are left out
    watched = watched_pods(pods, 1)
    assert list(watched) == ["prefill", "decode", "prefill-3", "decode-2"]
    assert watched["decode"] is None and watched["decode-2"].name == name("decode", 2)
    # instance 0 being deleted is judged (vanished), as in a 1P1D pair
    deleting0 = watched_pods([view("decode", 0, deleting=True), view("prefill", 0)], 1)
    fact_verdict = pair_verdict([], {k: v.raw for k, v in deleting0.items()})
    assert (fact_verdict.reason, fact_verdict.pod) == (health.REASON_POD_VANISHED, name("decode"))
    # a loading instance is not scraped, instance 0 included (one replaced alone loads in a Ready pair)
    assert not scrape_due(view("decode", 0, ready=False, started=False))
    assert scrape_due(view("decode", 0, ready=False, started=True))
    assert not scrape_due(view("decode", 1, ready=False, started=False))
    assert scrape_due(view("decode", 1, ready=False, started=True))
    assert not scrape_due(view("decode", 1, ip=None))
    assert scrape_due(PodView("x", "decode", 1, phase="Running", ready=True, ip="10.0.0.1", instance=1))  # no raw


def test_precedence_runs_over_every_instance_and_the_verdict_names_the_pod():
    healthy = {"prefill": pod_json("prefill"), "decode": pod_json("decode")}
    # a Failed prefill instance 1 beats everything after pod failures, wherever it is in the order
    failed = {**healthy, "decode-1": pod_json("decode", 1), "prefill-1": pod_json("prefill", 1, phase="Failed")}
    verdict = pair_verdict([], failed)
    assert (verdict.reason, verdict.pod) == (REASON_POD_FAILED, name("prefill", 1))
    # a container restart of decode 2 names decode 2
    restarted = {**healthy, "decode-2": pod_json("decode", 2, restarts=1)}
    verdict = pair_verdict([], restarted)
    assert (verdict.reason, verdict.pod) == (health.REASON_CONTAINER_RESTART, name("decode", 2))
    # an instance Pending for scheduling makes the verdict Pending (the planner never restarts then), no pod named
    pending = {**healthy, "decode-1": pod_json("decode", 1, phase="Pending", scheduled=False, ip=None)}
    verdict = pair_verdict([], pending)
    assert (verdict.restart, verdict.pending, verdict.pod) == (False, True, "")
    # a role with no pod at all: about the pair as a whole (no pod object, nothing to name)
    verdict = pair_verdict([], {"prefill": pod_json("prefill"), "decode": None})
    assert (verdict.reason, verdict.pod) == (health.REASON_POD_VANISHED, "")


# --- carry-over per instance ----------------------------------------------------------------------------------
def unreachable(role, instance, pod=None):
    target = health.ScrapeTarget(role, pod or name(role, instance), "127.0.0.1", 9, instance)
    return health.PodScrape(target, health.PodState.UNREACHABLE, f"{target.url()}: refused")


def healthy(role, instance, pod=None, transfers=0.0, deficit=0.0):
    target = health.ScrapeTarget(role, pod or name(role, instance), "127.0.0.1", 9, instance)
    metrics = health.PodMetrics({"peer": deficit} if deficit else {}, 0.0, 30.0, 1, 0.0, transfers)
    return health.PodScrape(target, health.PodState.HEALTHY, f"{role} pod {target.pod} healthy", metrics)


def objects_of(*keys_and_pods):
    return {key: pod for key, pod in keys_and_pods}


def test_streaks_and_counts_carry_over_per_instance_only_while_the_pod_is_the_same():
    objects = {"prefill": pod_json("prefill"), "decode": pod_json("decode"), "decode-1": pod_json("decode", 1)}
    base = [healthy("prefill", 0), healthy("decode", 0)]
    status_health, patches = None, []
    for i in range(UNREACHABLE_THRESHOLD):
        now = T0 + timedelta(seconds=10 * i)
        new, verdict = observe(status_health, 1, base + [unreachable("decode", 1)], objects, now=now)
        patch = health_patch(status_health, new, REFRESH, now=now)
        patches.append(patch)
        status_health = apply(status_health, patch)
    assert all(p is not None for p in patches), "each streak step is written at once"
    assert status_health["instances"]["decode-1"]["unreachableStreak"] == UNREACHABLE_THRESHOLD
    assert (status_health["verdict"], status_health["reason"], status_health["pod"]) == (
        VERDICT_UNHEALTHY, REASON_UNREACHABLE, name("decode", 1))
    assert status_health["roles"]["decode"]["unreachableStreak"] == 0  # instance 0's streak is its own
    # the instance replaced alone (same generation, same key, another pod): nothing carries over
    replaced = "chat-decode-g1-1-replacement"
    new, verdict = observe(status_health, 1, base + [unreachable("decode", 1, pod=replaced)], objects, now=T0)
    assert new["instances"]["decode-1"] == {"pod": replaced, "state": "unreachable", "deficit": 0,
                                            "oldestWaitSeconds": 0.0, "transfers": 0, "unreachableStreak": 1}
    assert not verdict.restart and "pod" not in new
    # transfer counts carry over for the same pod: a count that did not grow keeps its lastTransferTime
    h1, _ = observe(None, 1, base + [healthy("decode", 1, transfers=4)], objects, now=T0)
    h2, _ = observe(h1, 1, base + [healthy("decode", 1, transfers=4)], objects, now=T0 + timedelta(seconds=10))
    assert h2["instances"]["decode-1"]["lastTransferTime"] == "2026-12-01T08:00:00Z"
    assert h2["instances"]["decode-1"]["lastScrapeTime"] == "2026-12-01T08:00:10Z"


def test_instances_changes_are_meaningful_and_a_removed_instance_is_patched_away():
    objects = {"prefill": pod_json("prefill"), "decode": pod_json("decode"), "decode-1": pod_json("decode", 1)}
    base = [healthy("prefill", 0), healthy("decode", 0)]
    h1, _ = observe(None, 1, base + [healthy("decode", 1)], objects, now=T0)
    # only a number moved (transfers, exact deficit): not written before the refresh
    h2, _ = observe(h1, 1, base + [healthy("decode", 1, transfers=9)], objects, now=T0 + timedelta(seconds=10))
    assert health_patch(h1, h2, REFRESH, now=T0 + timedelta(seconds=10)) is None
    # signals missing on decode 1 (not yet a hang): at once
    h3, _ = observe(h1, 1, base + [healthy("decode", 1, deficit=2)], objects, now=T0 + timedelta(seconds=10))
    patch = health_patch(h1, h3, REFRESH, now=T0 + timedelta(seconds=10))
    assert patch is not None and patch["instances"]["decode-1"]["deficit"] == 2
    # a scale-down: the instance is no longer watched, its entry goes (merge patch null), at once
    h4, _ = observe(h1, 1, base, {"prefill": objects["prefill"], "decode": objects["decode"]},
                    now=T0 + timedelta(seconds=10))
    assert "instances" not in h4
    assert health_patch(h1, h4, REFRESH, now=T0 + timedelta(seconds=10))["instances"] is None


def test_restart_finding_names_the_pod_or_the_pair():
    written = {"pairGeneration": 3, "observedAt": "2026-12-01T08:00:00Z", "verdict": VERDICT_UNHEALTHY,
               "reason": REASON_HUNG, "message": "decode pod chat-decode-g3-2 hung", "roles": {},
               "pod": "chat-decode-g3-2"}
    assert restart_finding(written, 3) == Finding(REASON_HUNG, written["message"], 3, pod="chat-decode-g3-2")
    # written before the verdict named its pod (or about the pair as a whole): the pair
    del written["pod"]
    assert restart_finding(written, 3).pod == ""
    assert restart_finding({**written, "verdict": VERDICT_PENDING}, 3) is None


# --- a 1P1D pair: the same status and the same writes as before instances ---------------------------------------
def apply(target, patch):
    """RFC 7386, as the apiserver applies the watch's merge patch."""
    if patch is None:
        return target
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            result[key] = apply(result.get(key), value)
        else:
            result[key] = value
    return result


def one_p_one_d_ticks(h, hs=None):
    """A 1P1D pair's ticks through module `h` (health.py, now or as it was) and `hs` (its status.health half,
    health_status.py; None: `h` has both, as health.py once did): healthy, numbers moving, a decode
    unreachable to the threshold, back, a deficit, hung, a prefill Pending, a Failed decode, a restarted container,
    a stale prefill, the decode gone, a new generation, a refresh. Returns every tick's health, patch and verdict."""
    def target(role, generation=1):
        return h.ScrapeTarget(role, f"chat-{role}-g{generation}", "10.0.0.1" if role == "decode" else "10.0.0.2",
                              20001)

    def scraped(role, state="healthy", generation=1, deficit=0.0, oldest=0.0, transfers=0.0, reported=None):
        t = target(role, generation)
        if state == "unreachable":
            return h.PodScrape(t, h.PodState.UNREACHABLE, f"{t.url()} did not answer within 2s")
        m = h.PodMetrics({"10.0.0.2:20000": deficit} if deficit else {}, oldest, 30.0,
                         reported if reported is not None else generation, 0.0, transfers)
        text = {"healthy": f"{role} pod {t.pod} healthy", "hung": f"{role} pod {t.pod} hung: {deficit:g} signals",
                "stale_generation": f"{role} pod {t.pod} reports generation {reported}"}[state]
        return h.PodScrape(t, h.PodState(state), text, m)

    def obj(role, generation=1, **kw):
        return pod_json(role, 0, generation, **kw)

    both = {"prefill": obj("prefill"), "decode": obj("decode")}
    ticks = [
        (1, [scraped("decode"), scraped("prefill")], both),
        (1, [scraped("decode", transfers=5), scraped("prefill", transfers=5)], both),
        (1, [scraped("decode", "unreachable"), scraped("prefill", transfers=6)], both),
        (1, [scraped("decode", "unreachable"), scraped("prefill", transfers=6)], both),
        (1, [scraped("decode", "unreachable"), scraped("prefill", transfers=6)], both),
        (1, [scraped("decode", "unreachable"), scraped("prefill", transfers=6)], both),
        (1, [scraped("decode", transfers=7, deficit=2, oldest=1.5), scraped("prefill", transfers=7)], both),
        (1, [scraped("decode", "hung", transfers=7, deficit=3, oldest=40.0), scraped("prefill", transfers=7)], both),
        (1, [scraped("decode"), scraped("prefill")],
         {"prefill": obj("prefill", phase="Pending", scheduled=False, ip=None), "decode": obj("decode")}),
        (1, [scraped("decode"), scraped("prefill")], {"prefill": obj("prefill"), "decode": obj("decode", phase="Failed")}),
        (1, [scraped("decode"), scraped("prefill")], {"prefill": obj("prefill"), "decode": obj("decode", restarts=2)}),
        (1, [scraped("decode"), scraped("prefill", "stale_generation", reported=0)], both),
        (1, [scraped("prefill")], {"prefill": obj("prefill"), "decode": None}),
        (2, [scraped("decode", generation=2), scraped("prefill", generation=2)],
         {"prefill": obj("prefill", 2), "decode": obj("decode", 2)}),
        (2, [scraped("decode", generation=2, transfers=1), scraped("prefill", generation=2, transfers=1)],
         {"prefill": obj("prefill", 2), "decode": obj("decode", 2)}),
    ]
    hs = h if hs is None else hs
    out, written = [], None
    for i, (generation, scrapes, objects) in enumerate(ticks):
        # the last tick comes after the refresh interval: the numbers' own write
        now = T0 + timedelta(seconds=10 * i + (REFRESH if i == len(ticks) - 1 else 0))
        new, verdict = hs.observe(written, generation, scrapes, objects, now=now)
        patch = hs.health_patch(written, new, REFRESH, now=now)
        written = apply(written, patch)
        out.append({"health": new, "patch": patch, "written": written,
                    "verdict": [verdict.restart, verdict.reason, verdict.pending, verdict.message]})
    return out


def without_pod(health_or_patch):
    """Without the top-level `pod` and `podUid` (the entries' own `pod` is the scraped pod, as before)."""
    return {k: v for k, v in health_or_patch.items() if k not in ("pod", "podUid")}


def test_a_1p1d_pair_writes_what_it_wrote_before_instances():
    """Recorded from health.py as it was before instances (commit 4a649db): the same entries, the same patches at
    the same ticks (no extra write), the same verdicts; the one addition is `pod`, present exactly when Unhealthy and
    naming the pod the verdict is about (the top-level key only: the entries' own `pod` is unchanged)."""
    before = json.loads(FIXTURE.read_text())
    now = json.loads(json.dumps(one_p_one_d_ticks(health, health_status)))
    assert len(now) == len(before)
    for i, (was, tick) in enumerate(zip(before, now)):
        assert tick["verdict"] == was["verdict"], i
        assert without_pod(tick["health"]) == was["health"], i
        assert (tick["patch"] is None) == (was["patch"] is None), f"tick {i}: a write where there was none, or none"
        if tick["patch"] is not None:
            assert without_pod(tick["patch"]) == was["patch"], i
        assert without_pod(tick["written"]) == was["written"], i
        unhealthy = tick["health"]["verdict"] == VERDICT_UNHEALTHY
        assert ("pod" in tick["health"]) == (unhealthy and tick["verdict"][1] != health.REASON_POD_VANISHED), i
        assert "instances" not in tick["health"], i
    named = [t["health"].get("pod") for t in now]
    assert "chat-decode-g1" in named and "chat-prefill-g1" in named
