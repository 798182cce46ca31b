"""pdpair.operator.decide.health against real local HTTP servers serving the real pod exporter's output."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdpair import contract
from pdpair.operator.decide.health import (
    REASON_CONTAINER_RESTART,
    REASON_HUNG,
    REASON_POD_FAILED,
    REASON_POD_VANISHED,
    REASON_STALE_GENERATION,
    REASON_UNREACHABLE,
    PodState,
    ScrapeTarget,
    UNREACHABLE_THRESHOLD,
    pair_verdict,
)
from pdpair.operator.act.scrape import parse_pod_metrics, scrape_pods


@pytest.fixture
def pods(exporter_pods):
    """Start exporter pods on free ports; all are stopped at the end."""
    return exporter_pods


@pytest.fixture
def silent_port():
    """A port that accepts TCP connections (kernel backlog) but never answers: a stuck pod."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


class _FixedHandler(BaseHTTPRequestHandler):
    status = 200
    body = b""

    def do_GET(self):  # noqa: N802 - stdlib name
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fixed_server():
    servers = []

    def start(status: int, body: bytes) -> int:
        handler = type("H", (_FixedHandler,), {"status": status, "body": body})
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return httpd.server_address[1]

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def run(coro):
    return asyncio.run(coro)


def test_healthy_pod(pods):
    accounts, target = pods(generation=4)
    accounts.open_wait("t", "peer", 2, time.monotonic() + 30)
    accounts.on_signals("t", 1)  # a deficit but young: not hung
    (s,) = run(scrape_pods([target], expected_generation=4, hang_timeout_seconds=30))
    assert s.state is PodState.HEALTHY, s.message
    assert s.metrics.deficit == 1 and s.metrics.generation == 4 and s.metrics.hang_timeout_seconds == 30


def test_hung_pod_names_the_stuck_transfer(pods):
    accounts, target = pods(hang_timeout=0.2)
    accounts.open_wait("req-77", "10.0.0.9:20001", 6, time.monotonic() + 0.2)
    accounts.on_signals("req-77", 4)
    time.sleep(0.35)
    # hang_timeout_seconds=None: the pod's exported pdpair_hang_timeout_seconds decides
    (s,) = run(scrape_pods([target], expected_generation=1))
    assert s.state is PodState.HUNG, s.message
    assert s.details["transfer"]["id"] == "req-77"
    assert (s.details["transfer"]["expected"], s.details["transfer"]["received"]) == (6, 4)
    assert s.details["deficit_by_peer"] == {"10.0.0.9:20001": 2.0}
    assert "req-77" in s.message and "4/6" in s.message
    # the same pod under the pair's longer timeout is not hung
    (s,) = run(scrape_pods([target], expected_generation=1, hang_timeout_seconds=60))
    assert s.state is PodState.HEALTHY


def test_stale_generation(pods):
    _, target = pods(generation=2)
    (s,) = run(scrape_pods([target], expected_generation=3))
    assert s.state is PodState.STALE_GENERATION
    assert "generation 2" in s.message and "at 3" in s.message


def test_unreachable_kinds(closed_port, silent_port, fixed_server):
    targets = [
        ScrapeTarget("decode", "refused", "127.0.0.1", closed_port),
        ScrapeTarget("decode", "silent", "127.0.0.1", silent_port),
        ScrapeTarget("decode", "http500", "127.0.0.1", fixed_server(500, b"boom")),
        ScrapeTarget("decode", "not-pdpair", "127.0.0.1", fixed_server(200, b"other_metric 1\n")),
        ScrapeTarget("decode", "garbage", "127.0.0.1", fixed_server(200, b"{not exposition")),
    ]
    scrapes = {s.target.pod: s for s in run(scrape_pods(targets, expected_generation=1, timeout=0.5))}
    assert all(s.state is PodState.UNREACHABLE for s in scrapes.values()), scrapes
    assert "within 0.5s" in scrapes["silent"].message
    assert "HTTP 500" in scrapes["http500"].message
    assert "missing pdpair_pair_generation" in scrapes["not-pdpair"].message


