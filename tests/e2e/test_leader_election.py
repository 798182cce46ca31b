"""The leader-election protocol (pdpair.operator.act.election) against the real apiserver, in-process: exclusivity
while the leader renews, takeover only after the lease duration, the optimistic-concurrency race on an expired
Lease, release on a graceful stop, and fencing when renewals stop succeeding."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from pdpair.operator.act.election import ElectionSettings, LeaderElector
from devcluster.waiting import wait_for

pytestmark = pytest.mark.cluster

LEASE, RENEW, RETRY = 3.0, 2.0, 0.25


@pytest.fixture
def electors(local_cluster):
    """Makes electors; every one is stopped at teardown, so a failed test leaves no renew loop writing into the
    next test's apiserver (a leaked loop once turned one failure into two)."""
    from kubernetes import client

    made = []

    def make(ns, *names):
        coord = client.CoordinationV1Api(local_cluster.api_client())
        lease_name = f"leader-{uuid.uuid4().hex[:6]}"
        new = [LeaderElector(coord, ElectionSettings(lease_name, ns, f"{n}_{uuid.uuid4().hex[:4]}", LEASE, RENEW,
                                                      RETRY))
               for n in names]
        made.extend(new)
        return coord, lease_name, new

    yield make
    for elector in made:
        elector.stop()


def _take_lease(coord, ns, name, holder):
    """Overwrites the holder with a read-modify-write that retries on 409: the leader renews every RETRY seconds,
    so a single read-then-replace can lose the race."""
    from kubernetes.client.exceptions import ApiException

    for _ in range(40):
        lease = coord.read_namespaced_lease(name, ns)
        lease.spec.holder_identity = holder
        try:
            return coord.replace_namespaced_lease(name, ns, lease)
        except ApiException as exc:
            if exc.status != 409:
                raise
    raise AssertionError(f"could not overwrite lease {name}: 40 conflicts in a row")


def _holder(coord, ns, name):
    return coord.read_namespaced_lease(name, ns).spec.holder_identity


def test_standby_waits_for_expiry_and_release_hands_over_at_once(electors, cluster_namespace):
    ns = cluster_namespace
    coord, lease_name, (a, b) = electors(ns, "a", "b")
    lost = []
    assert a.wait_for_leadership()
    a.keep_leading(lost.append)

    # While a renews, b never wins: for several lease durations, trying every retry period.
    deadline = time.monotonic() + 3 * LEASE
    while time.monotonic() < deadline:
        assert not b.try_acquire_or_renew()
        time.sleep(RETRY)
    assert _holder(coord, ns, lease_name) == a.settings.identity and lost == []

    # a stops renewing (as if SIGKILLed): b takes over no sooner than a lease duration after a's last renewal.
    a.stop()
    last_renewal = coord.read_namespaced_lease(lease_name, ns).spec.renew_time.timestamp()
    took = threading.Event()
    threading.Thread(target=lambda: b.wait_for_leadership() and took.set(), daemon=True).start()
    assert took.wait(LEASE + 4 * RETRY + 10), "b never took the expired Lease"
    waited = time.time() - last_renewal
    print(f"\nb led {waited:.2f}s after a's last renewal (lease duration {LEASE:g}s)")
    assert waited >= LEASE - 0.2  # renewTime is stamped before the write is sent: the wait is at least LEASE
    lease = coord.read_namespaced_lease(lease_name, ns)
    assert lease.spec.holder_identity == b.settings.identity and lease.spec.lease_transitions == 1

    # Graceful stop: b releases; a fresh candidate leads within a retry period or two, not a lease duration.
    c = LeaderElector(coord, ElectionSettings(lease_name, ns, "c_1", LEASE, RENEW, RETRY))
    assert not c.try_acquire_or_renew()
    assert b.release()
    started = time.monotonic()
    assert c.wait_for_leadership()
    assert time.monotonic() - started < LEASE - 1, "a released Lease was treated as held"
    assert _holder(coord, ns, lease_name) == "c_1"
    assert not b.release()  # not ours any more: release leaves it alone
    assert _holder(coord, ns, lease_name) == "c_1"


def test_one_winner_when_candidates_race_for_an_expired_lease(electors, cluster_namespace):
    ns = cluster_namespace
    coord, lease_name, candidates = electors(ns, *[f"r{i}" for i in range(6)])
    for round_ in range(5):
        winners = []
        barrier = threading.Barrier(len(candidates))

        def campaign(elector):
            barrier.wait()
            if elector.try_acquire_or_renew():
                winners.append(elector.settings.identity)

        # Each round starts from a released Lease (no waiting), so every candidate may write: only one write wins.
        for elector in candidates:
            elector._observed_version = None
        threads = [threading.Thread(target=campaign, args=(e,)) for e in candidates]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        holder = _holder(coord, ns, lease_name)
        assert len(winners) == 1 and winners == [holder], f"round {round_}: winners {winners}, holder {holder}"
        next(e for e in candidates if e.settings.identity == holder).release()


def test_leader_fences_itself_when_renewals_fail(electors, cluster_namespace):
    """Someone else writes the Lease (a split brain the apiserver would otherwise allow): the leader's renewals see
    another holder, and within the renew deadline the watchdog calls on_lost (the process would exit)."""
    ns = cluster_namespace
    coord, lease_name, (a,) = electors(ns, "a")
    lost = threading.Event()
    reasons = []
    assert a.wait_for_leadership()
    a.keep_leading(lambda reason: (reasons.append(reason), lost.set()))
    time.sleep(2 * RETRY)
    assert not lost.is_set()
    _take_lease(coord, ns, lease_name, "intruder")
    stolen = time.monotonic()
    assert lost.wait(RENEW + 5), "the leader kept acting without a successful renewal"
    elapsed = time.monotonic() - stolen
    print(f"\nfenced {elapsed:.2f}s after the Lease was taken ({reasons[0]})")
    assert elapsed <= RENEW + 1.0
    a.stop()
    assert "no successful lease renewal" in reasons[0]
    wait_for(lambda: _holder(coord, ns, lease_name) == "intruder", 5, "the intruder still holding")


class _LostAnswers:
    """The coordination API with every lease write's answer after the first lost once the apiserver applied it, as
    a read timeout on a busy box does (urllib3 then retries the PUT, and the retry is refused with 409)."""

    def __init__(self, api):
        self.api = api
        self.writes = 0
        self.lost = 0

    def __getattr__(self, name):
        return getattr(self.api, name)

    def replace_namespaced_lease(self, *args, **kwargs):
        from kubernetes.client.exceptions import ApiException

        self.api.replace_namespaced_lease(*args, **kwargs)
        self.writes += 1
        if self.writes == 1:
            return None
        self.lost += 1
        raise ApiException(status=409, reason="Conflict")


def test_a_renewal_whose_answer_is_lost_still_counts(electors, cluster_namespace):
    """Every renewal lands but answers 409 (the lost-answer retry): the leader reads the Lease back, sees its own
    record and keeps leading; a 409 from another writer still fences (the test above). Costs ~3 s."""
    ns = cluster_namespace
    _, _, (a,) = electors(ns, "a")
    lossy = _LostAnswers(a.api)
    a.api = lossy
    lost = threading.Event()
    assert a.wait_for_leadership()
    a.keep_leading(lambda reason: lost.set())
    assert not lost.wait(RENEW + 1.0), "the leader fenced itself although every renewal landed"
    assert lossy.lost >= 2, f"only {lossy.lost} answers were lost: the test did not exercise the read-back"
    assert time.monotonic() - a.last_renewed_at < 2 * RETRY + 1.0
