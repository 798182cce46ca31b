"""An engine pod's readiness, /readyz on the connector's metrics server (the operator's default readinessProbe,
pods.py): prefill 503 until every TP rank is paired with decode; then the engine's own /health, then its warm-up
completion (warmup.py) decide. Real HTTP servers on
loopback (the metrics server, a stand-in for vLLM's /health) and a real rank exporter; about a second."""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from pdpair import contract
from pdpair.connector.rank_channel import PeerRanks, export_rank, rank_channel_key
from pdpair.connector.pod_server import readiness, serve, warm_when_serving
from pdpair.connector.signals import SignalAccounts
from pdpair.connector.warmup import WARMUP_PROMPT, Warmup
from devcluster.ports import free_port

PEER = "10.0.0.7:20000"  # the decode of prefill's peer set (host:portBase), the `peer` label of its pairing
RANK_KEY = rank_channel_key("unit-test-side-channel-key-0123456789")  # the TP ranks' channel key


class Engine:
    """vLLM's HTTP stand-in: /health answers `status` (200 or 503); /v1/models names one model; /v1/completions
    answers `completion_status` after `completion_delay` seconds and records each body (the warm-up's)."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.completion_status = 200
        self.completion_delay = 0.0
        self.completions: list[dict] = []
        self.release = threading.Event()
        self.release.set()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - stdlib name
                if self.path == "/v1/models":
                    body = json.dumps({"data": [{"id": "tiny"}]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(outer.status if self.path == "/health" else 404)
                self.end_headers()

            def do_POST(self):  # noqa: N802 - stdlib name
                outer.completions.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                outer.release.wait(30)
                self.send_response(outer.completion_status if self.path == "/v1/completions" else 404)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.url = f"{self.base}/health"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engine():
    e = Engine()
    yield e
    e.close()


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_not_ready_until_paired_then_the_engine_decides(engine):
    accounts = SignalAccounts("prefill", 30.0)
    ready, body = readiness(accounts, engine_health_url=engine.url)
    assert not ready and body["status"].startswith("waiting for decode") and body["paired"] == {"0": False}
    accounts.set_paired(True, PEER)
    assert readiness(accounts, engine_health_url=engine.url) == (True, {"paired": {"0": True}, "status": "ok"})
    engine.status = 503  # paired, but the engine does not serve (yet, or any more)
    ready, body = readiness(accounts, engine_health_url=engine.url)
    assert not ready and "503" in body["status"]
    accounts.set_paired(False, PEER)  # decode went away: not ready again until it pairs anew
    assert readiness(accounts, engine_health_url=engine.url)[0] is False


def test_an_engine_that_does_not_answer_is_not_ready():
    accounts = SignalAccounts("prefill", 30.0)
    accounts.set_paired(True, PEER)
    ready, body = readiness(accounts, engine_health_url=f"http://127.0.0.1:{free_port()}/health")
    assert not ready and "refused" in body["status"].lower()


def test_decode_is_ready_when_its_engine_serves(engine):
    accounts = SignalAccounts("decode", 30.0)
    assert readiness(accounts, engine_health_url=engine.url) == (True, {"status": "ok"})
    with pytest.raises(ValueError, match="only prefill pairs"):
        accounts.set_paired(True, PEER)


def test_served_over_http_with_every_tp_rank(engine):
    """TP = 2: rank 0 serves the pod's metrics port and reads rank 1 through its exporter; ready only when both
    ranks are paired."""
    port = free_port()
    rank0 = SignalAccounts("prefill", 30.0, rank=0)
    rank1 = SignalAccounts("prefill", 30.0, rank=1)
    exporter = export_rank(port, rank1, RANK_KEY)
    server = serve(port, rank0, ranks=PeerRanks(port, (1,), RANK_KEY), engine_health_url=engine.url)
    url = f"http://127.0.0.1:{server.port}{contract.READYZ_PATH}"
    try:
        rank0.set_paired(True, PEER)
        status, body = get(url)
        assert status == 503 and body["paired"] == {"0": True, "1": False} and "rank 1 not paired" in body["status"]
        rank1.set_paired(True, PEER)
        assert get(url) == (200, {"paired": {"0": True, "1": True}, "status": "ok"})
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
        assert 'pdpair_peer_paired{peer="10.0.0.7:20000",rank="1",role="prefill"} 1.0' in metrics
    finally:
        server.stop()
        exporter.stop()
    exporter = None
    status, body = get_unreachable(port, engine)
    assert status == 503 and body["status"] == "rank_unreachable"


def get_unreachable(port: int, engine: Engine) -> tuple[int, dict]:
    """A rank whose exporter is gone: the pod is not ready (its readiness cannot be known)."""
    rank0 = SignalAccounts("prefill", 30.0, rank=0)
    rank0.set_paired(True, PEER)
    server = serve(port, rank0, ranks=PeerRanks(port, (1,), RANK_KEY, timeout=0.2), engine_health_url=engine.url)
    try:
        return get(f"http://127.0.0.1:{server.port}{contract.READYZ_PATH}")
    finally:
        server.stop()


def _until(predicate, seconds=10.0):
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_ready_only_once_the_warm_up_completion_is_answered(engine, role):
    """The first /readyz after the engine serves starts one completion (max_tokens 1, the served model's name);
    not ready while it runs, ready once it is answered; never a second one."""
    accounts = SignalAccounts(role, 30.0)
    if role == "prefill":
        accounts.set_paired(True, PEER)
    warmup = Warmup(engine.base)
    engine.release.clear()  # the engine holds the completion (a compile in progress)
    ready, body = readiness(accounts, engine_health_url=engine.url, warmup=warmup)
    assert not ready and body["status"].startswith("warming up"), body
    _until(lambda: engine.completions)
    assert readiness(accounts, engine_health_url=engine.url, warmup=warmup)[0] is False
    engine.release.set()
    ready, body = _until(lambda: (lambda r: r if r[0] else None)(readiness(accounts, engine_health_url=engine.url,
                                                                             warmup=warmup)))
    assert body["status"] == "ok" and body["warmup"].startswith("ok"), body
    assert engine.completions == [{"model": "tiny", "prompt": WARMUP_PROMPT, "max_tokens": 1, "temperature": 0}]


def test_prefill_warms_up_while_it_waits_for_decode(engine):
    """Prefill's engine often serves long before decode listens (both start at once): its warm-up runs then, so
    the pairing, when it comes, is the last thing its readiness waits for. Not ready while unpaired, warm or not."""
    accounts = SignalAccounts("prefill", 30.0)
    warmup = Warmup(engine.base)
    ready, body = readiness(accounts, engine_health_url=engine.url, warmup=warmup)
    assert not ready and body["status"].startswith("waiting for decode"), body
    _until(lambda: engine.completions)  # started although nothing is paired
    _until(lambda: warmup.state()[0])
    ready, body = readiness(accounts, engine_health_url=engine.url, warmup=warmup)
    assert not ready and body["warmup"].startswith("ok"), body
    accounts.set_paired(True, PEER)
    ready, body = readiness(accounts, engine_health_url=engine.url, warmup=warmup)
    assert ready and body["status"] == "ok", body
    assert len(engine.completions) == 1


def test_the_warm_up_starts_when_the_engine_serves_without_waiting_for_a_probe(engine):
    """The metrics server watches its engine's /health and starts the warm-up the moment it serves, so the
    kubelet's first /readyz after that finds it done instead of starting it (a probe period on the pair's path to
    Ready). Nothing before the engine serves; one completion only, however many /readyz come. Cost: about 1 s."""
    import time

    engine.status = 503  # still loading
    warmup = Warmup(engine.base)
    alive = threading.Event()
    alive.set()
    watcher = warm_when_serving(warmup, engine.url, alive.is_set, interval=0.05)
    time.sleep(0.3)
    assert not engine.completions and warmup._thread is None
    engine.status = 200  # serves now: no /readyz call at all
    _until(lambda: engine.completions)
    _until(lambda: warmup.state()[0])
    watcher.join(5)
    assert not watcher.is_alive()
    accounts = SignalAccounts("decode", 30.0)
    ready, body = readiness(accounts, engine_health_url=engine.url, warmup=warmup)
    assert ready and body["warmup"].startswith("ok"), body
    assert len(engine.completions) == 1


def test_the_warm_up_watch_ends_with_the_server(engine):
    engine.status = 503
    alive = threading.Event()
    alive.set()
    watcher = warm_when_serving(Warmup(engine.base), engine.url, alive.is_set, interval=0.05)
    alive.clear()  # the metrics server stopped before the engine ever served
    watcher.join(5)
    assert not watcher.is_alive() and not engine.completions


def test_no_warm_up_before_the_engine_serves(engine):
    engine.status = 503
    warmup = Warmup(engine.base)
    assert readiness(SignalAccounts("decode", 30.0), engine_health_url=engine.url, warmup=warmup)[0] is False
    assert readiness(SignalAccounts("prefill", 30.0), engine_health_url=engine.url, warmup=warmup)[0] is False
    assert not engine.completions and warmup._thread is None


@pytest.mark.parametrize("failure", ["error", "timeout"])
def test_a_failed_warm_up_is_reported_and_does_not_hold_readiness(engine, failure):
    """A warm-up is an optimisation: an error status, or no answer within its deadline, ends it with the reason in
    /readyz's body, and the pod is ready (its /health said it serves)."""
    if failure == "error":
        engine.completion_status = 500
    else:
        engine.release.clear()
    warmup = Warmup(engine.base, timeout_seconds=1.0)
    accounts = SignalAccounts("decode", 30.0)
    ready, body = _until(lambda: (lambda r: r if r[0] else None)(readiness(accounts, engine_health_url=engine.url,
                                                                             warmup=warmup)))
    assert body["warmup"].startswith("failed"), body
    assert ("500" in body["warmup"]) if failure == "error" else ("timed out" in body["warmup"].lower()), body
    engine.release.set()


