"""The pod exporter (pdpair.connector.pod_server) over real HTTP, parsed with prometheus-client's parser."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pdpair import contract
from pdpair.connector.rank_channel import PeerRanks, export_rank, rank_channel_key
from pdpair.connector.pod_server import accounts_from_env, serve
from pdpair.connector.signals import SignalAccounts

PEER = "10.0.0.7:20000"  # the decode of prefill's peer set (host:portBase), the `peer` label of its pairing
RANK_KEY = rank_channel_key("unit-test-side-channel-key-0123456789")  # the TP ranks' channel key

RANK0 = ("rank", "0")  # every per-rank series of a TP = 1 engine (or of TP rank 0)


class FakeClock:
    """Only the clock is faked: ages and deadlines become exact, everything else is the real code."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scrape(port: int) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    families: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        families.setdefault(family.name, []).append(family)
    return families


def samples(port: int, series: str) -> dict[tuple, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == series:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def healthz(port: int) -> tuple[int, dict]:
    try:
        resp = urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)
        return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def served(clock):
    accounts = SignalAccounts("decode", 10.0, generation=7, clock=clock)
    server = serve(0, accounts, addr="127.0.0.1")
    yield accounts, server.port
    server.stop()


def test_every_contract_pod_metric_is_exported_with_its_type_and_labels(served):
    accounts, port = served
    accounts.open_wait("t1", "peer-a", 4, deadline=1e9)
    accounts.on_signals("t1", 4)
    accounts.close_wait("t1", "ok", nbytes=100, seconds=0.01)
    accounts.on_handshake("ok")
    accounts.set_listener_ready(0, True)
    accounts.set_transport_counters("peer-a", inflight=1, slots=256, requeues=2)
    accounts.count_rejected_transfer("checksum")

    families = scrape(port)
    for metric in contract.POD_METRICS:
        found = families.get(metric.base_name)
        assert found, f"{metric.name} missing from /metrics"
        (family,) = found
        assert family.type == metric.kind, metric.name
        assert family.documentation == metric.help, metric.name
        if metric is contract.PEER_PAIRED:  # prefill's pairing: declared on every pod, a series only on prefill
            assert not family.samples, family.samples
            continue
        assert family.samples, f"{metric.name} has no samples"
        for s in family.samples:
            assert s.name in metric.series_names, (s.name, metric.series_names)
            extra = {"le"} if s.name.endswith("_bucket") else set()
            assert set(s.labels) == set(metric.labels) | extra, (s.name, s.labels)
    assert samples(port, "pdpair_pair_generation") == {(): 7.0}
    assert samples(port, "pdpair_hang_timeout_seconds") == {(("role", "decode"),): 10.0}


def test_deficit_and_oldest_wait_follow_open_transfers_per_peer(served, clock):
    accounts, port = served
    role = ("role", "decode")
    accounts.open_wait("a1", "peer-a", 5, deadline=clock.now + 10)
    clock.now += 2
    accounts.open_wait("a2", "peer-a", 3, deadline=clock.now + 10)
    accounts.open_wait("b1", "peer-b", 2, deadline=clock.now + 10)
    accounts.on_signals("a1", 1)
    accounts.on_signals("b1", 2)  # peer-b has everything: deficit 0, and b1 no longer counts as waiting
    clock.now += 1

    assert samples(port, "pdpair_signal_deficit") == {
        (("peer", "peer-a"), RANK0, role): 7.0,
        (("peer", "peer-b"), RANK0, role): 0.0,
    }
    assert samples(port, "pdpair_signal_wait_oldest_seconds") == {(RANK0, role): 3.0}
    assert samples(port, "pdpair_signals_expected_total")[(("peer", "peer-a"), RANK0, role)] == 8.0
    assert samples(port, "pdpair_signals_received_total")[(("peer", "peer-a"), RANK0, role)] == 1.0

    accounts.on_signals("a1", 5)  # a1 complete: the oldest waiting one is now a2 (age 1)
    assert samples(port, "pdpair_signal_wait_oldest_seconds") == {(RANK0, role): 1.0}
    accounts.close_wait("a1", "ok", nbytes=10, seconds=0.5)
    accounts.close_wait("a2", "error", nbytes=0, seconds=1.0)
    accounts.close_wait("b1", "ok", nbytes=5, seconds=0.25)
    assert samples(port, "pdpair_signal_deficit") == {(("peer", "peer-a"), RANK0, role): 0.0, (("peer", "peer-b"), RANK0, role): 0.0}
    assert samples(port, "pdpair_signal_wait_oldest_seconds") == {(RANK0, role): 0.0}
    transfers = samples(port, "pdpair_kv_transfers_total")
    assert transfers[(("outcome", "ok"), RANK0, role)] == 2.0
    assert transfers[(("outcome", "error"), RANK0, role)] == 1.0
    assert transfers[(("outcome", "timeout"), RANK0, role)] == 0.0
    assert samples(port, "pdpair_kv_transfer_bytes_total") == {(RANK0, role): 15.0}
    assert samples(port, "pdpair_kv_transfer_seconds_count") == {(RANK0, role): 3.0}
    assert samples(port, "pdpair_kv_transfer_seconds_sum") == {(RANK0, role): 1.75}
    assert accounts.open_transfers() == 0


