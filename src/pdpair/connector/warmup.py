"""The engine's warm-up: one short completion through its own API before the pod reports Ready.

Why: at tensor parallel > 1, vLLM's CPU platform compiles a helper it calls on every request with torch.compile
(inductor, C++) on its first call (images/README.md: ~36 s measured), so the first user request of a freshly Ready
pair paid that compile. The connector's /readyz (every engine's readiness probe, metrics.readiness) starts this
once the engine's /health answers, and reports "warming up" until it is done; the request is a plain local
completion (no kv_transfer_params: nothing is pushed or pulled, no signal account moves).

It never blocks readiness for good: it runs once, with a deadline (`WARMUP_TIMEOUT_SECONDS`); an answer that is not
200, or no answer in time, ends it with the reason logged and kept in /readyz's body (`warmup`), and the pod is
Ready all the same: a warm-up is an optimisation, the engine's /health already said it serves.

With the pair's API key (VLLM_API_KEY, spec.apiKeySecret) vLLM refuses a /v1 request without it: both requests
carry `Authorization: Bearer <key>`, else every warm-up of a pair with a key would end in a 401, logged and passed
over, and the first user request would pay the compile again.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request

logger = logging.getLogger("pdpair.connector.warmup")

WARMUP_TIMEOUT_SECONDS = 300.0  # the whole warm-up: the model list, then one completion (a TP = 2 compile under load)
WARMUP_PROMPT = "warm up"


class Warmup:
    """One warm-up of the engine at `base_url` (http://127.0.0.1:<its API port>), in a daemon thread, started by the
    first `state()` call after the engine serves. Thread-safe."""

    def __init__(self, base_url: str, timeout_seconds: float = WARMUP_TIMEOUT_SECONDS,
                 api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_seconds = timeout_seconds
        # The engine's API key (PdPairConfig.api_key): sent as a bearer token with both requests; None or "": none.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self.done = False
        self.outcome = ""  # "ok (N.Ns)" or why it ended without an answer

    def state(self) -> tuple[bool, str]:
        """(done, what to report); starts the warm-up on the first call."""
        with self._lock:
            if self._thread is None:
                self._started = time.monotonic()
                self._thread = threading.Thread(target=self._run, name="pdpair-warmup", daemon=True)
                self._thread.start()
            if self.done:
                return True, self.outcome
            return False, f"warming up: one completion through the engine's API ({time.monotonic() - self._started:.0f}s)"

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout_seconds
        try:
            models = urllib.request.Request(f"{self.base_url}/v1/models", headers=self._headers)
            with urllib.request.urlopen(models, timeout=max(1.0, deadline - time.monotonic())) as r:
                model = json.load(r)["data"][0]["id"]
            body = json.dumps({"model": model, "prompt": WARMUP_PROMPT, "max_tokens": 1, "temperature": 0}).encode()
            request = urllib.request.Request(f"{self.base_url}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json", **self._headers})
            with urllib.request.urlopen(request, timeout=max(1.0, deadline - time.monotonic())) as r:
                r.read()
            outcome = f"ok ({time.monotonic() - self._started:.1f}s)"
            logger.info("warm-up done: %s", outcome)
        except Exception as exc:  # refused, an HTTP error status, a timeout, an odd body: report, never block
            outcome = f"failed after {time.monotonic() - self._started:.1f}s: {type(exc).__name__}: {exc}"[:500]
            logger.warning("warm-up %s; the pod is Ready all the same (its first request may be slow)", outcome)
        with self._lock:
            self.outcome, self.done = outcome, True