def test_one_silent_pod_delays_no_other_and_never_blocks_the_loop(pods, silent_port):
    """Two silent pods and four healthy ones in one pass, with a ticker measuring the event loop's lag meanwhile.

    Bounds are set against the per-pod timeout, with margins taken from the loop lag measured in the same run, so a
    loaded machine (which stalls every process now and then) does not fail it, while each way of getting it wrong
    still does:
    - serial scrapes: two silent pods take two whole timeouts; concurrent ones about one;
    - a pod waiting on another (a shared lock or a one-connection pool): healthy pods would be answered only when a
      silent one times out, i.e. not within their own timeout;
    - a blocking read of a silent pod: the loop would stall for a whole timeout.
    """
    timeout = 2.0
    tick = 0.01
    healthy = [pods(role=r)[1] for r in ("decode", "prefill", "decode", "prefill")]
    with socket.socket() as second:
        second.bind(("127.0.0.1", 0))
        second.listen(16)
        silent = [ScrapeTarget("decode", "silent-1", "127.0.0.1", silent_port),
                  ScrapeTarget("prefill", "silent-2", "127.0.0.1", second.getsockname()[1])]

        async def main():
            gaps, stop = [], asyncio.Event()

            async def ticker():
                last = asyncio.get_running_loop().time()
                while not stop.is_set():
                    await asyncio.sleep(tick)
                    now = asyncio.get_running_loop().time()
                    gaps.append(now - last)
                    last = now

            ticking = asyncio.create_task(ticker())
            await asyncio.sleep(5 * tick)  # the ticker runs before the pass starts
            started = time.monotonic()
            scrapes = await scrape_pods([*silent, *healthy], expected_generation=1, timeout=timeout)
            elapsed = time.monotonic() - started
            stop.set()
            await ticking
            return scrapes, elapsed, max(gaps)

        scrapes, elapsed, worst_gap = run(main())
    lag = max(0.0, worst_gap - tick)  # the longest the loop was late in this run (load, GC, or a blocking call)
    report = f"elapsed {elapsed:.2f}s, worst loop gap {worst_gap:.3f}s, scrapes {[round(s.seconds, 3) for s in scrapes]}"
    assert [s.state for s in scrapes[:2]] == [PodState.UNREACHABLE] * 2, report
    assert [s.state for s in scrapes[2:]] == [PodState.HEALTHY] * 4, report
    # Never blocked: a blocking read of a silent pod stalls the loop for a whole timeout.
    assert worst_gap < timeout / 2, report
    # Each healthy pod answered well inside its own timeout; only loop lag may stretch that.
    assert all(s.seconds < timeout / 2 + lag for s in scrapes[2:]), report
    # Concurrent: about one timeout (plus the loop's lateness when it fires), never two (serial).
    # (lag < timeout / 2 was asserted above, so this bound stays below the two timeouts a serial pass takes.)
    assert timeout * 0.95 <= elapsed < timeout + lag + timeout / 4, report


def test_no_hang_timeout_anywhere_is_a_clear_unreachable_verdict(fixed_server):
    body = b'pdpair_pair_generation 1\npdpair_signal_wait_oldest_seconds{role="decode"} 0\n'
    target = ScrapeTarget("decode", "old-pod", "127.0.0.1", fixed_server(200, body))
    (s,) = run(scrape_pods([target], expected_generation=1))
    assert s.state is PodState.UNREACHABLE and "no hang timeout" in s.message


def test_parse_refuses_a_non_integer_generation():
    with pytest.raises(ValueError, match="not an integer"):
        parse_pod_metrics("pdpair_pair_generation 1.5\npdpair_signal_wait_oldest_seconds{role=\"decode\"} 0\n")


def test_scrape_target_validation():
    with pytest.raises(ValueError, match="no host"):
        ScrapeTarget("decode", "p", "", 8000)
    with pytest.raises(ValueError, match="metrics port"):
        ScrapeTarget("decode", "p", "10.0.0.1", 0)
    assert ScrapeTarget("decode", "p", "fd00::1", 9).url() == "http://[fd00::1]:9/metrics"


# --- pair verdicts: real scrapes plus pod objects -------------------------------------------------
def pod(name, phase="Running", restarts=0, node="n1", deleting=False, scheduled=True):
    meta = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status = {
        "phase": phase,
        "containerStatuses": [
            {"name": "engine", "restartCount": restarts, "lastState": {"terminated": {"reason": "OOMKilled"}}}
        ],
        "conditions": [{"type": "PodScheduled", "status": "True" if scheduled else "False"}],
    }
    return {"metadata": meta, "spec": {"nodeName": node} if node else {}, "status": status}


