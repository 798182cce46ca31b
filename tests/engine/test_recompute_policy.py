"""kv_load_failure_policy=recompute: a transfer that loses signals does not fail the request; decode waits until the
deadline, then computes the prompt itself, and the answer is the same as a local computation."""

from __future__ import annotations

import time

import pytest

from conftest import GENERATION, HANG_TIMEOUT_SECONDS
from engines import engine, free_port, pair_env, running_pair
from test_pd_engine import completion, metric, tokens


@pytest.fixture(scope="module")
def recompute_pair(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("recompute-logs")
    drop = tmp_path_factory.mktemp("knobs") / "drop-signals"
    listen, metrics_port = free_port(), free_port()
    decode = engine("decode", tiny_model, logs, kv_role="kv_consumer", failure_policy="recompute",
                    pdpair_env=pair_env("decode", generation=GENERATION, listen_base=listen, metrics_port=metrics_port,
                                        hang_timeout=HANG_TIMEOUT_SECONDS))
    prefill = engine("prefill", tiny_model, logs, kv_role="kv_producer", extra_config={"test_drop_signals_file": str(drop)},
                     pdpair_env=pair_env("prefill", generation=GENERATION, peer_base=listen,
                                         hang_timeout=HANG_TIMEOUT_SECONDS))
    with running_pair(decode, prefill, logs) as rtr:
        yield decode, rtr, drop, f"http://127.0.0.1:{metrics_port}"


def test_lost_signals_are_recomputed_not_failed(recompute_pair):
    decode, rtr, drop, metrics = recompute_pair
    prompt = "Recompute me when the signals go missing. " * 4
    drop.write_text("1")  # every signal dropped
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
    # And the pair still transfers normally once signals flow again.
    before = metric(metrics, "pdpair_kv_transfers_total", {"outcome": "ok"})
    status, again = completion(rtr.url, "A fresh prompt after the fault was switched off. " * 2)
    assert status == 200, again
    assert metric(metrics, "pdpair_kv_transfers_total", {"outcome": "ok"}) == before + 1
