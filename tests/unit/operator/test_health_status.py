"""status.health: what the health watch writes (health_status.observe, health_patch) and what the reconciler reads back
from it (restart_finding, signals_condition). Scrapes come from real exporters (the connector's SignalAccounts on
real local HTTP servers); every round trip goes through the merge patch the watch sends, applied as the apiserver
applies it (RFC 7386), so what is asserted is what a restarted operator would read."""

from __future__ import annotations

import asyncio
import copy
import time
from datetime import datetime, timedelta, timezone

import pytest

from pdpair import contract
from pdpair.operator.decide.health import (
    REASON_HUNG,
    REASON_UNREACHABLE,
    UNREACHABLE_THRESHOLD,
    ScrapeTarget,
    next_streak,
)
from pdpair.operator.decide.health_status import (
    HEALTH_REFRESH_INTERVALS,
    VERDICT_HEALTHY,
    VERDICT_PENDING,
    VERDICT_UNHEALTHY,
    health_patch,
    merge_patch,
    newest,
    observe,
    restart_finding,
    signals_condition,
)
from pdpair.operator.act.scrape import scrape_pods
from pdpair.operator.model.observed import Finding
from pdpair.operator.model.conditions import status_diff

T0 = datetime(2026, 12, 1, 8, 0, 0, tzinfo=timezone.utc)
REFRESH = HEALTH_REFRESH_INTERVALS * 10.0


@pytest.fixture
def exporter(exporter_pods):
    """Exporter pods named `<role>-g<generation>`: streaks and counts in status carry over per pod name."""
    def start(role="decode", generation=1, hang_timeout=30.0):
        return exporter_pods(role, generation, hang_timeout, pod=f"{role}-g{generation}")

    return start


def scrape(targets, generation=1):
    return asyncio.run(scrape_pods(targets, expected_generation=generation, timeout=2.0))


def running(name):
    return {"metadata": {"name": name}, "status": {"phase": "Running", "containerStatuses": []}}


def apply_merge_patch(target, patch):
    """RFC 7386, as the apiserver applies a merge patch."""
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            result[key] = apply_merge_patch(result.get(key), value)
        else:
            result[key] = value
    return result


def write(status_health, new, now):
    """What the watch leaves in status: the patch (if due) applied to what was there."""
    patch = health_patch(status_health, new, REFRESH, now=now)
    return (status_health if patch is None else apply_merge_patch(status_health or {}, patch)), patch


def test_streak_rule():
    assert [next_streak(0, True), next_streak(1, True), next_streak(2, True)] == [1, 2, 3]
    assert next_streak(UNREACHABLE_THRESHOLD, True) == UNREACHABLE_THRESHOLD  # capped: no write per interval
    assert next_streak(2, False) == 0


def test_unreachable_streak_is_read_back_from_status(exporter, closed_port):
    _, decode = exporter("decode")
    gone = ScrapeTarget("prefill", "prefill-g1", "127.0.0.1", closed_port)
    pods = {"decode": running("decode-g1"), "prefill": running("prefill-g1")}
    status_health, verdicts = None, []
    for i in range(UNREACHABLE_THRESHOLD + 1):
        new, verdict = observe(status_health, 1, scrape([decode, gone]), pods, now=T0 + timedelta(seconds=10 * i))
        status_health, patch = write(status_health, new, T0 + timedelta(seconds=10 * i))
        verdicts.append(verdict)
        if i < UNREACHABLE_THRESHOLD:
            assert patch is not None, f"streak {i + 1} must be written: a restarted operator reads it back"
    assert [v.restart for v in verdicts] == [False] * (UNREACHABLE_THRESHOLD - 1) + [True, True]
    assert status_health["verdict"] == VERDICT_UNHEALTHY and status_health["reason"] == REASON_UNREACHABLE
    assert status_health["roles"]["prefill"]["unreachableStreak"] == UNREACHABLE_THRESHOLD
    assert status_health["roles"]["prefill"]["state"] == "unreachable"
    assert status_health["roles"]["decode"]["unreachableStreak"] == 0
    assert patch is None, "a streak past the threshold changes nothing and writes nothing"
    # the streak belongs to the pod: the next generation's pod starts from 0
    new, verdict = observe(status_health, 2, scrape([ScrapeTarget("prefill", "prefill-g2", "127.0.0.1", closed_port)],
                                                    generation=2), {"prefill": running("prefill-g2")}, now=T0)
    assert new["roles"]["prefill"]["unreachableStreak"] == 1 and not verdict.restart


