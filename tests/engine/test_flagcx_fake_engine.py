"""The same prefill -> decode flow with PDPAIR_TRANSPORT=flagcx: the connector drives the flagcx ctypes binding,
loaded against the test-only ABI-compatible libflagcx (tests/flagcx_abi, built on the native TCP core; real FlagCX
needs CUDA, NCCL and RDMA). Proves the connector is transport-agnostic, not FlagCX itself."""

from __future__ import annotations

import subprocess
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
    extra_env = {"FLAGCX_LIB_PATH": str(lib)}
    decode_env = pair_env("decode", generation=GENERATION, listen_base=listen, metrics_port=metrics_port,
                          hang_timeout=HANG_TIMEOUT_SECONDS)
    prefill_env = pair_env("prefill", generation=GENERATION, peer_base=listen, hang_timeout=HANG_TIMEOUT_SECONDS)
    for env in (decode_env, prefill_env):
        env[contract.ENV_TRANSPORT] = contract.TRANSPORT_FLAGCX
    decode = engine("decode", tiny_model, logs, kv_role="kv_consumer", pdpair_env=decode_env, extra_env=extra_env)
    prefill = engine("prefill", tiny_model, logs, kv_role="kv_producer", pdpair_env=prefill_env, extra_env=extra_env)
    with running_pair(decode, prefill, logs) as rtr:
        yield decode, prefill, rtr, f"http://127.0.0.1:{metrics_port}"


def test_prefill_to_decode_over_the_flagcx_binding(flagcx_pair):
    decode, prefill, rtr, metrics = flagcx_pair
    assert "transport flagcx" in decode.log() and "transport flagcx" in prefill.log()
    before = metric(metrics, "pdpair_kv_transfers_total", {"outcome": "ok"})
    for prompt in PROMPTS:
        status, via_pair = completion(rtr.url, prompt)
        assert status == 200, via_pair
        status, local = completion(prefill.url, prompt)  # prefill computing on its own = a single engine
        assert status == 200, local
        assert tokens(via_pair) == tokens(local), prompt
    assert metric(metrics, "pdpair_kv_transfers_total", {"outcome": "ok"}) == before + len(PROMPTS)
