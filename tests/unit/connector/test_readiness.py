"""Prefill's readiness, /readyz on the connector's metrics server (the operator's default readinessProbe for prefill,
pods.py): 503 until every TP rank is paired with decode, then the engine's own /health decides. Real HTTP servers on
loopback (the metrics server, a stand-in for vLLM's /health) and a real rank exporter; about a second."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.error
import urllib.request

import pytest

from pdpair import contract
from pdpair.connector.metrics import PeerRanks, export_rank, readiness, serve
from pdpair.connector.signals import SignalAccounts
from devcluster.ports import free_port


class Engine:
    """vLLM's /health stand-in: answers `status` (200 or 503)."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - stdlib name
                self.send_response(outer.status if self.path == "/health" else 404)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/health"
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
    accounts.set_paired(True)
    assert readiness(accounts, engine_health_url=engine.url) == (True, {"paired": {"0": True}, "status": "ok"})
    engine.status = 503  # paired, but the engine does not serve (yet, or any more)
    ready, body = readiness(accounts, engine_health_url=engine.url)
    assert not ready and "503" in body["status"]
    accounts.set_paired(False)  # decode went away: not ready again until it pairs anew
    assert readiness(accounts, engine_health_url=engine.url)[0] is False


def test_an_engine_that_does_not_answer_is_not_ready():
    accounts = SignalAccounts("prefill", 30.0)
    accounts.set_paired(True)
    ready, body = readiness(accounts, engine_health_url=f"http://127.0.0.1:{free_port()}/health")
    assert not ready and "refused" in body["status"].lower()


def test_decode_is_ready_when_its_engine_serves(engine):
    accounts = SignalAccounts("decode", 30.0)
    assert readiness(accounts, engine_health_url=engine.url) == (True, {"status": "ok"})
    with pytest.raises(ValueError, match="only prefill pairs"):
        accounts.set_paired(True)


def test_served_over_http_with_every_tp_rank(engine):
    """TP = 2: rank 0 serves the pod's metrics port and reads rank 1 through its exporter; ready only when both
    ranks are paired."""
    port = free_port()
    rank0 = SignalAccounts("prefill", 30.0, rank=0)
    rank1 = SignalAccounts("prefill", 30.0, rank=1)
    exporter = export_rank(port, rank1)
    server = serve(port, rank0, ranks=PeerRanks(port, (1,)), engine_health_url=engine.url)
    url = f"http://127.0.0.1:{server.port}{contract.READYZ_PATH}"
    try:
        rank0.set_paired(True)
        status, body = get(url)
        assert status == 503 and body["paired"] == {"0": True, "1": False} and "rank 1 not paired" in body["status"]
        rank1.set_paired(True)
        assert get(url) == (200, {"paired": {"0": True, "1": True}, "status": "ok"})
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
        assert 'pdpair_peer_paired{rank="1",role="prefill"} 1.0' in metrics
    finally:
        server.stop()
        exporter.stop()
    exporter = None
    status, body = get_unreachable(port, engine)
    assert status == 503 and body["status"] == "rank_unreachable"


def get_unreachable(port: int, engine: Engine) -> tuple[int, dict]:
    """A rank whose exporter is gone: the pod is not ready (its readiness cannot be known)."""
    rank0 = SignalAccounts("prefill", 30.0, rank=0)
    rank0.set_paired(True)
    server = serve(port, rank0, ranks=PeerRanks(port, (1,), timeout=0.2), engine_health_url=engine.url)
    try:
        return get(f"http://127.0.0.1:{server.port}{contract.READYZ_PATH}")
    finally:
        server.stop()
