"""Two operator replicas with leader election on the real control plane.

Both run `python -m pdpair.operator` with PDPAIR_LEADER_ELECT=true under the chart's ServiceAccount, as the chart's
two replicas do. The test SIGKILLs the leader while pairs are being created and while pairs restart, measures the
failover (kill -> the standby holds the Lease -> the work is finished), and checks nothing was done twice: no pod
created twice for one pair+role+generation (a watch records every pod), no double restart (status.restarts, the
generation, the Restarting Events), every port leased once and listed by one pair, no orphan pod.
"""

from __future__ import annotations

import time
import urllib.request

import pytest

from pdpair.contract import GROUP, PLURAL, VERSION
from tests.e2e.ha_support import (
    DecodeListeners,
    ElectionTiming,
    Expected,
    PodLedger,
    Replicas,
    audit,
    converged,
    lease_holder,
)
from tests.e2e.operator_helpers import (
    OPERATOR_NS,
    PORTS_PER_PAIR_NO_ROUTER,
    Api,
    cleanup_pairs,
    create_many,
    pool_of_free_ports,
)
from devcluster.waiting import wait_for

pytestmark = pytest.mark.cluster

TIMING = ElectionTiming(lease_duration=8.0, renew_deadline=5.0, retry_period=1.0)
PAIRS = 12
# Generous: kopf's own start (imports, watches) after winning takes seconds on a loaded 2-core machine.
CONVERGE_TIMEOUT = 180
STARTUP_LINE = "pdpair operator: pool"  # handlers.configure logs it once kopf runs: a standby must never print it


def _healthz(proc):
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.liveness_port}/healthz", timeout=5) as resp:
        return resp.status