def test_good_scrape_resets_the_streak(exporter):
    _, decode = exporter("decode")
    before = {"pairGeneration": 1, "observedAt": "2026-12-01T08:00:00Z", "verdict": VERDICT_HEALTHY, "reason": "",
              "message": "healthy", "roles": {"decode": {"pod": decode.pod, "state": "unreachable",
                                                         "unreachableStreak": 2}}}
    new, verdict = observe(before, 1, scrape([decode]), {"decode": running(decode.pod)}, now=T0)
    assert new["roles"]["decode"]["unreachableStreak"] == 0 and new["roles"]["decode"]["state"] == "healthy"
    assert new["verdict"] == VERDICT_HEALTHY and not verdict.restart


def test_last_transfer_time_moves_only_when_the_count_grows(exporter):
    accounts, decode = exporter("decode")
    pods = {"decode": running(decode.pod)}
    h1, _ = observe(None, 1, scrape([decode]), pods, now=T0)
    assert h1["roles"]["decode"]["transfers"] == 0 and "lastTransferTime" not in h1["roles"]["decode"]
    accounts.open_wait("t1", "peer", 2, time.monotonic() + 30)
    accounts.on_signals("t1", 2)
    accounts.close_wait("t1", contract.OUTCOME_OK, 100, 0.01)
    h2, _ = observe(h1, 1, scrape([decode]), pods, now=T0 + timedelta(seconds=10))
    assert h2["roles"]["decode"]["transfers"] == 1
    assert h2["roles"]["decode"]["lastTransferTime"] == "2026-12-01T08:00:10Z"
    h3, _ = observe(h2, 1, scrape([decode]), pods, now=T0 + timedelta(seconds=20))
    assert h3["roles"]["decode"]["lastTransferTime"] == "2026-12-01T08:00:10Z"  # no new transfer
    assert h3["roles"]["decode"]["lastScrapeTime"] == "2026-12-01T08:00:20Z"
    # a failed transfer is no successful one
    accounts.count_failed_transfer()
    h4, _ = observe(h3, 1, scrape([decode]), pods, now=T0 + timedelta(seconds=30))
    assert h4["roles"]["decode"]["transfers"] == 1 and h4["roles"]["decode"]["lastTransferTime"] == "2026-12-01T08:00:10Z"


def test_hung_pod_is_unhealthy_and_reads_back_as_a_restart(exporter):
    accounts, decode = exporter("decode", hang_timeout=0.2)
    _, prefill = exporter("prefill")
    accounts.open_wait("stuck", "peer", 5, time.monotonic() + 0.2)
    accounts.on_signals("stuck", 2)
    time.sleep(0.35)
    new, verdict = observe(None, 1, scrape([decode, prefill]),
                           {"decode": running(decode.pod), "prefill": running(prefill.pod)}, now=T0)
    assert verdict.hung
    assert (new["verdict"], new["reason"]) == (VERDICT_UNHEALTHY, REASON_HUNG)
    assert new["roles"]["decode"]["state"] == "hung" and new["roles"]["decode"]["deficit"] == 3
    assert new["roles"]["decode"]["oldestWaitSeconds"] >= 0.3
    assert new["roles"]["prefill"]["state"] == "healthy"
    assert new["pod"] == decode.pod  # the verdict names its pod (the planner replaces an xPyD instance alone)
    assert restart_finding(new, 1) == Finding(REASON_HUNG, new["message"], 1, pod=decode.pod)
    assert "stuck" in new["message"]
    cond = signals_condition(new, 1)
    assert (cond.type, cond.status, cond.reason) == (contract.COND_SIGNALS_HEALTHY, "False", "Hung")
    # a verdict about another generation decides nothing
    assert restart_finding(new, 2) is None
    assert (signals_condition(new, 2).status, signals_condition(new, 2).reason) == ("Unknown", "NotJudged")


def test_pending_pod_gives_pending(exporter):
    _, decode = exporter("decode")
    unscheduled = {"metadata": {"name": "prefill-g1"}, "spec": {},
                   "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False"}]}}
    new, verdict = observe(None, 1, scrape([decode]), {"decode": running(decode.pod), "prefill": unscheduled}, now=T0)
    assert new["verdict"] == VERDICT_PENDING and verdict.pending and not verdict.restart
    assert restart_finding(new, 1) is None
    assert (signals_condition(new, 1).status, signals_condition(new, 1).reason) == ("Unknown", "PodsPending")


