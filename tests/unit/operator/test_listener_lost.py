"""A pair that served and then lost decode's side-channel listener (reason listener_lost), pure: the health watch's
verdict (health_status.observe over real exporters' metrics and the watch's TCP probe results, health_status.watch_generation for a
generation that lost Ready), status.health as written and read back, and the planner's decision from it (a counted
restart of a 1P1D pair, from its budget like a hang; the decode instance alone in a serving xPyD pair).

Before this, such a pair showed phase PrefillStarting with KV health Healthy and 0 restarts for as long as its pods
lived: the watch judged only Ready pairs, read nothing about the listener, and the reconciler's listener probe stops
once a generation served. `test_without_the_finding_a_regressed_pair_only_waits` pins what the planner does without
the finding (it waits for prefill's readiness forever), which is why the finding has to come from the watch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import pytest

from pdpair import contract
from prometheus_client import generate_latest

from pdpair.connector.signals import SignalAccounts
from pdpair.contract import PHASE_PREFILL_STARTING, PHASE_READY, PHASE_RESTARTING
from pdpair.operator.act import listener_probe, scrape
from pdpair.operator.decide import health
from pdpair.operator.decide import health_status
from pdpair.operator.decide import planner
from pdpair.operator.decide import recreate as d
from pdpair.operator.model.pair_spec import spec_fingerprint
from pdpair.operator.decide.health import PodScrape, PodState, ScrapeTarget
from pdpair.operator.model.observed import Finding, Observed, PodView
from tests.unit.operator.test_planner import NOW, READY_PODS, SPEC, observed, pod, raw


# --- the pod's own report: pdpair_listener_failed ------------------------------------------------------------
def _exposition(role: str, *, failed: bool = False, rank: int = 0) -> str:
    """The exposition of the connector's real accounts for one TP rank (what its /metrics serves)."""
    accounts = SignalAccounts(role=role, hang_timeout_seconds=30, generation=1, rank=rank)
    if role == contract.ROLE_DECODE:
        accounts.set_listener_ready(rank, True)
    if failed:
        accounts.set_listener_failed(f"rank {rank}: side-channel loop stopped: RuntimeError('boom')")
    return generate_latest(accounts.registry).decode()


def test_a_decode_that_reports_its_loop_stopped_exports_it_and_is_judged_listener_lost():
    text = _exposition(contract.ROLE_DECODE, failed=True)
    assert f'{contract.LISTENER_FAILED.name}{{rank="0",role="decode"}} 1.0' in text
    metrics = scrape.parse_pod_metrics(text)
    assert metrics.listener_failed == ("0",)
    target = ScrapeTarget("decode", "kv-decode-g1", "10.0.0.1", 20002)
    state, message = scrape._judge(target, metrics, 1, 30)
    assert state is PodState.LISTENER_LOST
    assert "kv-decode-g1" in message and "rank 0" in message and contract.LISTENER_FAILED.name in message


def test_a_serving_decode_exports_0_and_stays_healthy():
    text = _exposition(contract.ROLE_DECODE)
    assert f'{contract.LISTENER_FAILED.name}{{rank="0",role="decode"}} 0.0' in text
    metrics = scrape.parse_pod_metrics(text)
    assert metrics.listener_failed == ()
    state, _ = scrape._judge(ScrapeTarget("decode", "d", "10.0.0.1", 20002), metrics, 1, 30)
    assert state is PodState.HEALTHY


def test_prefill_exports_no_listener_series():
    assert f"{contract.LISTENER_FAILED.name}{{" not in _exposition(contract.ROLE_PREFILL)


def test_a_higher_rank_that_stopped_is_named():
    """At TP 2 rank 0 serves every rank's series (rank 1's through the rank channel): rank 1 failed, rank 0 not."""
    rank1 = [line for line in _exposition(contract.ROLE_DECODE, failed=True, rank=1).splitlines()
             if line.startswith(contract.LISTENER_FAILED.name + "{")]
    metrics = scrape.parse_pod_metrics(_exposition(contract.ROLE_DECODE) + "\n".join(rank1) + "\n")
    assert metrics.listener_failed == ("1",)


