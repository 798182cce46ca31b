"""Condition setter: reports changes, moves lastTransitionTime only on a real flip."""

import pytest

from pdpair.operator.model.conditions import Condition, apply_conditions, set_condition, status_diff


def test_new_condition_is_a_change():
    conds = []
    assert set_condition(conds, Condition("Ready", "False", "Starting"), now="t1")
    assert conds == [{"type": "Ready", "status": "False", "reason": "Starting", "message": "", "lastTransitionTime": "t1"}]


def test_same_condition_is_no_change():
    conds = []
    set_condition(conds, Condition("Ready", "False", "Starting", "m"), now="t1")
    assert not set_condition(conds, Condition("Ready", "False", "Starting", "m"), now="t2")
    assert conds[0]["lastTransitionTime"] == "t1"


def test_reason_change_keeps_transition_time():
    conds = []
    set_condition(conds, Condition("Ready", "False", "Starting"), now="t1")
    assert set_condition(conds, Condition("Ready", "False", "Waiting"), now="t2")
    assert conds[0]["lastTransitionTime"] == "t1" and conds[0]["reason"] == "Waiting"


def test_status_flip_moves_transition_time():
    conds = []
    set_condition(conds, Condition("Ready", "False", "Starting"), now="t1")
    assert set_condition(conds, Condition("Ready", "True", "PairReady"), now="t2")
    assert conds[0]["lastTransitionTime"] == "t2"


def test_other_types_untouched_and_copy_semantics():
    original = [{"type": "SignalsHealthy", "status": "True", "reason": "Ok", "message": "", "lastTransitionTime": "t0"}]
    result, changed = apply_conditions(original, [Condition("Ready", "True", "PairReady")], now="t1")
    assert changed and len(result) == 2 and result[0] == original[0]
    assert len(original) == 1  # the input is not modified


@pytest.mark.parametrize("status, reason", [("Yes", "Ok"), ("True", ""), ("True", "1bad")])
def test_bad_conditions_are_refused(status, reason):
    with pytest.raises(ValueError):
        Condition("Ready", status, reason)


def test_status_diff_is_minimal():
    assert status_diff({"a": 1, "b": [1]}, {"a": 1, "b": [1, 2], "c": 3}) == {"b": [1, 2], "c": 3}
    assert status_diff({"a": 1}, {"a": 1}) == {}


def test_status_diff_removes_a_key_gone_from_a_map():
    """A merge patch merges maps: pods.router must be sent as null once the router is gone, or it stays."""
    old = {"pods": {"decode": "p-decode-g1", "prefill": "p-prefill-g1", "router": "p-router-g1"}}
    new = {"pods": {"decode": "p-decode-g2", "prefill": "p-prefill-g2"}}
    assert status_diff(old, new) == {"pods": {"decode": "p-decode-g2", "prefill": "p-prefill-g2", "router": None}}
    assert status_diff({"service": "p"}, {"service": None}) == {"service": None}
    assert status_diff({}, {"service": None}) == {}