def test_timeouts_are_counted_once_whether_seen_by_a_scrape_or_by_close(served, clock):
    accounts, port = served
    timeouts = (RANK0, ("role", "decode"))
    accounts.open_wait("late", "peer-a", 2, deadline=clock.now + 5)
    clock.now += 4
    assert samples(port, "pdpair_signal_wait_timeouts_total") == {timeouts: 0.0}
    clock.now += 2  # past the deadline, still open: a scrape counts it
    assert samples(port, "pdpair_signal_wait_timeouts_total") == {timeouts: 1.0}
    assert samples(port, "pdpair_signal_wait_timeouts_total") == {timeouts: 1.0}
    accounts.close_wait("late", "timeout", nbytes=0, seconds=6)  # already counted
    assert samples(port, "pdpair_signal_wait_timeouts_total") == {timeouts: 1.0}

    accounts.open_wait("late2", "peer-a", 2, deadline=clock.now + 5)
    accounts.close_wait("late2", "timeout", nbytes=0, seconds=5)  # the connector saw it first
    assert samples(port, "pdpair_signal_wait_timeouts_total") == {timeouts: 2.0}
    assert samples(port, "pdpair_kv_transfers_total")[(("outcome", "timeout"), RANK0, ("role", "decode"))] == 2.0


def test_healthz_names_the_stuck_transfer_only_past_the_hang_timeout(served, clock):
    accounts, port = served
    assert healthz(port) == (200, {"status": "ok", "deficit": 0, "oldest_wait_seconds": 0.0, "hang_timeout_seconds": 10.0})
    accounts.open_wait("stuck-1", "10.1.2.3:20001", 12, deadline=clock.now + 10)
    accounts.on_signals("stuck-1", 9)
    clock.now += 10  # equal to the timeout: not hung yet (contract: strictly greater)
    code, body = healthz(port)
    assert code == 200 and body["status"] == "ok" and body["deficit"] == 3
    clock.now += 0.5
    code, body = healthz(port)
    assert code == 503
    assert body["status"] == "hung"
    assert body["transfer"] == {"id": "stuck-1", "peer": "10.1.2.3:20001", "expected": 12, "received": 9, "age_seconds": 10.5}
    accounts.on_signals("stuck-1", 12)  # the missing signals arrive: healthy again
    code, body = healthz(port)
    assert code == 200 and body["deficit"] == 0
    assert "transfer" not in body