# --- status.health: the verdict within one tick (reported) or two (probe refused) ----------------------------
DECODE = ScrapeTarget("decode", "kv-decode-g1", "10.0.0.1", 20002)
PREFILL = ScrapeTarget("prefill", "kv-prefill-g1", "10.0.0.2", 20012)
PODS = {"decode": raw("kv-decode-g1"), "prefill": raw("kv-prefill-g1")}
METRICS = health.PodMetrics({}, 0.0, 30.0, 1, 0.0, 5.0)


def healthy(target):
    return PodScrape(target, PodState.HEALTHY, f"{target.role} pod {target.pod} healthy", METRICS)


def lost(target):
    return PodScrape(target, PodState.LISTENER_LOST, f"{target.role} pod {target.pod}: side-channel listener lost",
                     dataclasses.replace(METRICS, listener_failed=("0",)))


def tick(previous, scrapes, refused=None):
    return health_status.observe(previous, 1, scrapes, PODS, refused=refused)


def test_reported_stop_is_unhealthy_on_the_first_tick_naming_decode():
    before, _ = tick(None, [healthy(DECODE), healthy(PREFILL)], {DECODE.pod: ()})
    assert before["verdict"] == "Healthy" and "listenerStreak" not in before["roles"]["decode"]
    after, verdict = tick(before, [lost(DECODE), healthy(PREFILL)], {DECODE.pod: ()})
    assert (after["verdict"], after["reason"], after["pod"]) == ("Unhealthy", "listener_lost", DECODE.pod)
    assert after["roles"]["decode"]["state"] == "listener_lost" and verdict.restart
    assert health_status.health_patch(before, after, 300) is not None  # written at once
    finding = health_status.restart_finding(after, 1)
    assert (finding.reason, finding.pod, finding.counted) == ("listener_lost", DECODE.pod, True)
    cond = health_status.signals_condition(after, 1)
    assert (cond.status, cond.reason) == ("False", "ListenerLost")


@pytest.mark.parametrize("ticks, verdict, streak", [
    # ports refused per tick (() = accepted, None = no answer), the verdict after the last tick, the streak written
    ([(20001,)], "Healthy", 1),
    ([(20001,), (20001,)], "Unhealthy", 2),
    ([(20001,), ()], "Healthy", 0),  # one refusal, then the listener accepts: nothing
    ([(20001,), None, (20001,)], "Unhealthy", 2),  # a timeout in between is no evidence either way
    ([None, None, None], "Healthy", 0),  # a loaded operator timing out is never a verdict
    ([(20001,), (20001,), (20001,)], "Unhealthy", 2),  # capped: no rewrite per tick
], ids=["one refusal", "two in a row", "refused then accepted", "timeout between", "only timeouts", "capped"])
def test_probe_refusals_in_a_row(ticks, verdict, streak):
    h = None
    writes = 0
    for ports in ticks:
        new, _ = tick(h, [healthy(DECODE), healthy(PREFILL)], {DECODE.pod: ports})
        writes += health_status.health_patch(h, new, 300) is not None
        h = new
    assert h["verdict"] == verdict
    assert h["roles"]["decode"].get("listenerStreak", 0) == streak
    if verdict == "Unhealthy":
        assert (h["reason"], h["pod"], h["roles"]["decode"]["state"]) == ("listener_lost", DECODE.pod,
                                                                          "listener_lost")
        assert "refused the operator's probe" in h["message"] and "20001" in h["message"]
    assert writes <= 1 + health.LISTENER_REFUSED_THRESHOLD