@pytest.mark.parametrize("status_health, generation, expected", [
    (None, 1, ("Unknown", "NotJudged")),
    ({}, 1, ("Unknown", "NotJudged")),
    ({"pairGeneration": 1, "verdict": "Maybe"}, 1, ("Unknown", "NotJudged")),
    ({"pairGeneration": "1", "verdict": VERDICT_HEALTHY}, 1, ("Unknown", "NotJudged")),
    ({"pairGeneration": 1, "verdict": VERDICT_HEALTHY, "message": "healthy"}, 1, ("True", "Healthy")),
    ({"pairGeneration": 1, "verdict": VERDICT_HEALTHY}, 2, ("Unknown", "NotJudged")),
    ({"pairGeneration": 3, "verdict": VERDICT_UNHEALTHY, "reason": "stale_generation"}, 3,
     ("False", "StaleGeneration")),
])
def test_signals_healthy_from_status(status_health, generation, expected):
    cond = signals_condition(status_health, generation)
    assert (cond.status, cond.reason) == expected
    assert (restart_finding(status_health, generation) is not None) == (expected[0] == "False")


def test_only_meaningful_changes_write_at_once(exporter):
    accounts, decode = exporter("decode")
    pods = {"decode": running(decode.pod)}
    status_health, patch = write(None, observe(None, 1, scrape([decode]), pods, now=T0)[0], T0)
    assert patch is not None and status_health["verdict"] == VERDICT_HEALTHY
    # transfers and scrape times move every scrape on a busy pair: not written until the refresh is due
    for i in range(1, 4):
        accounts.open_wait(f"t{i}", "peer", 1, time.monotonic() + 30)
        accounts.on_signals(f"t{i}", 1)
        accounts.close_wait(f"t{i}", contract.OUTCOME_OK, 1, 0.01)
        now = T0 + timedelta(seconds=10 * i)
        status_health, patch = write(status_health, observe(status_health, 1, scrape([decode]), pods, now=now)[0], now)
        assert patch is None, patch
    # refresh due: observedAt and the numbers are written, as a patch of what changed only
    now = T0 + timedelta(seconds=REFRESH)
    new = observe(status_health, 1, scrape([decode]), pods, now=now)[0]
    status_health, patch = write(status_health, new, now)
    assert patch is not None and set(patch) == {"observedAt", "roles"}
    assert status_health == new and status_health["roles"]["decode"]["transfers"] == 3
    # signals going missing is written at once
    accounts.open_wait("open", "peer", 4, time.monotonic() + 30)
    now += timedelta(seconds=10)
    status_health, patch = write(status_health, observe(status_health, 1, scrape([decode]), pods, now=now)[0], now)
    assert patch is not None and patch["roles"]["decode"]["deficit"] == 4


def test_merge_patch_round_trips():
    old = {"a": 1, "roles": {"decode": {"pod": "d1", "lastTransferTime": "x"}, "prefill": {"pod": "p1"}}}
    new = {"a": 2, "roles": {"decode": {"pod": "d2"}}}
    patch = merge_patch(old, new)
    assert patch == {"a": 2, "roles": {"decode": {"pod": "d2", "lastTransferTime": None}, "prefill": None}}
    assert apply_merge_patch(old, patch) == new
    assert merge_patch(new, new) == {}


def test_reconciler_status_writes_never_carry_health():
    """The reconciler's status writes are status_diff(snapshot, snapshot + its own fields): health, which it never
    sets, is never in them, whatever its snapshot holds."""
    snapshot = {"phase": "Ready", "health": {"pairGeneration": 1, "verdict": VERDICT_HEALTHY}}
    patch = status_diff(snapshot, {**snapshot, "phase": "Restarting", "pairGeneration": 2})
    assert "health" not in patch



def test_newest_of_own_write_and_body():
    def h(generation, at):
        return {"pairGeneration": generation, "observedAt": at, "verdict": VERDICT_HEALTHY}

    ours, body = h(1, "2026-12-01T08:00:10Z"), h(1, "2026-12-01T08:00:00Z")
    assert newest(ours, body) is ours and newest(body, ours) is ours  # the body lags our own write
    assert newest(None, body) is body and newest(ours, None) is ours and newest(None, None) is None
    assert newest(h(1, "2026-12-01T09:00:00Z"), h(2, "2026-12-01T08:00:00Z"))["pairGeneration"] == 2
    assert newest({"verdict": "junk"}, body) is body
