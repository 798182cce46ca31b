"""The same prefill -> decode flow with PDPAIR_TRANSPORT=flagcx: the connector drives the flagcx ctypes binding,
loaded against the test-only ABI-compatible libflagcx (tests/flagcx_abi, built on the native TCP core; real FlagCX
needs CUDA, NCCL and RDMA). Proves the connector is transport-agnostic, not FlagCX itself.

The pair's decode runs kv_load_failure_policy=recompute, and the fake library drops every put while a knob file
exists (FAKE_FLAGCX_DROP_FILE: the loss the seed's full request slots caused, reported as posted): a transfer that
loses its signals does not fail the request; decode waits until the deadline, then computes the prompt itself, and
the answer is the same as a local computation. One pair for both (until 2026-12-07 the recompute policy had a TCP
pair of its own: one pair's start, about 50 s of the engine tier, saved)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from pdpair import contract

from conftest import GENERATION, HANG_TIMEOUT_SECONDS
from engines import engine, free_port, pair_env, running_pair
from test_pd_engine import completion, metric, tokens

FAKE_DIR = Path(__file__).resolve().parents[1] / "flagcx_abi"
PROMPTS = ["FlagCX-shaped pairs move blocks. " * 4, "One more prompt over the ctypes layer", "x y z " * 30]


@pytest.fixture(scope="module")
def flagcx_pair(tiny_model, tmp_path_factory):
    build = subprocess.run(["make", "-C", str(FAKE_DIR)], capture_output=True, text=True, timeout=600)
    if build.returncode != 0:
        pytest.fail(f"make -C {FAKE_DIR} failed:\n{build.stdout}\n{build.stderr}")
    lib = FAKE_DIR / "build" / "default" / "libflagcx.so"
    assert lib.is_file(), lib
    logs = tmp_path_factory.mktemp("flagcx-logs")
    listen, metrics_port = free_port(), free_port()
    drop = tmp_path_factory.mktemp("knobs") / "drop-puts"
    extra_env = {"FLAGCX_LIB_PATH": str(lib), "FAKE_FLAGCX_DROP_FILE": str(drop)}
    decode_env = pair_env("decode", generation=GENERATION, listen_base=listen, metrics_port=metrics_port,
                          hang_timeout=HANG_TIMEOUT_SECONDS)
    prefill_env = pair_env("prefill", generation=GENERATION, peer_base=listen, hang_timeout=HANG_TIMEOUT_SECONDS)
    for env in (decode_env, prefill_env):
        env[contract.ENV_TRANSPORT] = contract.TRANSPORT_FLAGCX
    decode = engine("decode", tiny_model, logs, kv_role="kv_consumer", failure_policy="recompute",
                    pdpair_env=decode_env, extra_env=extra_env)
    prefill = engine("prefill", tiny_model, logs, kv_role="kv_producer", pdpair_env=prefill_env, extra_env=extra_env)
    with running_pair(decode, prefill, logs) as rtr:
        yield decode, prefill, rtr, f"http://127.0.0.1:{metrics_port}", drop


def test_prefill_to_decode_over_the_flagcx_binding(flagcx_pair):
    decode, prefill, rtr, metrics, _ = flagcx_pair
    assert "transport flagcx" in decode.log() and "transport flagcx" in prefill.log()
    before = metric(metrics, "pdpair_kv_transfers_total", {"outcome": "ok"})
    for prompt in PROMPTS:
        status, via_pair = completion(rtr.url, prompt)
        assert status == 200, via_pair
        status, local = completion(prefill.url, prompt)  # prefill computing on its own = a single engine
        assert status == 200, local
        assert tokens(via_pair) == tokens(local), prompt
    assert metric(metrics, "pdpair_kv_transfers_total", {"outcome": "ok"}) == before + len(PROMPTS)


def test_lost_signals_are_recomputed_not_failed(flagcx_pair):
    decode, _, rtr, metrics, drop = flagcx_pair
    prompt = "Recompute me when the signals go missing. " * 4
    drop.write_text("")  # every put (and its signal) dropped
    try:
        started = time.monotonic()
        status, via_pair = completion(rtr.url, prompt)
        elapsed = time.monotonic() - started
    finally:
        drop.unlink()
    assert status == 200, via_pair
    assert via_pair["choices"][0]["finish_reason"] == "length"
    assert elapsed >= HANG_TIMEOUT_SECONDS * 0.8, "decode must have waited for the deadline before recomputing"
    assert metric(metrics, "pdpair_signal_wait_timeouts_total") == 1
    assert "timed out after" in decode.log()
    status, local = completion(decode.url, prompt)
    assert status == 200 and tokens(via_pair) == tokens(local)
    # And the pair still transfers normally once puts flow again.
    before = metric(metrics, "pdpair_kv_transfers_total", {"outcome": "ok"})
    status, again = completion(rtr.url, "A fresh prompt after the fault was switched off. " * 2)
    assert status == 200, again
    assert metric(metrics, "pdpair_kv_transfers_total", {"outcome": "ok"}) == before + 1
