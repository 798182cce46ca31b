"""Prefill and decode workers without vLLM's engine: real KV tensors, the real tcp transport and real side channels
on localhost, driven through the same metadata the schedulers build.

The stalled-push test proves that prefill serves Pulls off its side-channel thread: while one push cannot finish
(the native sender holds every send), the side channel still answers the next Pull.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import types

import pytest
import torch

from pdpair import contract, native
from pdpair.connector.config import PdPairConfig
from pdpair.connector.scheduler import PdPairConnectorMetadata, RecvRequest, SendRequest
from pdpair.connector.prefill_worker import SLOW_PUSH_SECONDS, PrefillWorker
from pdpair.connector.decode_worker import DecodeWorker, transfer_tag
from pdpair.connector.deadlines import PEER_DEATH_SECONDS, keyed_pull_deadline
from pdpair.connector.metadata import PullFailed
from pdpair.connector.transports import SignalWaitTimeout, TransferRejected, TransportError
from pdpair.connector.worker import SignalWait
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
    yield from _pair()


def _pair(hang: float = HANG_TIMEOUT, **prefill_settings):
    """A paired decode and prefill worker with this hang timeout (prefill's config with `prefill_settings`); both
    shut down after."""
    port = free_port()
    decode = DecodeWorker(dataclasses.replace(config(contract.ROLE_DECODE, port), hang_timeout_seconds=hang), 0, 1,
                          32, "0.32.0")
    prefill = PrefillWorker(dataclasses.replace(config(contract.ROLE_PREFILL, port), hang_timeout_seconds=hang,
                                                **prefill_settings), 0, 1, 32, "0.32.0")
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


def rejected(decode: DecodeWorker, reason: str) -> float:
    return decode.accounts.registry.get_sample_value(
        "pdpair_kv_transfers_rejected_total", {"role": "decode", "rank": "0", "reason": reason}
    )


def decode_conn_comm(decode: DecodeWorker):
    (edge,) = decode.side.edges()
    return edge.comm


def decode_conn(decode: DecodeWorker) -> native.Connection:
    (edge,) = decode.side.edges()
    assert edge.comm.supports_transfer_checks  # the connector's tcp transport checks transfers on decode
    return edge.comm._conn


def test_a_load_declares_its_transfer_and_retires_it(pair):
    """Decode declares each Pull's blocks before sending it, prefill tags its puts, and the declaration is gone once
    the load settled: a put of the same tag afterwards is refused and writes nothing."""
    decode, prefill, decode_kv, prefill_kv = pair
    send(prefill, "p1", [2, 3])
    recv(decode, "d1", "p1", 0, [5, 6])
    finished, failed = settle(decode, {"d1"}, idle=True)
    assert failed == set()
    for name in LAYERS:
        assert torch.equal(decode_kv[name][5], prefill_kv[name][2]) and torch.equal(decode_kv[name][6], prefill_kv[name][3])
    stats = decode_conn(decode).stats()
    assert stats.transfers_outstanding == 0
    assert (stats.refused_unknown_transfer, stats.refused_out_of_window, stats.refused_checksum) == (0, 0, 0)
    # a late put with d1's tag (its blocks may belong to another request by now) is refused
    comm, (edge,) = prefill.side.comm, prefill._edges.values()
    chunk = prefill.regions.chunk_bytes[0]
    comm.put_signal(edge.local_indices[0], 0, edge.peer_indices[0], 5 * chunk, chunk, 0,
                    transfer_id=transfer_tag("d1"), generation=1)  # the first Pull of a decode worker: generation 1
    with pytest.raises(TransportError) as info:
        comm.flush(time.monotonic() + DEADLINE)
    assert "REMOTE_REJECTED" in str(info.value) and "not a transfer it expects" in str(info.value)
    assert decode_conn(decode).stats().refused_unknown_transfer == 1
    for name in LAYERS:
        assert torch.equal(decode_kv[name][5], prefill_kv[name][2]), "a refused put was written"


def test_a_put_outside_every_pull_is_refused_and_writes_nothing(pair):
    """A put into decode's blocks that no Pull asked for (untagged, or tagged for a transfer never declared) is
    refused by decode's transport: nothing written, counted, the pair keeps serving."""
    decode, prefill, decode_kv, prefill_kv = pair
    comm, (edge,) = prefill.side.comm, prefill._edges.values()
    chunk, src, dst = prefill.regions.chunk_bytes[0], edge.local_indices[0], edge.peer_indices[0]
    comm.put_signal(src, 0, dst, 0, chunk, 1)  # untagged
    comm.put_signal(src, 0, dst, chunk, chunk, 1, transfer_id=12345, generation=7)  # never declared
    with pytest.raises(TransportError):
        comm.flush(time.monotonic() + DEADLINE)
    assert decode_conn(decode).stats().refused_unknown_transfer == 2
    for name in LAYERS:
        assert bool((decode_kv[name] == -1).all()), "a put no Pull asked for was written"
    send(prefill, "p1", [1])
    recv(decode, "d1", "p1", 0, [0])
    finished, failed = settle(decode, {"d1"})
    assert failed == set() and all(torch.equal(decode_kv[n][0], prefill_kv[n][1]) for n in LAYERS)




def test_a_refused_load_gives_its_signal_slot_back(pair):
    """A load whose put was refused is retired before it fails, so nothing of it can land or signal any more and its
    signal slot serves again, after every other free slot: a run of refused loads never drains the edge's slots (a
    timed-out load keeps its slot out of use instead: its deficit stays visible until the pair restarts)."""
    decode, prefill, decode_kv, prefill_kv = pair
    send(prefill, "p0", [1])
    recv(decode, "d0", "p0", 0, [6])
    settle(decode, {"d0"})
    comm = decode_conn_comm(decode)
    free_before = len(decode._free_slots[comm])
    for i in range(3):
        prefill.side.comm._conn.set_fault(native.Fault.CORRUPT_PUTS, 1)  # the next put goes out with a byte flipped
        send(prefill, f"p{i + 1}", [2, 3])
        recv(decode, f"d{i + 1}", f"p{i + 1}", 0, [4, 5])
        _, failed = settle(decode, {f"d{i + 1}"})
        assert f"d{i + 1}" in failed
    assert len(decode._free_slots[comm]) == free_before, "a refused load kept its signal slot"
    # ... and goes to the back of the line: a late put of a refused load meets no new load on its slot
    assert list(decode._free_slots[comm])[-4:] == [0, 1, 2, 3], list(decode._free_slots[comm])[-6:]
    send(prefill, "p9", [1])
    recv(decode, "d9", "p9", 0, [6])
    _, failed = settle(decode, {"d9"})
    assert "d9" not in failed and all(torch.equal(decode_kv[n][6], prefill_kv[n][1]) for n in LAYERS)


def test_a_corrupted_put_fails_its_load_at_once_with_a_metric(pair, error_logs):
    """A byte flipped on the way (TEST ONLY native fault on prefill's connection): decode refuses the put, the load
    fails within seconds (not at the 30 s hang timeout) with a clear error and pdpair_kv_transfers_rejected_total
    {reason="checksum"}; its bytes are never handed to the engine as loaded, and the next load on the pair works."""
    decode, prefill, decode_kv, prefill_kv = pair
    prefill.side.comm._conn.set_fault(native.Fault.CORRUPT_PUTS, 1)
    send(prefill, "p1", [2, 3])
    started = time.monotonic()
    recv(decode, "d1", "p1", 0, [4, 5])
    finished, failed = settle(decode, {"d1"})
    assert "d1" in failed
    assert time.monotonic() - started < HANG_TIMEOUT / 3, "the load failed at its deadline, not at the refusal"
    assert rejected(decode, "checksum") == 1 and rejected(decode, "unexpected_transfer") == 0
    assert "refused on arrival (checksum)" in error_logs.text, error_logs.text
    assert decode.stats.data.get("transfers_ok", 0) == 0
    send(prefill, "p2", [1])
    recv(decode, "d2", "p2", 0, [6])
    finished, failed = settle(decode, {"d2"})
    assert "d2" not in failed and all(torch.equal(decode_kv[n][6], prefill_kv[n][1]) for n in LAYERS)


def test_a_prefill_gone_mid_transfer_fails_the_load_within_the_peer_death_bound(pair):
    """Prefill's data connection ends in the middle of a load (as the kernel ends a SIGKILLed prefill's): its puts
    are held back on the way (native HOLD_SENDS), so the load is mid-transfer; the connection is then closed, and
    the load fails within deadlines.PEER_DEATH_SECONDS counted from the close, not at the 30 s hang timeout, and
    nothing it carried is handed over as loaded. Cost: one load, under a second."""
    decode, prefill, decode_kv, prefill_kv = pair
    send(prefill, "p1", [1, 2])
    conn = prefill.side.comm._conn
    conn.set_fault(native.Fault.HOLD_SENDS, 1)
    recv(decode, "d1", "p1", 0, [4, 5])
    deadline = time.monotonic() + DEADLINE
    while conn.stats().queued == 0 and time.monotonic() < deadline:  # the push has begun: its puts wait in the queue
        time.sleep(0.01)
    assert conn.stats().queued > 0, "the push never started"
    closed_at = time.monotonic()
    conn.close()
    _, failed = settle(decode, {"d1"})
    assert "d1" in failed
    assert time.monotonic() - closed_at < PEER_DEATH_SECONDS, "the load outlived its prefill's connection"
    assert decode.stats.data.get("transfers_ok", 0) == 0


def test_a_pull_failed_fails_only_a_wait_on_the_edge_it_came_from(pair, knob_logs):
    """Transfer ids are not secret: a paired prefill's PullFailed naming another edge's transfer is ignored (logged),
    so one prefill cannot fail another's loads; the same message from the wait's own edge fails it at once. Cost: one
    load that never gets its KV (its Pull is answered by the failure), well under a second."""
    decode, prefill, decode_kv, prefill_kv = pair
    recv(decode, "d1", "p-never-sent", 0, [4])  # prefill parks the Pull: the wait stays open
    deadline = time.monotonic() + DEADLINE
    while "d1" not in decode._waits and time.monotonic() < deadline:
        time.sleep(0.01)
    wait = decode._waits["d1"]
    (edge,) = decode.side.edges()
    stranger = types.SimpleNamespace(comm=object(), instance="prefill-other")
    decode._on_pull_failed(PullFailed("d1", "forged"), stranger)
    assert wait.failed_reason is None
    assert "which is another edge's: ignored" in knob_logs.text
    decode._on_pull_failed(PullFailed("d1", "prefill holds no KV"), edge)
    started = time.monotonic()
    _, failed = settle(decode, {"d1"})
    assert "d1" in failed and time.monotonic() - started < HANG_TIMEOUT / 3


def blocks_held(prefill: PrefillWorker) -> float:
    return prefill.accounts.registry.get_sample_value("pdpair_kv_blocks_held", {"role": "prefill", "rank": "0"})


def test_prefill_exports_the_blocks_it_holds_until_pulled_or_leased_out(pair):
    """pdpair_kv_blocks_held: 0 from the start; the blocks of finished requests waiting for a Pull while they wait;
    back down as each is pulled, and when a request's send lease runs out without a Pull (a decode that died or
    never asks), so a leak of held blocks is visible before the lease ends it. Cost: 2 loads, under a second."""
    decode, prefill, decode_kv, prefill_kv = pair
    assert blocks_held(prefill) == 0
    send(prefill, "p1", [1, 2])
    prefill.start_load_kv(PdPairConnectorMetadata(reqs_to_send=[SendRequest("p2", [3], time.monotonic() + 0.5)]))
    prefill.get_transfer_results()
    assert blocks_held(prefill) == 3
    recv(decode, "d1", "p1", 0, [4, 5])
    assert settle(decode, {"d1"})[1] == set()
    deadline = time.monotonic() + DEADLINE
    finished: set[str] = set()
    while finished != {"p1", "p2"} and time.monotonic() < deadline:  # p2's lease ends without a Pull
        finished |= prefill.get_transfer_results()
        time.sleep(0.05)
    assert finished == {"p1", "p2"}
    assert blocks_held(prefill) == 0


@pytest.fixture
def knob_pair(tmp_path):
    """A pair whose prefill has the corrupt-puts knob configured (TEST ONLY test_corrupt_puts_file); the file is
    absent at first."""
    knob = tmp_path / "corrupt-puts"
    for decode, prefill, decode_kv, prefill_kv in _pair(test_corrupt_puts_file=str(knob)):
        yield decode, prefill, decode_kv, prefill_kv, knob


def test_the_corrupt_puts_knob_fails_loads_while_its_file_exists(knob_pair, error_logs):
    """TEST ONLY knob test_corrupt_puts_file: absent, loads work; while the file exists, every put of prefill's
    connection has a byte flipped on the way, so each load fails at once with pdpair_kv_transfers_rejected_total
    {reason="checksum"} and nothing it carried is handed over as loaded; once the file is gone, the next push turns
    the fault off and loads work again on the same pair."""
    decode, prefill, decode_kv, prefill_kv, knob = knob_pair
    send(prefill, "p1", [1])
    recv(decode, "d1", "p1", 0, [0])
    finished, failed = settle(decode, {"d1"})
    assert failed == set() and all(torch.equal(decode_kv[n][0], prefill_kv[n][1]) for n in LAYERS)

    knob.write_text("")
    for i, (src, dst) in enumerate(((2, 4), (3, 5)), start=2):
        send(prefill, f"p{i}", [src])
        started = time.monotonic()
        recv(decode, f"d{i}", f"p{i}", 0, [dst])
        finished, failed = settle(decode, {f"d{i}"})
        assert f"d{i}" in failed, f"load d{i} was not failed while the knob file existed"
        assert time.monotonic() - started < HANG_TIMEOUT / 3, "the load failed at its deadline, not at the refusal"
    assert rejected(decode, "checksum") == 2
    assert decode.stats.data.get("transfers_ok", 0) == 1
    assert error_logs.text.count("failed: a put of it was refused on arrival (checksum)") == 2, error_logs.text
    assert decode_conn(decode).stats().refused_checksum >= 2

    knob.unlink()
    edges = list(prefill._edges.values())
    send(prefill, "p4", [6])
    recv(decode, "d4", "p4", 0, [7])
    finished, failed = settle(decode, {"d4"})
    assert "d4" not in failed and all(torch.equal(decode_kv[n][7], prefill_kv[n][6]) for n in LAYERS)
    assert rejected(decode, "checksum") == 2
    assert list(prefill._edges.values()) == edges, "the pair was replaced instead of serving on"


@pytest.mark.parametrize("reason", [contract.REJECTED_OUTSIDE_WINDOW, contract.REJECTED_UNEXPECTED_TRANSFER,
                                    contract.REJECTED_INCOMPLETE])
def test_the_corrupt_puts_knob_content_names_the_refusal(knob_pair, knob_logs, reason):
    """The knob file's content picks the damage (testing_knobs.PUT_FAULT_BY_CONTENT), named by the refusal decode must
    count: `outside_window` puts every block into block 0 (no Pull asks for it), `unexpected_transfer` tags every put
    with the previous transfer's tag (retired, its blocks free for reuse), `incomplete` sends half of every block with
    that half's checksum. Each load fails at the refusal, counted under that reason and no other, decode's block 0
    keeps its bytes, and once the file is gone the same pair loads again. A content naming no fault is ignored (a
    warning), never raised. Cost: 4 loads on an in-process pair, well under a second."""
    decode, prefill, decode_kv, prefill_kv, knob = knob_pair
    send(prefill, "p1", [1])  # a finished transfer first: the stale tag is its tag
    recv(decode, "d1", "p1", 0, [6])
    assert settle(decode, {"d1"})[1] == set()
    block0 = [decode_kv[n][0].clone() for n in LAYERS]

    knob.write_text(reason + "\n")
    send(prefill, "p2", [2, 3])
    started = time.monotonic()
    recv(decode, "d2", "p2", 0, [4, 5])
    _, failed = settle(decode, {"d2"})
    assert "d2" in failed, f"a load with {reason} puts was not failed"
    assert time.monotonic() - started < HANG_TIMEOUT / 3, "the load failed at its deadline, not at the refusal"
    assert {r: rejected(decode, r) for r in contract.REJECTED_REASONS} == \
        {r: int(r == reason) for r in contract.REJECTED_REASONS}
    assert f"refused on arrival ({reason})" in knob_logs.text, knob_logs.text
    assert all(torch.equal(decode_kv[n][0], block0[i]) for i, n in enumerate(LAYERS)), "block 0 was written"

    knob.write_text("no-such-fault")
    send(prefill, "p3", [2])
    recv(decode, "d3", "p3", 0, [4])
    assert settle(decode, {"d3"})[1] == set(), "an unknown knob content must set no fault"
    assert "names no put fault" in knob_logs.text
    knob.unlink()
    send(prefill, "p4", [3])
    recv(decode, "d4", "p4", 0, [7])
    assert settle(decode, {"d4"})[1] == set()
    assert all(torch.equal(decode_kv[n][7], prefill_kv[n][3]) for n in LAYERS)


class _SlotComm:
    """A pair communicator whose slot is either failed by a refused put (`refused`) or merely short of its count."""

    supports_transfer_checks = True

    def __init__(self, refused: bool) -> None:
        self.refused = refused

    def wait_signal(self, signal_slot: int, expected: int, deadline: float) -> None:
        if self.refused:
            raise TransferRejected(f"a put for signal slot {signal_slot} was refused on arrival (checksum)", "checksum")
        raise SignalWaitTimeout(signal_slot, expected, 0, 0.0)


@pytest.mark.parametrize("refused", [True, False])
def test_a_pull_failed_that_follows_a_refusal_still_names_the_refusal(refused):
    """Prefill answers PullFailed when decode refused one of its puts, and that answer may reach the waiter between
    two wait slices, before it saw its failed slot: the load must still fail as TransferRejected (counted by reason),
    not as "prefill could not serve". A PullFailed with nothing refused keeps its own reason."""
    decode = DecodeWorker(config(contract.ROLE_DECODE, free_port()), 0, 1, 32, "0.32.0")
    try:
        now = time.monotonic()
        wait = SignalWait(recv=RecvRequest("d1", "p1", 0, [1], "prefill-0"), slot=3, base=0, expected=2, nbytes=0,
                          started=now, deadline=now + DEADLINE, comm=_SlotComm(refused),
                          failed_reason="prefill transport error: flush: PDPAIR_REMOTE_REJECTED")
        with pytest.raises(TransportError) as info:
            decode._wait_until(wait, 1, 0)
        if refused:
            assert isinstance(info.value, TransferRejected) and info.value.reason == "checksum"
        else:
            assert not isinstance(info.value, TransferRejected)
            assert "prefill could not serve the pull: prefill transport error" in str(info.value)
    finally:
        decode.shutdown()


def test_a_release_during_a_push_reports_the_blocks_sent_once_after_both(pair):
    """Decode releases a request whose load failed (its scheduler's reqs_to_release) while prefill's push of it may
    still be reading its blocks: prefill reports the blocks sent exactly once, when the last of the two serves ends.
    Reported at the release, the blocks would go back to the engine under the push; reported twice, vLLM's scheduler
    asserts the request is still its own and the prefill engine dies (seen with decode refusing corrupted puts)."""
    import threading

    from pdpair.connector.metadata import Pull

    decode, prefill, _, _ = pair
    pushing, go_on = threading.Event(), threading.Event()
    real_push = prefill._push

    def held_push(*args, **kwargs):
        pushing.set()
        assert go_on.wait(DEADLINE), "the test never let the push go on"
        return real_push(*args, **kwargs)

    prefill._push = held_push
    send(prefill, "p1", [2, 3])
    recv(decode, "d1", "p1", 0, [4, 5])
    assert pushing.wait(DEADLINE), "the Pull never reached prefill's push"
    (edge,) = prefill._edges_now()
    prefill._on_pull(edge, Pull("release-p1", "p1", 0, [], 0, 0))
    reported: list[str] = []
    deadline = time.monotonic() + 1.0  # the release's serve is quick: it reports nothing while the push holds
    while time.monotonic() < deadline:
        reported += prefill.get_transfer_results()
        time.sleep(0.01)
    assert reported == [], "the blocks were reported sent while the push still read them"
    go_on.set()
    settle(decode, {"d1"})
    deadline = time.monotonic() + DEADLINE
    while "p1" not in reported and time.monotonic() < deadline:
        reported += prefill.get_transfer_results()
        time.sleep(0.01)
    for _ in range(20):  # and never again
        reported += prefill.get_transfer_results()
        time.sleep(0.01)
    assert reported == ["p1"], reported


def test_a_pull_named_by_the_routers_key_waits_for_the_prompt_and_is_served_only_for_its_digest(pair):
    """Both legs at once: decode's Pull names the router's transfer key before prefill has computed the request; it
    is parked, then served as soon as the send with that key comes, only when the Pull's prompt digest is the
    send's (a Pull for another prompt, or one naming the key without a digest, fails at once). Cost: under 2 s."""
    decode, prefill, decode_kv, prefill_kv = pair
    key, other_key = "t-" + "a" * 32, "t-" + "b" * 32
    digest, wrong = bytes(range(32)), bytes(32)
    decode.start_load_kv(PdPairConnectorMetadata(reqs_to_recv=[
        RecvRequest("d1", key, 0, [6, 7], "prefill-0", digest, keyed=True),  # parked: prefill has nothing yet
        RecvRequest("d2", other_key, 0, [4], "prefill-0", wrong, keyed=True),
        RecvRequest("d3", other_key, 0, [5], "prefill-0", keyed=True)]))  # names a key without a digest
    time.sleep(0.2)
    assert not decode.get_transfer_results()[0], "nothing may settle before prefill holds the request"
    assert decode.accounts.open_transfers() == 0, "a Pull waiting for prefill's computation is no transfer yet"
    prefill.start_load_kv(PdPairConnectorMetadata(reqs_to_send=[
        SendRequest("prefill-internal-1", [2, 3], time.monotonic() + 60, transfer_key=key, prompt_digest=digest),
        SendRequest("prefill-internal-2", [1], time.monotonic() + 60, transfer_key=other_key, prompt_digest=digest)]))
    finished, failed = settle(decode, {"d1", "d2", "d3"}, idle=True)
    assert failed == {"d2", "d3"}
    for name in LAYERS:
        assert torch.equal(decode_kv[name][6], prefill_kv[name][2]) and torch.equal(decode_kv[name][7], prefill_kv[name][3])
        assert bool((decode_kv[name][4:6] == -1).all()), "a refused Pull wrote KV"
    deadline = time.monotonic() + DEADLINE
    sent: set[str] = set()
    while "prefill-internal-1" not in sent:  # reported by prefill's own request id, which vLLM knows
        assert time.monotonic() < deadline, "prefill never reported the keyed send finished"
        sent |= prefill.get_transfer_results(idle=True)
    assert key not in prefill._keys and other_key in prefill._keys  # the refused one is still held for its decode


def test_a_pull_with_another_prompts_digest_is_refused_by_request_id_too(pair):
    """The digest is checked on every Pull that carries one, by request id as well (sequential mode). Cost: < 1 s."""
    decode, prefill, decode_kv, _ = pair
    prefill.start_load_kv(PdPairConnectorMetadata(reqs_to_send=[
        SendRequest("p1", [1], time.monotonic() + 60, prompt_digest=bytes(range(32)))]))
    decode.start_load_kv(PdPairConnectorMetadata(reqs_to_recv=[RecvRequest("d1", "p1", 0, [2], "prefill-0",
                                                                            bytes(32))]))
    _, failed = settle(decode, {"d1"}, idle=True)
    assert failed == {"d1"}
    assert all(bool((decode_kv[name][2] == -1).all()) for name in LAYERS)


def test_a_keyed_pull_may_wait_for_prefill_longer_than_the_hang_timeout_without_a_deficit():
    """Both legs at once on a pair with a 1 s hang timeout: decode's keyed Pull waits 2.5 s for prefill's
    computation (past the hang timeout, and past the half of it a request-id Pull may be parked) with no open
    transfer in decode's health accounts (never hung), then is served at once when the send comes (PullStarted opens
    its account, the signals close it). Cost: about 3 s."""
    port = free_port()
    decode = DecodeWorker(dataclasses.replace(config(contract.ROLE_DECODE, port), hang_timeout_seconds=1.0), 0, 1, 32,
                          "0.32.0")
    prefill = PrefillWorker(dataclasses.replace(config(contract.ROLE_PREFILL, port), hang_timeout_seconds=1.0), 0, 1,
                            32, "0.32.0")
    decode_kv = {name: torch.full((NUM_BLOCKS, *BLOCK_SHAPE), -1.0) for name in LAYERS}
    prefill_kv = kv_caches(0.0)
    try:
        decode.register_kv_caches(decode_kv, NUM_BLOCKS)
        prefill.register_kv_caches(prefill_kv, NUM_BLOCKS)
        assert prefill.side.connected.wait(DEADLINE) and decode.side.connected.wait(DEADLINE)
        key, digest = "t-" + "c" * 32, bytes(range(32))
        decode.start_load_kv(PdPairConnectorMetadata(reqs_to_recv=[
            RecvRequest("d1", key, 0, [2], "prefill-0", digest, keyed=True)]))
        waited = time.monotonic() + 2.5
        while time.monotonic() < waited:
            assert decode.accounts.health().stuck is None, "a Pull waiting for prefill's computation is not a hang"
            assert not decode.get_transfer_results()[0]
            time.sleep(0.1)
        prefill.start_load_kv(PdPairConnectorMetadata(reqs_to_send=[
            SendRequest("internal", [5], time.monotonic() + 60, transfer_key=key, prompt_digest=digest)]))
        _, failed = settle(decode, {"d1"}, idle=True)
        assert failed == set()
        assert all(torch.equal(decode_kv[name][2], prefill_kv[name][5]) for name in LAYERS)
        assert decode.accounts.open_transfers() == 0 and decode.stats.data["transfers_ok"] == 1
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_keyed_pull_whose_prompt_is_never_computed_fails_cleanly_at_prefills_bound():
    """Both legs at once, a prefill leg that never arrives (0.5 s hang timeout, so prefill's bound on a keyed Pull is
    2 s): prefill refuses the parked Pull at its bound and decode fails the load at once, as a failed load, not a
    transfer's timeout: no health account was ever opened, no deficit, nothing counted as a timeout. The engine tier
    drives the router's side of the same on real engines. Cost: about 3 s."""
    port = free_port()
    decode = DecodeWorker(dataclasses.replace(config(contract.ROLE_DECODE, port), hang_timeout_seconds=0.5), 0, 1, 32,
                          "0.32.0")
    prefill = PrefillWorker(dataclasses.replace(config(contract.ROLE_PREFILL, port), hang_timeout_seconds=0.5), 0, 1,
                            32, "0.32.0")
    try:
        decode.register_kv_caches({name: torch.full((NUM_BLOCKS, *BLOCK_SHAPE), -1.0) for name in LAYERS}, NUM_BLOCKS)
        prefill.register_kv_caches(kv_caches(0.0), NUM_BLOCKS)
        assert prefill.side.connected.wait(DEADLINE) and decode.side.connected.wait(DEADLINE)
        started = time.monotonic()
        decode.start_load_kv(PdPairConnectorMetadata(reqs_to_recv=[
            RecvRequest("d1", "t-" + "d" * 32, 0, [2], "prefill-0", bytes(32), keyed=True)]))
        _, failed = settle(decode, {"d1"}, idle=True)
        elapsed = time.monotonic() - started
        assert failed == {"d1"}
        bound = keyed_pull_deadline(0.5, 0.0)
        assert bound * 0.9 <= elapsed <= bound + 5, elapsed
        health = decode.accounts.health()
        assert health.stuck is None and decode.stats.data["transfers_timed_out"] == 0, (health, decode.stats.data)
        assert decode.stats.data["transfers_failed"] == 1 and decode.accounts.open_transfers() == 0
    finally:
        prefill.shutdown()
        decode.shutdown()
