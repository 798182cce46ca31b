"""The side channel with real threads, real ZMQ sockets and the real tcp transport (pdpair.native): decode listens,
prefill connects (retrying while decode is absent), both init the pair and exchange regions, Pulls flow, generation
mismatches are refused, and stop() joins the threads and frees the port."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
import torch

from pdpair.connector.decode_side_channel import DecodeSideChannel
from pdpair.connector.side_channel import HandshakeError
from pdpair.connector.prefill_side_channel import PrefillSideChannel
from pdpair.contract import parse_ports_in_use
from pdpair.connector.metadata import KvLayout, Pull, PullDone, compatibility_factors, compatibility_hash
from pdpair.connector.signals import SignalAccounts
from pdpair.connector.transports.tcp import TcpTransport
from devcluster.ports import free_port, port_is_free
from tests.side_channel_support import TEST_KEY_BYTES

FACTORS = compatibility_factors(KvLayout(["l0"], [4096], 32, "torch.float32", 1), "0.32.0")
HASH = compatibility_hash(FACTORS)


class Side:
    """One side's KV buffer and callbacks, recording what happened."""

    def __init__(self, fill: float) -> None:
        self.buffer = torch.full((1024,), fill, dtype=torch.float32)
        self.pulls: list[Pull] = []
        self.done: list[PullDone] = []
        self.failed = []
        self.indices: list[int] = []
        self.got_pull = threading.Event()
        self.got_done = threading.Event()

    def register(self, comm):
        self.indices = [comm.register_region(self.buffer.data_ptr(), 4096)]
        return comm.local_region_table(), self.indices, 1


def make_decode(port: int, side: Side, generation: int = 4, host: str = "127.0.0.1"):
    accounts = SignalAccounts("decode", 5.0, generation=generation)
    channel = DecodeSideChannel(
        host=host, port=port, tp_rank=0, generation=generation, transport=TcpTransport(), hang_timeout_seconds=5.0,
        local_hash=HASH, factors=FACTORS, key=TEST_KEY_BYTES, register_regions=side.register,
        on_pull_done=lambda d: (side.done.append(d), side.got_done.set()),
        on_pull_failed=lambda failed, sender: side.failed.append(failed), on_disconnect=lambda edge, reason: None, accounts=accounts,
    )
    return channel, accounts


def make_prefill(port: int, side: Side, generation: int = 4):
    accounts = SignalAccounts("prefill", 5.0, generation=generation)

    def on_pull(pull: Pull):
        side.pulls.append(pull)
        comm = channel.comm
        comm.put_signal(side.indices[0], 0, side.peer_indices[0], 0, 4096, pull.signal_slot)
        comm.flush(time.monotonic() + 5)
        side.got_pull.set()
        return PullDone(pull.transfer_id, 4096)

    def on_connected(welcome):
        side.peer_indices = welcome.region_indices

    channel = PrefillSideChannel(
        peer_host="127.0.0.1", peer_port=port, tp_rank=0, generation=generation, pair="p", transport=TcpTransport(),
        hang_timeout_seconds=5.0, local_hash=HASH, factors=FACTORS, key=TEST_KEY_BYTES, register_regions=side.register,
        on_pull=on_pull,
        on_tick=lambda: [], on_connected=on_connected, accounts=accounts,
    )
    return channel, accounts


def handshakes(accounts: SignalAccounts, outcome: str) -> float:
    value = accounts.registry.get_sample_value("pdpair_handshakes_total", {"role": accounts.role, "rank": accounts.rank, "outcome": outcome})
    return value or 0.0


def test_prefill_first_retries_then_pairs_and_moves_bytes():
    port = free_port()
    decode_side, prefill_side = Side(0.0), Side(7.0)
    prefill, prefill_accounts = make_prefill(port, prefill_side)
    decode, decode_accounts = make_decode(port, decode_side)
    prefill.start()
    try:
        time.sleep(1.0)
        assert prefill.attempts >= 2 and not prefill.connected.is_set()
        assert handshakes(prefill_accounts, "retry") >= 2
        decode.start_and_wait()
        assert decode_accounts.registry.get_sample_value("pdpair_listener_ready", {"role": "decode", "rank": "0"}) == 1
        assert prefill.connected.wait(15) and decode.connected.wait(5)
        assert handshakes(decode_accounts, "ok") == 1 and handshakes(prefill_accounts, "ok") == 1

        slot = 3
        base = decode.comm.read_signal(slot)
        decode.post(Pull("d-1", "p-1", 0, [0], slot, 1))
        assert prefill_side.got_pull.wait(10)
        decode.comm.wait_signal(slot, base + 1, time.monotonic() + 5)
        assert torch.equal(decode_side.buffer, prefill_side.buffer)
        assert decode_side.got_done.wait(5) and decode_side.done[0].nbytes == 4096
    finally:
        prefill.stop()
        decode.stop()
    assert not prefill.is_alive() and not decode.is_alive()
    assert port_is_free(port)