@pytest.fixture
def healthy_pair(pods):
    d_acc, d = pods(role="decode", generation=5)
    p_acc, p = pods(role="prefill", generation=5)
    return (d_acc, d), (p_acc, p)


def _scrape(targets, generation=5):
    return run(scrape_pods(targets, expected_generation=generation))


@pytest.mark.parametrize(
    "decode_pod, prefill_pod, restart, reason, pending",
    [
        (pod("d"), pod("p"), False, None, False),
        (None, pod("p"), True, REASON_POD_VANISHED, False),
        (pod("d", deleting=True), pod("p"), True, REASON_POD_VANISHED, False),
        (pod("d", phase="Failed"), pod("p"), True, REASON_POD_FAILED, False),
        (pod("d", phase="Succeeded"), pod("p"), True, REASON_POD_FAILED, False),
        (pod("d"), pod("p", restarts=2), True, REASON_CONTAINER_RESTART, False),
        (pod("d", phase="Failed"), pod("p", restarts=1), True, REASON_POD_FAILED, False),
        (pod("d"), pod("p", phase="Pending", node=None, scheduled=False), False, None, True),
        (pod("d"), pod("p", phase="Pending", node="n2"), False, None, False),  # scheduled, starting
    ],
)
def test_pod_facts(healthy_pair, decode_pod, prefill_pod, restart, reason, pending):
    (_, d), (_, p) = healthy_pair
    verdict = pair_verdict(_scrape([d, p]), {"decode": decode_pod, "prefill": prefill_pod})
    assert (verdict.restart, verdict.reason, verdict.pending) == (restart, reason, pending), verdict.message
    if reason == REASON_CONTAINER_RESTART:
        assert "restarted 2x" in verdict.message and "OOMKilled" in verdict.message


def test_hung_and_stale_pods_make_the_pair_restart(pods):
    d_acc, d = pods(role="decode", generation=5, hang_timeout=0.2)
    _, p = pods(role="prefill", generation=4)
    objects = {"decode": pod("d"), "prefill": pod("p")}
    verdict = pair_verdict(_scrape([d, p]), objects)
    assert (verdict.restart, verdict.reason) == (True, REASON_STALE_GENERATION)
    d_acc.open_wait("x", "peer", 3, time.monotonic() + 0.2)
    time.sleep(0.3)
    verdict = pair_verdict(_scrape([d, p]), objects)
    assert (verdict.restart, verdict.reason, verdict.hung) == (True, REASON_HUNG, True)  # hung outranks stale
    # a pod Pending for scheduling blocks the restart verdict whatever the scrapes say
    objects["prefill"] = pod("p", phase="Pending", node=None, scheduled=False)
    verdict = pair_verdict(_scrape([d, p]), objects)
    assert (verdict.restart, verdict.pending) == (False, True)


def test_unreachable_needs_a_streak(healthy_pair, closed_port):
    (_, d), _ = healthy_pair
    gone = ScrapeTarget("prefill", "prefill-x", "127.0.0.1", closed_port)
    objects = {"decode": pod("d"), "prefill": pod("prefill-x")}
    scrapes = _scrape([d, gone])
    verdicts = [pair_verdict(scrapes, objects, {"prefill-x": streak}) for streak in range(1, UNREACHABLE_THRESHOLD + 1)]
    assert [v.restart for v in verdicts] == [False] * (UNREACHABLE_THRESHOLD - 1) + [True]
    assert verdicts[-1].reason == REASON_UNREACHABLE
    # without streaks one unreachable scrape is enough
    assert pair_verdict(scrapes, objects).reason == REASON_UNREACHABLE


def test_reasons_are_the_operator_metrics_labels():
    from pdpair.operator.decide.health import RESTART_REASONS
    from pdpair.operator.act.metrics import RESTART_REASONS as metric_reasons

    assert RESTART_REASONS is metric_reasons
    assert contract.OPERATOR_PAIR_RESTARTS.labels == ("namespace", "pair", "reason")