def test_the_streak_restarts_for_a_new_pod_and_is_read_back_after_an_operator_restart():
    one, _ = tick(None, [healthy(DECODE), healthy(PREFILL)], {DECODE.pod: (20001,)})
    # a restarted watch starts from status alone (the body's status.health): the streak carries over
    two, _ = tick(dict(one), [healthy(DECODE), healthy(PREFILL)], {DECODE.pod: (20001,)})
    assert two["verdict"] == "Unhealthy"
    other = dataclasses.replace(DECODE, pod="kv-decode-g1-new")
    three, _ = health_status.observe(one, 1, [healthy(other), healthy(PREFILL)],
                              {"decode": raw("kv-decode-g1-new"), "prefill": raw("kv-prefill-g1")},
                              refused={other.pod: (20001,)})
    assert three["verdict"] == "Healthy" and three["roles"]["decode"]["listenerStreak"] == 1


def test_a_lost_listener_outranks_a_hang_and_keeps_the_scrapes_own_unreachable_streak():
    hung = PodScrape(PREFILL, PodState.HUNG, "prefill hung", METRICS)
    h, _ = tick(None, [lost(DECODE), hung], {DECODE.pod: ()})
    assert h["reason"] == "listener_lost"
    silent = PodScrape(DECODE, PodState.UNREACHABLE, "no answer")
    h, _ = tick(None, [silent, healthy(PREFILL)], {DECODE.pod: (20001,)})
    h, _ = tick(h, [silent, healthy(PREFILL)], {DECODE.pod: (20001,)})
    assert h["reason"] == "listener_lost" and h["roles"]["decode"]["unreachableStreak"] == 2


@pytest.mark.parametrize("status, judged", [
    ({"pairGeneration": 1, "phase": PHASE_READY}, 1),
    # served, then lost Ready (prefill unpaired, decode's /readyz failing): still judged
    ({"pairGeneration": 1, "phase": PHASE_PREFILL_STARTING,
      "health": {"pairGeneration": 1, "verdict": "Healthy"}}, 1),
    # a generation still starting: never judged (the startup probe is its deadline)
    ({"pairGeneration": 2, "phase": PHASE_PREFILL_STARTING,
      "health": {"pairGeneration": 1, "verdict": "Unhealthy"}}, None),
    ({"pairGeneration": 1, "phase": PHASE_PREFILL_STARTING}, None),
    ({"pairGeneration": 1, "phase": PHASE_RESTARTING, "health": {"pairGeneration": 1, "verdict": "Unhealthy"}},
     None),
    ({"pairGeneration": 1, "phase": "Failed", "health": {"pairGeneration": 1, "verdict": "Unhealthy"}}, None),
    ({}, None),
], ids=["ready", "served then regressed", "new generation starting", "never judged", "restarting", "failed",
        "empty"])
def test_watch_generation(status, judged):
    assert health_status.watch_generation(status) == judged


# --- the watch's probe: refused vs no answer ------------------------------------------------------------------
def test_refused_ports_tells_a_closed_listener_from_no_answer():
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(4)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    open_port, closed_port = listening.getsockname()[1], closed.getsockname()[1]
    closed.close()  # nothing listens there now: the kernel answers RST
    try:
        assert asyncio.run(listener_probe.refused_ports("127.0.0.1", [open_port], 1.0)) == ()
        assert asyncio.run(listener_probe.refused_ports("127.0.0.1", [open_port, closed_port], 1.0)) == (
            closed_port,)
        # a timeout (here: a deadline no connect can meet) is no evidence either way
        assert asyncio.run(listener_probe.refused_ports("127.0.0.1", [open_port], 1e-9)) is None
    finally:
        listening.close()


# --- the planner's decision --------------------------------------------------------------------------------
def listener_lost(gen=1, pod_name=""):
    return Finding(health.REASON_LISTENER_LOST, "decode pod p-decode-1: side-channel listener lost", gen,
                   pod=pod_name)


# A served 1P1D generation that lost Ready after its listener went: prefill unpaired (NotReady), decode's /readyz 503
REGRESSED = {"pairGeneration": 1, "phase": PHASE_PREFILL_STARTING}
REGRESSED_PODS = (pod("decode", ready=False), pod("prefill", ready=False), pod("router", ready=False))