def test_generation_mismatch_is_refused_with_a_clear_log_line(caplog):
    port = free_port()
    decode, decode_accounts = make_decode(port, Side(0.0), generation=5)
    prefill, prefill_accounts = make_prefill(port, Side(1.0), generation=4)
    decode.start_and_wait()
    with caplog.at_level(logging.ERROR, logger="pdpair"):
        prefill.start()
        try:
            deadline = time.monotonic() + 10
            while handshakes(decode_accounts, "refused") < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
            assert not prefill.connected.is_set() and not decode.connected.is_set()
        finally:
            prefill.stop()
            decode.stop()
    assert handshakes(decode_accounts, "refused") >= 1 and handshakes(prefill_accounts, "refused") >= 1
    text = caplog.text
    assert "generation mismatch" in text and "PDPAIR_GENERATION=4" in text and "this decode has 5" in text


def test_listener_on_a_taken_port_fails_at_start_naming_it():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        decode, _ = make_decode(port, Side(0.0), host="0.0.0.0")
        with pytest.raises(HandshakeError, match=f"cannot listen on 0.0.0.0:{port}"):
            decode.start_and_wait()
        decode.stop()


def test_stop_joins_the_listener_and_frees_the_port_for_the_next_one():
    port = free_port()
    for _ in range(3):
        decode, _ = make_decode(port, Side(0.0))
        decode.start_and_wait()
        assert not port_is_free(port)
        started = time.monotonic()
        decode.stop()
        assert time.monotonic() - started < 2.0
        assert not decode.is_alive() and port_is_free(port)


def test_prefill_notices_a_decode_that_went_away_before_its_serve_loop_started(monkeypatch):
    """The race CI hit: decode restarts right after the Welcome, before prefill's thread reaches its serve
    loop. Prefill must still see the disconnect (its DEALER would reconnect silently to the next decode, and a
    watch attached only in the serve loop never fired), else it keeps a pair with a decode that no longer exists.
    Made certain here: the serve loop starts only after decode has stopped. Cost: about 1 s."""
    decode_gone = threading.Event()
    serve = PrefillSideChannel._serve

    def serve_after_decode_is_gone(self):
        decode_gone.wait(15)
        return serve(self)

    monkeypatch.setattr(PrefillSideChannel, "_serve", serve_after_decode_is_gone)
    port = free_port()
    prefill, _ = make_prefill(port, Side(3.0))
    first, _ = make_decode(port, Side(0.0))
    first.start_and_wait()
    prefill.start()
    try:
        assert prefill.connected.wait(15)
        first.stop()
        decode_gone.set()
        deadline = time.monotonic() + 10
        while prefill.connected.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not prefill.connected.is_set(), "prefill must notice that decode went away"
    finally:
        decode_gone.set()
        prefill.stop()


def paired_within(accounts: SignalAccounts, port: int, want: bool, seconds: float = 5.0) -> bool:
    """The pairing state prefill's readiness (/readyz) reads, as it settles after `connected` flips."""
    deadline = time.monotonic() + seconds
    while accounts.paired != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return accounts.paired == want and accounts.registry.get_sample_value(
        "pdpair_peer_paired", {"role": "prefill", "rank": "0", "peer": f"127.0.0.1:{port}"}) == float(want)


def test_prefill_pairs_again_with_a_restarted_decode():
    """Also the pairing state prefill's readiness reads: 0 before, 1 while paired, 0 when decode went, 1 again."""
    port = free_port()
    prefill_side = Side(3.0)
    prefill, prefill_accounts = make_prefill(port, prefill_side)
    first, _ = make_decode(port, Side(0.0))
    assert paired_within(prefill_accounts, port, False, 0)
    first.start_and_wait()
    prefill.start()
    try:
        assert prefill.connected.wait(15) and paired_within(prefill_accounts, port, True)
        old_comm = prefill.comm
        first.stop()  # decode's process restarts (same generation, same port)
        deadline = time.monotonic() + 10
        while prefill.connected.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not prefill.connected.is_set(), "prefill must notice that decode went away"
        assert paired_within(prefill_accounts, port, False)
        second_side = Side(0.0)
        second, _ = make_decode(port, second_side)
        second.start_and_wait()
        try:
            assert prefill.connected.wait(20) and second.connected.wait(5)
            assert paired_within(prefill_accounts, port, True)
            assert prefill.comm is not old_comm
            assert handshakes(prefill_accounts, "ok") == 2
            slot = 1
            base = second.comm.read_signal(slot)
            second.post(Pull("d-2", "p-2", 0, [0], slot, 1))
            second.comm.wait_signal(slot, base + 1, time.monotonic() + 5)
            assert torch.equal(second_side.buffer, prefill_side.buffer)
        finally:
            second.stop()
    finally:
        prefill.stop()