def test_requeues_follow_the_transports_cumulative_count_and_survive_a_reset(served):
    accounts, port = served
    key = (("peer", "p"), RANK0)
    accounts.set_transport_counters("p", inflight=3, slots=256, requeues=5)
    accounts.set_transport_counters("p", inflight=0, slots=256, requeues=9)
    assert samples(port, "pdpair_transport_requeues_total") == {key: 9.0}
    accounts.set_transport_counters("p", inflight=1, slots=128, requeues=2)  # transport recreated
    assert samples(port, "pdpair_transport_requeues_total") == {key: 11.0}
    assert samples(port, "pdpair_transport_inflight") == {key: 1.0}
    assert samples(port, "pdpair_transport_slots") == {key: 128.0}


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda a: a.open_wait("", "p", 1, 1.0), "transfer_id"),
        (lambda a: a.open_wait("t", "p q", 1, 1.0), "peer"),
        (lambda a: a.open_wait("t", "p", -1, 1.0), "expected_signals"),
        (lambda a: a.open_wait("t", "p", True, 1.0), "expected_signals"),
        (lambda a: a.open_wait("t", "p", 1, float("nan")), "deadline"),
        (lambda a: a.on_signals("nope", 1), "no open wait"),
        (lambda a: a.close_wait("nope", "ok", 0, 0.0), "no open wait"),
        (lambda a: a.close_wait("open", "maybe", 0, 0.0), "outcome"),
        (lambda a: a.close_wait("open", "ok", -1, 0.0), "nbytes"),
        (lambda a: a.close_wait("open", "ok", 0, -0.1), "seconds"),
        (lambda a: a.on_signals("open", 3), "only 2 expected"),
        (lambda a: a.open_wait("open", "p", 1, 1.0), "already has an open wait"),
        (lambda a: a.on_handshake("Bad Outcome"), "handshake outcome"),
        (lambda a: a.set_listener_ready(0, 1), "ready must be a bool"),
        (lambda a: a.set_transport_counters("p", -1, 1, 1), "inflight"),
        (lambda a: a.set_pair_generation(-2), "generation"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(call, message):
    accounts = SignalAccounts("prefill", 1.0)
    accounts.open_wait("open", "p", 2, 1e9)
    with pytest.raises(ValueError, match=message):
        call(accounts)


def test_any_request_id_is_a_valid_transfer_id(served):
    accounts, port = served
    accounts.open_wait("chat cmpl/ünïcode id#1", "peer-a", 1, deadline=1e9)
    accounts.on_signals("chat cmpl/ünïcode id#1", 1)
    accounts.close_wait("chat cmpl/ünïcode id#1", "ok", nbytes=1, seconds=0.0)
    assert samples(port, "pdpair_kv_transfers_total")[(("outcome", "ok"), RANK0, ("role", "decode"))] == 1.0


def test_received_total_may_not_go_down():
    accounts = SignalAccounts("decode", 1.0)
    accounts.open_wait("t", "p", 4, 1e9)
    accounts.on_signals("t", 3)
    with pytest.raises(ValueError, match="went down"):
        accounts.on_signals("t", 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"role": "router", "hang_timeout_seconds": 1}, "role"),
        ({"role": "decode", "hang_timeout_seconds": 0}, "hang_timeout_seconds"),
        ({"role": "decode", "hang_timeout_seconds": float("inf")}, "hang_timeout_seconds"),
    ],
)
def test_bad_construction_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SignalAccounts(**kwargs)


def test_serve_refuses_a_second_hang_timeout_and_bad_ports():
    accounts = SignalAccounts("decode", 5.0)
    with pytest.raises(ValueError, match="differs"):
        serve(0, accounts, hang_timeout_seconds=6.0)
    with pytest.raises(ValueError, match="port"):
        serve(70000, accounts)


def test_accounts_from_env():
    env = {
        contract.ENV_ROLE: "prefill",
        contract.ENV_HANG_TIMEOUT_SECONDS: "30",
        contract.ENV_GENERATION: "4",
    }
    accounts = accounts_from_env(env, registry=CollectorRegistry())
    assert (accounts.role, accounts.hang_timeout_seconds) == ("prefill", 30.0)
    assert accounts.registry.get_sample_value("pdpair_pair_generation") == 4.0
    with pytest.raises(ValueError, match=contract.ENV_HANG_TIMEOUT_SECONDS):
        accounts_from_env({contract.ENV_ROLE: "decode"})
    with pytest.raises(ValueError, match="must be a number"):
        accounts_from_env({contract.ENV_ROLE: "decode", contract.ENV_HANG_TIMEOUT_SECONDS: "soon"})


def test_serve_and_stop_three_times_on_the_same_port_frees_it():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for generation in range(3):
        accounts = SignalAccounts("decode", 1.0, generation=generation)
        server = serve(port, accounts, addr="127.0.0.1")
        assert server.port == port
        assert samples(port, "pdpair_pair_generation") == {(): float(generation)}
        server.stop()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
    assert not [t for t in threading.enumerate() if t.name == f"pdpair-metrics-{port}"]


