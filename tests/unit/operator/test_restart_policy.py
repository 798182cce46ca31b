"""Table tests of pdpair.operator.decide.restart_policy (pure functions)."""

from __future__ import annotations

import pytest

from pdpair.operator.model.observed import PodView, pending_for_scheduling
from pdpair.operator.decide.restart_policy import (
    Action,
    RestartPolicy,
    backoff_for,
    decide,
    prune,
    restarts_in_window,
)

POLICY = RestartPolicy(max_restarts=3, window_seconds=100, backoff_seconds=10, max_backoff_seconds=35)


@pytest.mark.parametrize(
    "n, expected",
    [(1, 10), (2, 20), (3, 35), (4, 35), (60, 35), (10_000, 35)],
)
def test_backoff_doubles_from_backoff_seconds_and_caps(n, expected):
    assert backoff_for(POLICY, n) == expected


def test_backoff_zero_means_no_wait():
    assert backoff_for(RestartPolicy(backoff_seconds=0, max_backoff_seconds=0), 5) == 0


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_backoff_refuses_bad_n(n):
    with pytest.raises(ValueError, match="n must be"):
        backoff_for(POLICY, n)


@pytest.mark.parametrize(
    "name, times, now, pending, action, not_before, count",
    [
        ("first restart is immediate", [], 1000, False, Action.RESTART_NOW, None, 0),
        ("inside the first backoff", [995], 1000, False, Action.WAIT, 1005, 1),
        ("first backoff over", [990], 1000, False, Action.RESTART_NOW, None, 1),
        ("second backoff doubles", [950, 990], 1000, False, Action.WAIT, 1010, 2),
        ("second backoff over", [950, 980], 1000, False, Action.RESTART_NOW, None, 2),
        ("budget spent", [950, 960, 999], 1000, False, Action.BUDGET_EXHAUSTED, None, 3),
        ("budget spent even past the backoff", [920, 940, 960], 1000, False, Action.BUDGET_EXHAUSTED, None, 3),
        ("old restarts leave the window", [800, 850, 990], 1000, False, Action.RESTART_NOW, None, 1),
        ("exactly window-old counts no more", [900, 950, 960], 1000, False, Action.RESTART_NOW, None, 2),
        ("unordered history", [960, 900.5, 950], 1000, False, Action.BUDGET_EXHAUSTED, None, 3),
        ("pending pods block everything", [], 1000, True, Action.PENDING_SCHEDULING, None, 0),
        ("pending wins over exhausted", [950, 960, 999], 1000, True, Action.PENDING_SCHEDULING, None, 3),
    ],
)
def test_decide(name, times, now, pending, action, not_before, count):
    decision = decide(POLICY, times, now, pods_pending_scheduling=pending)
    assert (decision.action, decision.not_before, decision.restarts_in_window) == (action, not_before, count), name
    assert decision.message


def test_zero_max_restarts_never_restarts():
    assert decide(RestartPolicy(max_restarts=0), [], 0).action is Action.BUDGET_EXHAUSTED


def test_a_simulated_crash_loop_spends_the_budget_with_growing_gaps():
    """Restart as soon as allowed, forever: the gaps follow the backoff and the budget ends it."""
    policy = RestartPolicy(max_restarts=4, window_seconds=1000, backoff_seconds=5, max_backoff_seconds=12)
    now, times = 0.0, []
    while True:
        d = decide(policy, times, now)
        if d.action is Action.WAIT:
            now = d.not_before
            continue
        if d.action is Action.BUDGET_EXHAUSTED:
            break
        assert d.action is Action.RESTART_NOW
        times.append(now)
    assert times == [0, 5, 15, 27]
    assert now == 27


def test_window_and_prune():
    assert restarts_in_window(POLICY, [1, 50, 51, 99, 120], 150) == [51, 99, 120]
    assert prune(POLICY, [120, 1, 99], 150) == [99, 120]


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"maxRestarts": -1}, "maxRestarts"),
        ({"maxRestarts": 1.5}, "maxRestarts"),
        ({"windowSeconds": 0}, "windowSeconds"),
        ({"backoffSeconds": -1}, "backoffSeconds"),
        ({"backoffSeconds": float("nan")}, "backoffSeconds"),
        ({"backoffSeconds": 20, "maxBackoffSeconds": 10}, "maxBackoffSeconds"),
        ({"maxRestart": 3}, "unknown keys"),
    ],
)
def test_from_spec_refuses_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        RestartPolicy.from_spec(spec)


def test_from_spec_defaults_match_the_crd():
    assert RestartPolicy.from_spec(None) == RestartPolicy(5, 1800, 10, 300)
    assert RestartPolicy.from_spec({"maxRestarts": 2}).max_restarts == 2


def test_bad_timestamps_are_refused():
    with pytest.raises(ValueError, match="restart times"):
        decide(POLICY, [float("inf")], 0)


@pytest.mark.parametrize(
    "pod, pending",
    [
        (None, False),
        ({"status": {"phase": "Running"}, "spec": {"nodeName": "n1"}}, False),
        ({"status": {"phase": "Pending"}, "spec": {}}, True),
        (
            {
                "status": {
                    "phase": "Pending",
                    "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}],
                },
                "spec": {},
            },
            True,
        ),
        ({"status": {"phase": "Pending"}, "spec": {"nodeName": "n1"}}, False),
        ({"status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]}, "spec": {}}, False),
        ({"status": {"phase": "Failed"}, "spec": {}}, False),
    ],
)
def test_pending_for_scheduling(pod, pending):
    assert pending_for_scheduling(pod) is pending
    if pod:  # the parsed view follows the same rule
        assert PodView.from_pod(pod).pending_scheduling is pending
