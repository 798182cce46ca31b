"""Prefill and decode workers without vLLM's engine: real KV tensors, the real tcp transport and real side channels
on localhost, driven through the same metadata the schedulers build.

The stalled-push test proves that prefill serves Pulls off its side-channel thread: while one push cannot finish
(the native sender holds every send), the side channel still answers the next Pull.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from pdpair import contract, native
from pdpair.connector.config import PdPairConfig
from pdpair.connector.scheduler import PdPairConnectorMetadata, RecvRequest, SendRequest
from pdpair.connector.prefill_worker import SLOW_PUSH_SECONDS, PrefillWorker
from pdpair.connector.decode_worker import DecodeWorker
from devcluster.ports import free_port
from tests.side_channel_support import TEST_SIDE_CHANNEL_KEY

NUM_BLOCKS = 8
LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
BLOCK_SHAPE = (2, 32, 2, 32)  # K/V, tokens per block, heads, head dim: 16 KiB of float32 per block and layer
HANG_TIMEOUT = 30.0  # longer than any wait below: a test that needs it has failed
DEADLINE = 20.0


def config(role: str, port: int) -> PdPairConfig:
    return PdPairConfig(
        role=role, generation=3, pair="unit", namespace="default", transport=contract.TRANSPORT_TCP,
        hang_timeout_seconds=HANG_TIMEOUT, metrics_port=None, listen_host="127.0.0.1",
        listen_port_base=port if role == contract.ROLE_DECODE else None,
        peer_host="127.0.0.1" if role == contract.ROLE_PREFILL else None,
        peer_port_base=port if role == contract.ROLE_PREFILL else None,
        instance="prefill-0" if role == contract.ROLE_PREFILL else "", side_channel_key=TEST_SIDE_CHANNEL_KEY,
    )


def kv_caches(fill: float) -> dict[str, torch.Tensor]:
    caches = {}
    for layer, name in enumerate(LAYERS):
        tensor = torch.full((NUM_BLOCKS, *BLOCK_SHAPE), fill, dtype=torch.float32)
        for block in range(NUM_BLOCKS):
            tensor[block] = 1000 * layer + block  # each (layer, block) is recognisable
        caches[name] = tensor
    return caches


@pytest.fixture
def pair():
    port = free_port()
    decode = DecodeWorker(config(contract.ROLE_DECODE, port), 0, 1, 32, "0.32.0")
    prefill = PrefillWorker(config(contract.ROLE_PREFILL, port), 0, 1, 32, "0.32.0")
    decode_kv = {name: torch.full((NUM_BLOCKS, *BLOCK_SHAPE), -1.0) for name in LAYERS}
    prefill_kv = kv_caches(0.0)
    try:
        decode.register_kv_caches(decode_kv, NUM_BLOCKS)
        prefill.register_kv_caches(prefill_kv, NUM_BLOCKS)
        assert prefill.side.connected.wait(DEADLINE) and decode.side.connected.wait(DEADLINE), "the pair never formed"
        yield decode, prefill, decode_kv, prefill_kv
    finally:
        prefill.shutdown()
        decode.shutdown()


def send(prefill: PrefillWorker, request_id: str, blocks: list[int]) -> None:
    prefill.start_load_kv(PdPairConnectorMetadata(reqs_to_send=[SendRequest(request_id, blocks, time.monotonic() + 60)]))


def recv(decode: DecodeWorker, request_id: str, remote_id: str, first_block: int, blocks: list[int]) -> None:
    decode.start_load_kv(PdPairConnectorMetadata(reqs_to_recv=[RecvRequest(request_id, remote_id, first_block, blocks, "prefill-0")]))


def settle(decode: DecodeWorker, wanted: set[str], idle: bool = False) -> tuple[set[str], set[str]]:
    """Poll get_transfer_results (as the engine does every step) until every wanted request has settled."""
    finished, failed = set(), set()
    deadline = time.monotonic() + DEADLINE
    while not wanted <= finished and time.monotonic() < deadline:
        done, bad = decode.get_transfer_results(idle)
        finished |= done
        failed |= bad
        time.sleep(0.01)
    assert wanted <= finished, f"not settled within {DEADLINE}s: {wanted - finished}"
    return finished, failed


def test_a_pull_moves_every_block_and_records_the_stages(pair):
    decode, prefill, decode_kv, prefill_kv = pair
    send(prefill, "p1", [3, 4, 5])
    recv(decode, "d1", "p1", 1, [6, 7])  # blocks 4 and 5 of prefill's three
    finished, failed = settle(decode, {"d1"}, idle=True)  # idle steps wait on the transfer instead of spinning
    assert failed == set()
    for name in LAYERS:
        assert torch.equal(decode_kv[name][6], prefill_kv[name][4])
        assert torch.equal(decode_kv[name][7], prefill_kv[name][5])
        assert bool((decode_kv[name][:6] == -1).all()), "a block outside the Pull was written"
    stats = decode.stats.data
    assert stats["transfers_ok"] == 1 and stats["transfer_bytes"] == [2 * 2 * 16384]
    assert len(stats["stage_pull_to_first_signal_seconds"]) == 1
    assert len(stats["stage_last_signal_to_engine_seconds"]) == 1
    deadline = time.monotonic() + DEADLINE
    while "p1" not in prefill.get_transfer_results(idle=True):  # the send is reported finished, freeing prefill's blocks
        assert time.monotonic() < deadline, "prefill never reported p1's send finished"
        time.sleep(0.01)
    assert len(prefill.stats.data["stage_push_seconds"]) == 1


def test_a_stalled_push_does_not_block_the_side_channel(pair, caplog):
    decode, prefill, decode_kv, prefill_kv = pair
    comm = prefill.side.comm
    comm._conn.set_fault(native.Fault.HOLD_SENDS, 1)  # TEST ONLY: the sender sends nothing until released
    held = time.monotonic()
    send(prefill, "p1", [1, 2])
    send(prefill, "p2", [3])
    recv(decode, "d1", "p1", 0, [4, 5])  # its push posts, then waits in flush: nothing can be sent
    recv(decode, "d2", "p2", 5, [6])  # an invalid range: prefill answers PullFailed through the side channel
    deadline = time.monotonic() + DEADLINE
    failed: set[str] = set()
    finished: set[str] = set()
    while "d2" not in failed and time.monotonic() < deadline:
        done, bad = decode.get_transfer_results()
        finished |= done
        failed |= bad
        time.sleep(0.01)
    assert "d2" in failed, "the side channel did not answer while another request's push was stalled"
    assert "d1" not in finished, "d1 finished although its sends are held"
    time.sleep(max(0.0, held + SLOW_PUSH_SECONDS + 0.5 - time.monotonic()))  # held longer than a push may take
    with caplog.at_level(logging.WARNING, logger="pdpair"):
        comm._conn.set_fault(native.Fault.HOLD_SENDS, 0)
        finished, failed = settle(decode, {"d1"})
        assert "d1" not in failed
        deadline = time.monotonic() + DEADLINE
        while "p1" not in prefill.get_transfer_results():  # the push thread logs before it reports the send
            assert time.monotonic() < deadline, "prefill never reported p1's send finished"
            time.sleep(0.01)
    for name in LAYERS:
        assert torch.equal(decode_kv[name][4], prefill_kv[name][1])
        assert torch.equal(decode_kv[name][5], prefill_kv[name][2])
    # The slow push names itself, with where its time went: what to read first when decode's wait times out.
    slow = [r.getMessage() for r in caplog.records if "transfer d1 (prefill request p1): served" in r.getMessage()]
    assert len(slow) == 1, caplog.text
    assert "putting and flushing 65536 bytes" in slow[0], slow[0]