def test_concurrent_worker_threads_keep_exact_accounts(served):
    accounts, port = served
    per_thread, threads = 200, 8

    def worker(n: int) -> None:
        for i in range(per_thread):
            tid = f"w{n}-{i}"
            accounts.open_wait(tid, f"peer-{n % 2}", 3, deadline=1e12)
            accounts.on_signals(tid, 1)
            accounts.on_signals(tid, 3)
            accounts.close_wait(tid, "ok", nbytes=2, seconds=0.001)

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    scraper_errors: list[BaseException] = []

    def scraper() -> None:
        try:
            for _ in range(20):
                scrape(port)
        except BaseException as exc:  # noqa: BLE001 - reported below
            scraper_errors.append(exc)

    pool.append(threading.Thread(target=scraper))
    for t in pool:
        t.start()
    for t in pool:
        t.join(60)
    assert not scraper_errors
    total = per_thread * threads
    expected = samples(port, "pdpair_signals_expected_total")
    received = samples(port, "pdpair_signals_received_total")
    assert sum(expected.values()) == sum(received.values()) == 3 * total
    assert samples(port, "pdpair_kv_transfers_total")[(("outcome", "ok"), RANK0, ("role", "decode"))] == total
    assert set(samples(port, "pdpair_signal_deficit").values()) == {0.0}
    assert accounts.open_transfers() == 0


def test_two_engines_in_one_process_do_not_collide():
    first, second = SignalAccounts("prefill", 1.0), SignalAccounts("decode", 1.0)
    first.on_handshake("ok")
    assert first.registry.get_sample_value("pdpair_handshakes_total", {"role": "prefill", "rank": "0", "outcome": "ok"}) == 1.0
    assert second.registry.get_sample_value("pdpair_handshakes_total", {"role": "decode", "rank": "0", "outcome": "ok"}) == 0.0