CASES = [
    # name, status, observed, outcome, restart reason, next step
    ("Ready: restart now, from the budget", {"pairGeneration": 1, "phase": PHASE_READY},
     observed(health=listener_lost()), planner.OUTCOME_STEP, health.REASON_LISTENER_LOST, d.STEP_DELETE_PREFILL),
    ("lost Ready already (PrefillStarting): restart now", REGRESSED,
     observed(pods=REGRESSED_PODS, health=listener_lost()), planner.OUTCOME_STEP, health.REASON_LISTENER_LOST,
     d.STEP_DELETE_PREFILL),
    ("inside the backoff: wait, phase Restarting", REGRESSED,
     observed(pods=REGRESSED_PODS, health=listener_lost(), restart_times=(NOW - 5,)), planner.OUTCOME_BACKOFF,
     None, None),
    ("budget spent: Failed", REGRESSED,
     observed(pods=REGRESSED_PODS, health=listener_lost(), restart_times=(NOW - 300, NOW - 200, NOW - 100)),
     planner.OUTCOME_FAILED, None, None),
    ("about an older generation: no restart", {"pairGeneration": 2, "phase": PHASE_READY},
     observed(pods=(pod("decode", 2), pod("prefill", 2), pod("router", 2)), health=listener_lost(1)),
     planner.OUTCOME_STEP, None, d.STEP_READY),
]


@pytest.mark.parametrize("name, status, obs, outcome, reason, step", CASES, ids=[c[0] for c in CASES])
def test_plan(name, status, obs, outcome, reason, step):
    decided = planner.plan(SPEC, status, obs, NOW)
    assert decided.outcome == outcome
    assert (decided.restart.reason if decided.restart else None) == reason
    assert (decided.steps.step if decided.steps else None) == step
    if decided.restart is not None:
        assert decided.restart.counted and decided.restart_times[-1] == NOW  # in the budget, like a hang
        assert decided.steps.pair_generation == 2 and decided.steps.phase == PHASE_RESTARTING
    if outcome == planner.OUTCOME_FAILED:
        assert "listener lost" in decided.message
    if outcome == planner.OUTCOME_BACKOFF:
        assert "listener lost" in decided.message and decided.phase == PHASE_RESTARTING


def test_without_the_finding_a_regressed_pair_only_waits():
    """What the planner does with the same pods and no verdict: wait for prefill's readiness, with no deadline, and
    no restart. The status the reconciler wrote before this fix said exactly that for 5 minutes on the real nodes."""
    decided = planner.plan(SPEC, REGRESSED, observed(pods=REGRESSED_PODS), NOW)
    assert decided.outcome == planner.OUTCOME_STEP and decided.restart is None
    assert (decided.steps.step, decided.steps.phase) == (d.STEP_WAIT_PREFILL_READY, PHASE_PREFILL_STARTING)


def test_xpyd_heals_the_decode_alone():
    """1P2D, serving: decode instance 1's listener is lost; decode 0 still serves, so only that instance is replaced
    (instances.heal, under its own budget), reason listener_lost; the pair stays Ready and is not restarted."""
    spec = {**SPEC, "decode": {"replicas": 2}}
    h = spec_fingerprint(spec)
    decode1 = PodView("p-decode-1-i1", "decode", 1, h, "Running", True, "10.0.0.3", False, True, 0, "uid-d1",
                      instance=1, raw=raw("p-decode-1-i1"))
    pods = tuple(dataclasses.replace(p, spec_hash=h) for p in READY_PODS) + (decode1,)
    obs = Observed(pods, ports_complete=True, decode_listening=True, meta_generation=1,
                   health=listener_lost(pod_name=decode1.name))
    decided = planner.plan(spec, {"pairGeneration": 1, "phase": PHASE_READY}, obs, NOW)
    assert decided.outcome == planner.OUTCOME_STEP and decided.restart is None
    steps = decided.steps
    assert steps.delete == (decode1.name,) and steps.replaced_instance == ("decode", health.REASON_LISTENER_LOST)
    assert steps.phase == PHASE_READY and steps.pair_generation == 1
    assert list(steps.instance_restart_times) == ["decode-1"]