def _metric_samples(proc):
    """The sample lines of the replica's /metrics (a standby serves a valid page with none)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None  # between the standby's server and the leader's: nothing listens for a moment
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def _kill_leader_and_time_failover(replicas, api, ns, expected, what):
    """SIGKILL the leader; return (the new leader, when the kill happened, seconds from the kill to the new holder).
    The supervisor restarts the killed replica, as the kubelet would: it comes back as the standby."""
    old_name = wait_for(replicas.leader, 30, "a live leader", interval=0.05)
    old_identity = lease_holder(api, replicas.lease_name)
    killed_at_wall, killed_at = time.time(), time.monotonic()
    replicas.kill(old_name)
    # The dead leader's last renewal (stamped by its clock, on this same host, just before it sent the write).
    renewed = api.coord.read_namespaced_lease(replicas.lease_name, OPERATOR_NS).spec.renew_time.timestamp()
    mid_flight = converged(api, ns, expected) is None  # read while nobody leads: the state the kill left
    new_name, _ = replicas.wait_leader(TIMING.failover_bound + 30, other_than=old_identity)
    failover = time.monotonic() - killed_at
    assert mid_flight, f"{what}: the kill came after all the work was done"
    since_renewal = killed_at_wall - renewed + failover
    print(f"\n{what}: killed leader {old_name}; {new_name} led {failover:.2f}s later "
          f"({since_renewal:.2f}s after the last renewal = {since_renewal / TIMING.lease_duration:.2f} x the lease "
          f"duration of {TIMING.lease_duration:g}s, the floor)")
    # The standby must not take the Lease before it expired: at least lease duration after the last renewal it saw
    # (the renewal's own time, written by the leader's clock on this same host; 1 s for observation slack).
    assert since_renewal >= TIMING.lease_duration - 1.0, f"the standby took the Lease early ({since_renewal:.2f}s)"
    assert failover <= TIMING.failover_bound + 10, f"failover took {failover:.1f}s"
    return new_name, killed_at, failover


def test_leader_sigkill_during_creates_and_restarts_does_nothing_twice(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    replicas = Replicas(platform, ns, pool_of_free_ports(PAIRS * PORTS_PER_PAIR_NO_ROUTER + 6), tmp_path, TIMING, api)
    ledger = PodLedger(api, ns)
    listeners = DecodeListeners(api, ns)
    expected = {f"ha{i:02d}": Expected() for i in range(PAIRS)}
    try:
        replicas.start("a")
        replicas.wait_leader(30)
        assert replicas.leader() == "a"
        standby = replicas.start("b")
        # The standby: live, campaigning, and not running kopf (no handler, so no pod, lease or status write).
        assert _healthz(standby) == 200
        wait_for(lambda: "is a candidate" in standby.log_tail(), 30, "b campaigning")
        time.sleep(2 * TIMING.retry_period)
        assert replicas.leader() == "a"
        assert STARTUP_LINE not in standby.log_tail(20000), "the standby started kopf"
        replicas.supervise()  # from here on a replica that dies (killed, or fenced on a stalled box) comes back
        assert _metric_samples(standby) == [], "a standby must export no operator series (the leader does)"
        wait_for(lambda: any(line.startswith("pdpair_operator_port_pool_size")
                             for line in _metric_samples(replicas.procs["a"]) or []), 60, "the leader's metrics")

        # 1. Kill the leader while the pairs are being created and their pods started.
        create_many(api, ns, sorted(expected))
        wait_for(lambda: len(ledger.seen) >= 3, 60, "the first pods created", interval=0.02)
        new_leader, killed_at, failover_create = _kill_leader_and_time_failover(replicas, api, ns, expected,
                                                                                "during creates")
        wait_for(lambda: any(line.startswith("pdpair_operator_port_pool_size")
                             for line in _metric_samples(replicas.procs[new_leader]) or []), 60,
                 "the new leader serving the operator metrics")
        wait_for(lambda: converged(api, ns, expected), CONVERGE_TIMEOUT, "every pair Ready after the failover",
                 interval=0.2)
        print(f"all {PAIRS} pairs Ready {time.monotonic() - killed_at:.1f}s after the kill")

        # 2. Trigger ordered restarts (the decode pod of a Ready pair vanishes) and kill the leader mid-restart.
        victims = sorted(expected)[: PAIRS // 2]
        for name in victims:
            api.core.delete_namespaced_pod(f"{name}-decode-g1", ns)
            expected[name].restarts += 1
        wait_for(lambda: any((api.pair(ns, n).get("status") or {}).get("pairGeneration") == 2 for n in victims), 30,
                 "the first restart under way", interval=0.02)
        _, killed_at, failover_restart = _kill_leader_and_time_failover(replicas, api, ns, expected,
                                                                        "during restarts")
        wait_for(lambda: converged(api, ns, expected), CONVERGE_TIMEOUT, "every pair Ready after the restarts",
                 interval=0.2)
        print(f"restarted pairs Ready {time.monotonic() - killed_at:.1f}s after the kill")

        # 3. A spec change, then a graceful handoff: SIGTERM releases the Lease, the standby leads within a retry.
        api.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "ha11", {"spec": {"image": "img:2"}})
        expected["ha11"].rollouts += 1
        leader = wait_for(replicas.leader, 30, "a live leader", interval=0.05)
        identity = lease_holder(api, replicas.lease_name)
        stopping = replicas.procs[leader]
        stopped_at = time.monotonic()
        stopping.stop()
        new_name, _ = replicas.wait_leader(TIMING.lease_duration + 30, other_than=identity)
        handoff = time.monotonic() - stopped_at
        print(f"graceful handoff {leader} -> {new_name}: {handoff:.2f}s (SIGTERM to new holder; includes kopf's "
              f"own shutdown)")
        assert stopping.proc.returncode == 0, stopping.log_tail()
        assert "leader election: released lease" in stopping.log_tail(), "SIGTERM did not release the Lease"
        assert handoff < TIMING.lease_duration + 20
        wait_for(lambda: converged(api, ns, expected), CONVERGE_TIMEOUT, "the rollout finished", interval=0.5)

        facts = audit(api, ns, expected, ledger, PORTS_PER_PAIR_NO_ROUTER)
        print(f"audit: {facts}; failovers {failover_create:.2f}s (creates), {failover_restart:.2f}s (restarts), "
              f"graceful {handoff:.2f}s; replica exits {replicas.exits} ({replicas.fenced_exits()} fenced)")
        cleanup_pairs(api, ns)
        wait_for(lambda: api.leases(ns) == [], 60, "every port lease released")
    except BaseException:
        print(replicas.logs())
        raise
    finally:
        listeners.stop()
        ledger.stop()
        replicas.stop()
    assert lease_holder(api, replicas.lease_name) in (None, ""), "the last leader did not release the Lease on SIGTERM"