def test_metrics_demo_process_goes_hung_after_the_timeout_and_stops_on_sigterm():
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.metrics_demo", "--hang-timeout", "1", "--deficit", "3",
         "--expected", "8", "--generation", "5", "--ok-every", "0.1"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        started = time.monotonic()
        line = proc.stdout.readline()
        assert line, f"metrics_demo printed nothing (exit {proc.poll()})"
        port = json.loads(line)["port"]
        code, body = healthz(port)
        assert code == 200 and body["deficit"] == 3, body
        assert samples(port, "pdpair_pair_generation") == {(): 5.0}
        while time.monotonic() - started < 10:
            code, body = healthz(port)
            if code == 503:
                break
            time.sleep(0.1)
        assert code == 503, body
        assert body["transfer"]["id"] == "demo-stuck" and body["transfer"]["received"] == 5
        assert samples(port, "pdpair_kv_transfers_total")[(("outcome", "ok"), RANK0, ("role", "decode"))] >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_metrics_demo_native_source_drops_signals_through_the_real_transport():
    """The deficit comes from pdpair.native's test-only signal drop, seen through a real signal wait."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.metrics_demo", "--source", "native", "--hang-timeout", "0.5",
         "--deficit", "3", "--expected", "8", "--ok-every", "0.1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line, f"metrics_demo printed nothing (exit {proc.poll()})"
        assert json.loads(line)["source"] == "native"
        port = json.loads(line)["port"]
        deadline = time.monotonic() + 10
        code, body = healthz(port)
        while code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
            code, body = healthz(port)
        assert code == 503, body
        peer = body["transfer"]["peer"]
        assert (body["transfer"]["expected"], body["transfer"]["received"]) == (8, 5)
        # The deficit sums every open wait of the peer: a complete transfer (4 signals, one every 0.1 s) that is in
        # flight at the scrape adds its own outstanding 0..4. The stuck one's 3 must show alone between them.
        key = (("peer", peer), RANK0, ("role", "decode"))
        seen = [samples(port, "pdpair_signal_deficit")]
        while seen[-1] != {key: 3.0} and time.monotonic() < deadline + 10:
            time.sleep(0.05)
            seen.append(samples(port, "pdpair_signal_deficit"))
        assert seen[-1] == {key: 3.0}, seen
        assert all(s.keys() == {key} and 3.0 <= s[key] <= 7.0 for s in seen), seen
        assert samples(port, "pdpair_signal_wait_timeouts_total") == {(RANK0, ("role", "decode")): 1.0}
        # complete transfers still flow on the same connection while the stuck one stays open
        ok = samples(port, "pdpair_kv_transfers_total")[(("outcome", "ok"), RANK0, ("role", "decode"))]
        time.sleep(0.5)
        assert samples(port, "pdpair_kv_transfers_total")[(("outcome", "ok"), RANK0, ("role", "decode"))] > ok
        assert samples(port, "pdpair_transport_slots") == {(("peer", peer), RANK0): 256.0}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_zero_serves_every_tp_ranks_series_and_verdict(clock):
    """TP = 2: each rank has its own accounts (in vLLM, its own worker process); rank 0 serves the pod's port and
    merges rank 1's series (labelled rank="1") and verdict, read over rank 1's local socket at each request."""
    metrics_port = free_tcp_port()
    rank0 = SignalAccounts("decode", 10.0, generation=3, rank=0, clock=clock)
    rank1 = SignalAccounts("decode", 10.0, generation=3, rank=1, clock=clock)
    exporter = export_rank(metrics_port, rank1, RANK_KEY)
    server = serve(0, rank0, addr="127.0.0.1", ranks=PeerRanks(metrics_port, (1,), RANK_KEY))
    try:
        rank0.open_wait("r0", "prefill-r0", 4, deadline=clock.now + 10)
        rank0.on_signals("r0", 4)
        rank0.close_wait("r0", "ok", nbytes=64, seconds=0.01)
        rank1.open_wait("r1", "prefill-r1", 4, deadline=clock.now + 10)
        rank1.on_signals("r1", 1)
        rank1.set_listener_ready(1, True)
        port = server.port
        assert samples(port, "pdpair_signal_deficit") == {
            (("peer", "prefill-r0"), RANK0, ("role", "decode")): 0.0,
            (("peer", "prefill-r1"), ("rank", "1"), ("role", "decode")): 3.0,
        }
        assert samples(port, "pdpair_listener_ready") == {(RANK0, ("role", "decode")): 0.0,
                                                          (("rank", "1"), ("role", "decode")): 1.0}
        transfers = samples(port, "pdpair_kv_transfers_total")
        assert transfers[(("outcome", "ok"), RANK0, ("role", "decode"))] == 1.0
        assert transfers[(("outcome", "ok"), ("rank", "1"), ("role", "decode"))] == 0.0
        assert samples(port, "pdpair_pair_generation") == {(): 3.0}  # pod-level series once, from rank 0
        assert healthz(port)[0] == 200

        clock.now += 10.5  # rank 1's wait passes the hang timeout; rank 0 has nothing open
        code, body = healthz(port)
        assert code == 503 and body["status"] == "hung", body
        assert body["transfer"]["rank"] == 1 and body["transfer"]["id"] == "r1", body
        assert body["ranks"]["0"]["status"] == "ok" and body["ranks"]["1"]["status"] == "hung", body
        assert samples(port, "pdpair_signal_wait_timeouts_total")[(("rank", "1"), ("role", "decode"))] == 1.0

        rank1.close_wait("r1", "timeout", nbytes=0, seconds=10.5)
        assert healthz(port)[0] == 200
        exporter.stop()  # rank 1's worker is gone: the pod cannot vouch for it
        code, body = healthz(port)
        assert code == 503 and body["status"] == "rank_unreachable" and "1" in body["unreachable_ranks"], body
        assert not any(labels for labels in samples(port, "pdpair_listener_ready") if ("rank", "1") in labels)
    finally:
        server.stop()
        exporter.stop()


def test_prefill_exports_its_pairing_per_decode_from_the_start():
    """pdpair_peer_paired{peer} is 0 for a decode of prefill's peer set from the moment its edge exists (the edge's
    side channel calls set_paired(False, peer) when it is made, before any attempt), so a rule or a dashboard sees
    "not paired" rather than "absent"; 1 while paired; its series goes when the decode leaves the set. Prefill's
    /readyz reads `paired`: at least one decode paired. Cost: milliseconds."""
    accounts = SignalAccounts("prefill", 10.0)
    server = serve(0, accounts, addr="127.0.0.1")
    other = "[fd00::9]:20010"
    try:
        assert samples(server.port, "pdpair_peer_paired") == {}
        accounts.set_paired(False, PEER)
        accounts.set_paired(False, other)
        assert samples(server.port, "pdpair_peer_paired") == {
            (("peer", PEER), ("rank", "0"), ("role", "prefill")): 0.0,
            (("peer", other), ("rank", "0"), ("role", "prefill")): 0.0,
        }
        assert not accounts.paired
        accounts.set_paired(True, PEER)
        assert accounts.paired and accounts.paired_peers() == {PEER: True, other: False}
        accounts.forget_peer(PEER)
        assert samples(server.port, "pdpair_peer_paired") == {(("peer", other), ("rank", "0"), ("role", "prefill")): 0.0}
        assert not accounts.paired
    finally:
        server.stop()