def test_held_probes_answer_when_the_pod_passes_and_a_bad_wait_is_refused(engine):
    """The operator's probes ask `?wait=1` (pod_defaults.PROBE_WAIT_SECONDS): /readyz and /startupz are held while they fail
    and answer 200 on the first re-check that passes (every PROBE_WAIT_POLL_SECONDS), not when the hold is over;
    one that keeps failing answers 503 after the hold. /startupz is the engine's /health alone (no pairing, no
    warm-up). Real metrics server and engine stand-in; about 1.5 s; bounds: the 3 s hold, never a re-check's timing."""
    accounts = SignalAccounts("prefill", 30.0)
    server = serve(0, accounts, engine_health_url=engine.url)
    base = f"http://127.0.0.1:{server.port}"
    try:
        engine.status = 503
        assert get(f"{base}{contract.STARTUPZ_PATH}")[0] == 503
        answers: list = []
        began = time.monotonic()
        waiter = threading.Thread(target=lambda: answers.append(get(f"{base}{contract.READYZ_PATH}?wait=3")))
        waiter.start()
        time.sleep(0.5)
        assert answers == []  # held, not answered 503 at once
        engine.status = 200
        assert get(f"{base}{contract.STARTUPZ_PATH}?wait=1") == (200, {"status": "serving"})  # serving, unpaired
        accounts.set_paired(True, PEER)
        waiter.join(10)
        assert answers == [(200, {"paired": {"0": True}, "status": "ok"})]
        assert time.monotonic() - began < 3.0  # answered on a re-check, not when the hold ran out

        accounts.set_paired(False, PEER)
        began = time.monotonic()
        status, body = get(f"{base}{contract.READYZ_PATH}?wait=0.5")
        assert status == 503 and body["status"].startswith("waiting for decode")
        assert time.monotonic() - began >= 0.5
        for bad in ("abc", "-1", "nan", "inf"):
            status, body = get(f"{base}{contract.READYZ_PATH}?wait={bad}")
            assert status == 400 and "wait must be a number" in body["error"], bad
    finally:
        server.stop()
