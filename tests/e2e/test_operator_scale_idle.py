"""The operator's write discipline at a CI-sized scale (the full-size benchmark is
tests/bench/bench_operator_scale.py): pairs reach Ready with exactly the writes they need, none refused, and once
they are Ready the operator writes nothing, counted by the apiserver itself (`apiserver_request_total`).

Every port of the pool listens on 127.0.0.1 (the kwok pods' IP), so the decode gate's probe passes for every pair.
"""

from __future__ import annotations

import contextlib
import socket
import time

import pytest

from pdpair.contract import GROUP, PLURAL
from devcluster.apiserver_metrics import by_kind, counts_delta, key_name, write_counts
from pdpair.operator.model.config import ENV_RESYNC_INTERVAL
from tests.e2e.operator_helpers import (
    NO_HEALTH,
    PORTS_PER_PAIR_NO_ROUTER,
    Api,
    cleanup_pairs,
    create_many,
    operator,
    pool_of_free_ports,
)
from devcluster.waiting import wait_for

pytestmark = pytest.mark.cluster

PAIRS = 20
# The operator's full reconcile of every pair, shortened for this test from devrun's 10 s, and the idle window: > 2
# resync intervals, so every pair makes 2+ idle passes (as 25 s against 10 s did, 13 s sooner).
RESYNC_SECONDS = 5
IDLE_SECONDS = 12

STEP_EVENTS = {"PortsLeased", "PodCreated", "DecodeListening"}
LEASE_CREATE = ("POST", "coordination.k8s.io", "leases", "")
POD_CREATE = ("POST", "", "pods", "")
# What this operator writes; in a shared cluster, other writers (kwok node leases, the scheduler's bindings and
# events.k8s.io Events, the namespace controller cleaning up earlier tests) use other kinds.
OPERATOR_WRITES = {LEASE_CREATE, POD_CREATE, ("PATCH", GROUP, PLURAL, "status"), ("PATCH", GROUP, PLURAL, ""),
                   ("POST", "", "events", ""), ("POST", "", "services", ""), ("PATCH", "", "services", "")}


@contextlib.contextmanager
def listening(pool: str):
    first, last = (int(p) for p in pool.split("-"))
    socks = []
    try:
        for port in range(first, last + 1):
            s = socket.socket()
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen(16)
        yield
    finally:
        for s in socks:
            s.close()


def test_pairs_reach_ready_without_refused_writes_then_idle_writes_nothing(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    pool = pool_of_free_ports(PAIRS * PORTS_PER_PAIR_NO_ROUTER + 12)
    with listening(pool), operator(platform, ns, pool, tmp_path,
                                   env={**NO_HEALTH, ENV_RESYNC_INTERVAL: str(RESYNC_SECONDS)}) as proc:
        before = write_counts(cluster)
        create_many(api, ns, [f"s{i:02d}" for i in range(PAIRS)])
        wait_for(lambda: sum((p.get("status") or {}).get("phase") == "Ready" for p in api.pairs(ns)) == PAIRS, 240,
                 f"{PAIRS} pairs Ready", interval=0.5)
        writes = counts_delta(write_counts(cluster), before)
        ours = {k: v for k, v in writes.items() if k[:4] in OPERATOR_WRITES}
        refused = {key_name(k): v for k, v in ours.items() if not k[4].startswith("2")}
        ok = by_kind(ours, ok_only=True)
        print(f"\n{PAIRS} pairs Ready; operator writes: " + ", ".join(f"{key_name(k)} {v}" for k, v in sorted(ours.items())))
        # Each pod and each lease is created once: no re-create of a pod the index had not shown yet (409s).
        assert refused == {}, f"writes the apiserver refused: {refused}"
        assert ok[POD_CREATE] == 2 * PAIRS
        assert ok[LEASE_CREATE] == PORTS_PER_PAIR_NO_ROUTER * PAIRS

        # kopf posts Events from a queue, after the step that emitted them: let the 4 of each pair arrive first
        wait_for(lambda: sum(e.reason in STEP_EVENTS for e in api.events(ns)) >= 4 * PAIRS, 120,
                 "every pair's PortsLeased, 2 PodCreated and DecodeListening Events", interval=1)
        rss_ready = rss_kib(proc.proc.pid)
        before = write_counts(cluster)
        time.sleep(IDLE_SECONDS)  # an observation window, not a synchronisation
        idle = counts_delta(write_counts(cluster), before)
        idle_ours = {key_name(k): v for k, v in idle.items() if k[:4] in OPERATOR_WRITES}
        print(f"idle {IDLE_SECONDS}s: all writes {dict((key_name(k), v) for k, v in idle.items())}; "
              f"operator RSS {rss_ready // 1024} -> {rss_kib(proc.proc.pid) // 1024} MiB")
        assert idle_ours == {}, f"the operator wrote while nothing changed: {idle_ours}"
        assert sum((p.get("status") or {}).get("phase") == "Ready" for p in api.pairs(ns)) == PAIRS
        cleanup_pairs(api, ns, timeout=180)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