def test_prefill_send_to_a_decode_that_stopped_reading_times_out_instead_of_blocking(monkeypatch, caplog):
    """Decode's side-channel thread hangs (its PullDone callback never returns), so it stops reading; prefill keeps
    sending until ZMQ's high-water mark and the kernel buffers are full. The send must fail after SNDTIMEO and
    prefill must drop the pair and handshake again, not block its thread forever."""
    monkeypatch.setattr("pdpair.connector.side_channel.SEND_TIMEOUT_SECONDS", 1.0)  # the sockets' SNDTIMEO
    monkeypatch.setattr("pdpair.connector.prefill_side_channel.SEND_TIMEOUT_SECONDS", 1.0)  # its log line
    port = free_port()
    decode_side, prefill_side = Side(0.0), Side(2.0)
    release = threading.Event()
    decode, _ = make_decode(port, decode_side)
    decode.on_pull_done = lambda done: release.wait(60)  # decode's loop is stuck from the first PullDone on
    flood = threading.Event()
    prefill, prefill_accounts = make_prefill(port, prefill_side)
    prefill.on_tick = lambda: [PullDone(f"t-{k}", 4096) for k in range(20000)] if flood.is_set() else []
    decode.start_and_wait()
    prefill.start()
    try:
        assert prefill.connected.wait(15) and decode.connected.wait(5)
        with caplog.at_level(logging.ERROR, logger="pdpair"):
            flood.set()
            deadline = time.monotonic() + 60
            while prefill.connected.is_set() and time.monotonic() < deadline:
                time.sleep(0.1)
            flood.clear()
            assert not prefill.connected.is_set(), "prefill's send blocked past its timeout (or never filled up)"
        assert "side channel to decode" in caplog.text and "is stuck (decode took nothing for 1s)" in caplog.text
        assert prefill.comm is None
    finally:
        started = time.monotonic()
        prefill.stop()
        assert time.monotonic() - started < 5, "prefill's thread must stop promptly, no send may block it"
        release.set()
        decode.on_pull_done = lambda done: None
        decode.stop(timeout=30)


def test_decode_pull_to_a_prefill_that_is_gone_fails_at_once():
    """ROUTER_MANDATORY: a Pull for a prefill whose connection is gone becomes a PullFailed now, not a silent drop
    that decode only notices at its hang timeout."""
    port = free_port()
    decode_side = Side(0.0)
    decode, _ = make_decode(port, decode_side)
    prefill, _ = make_prefill(port, Side(1.0))
    decode.start_and_wait()
    prefill.start()
    try:
        assert prefill.connected.wait(15) and decode.connected.wait(5)
        prefill.stop()
        time.sleep(0.5)  # the ROUTER learns of the disconnect
        decode.post(Pull("d-gone", "p-gone", 0, [0], 2, 1))
        deadline = time.monotonic() + 5
        while not decode_side.failed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [f.transfer_id for f in decode_side.failed] == ["d-gone"]
        assert "Pull not delivered to prefill: prefill is gone" in decode_side.failed[0].reason
    finally:
        prefill.stop()
        decode.stop()


def test_listener_on_a_taken_port_tells_the_operator_in_the_termination_message(tmp_path, monkeypatch):
    """The race after the pod's preflight: the connector's own EADDRINUSE names the port the way the preflight does."""
    log = tmp_path / "termination-log"
    log.write_text("")
    monkeypatch.setenv("PDPAIR_TERMINATION_LOG", str(log))
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        decode, _ = make_decode(port, Side(0.0), host="0.0.0.0")
        with pytest.raises(HandshakeError):
            decode.start_and_wait()
        decode.stop()
    assert parse_ports_in_use(log.read_text()) == (port,)
    assert "side-channel listener" in log.read_text()
