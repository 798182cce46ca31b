"""The defaults the operator, the connector and the CRD share are declared once (pdpair.contract) and the CRD states
the same: a test fails when one drifts.

Cost: under a second; no cluster.
"""

from __future__ import annotations

from pdpair import contract
from pdpair.connector import config as connector_config
from pdpair.connector.transports import TRANSPORT_SPECS, flagcx
from pdpair.operator.build import pod_defaults
from tests.crd_defaults import spec_schema


def test_the_crd_states_the_contract_defaults():
    connector = spec_schema()["properties"]["connector"]["properties"]
    assert connector["hangTimeoutSeconds"]["default"] == contract.DEFAULT_HANG_TIMEOUT_SECONDS
    assert connector["slots"]["default"] == contract.DEFAULT_TRANSPORT_SLOTS
    assert connector["slots"]["maximum"] == contract.MAX_TRANSPORT_SLOTS


def test_the_connector_and_the_operator_use_the_contract_defaults():
    assert connector_config.DEFAULT_HANG_TIMEOUT_SECONDS is contract.DEFAULT_HANG_TIMEOUT_SECONDS
    assert connector_config.DEFAULT_TRANSPORT_SLOTS is contract.DEFAULT_TRANSPORT_SLOTS
    assert flagcx.DEFAULT_SLOTS == contract.MAX_FLAGCX_TRANSPORT_SLOTS
    assert pod_defaults.FLAGCX_ENV_DEFAULTS is contract.FLAGCX_ENV_DEFAULTS
    assert TRANSPORT_SPECS[contract.TRANSPORT_FLAGCX].env_defaults is contract.FLAGCX_ENV_DEFAULTS
    assert TRANSPORT_SPECS[contract.TRANSPORT_FLAGCX].max_slots == contract.MAX_FLAGCX_TRANSPORT_SLOTS


def test_the_crd_states_the_replicas_default_and_bound_of_the_contract():
    """spec.<role>.replicas: the planner's fallback for a spec stored before the field existed (spec_fields.replicas)
    is the CRD's default; the status schema's bounds follow the same maximum."""
    spec = spec_schema()["properties"]
    for role in (contract.ROLE_PREFILL, contract.ROLE_DECODE):
        replicas = spec[role]["properties"]["replicas"]
        assert replicas["default"] == contract.DEFAULT_REPLICAS
        assert replicas["maximum"] == contract.MAX_REPLICAS
        assert replicas["minimum"] == 1
    router = spec[contract.ROLE_ROUTER]["properties"]["replicas"]
    assert (router["default"], router["minimum"], router["maximum"]) == (
        contract.DEFAULT_ROUTER_REPLICAS, 1, contract.MAX_ROUTER_REPLICAS)


def test_a_held_probe_sleeps_a_poll_interval_at_most_and_never_past_its_wait():
    """contract.probe_hold_pause, which the connector's and the router's held /readyz loops share: a passing check
    or a spent wait answers now; otherwise the next check comes after the poll interval, or when the wait ends."""
    assert contract.probe_hold_pause(True, 0.9) is None
    assert contract.probe_hold_pause(False, 0.0) is None and contract.probe_hold_pause(False, -0.1) is None
    assert contract.probe_hold_pause(False, 0.9) == contract.PROBE_WAIT_POLL_SECONDS
    assert contract.probe_hold_pause(False, 0.05) == 0.05
    assert contract.probe_hold_pause(False, 0.9, interval=0.5) == 0.5
