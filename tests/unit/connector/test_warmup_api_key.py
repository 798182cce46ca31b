"""The connector's warm-up with the pair's API key (VLLM_API_KEY, spec.apiKeySecret): vLLM refuses a /v1 request
without `Authorization: Bearer <key>`, so the warm-up's two requests to its own engine carry it. A real HTTP stand-in
for vLLM on loopback that applies vLLM's rule (sha256 digests compared in constant time, /v1 guarded, /health open);
about 0.1 s in all."""

from __future__ import annotations

import hashlib
import http.server
import json
import secrets
import threading
import time

import pytest

from pdpair import contract
from pdpair.connector.config import PdPairConfig
from pdpair.connector.warmup import WARMUP_PROMPT, Warmup

KEY = "sk-pair-0123456789abcdef"
SIDE_CHANNEL_KEY = "unit-test-side-channel-key-0123456789abcdef"
DECODE_ENV = {contract.ENV_TRANSPORT: contract.TRANSPORT_TCP, contract.ENV_SIDE_CHANNEL_KEY: SIDE_CHANNEL_KEY,
              contract.ENV_LISTEN_PORT_BASE: "20000", contract.ENV_HTTP_PORT: "8000"}


class GuardedEngine:
    """vLLM's HTTP side as far as the warm-up sees it, with an API key: a request under /v1 without `Bearer <key>` is
    401 `{"error": "Unauthorized"}` (vllm AuthenticationMiddleware's answer); /v1/models names one model,
    /v1/completions answers {}; every request's path and Authorization header is recorded."""

    def __init__(self, key: str) -> None:
        self.digest = hashlib.sha256(key.encode()).digest()
        self.seen: list[tuple[str, str | None]] = []
        self.completions: list[dict] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _authorized(self) -> bool:
                outer.seen.append((self.path, self.headers.get("Authorization")))
                scheme, _, given = (self.headers.get("Authorization") or "").partition(" ")
                ok = scheme.lower() == "bearer" and secrets.compare_digest(
                    hashlib.sha256(given.encode()).digest(), outer.digest)
                if not ok and self.path.startswith("/v1"):
                    self._answer(401, {"error": "Unauthorized"})
                return ok or not self.path.startswith("/v1")

            def _answer(self, status: int, doc: dict) -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802 - stdlib name
                if self._authorized():
                    self._answer(200, {"data": [{"id": "tiny"}]} if self.path == "/v1/models" else {})

            def do_POST(self):  # noqa: N802 - stdlib name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self._authorized():
                    outer.completions.append(body)
                    self._answer(200, {})

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engine():
    e = GuardedEngine(KEY)
    yield e
    e.close()


def finished(warmup: Warmup, seconds: float = 10.0) -> str:
    deadline = time.monotonic() + seconds
    done, what = warmup.state()
    while not done and time.monotonic() < deadline:
        time.sleep(0.02)
        done, what = warmup.state()
    assert done, what
    return what


def test_the_warm_up_sends_the_key_from_the_environment(engine):
    """VLLM_API_KEY in the pod's environment reaches PdPairConfig.api_key (kept out of its repr), and a Warmup given
    it sends `Authorization: Bearer <key>` with both of its requests, /v1/models and /v1/completions: the engine
    serves them and the warm-up ends ok. Cost: ~0.05 s."""
    config = PdPairConfig.from_env("kv_consumer", {}, {**DECODE_ENV, contract.ENV_API_KEY: KEY})
    assert config.api_key == KEY and KEY not in repr(config)
    warmup = Warmup(engine.base, api_key=config.api_key)
    assert finished(warmup).startswith("ok")
    assert engine.seen == [("/v1/models", f"Bearer {KEY}"), ("/v1/completions", f"Bearer {KEY}")]
    assert engine.completions == [{"model": "tiny", "prompt": WARMUP_PROMPT, "max_tokens": 1, "temperature": 0}]


def test_without_the_key_the_warm_up_is_refused_and_says_so(engine):
    """What the header prevents: a warm-up without the key meets vLLM's 401 and ends "failed" naming it (the pod is
    Ready all the same, so this failure would be silent but for the log and /readyz's body); an unset or empty
    VLLM_API_KEY is no key and sends no header. Cost: ~0.05 s."""
    for env in (DECODE_ENV, {**DECODE_ENV, contract.ENV_API_KEY: ""}):
        assert PdPairConfig.from_env("kv_consumer", {}, env).api_key is None
    warmup = Warmup(engine.base, api_key=None)
    outcome = finished(warmup)
    assert outcome.startswith("failed") and "401" in outcome, outcome
    assert engine.seen == [("/v1/models", None)] and engine.completions == []
