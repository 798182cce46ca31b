"""Leader election's pure parts (election.py) and its configuration; the protocol itself runs against the real
apiserver in tests/e2e/test_leader_election.py."""

import pytest

from pdpair.operator.__main__ import candidate_identity
from pdpair.operator.model.config import ConfigError, OperatorConfig
from pdpair.operator.act.election import ElectionSettings, may_take

BASE = {"PDPAIR_OPERATOR_NAMESPACE": "pdpair-system"}


@pytest.mark.parametrize("holder, observed_at, now, expected", [
    (None, 0.0, 0.0, True),  # nobody holds it
    ("", 100.0, 100.0, True),  # released (empty holder): no need to wait for expiry
    ("me_1", 100.0, 100.0, True),  # ours: renew
    ("other_1", 100.0, 114.9, False),  # another holder, record seen changing 14.9 s ago: still valid
    ("other_1", 100.0, 115.0, True),  # unchanged for the whole lease duration: expired
])
def test_may_take(holder, observed_at, now, expected):
    assert may_take(holder, "me_1", observed_at, 15.0, now) is expected


@pytest.mark.parametrize("retry, renew, lease", [(2, 10, 10), (10, 10, 15), (3, 2, 15), (0, 10, 15)])
def test_settings_need_retry_below_renew_below_lease(retry, renew, lease):
    with pytest.raises(ValueError, match="retry period"):
        ElectionSettings("l", "ns", "me", lease_duration=lease, renew_deadline=renew, retry_period=retry)


def test_election_defaults_off_with_client_go_timing():
    cfg = OperatorConfig.from_env(BASE)
    assert cfg.leader_elect is False
    assert (cfg.leader_lease_duration, cfg.leader_renew_deadline, cfg.leader_retry_period) == (15.0, 10.0, 2.0)
    assert cfg.leader_lease_name == "pdpair-operator-leader"


def test_election_values():
    cfg = OperatorConfig.from_env({**BASE, "PDPAIR_LEADER_ELECT": "True", "PDPAIR_LEADER_LEASE_NAME": "rel-leader",
                                   "PDPAIR_LEADER_LEASE_DURATION_SECONDS": "8",
                                   "PDPAIR_LEADER_RENEW_DEADLINE_SECONDS": "5",
                                   "PDPAIR_LEADER_RETRY_PERIOD_SECONDS": "0.5"})
    assert (cfg.leader_elect, cfg.leader_lease_name, cfg.leader_lease_duration, cfg.leader_renew_deadline,
            cfg.leader_retry_period) == (True, "rel-leader", 8.0, 5.0, 0.5)


@pytest.mark.parametrize("env, fragment", [
    ({"PDPAIR_LEADER_ELECT": "maybe"}, "PDPAIR_LEADER_ELECT: expected true or false"),
    ({"PDPAIR_LEADER_LEASE_NAME": "Leader_A"}, "PDPAIR_LEADER_LEASE_NAME"),
    ({"PDPAIR_LEADER_RENEW_DEADLINE_SECONDS": "15"}, "the leader must stop before a standby may take over"),
    ({"PDPAIR_LEADER_RETRY_PERIOD_SECONDS": "12"}, "PDPAIR_LEADER_RETRY_PERIOD_SECONDS (12)"),
    ({"PDPAIR_LEADER_LEASE_DURATION_SECONDS": "-1"}, "PDPAIR_LEADER_LEASE_DURATION_SECONDS"),
])
def test_bad_election_settings_are_refused_at_start(env, fragment):
    with pytest.raises(ConfigError, match=None) as err:
        OperatorConfig.from_env({**BASE, **env})
    assert fragment in str(err.value)


def test_candidate_identity_is_the_pod_name_plus_a_per_process_suffix():
    first = candidate_identity({"PDPAIR_POD_NAME": "pdpair-operator-7c9-x2"})
    second = candidate_identity({"PDPAIR_POD_NAME": "pdpair-operator-7c9-x2"})
    assert first.startswith("pdpair-operator-7c9-x2_") and second.startswith("pdpair-operator-7c9-x2_")
    assert first != second  # a restarted container waits for its old incarnation's Lease to expire
