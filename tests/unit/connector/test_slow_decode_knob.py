"""TEST ONLY knob test_slow_decode_file (TEST_ONLY_PDPAIR_SLOW_DECODE_FILE): the file's milliseconds are slept in
every decode model step, read at most every TEST_SLOW_DECODE_POLL_SECONDS, and a bad content never raises.

Timing is asserted one way only (at least the delay): a busy 2-core box stretches every sleep. Where a step must not
sleep, the file asks for seconds and the bound is half of that, so only a sleep that happened can fail it.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from pdpair import contract
from pdpair.connector import testing_knobs
from pdpair.connector.config import PdPairConfig
from pdpair.connector.scheduler import PdPairConnectorMetadata
from pdpair.connector.testing_knobs import TEST_SLOW_DECODE_MAX_MS, SlowDecodeKnob
from pdpair.connector.decode_worker import DecodeWorker
from pdpair.connector.prefill_worker import PrefillWorker
from devcluster.ports import free_port
from tests.side_channel_support import TEST_SIDE_CHANNEL_KEY

NUM_BLOCKS = 4
LONG_DELAY_MS = 4000  # a step that slept it would take >= 4 s; "no sleep" is asserted as < 2 s
NO_SLEEP_BOUND_SECONDS = LONG_DELAY_MS / 1000 / 2


@pytest.fixture
def read_every_time(monkeypatch):
    """Each call reads the file (no caching), so a test sees its own writes at once."""
    monkeypatch.setattr(testing_knobs, "TEST_SLOW_DECODE_POLL_SECONDS", 0.0)




def timed(call) -> float:
    started = time.monotonic()
    call()
    return time.monotonic() - started


def test_absent_file_means_no_delay(tmp_path, read_every_time):
    knob = SlowDecodeKnob(str(tmp_path / "slow"))
    assert knob.delay_seconds() == 0.0
    assert timed(knob.sleep) < NO_SLEEP_BOUND_SECONDS


def test_the_file_milliseconds_are_slept_while_it_exists(tmp_path, read_every_time, knob_logs):
    path = tmp_path / "slow"
    knob = SlowDecodeKnob(str(path))
    path.write_text("50\n")
    assert knob.delay_seconds() == pytest.approx(0.05)
    assert timed(knob.sleep) >= 0.05
    path.write_text("2.5")
    assert knob.delay_seconds() == pytest.approx(0.0025)
    path.write_text(str(TEST_SLOW_DECODE_MAX_MS))
    assert knob.delay_seconds() == pytest.approx(TEST_SLOW_DECODE_MAX_MS / 1000)
    path.unlink()
    assert knob.delay_seconds() == 0.0
    messages = [r.getMessage() for r in knob_logs.records]
    assert any("sleeps 50 ms" in m for m in messages) and any("no longer slowed" in m for m in messages), messages


@pytest.mark.parametrize("content", ["fast", "", "-1", "10001", "nan", "inf", "1e9", "50ms"])
def test_a_bad_content_means_no_delay_and_one_warning(tmp_path, read_every_time, knob_logs, content):
    path = tmp_path / "slow"
    path.write_text(content)
    knob = SlowDecodeKnob(str(path))
    for _ in range(5):  # five engine steps, one warning
        assert knob.delay_seconds() == 0.0
    warnings = [r.getMessage() for r in knob_logs.records if "not a number of milliseconds" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert repr(content) in warnings[0]
    path.write_text("20")  # fixed: the knob applies from the next read
    assert knob.delay_seconds() == pytest.approx(0.02)


def test_an_unreadable_file_means_no_delay(tmp_path, read_every_time, knob_logs):
    (tmp_path / "slow").mkdir()  # open() fails with IsADirectoryError
    knob = SlowDecodeKnob(str(tmp_path / "slow"))
    assert knob.delay_seconds() == 0.0 and knob.delay_seconds() == 0.0
    assert len([r for r in knob_logs.records if "unreadable" in r.getMessage()]) == 1


def test_the_file_is_read_at_most_once_per_poll_interval(tmp_path, monkeypatch):
    monkeypatch.setattr(testing_knobs, "TEST_SLOW_DECODE_POLL_SECONDS", 3600.0)
    path = tmp_path / "slow"
    path.write_text("30")
    knob = SlowDecodeKnob(str(path))
    assert knob.delay_seconds() == pytest.approx(0.03)
    path.unlink()
    assert knob.delay_seconds() == pytest.approx(0.03)  # cached: no read within the interval
    monkeypatch.setattr(testing_knobs, "TEST_SLOW_DECODE_POLL_SECONDS", 0.0)
    assert knob.delay_seconds() == 0.0


# --- the hook: DecodeWorker.start_load_kv, called by vLLM once per engine step -------------------------------------
def decode_config(knob_path: str) -> PdPairConfig:
    """Through from_env with the test-only variable, as a decode pod under the operator gets it."""
    env = {contract.ENV_TRANSPORT: contract.TRANSPORT_TCP, contract.ENV_LISTEN_PORT_BASE: str(free_port()),
           contract.ENV_TEST_SLOW_DECODE_FILE: knob_path, contract.ENV_SIDE_CHANNEL_KEY: TEST_SIDE_CHANNEL_KEY}
    return dataclasses.replace(PdPairConfig.from_env("kv_consumer", {}, env), listen_host="127.0.0.1")


@pytest.fixture
def decode(tmp_path):
    path = tmp_path / "slow"
    decode = DecodeWorker(decode_config(str(path)), 0, 1, 32, "0.32.0")
    try:
        decode.register_kv_caches({"model.layers.0.attn": torch.zeros(NUM_BLOCKS, 2, 32, 2, 8)}, NUM_BLOCKS)
        yield decode, path
    finally:
        decode.shutdown()


def test_every_decode_model_step_sleeps_the_delay_with_no_kv_to_receive(decode, read_every_time):
    worker_, path = decode
    step = PdPairConnectorMetadata()  # a decode step: tokens scheduled, nothing to load
    path.write_text("50")
    for _ in range(3):
        assert timed(lambda: worker_.start_load_kv(step)) >= 0.05
    path.unlink()
    assert timed(lambda: worker_.start_load_kv(step)) < NO_SLEEP_BOUND_SECONDS


def test_a_step_that_runs_no_model_is_not_slowed(decode, read_every_time):
    worker_, path = decode
    path.write_text(str(LONG_DELAY_MS))
    assert timed(lambda: worker_.start_load_kv(PdPairConnectorMetadata(idle_step=True))) < NO_SLEEP_BOUND_SECONDS


def test_prefill_never_sleeps_even_with_the_field_set_in_code(tmp_path, read_every_time):
    """from_env refuses the knob on prefill; a config built in code that sets it anyway is still not slept on."""
    path = tmp_path / "slow"
    path.write_text(str(LONG_DELAY_MS))
    config = PdPairConfig(
        role=contract.ROLE_PREFILL, generation=0, pair="unit", namespace="default", transport=contract.TRANSPORT_TCP,
        hang_timeout_seconds=30.0, metrics_port=None, listen_host="127.0.0.1", listen_port_base=None,
        peer_host="127.0.0.1", peer_port_base=free_port(), instance="prefill-0", test_slow_decode_file=str(path),
        side_channel_key=TEST_SIDE_CHANNEL_KEY,
    )
    prefill = PrefillWorker(config, 0, 1, 32, "0.32.0")
    try:
        assert timed(lambda: prefill.start_load_kv(PdPairConnectorMetadata())) < NO_SLEEP_BOUND_SECONDS
    finally:
        prefill.shutdown()
