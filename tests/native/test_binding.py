"""Tests of pdpair.native, the cffi binding of native/: real sockets over loopback, real processes."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from pdpair import native
from pdpair.native import (
    Closed,
    Context,
    DataRejected,
    Fault,
    PeerClosed,
    Refusal,
    RemoteRejected,
    Status,
    TransportError,
    WaitTimeout,
)

TIMEOUT = 10.0


@dataclass
class Pair:
    ctx_a: Context
    ctx_b: Context
    a: native.Connection  # accepted side
    b: native.Connection  # connecting side
    mem_a: bytearray
    mem_b: bytearray
    port: int


def marry(ctx_a: Context, ctx_b: Context, port: int = 0) -> tuple[native.Connection, native.Connection, int]:
    with ctx_a.listen("127.0.0.1", port) as listener, ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(listener.accept, timeout=TIMEOUT)
        b = ctx_b.connect("127.0.0.1", listener.port, timeout=TIMEOUT)
        return accepted.result(), b, listener.port


def _married(ctx_a: Context, ctx_b: Context, size: int):
    """Both contexts with one region of `size` bytes each, connected; everything closed afterwards."""
    mem_a, mem_b = bytearray(size), bytearray(size)
    ctx_a.register(mem_a)
    ctx_b.register(mem_b)
    a, b, port = marry(ctx_a, ctx_b)
    yield Pair(ctx_a, ctx_b, a, b, mem_a, mem_b, port)
    a.close()
    b.close()
    ctx_a.close()
    ctx_b.close()


@pytest.fixture
def pair():
    yield from _married(Context(token=5), Context(token=5), 1 << 20)


def test_version_and_status_names():
    assert native.version() == "0.1.0"
    assert Status.OK == 0 and Status.TIMEOUT != Status.PEER_CLOSED
    err = TransportError(12345)
    assert err.status_name == "PDPAIR_UNKNOWN" and "unknown pdpair status" in str(err)
    assert TransportError(Status.PEER_CLOSED).status_name == "PDPAIR_PEER_CLOSED"


def test_put_signal_roundtrip(pair: Pair):
    pair.mem_b[:4096] = bytes(range(256)) * 16
    req = pair.b.put_signal(0, 0, 0, 1000, 4096, signal_slot=3)
    assert pair.a.wait_signal(3, 1, timeout=TIMEOUT) == 1
    assert pair.mem_a[1000:5096] == pair.mem_b[:4096]
    pair.b.wait(req, timeout=TIMEOUT)
    assert pair.b.test(req) is True
    req2 = pair.b.put(pair.ctx_b.regions[0], 10, 0, 0, 5)
    pair.b.signal(3)
    pair.b.flush(timeout=TIMEOUT)
    assert pair.b.test(req2) and req2 == req + 1
    assert pair.a.read_signal(3) == 2
    assert pair.mem_a[:5] == pair.mem_b[10:15]
    pair.a.reset_signal(3)
    assert pair.a.read_signal(3) == 0
    stats = pair.b.stats()
    assert (stats.slots, stats.posted, stats.completed, stats.signals_sent, stats.bytes_sent) == (256, 3, 3, 2, 4101)
    assert stats.outstanding == 0
    assert pair.a.stats().signals_received == 2
    assert pair.a.remote_regions == [1 << 20] and pair.a.state == Status.OK


def test_register_pointer_and_late_region(pair: Pair):
    raw = ctypes.create_string_buffer(8192)
    region = pair.ctx_a.register_pointer(ctypes.addressof(raw), 8192, keepalive=raw)
    assert region.index == 1 and region.size == 8192
    pair.b.wait_remote_regions(2, timeout=TIMEOUT)
    assert pair.b.remote_regions == [1 << 20, 8192]
    pair.mem_b[:100] = b"x" * 100
    pair.b.put_signal(0, 0, 1, 8000, 100, signal_slot=0)
    pair.a.wait_signal(0, 1, timeout=TIMEOUT)
    assert raw.raw[8000:8100] == b"x" * 100


def test_bad_arguments_fail_early(pair: Pair):
    with pytest.raises(TransportError) as info:
        pair.b.put(0, 0, 0, (1 << 20) - 10, 11)  # past the peer's region end
    assert info.value.status == Status.INVALID_ARGUMENT and "remote range" in info.value.detail
    with pytest.raises(TransportError):
        pair.b.put(7, 0, 0, 0, 1)  # unknown local region
    with pytest.raises(ValueError):
        pair.a.wait_signal(0, 1, timeout=-1)
    with pytest.raises(TypeError):
        pair.a.wait_signal(0, 1, timeout=None)
    with pytest.raises(ValueError):
        pair.a.wait_signal(0, 1, timeout=float("inf"))
    with pytest.raises(ValueError):
        pair.b.put(0, -1, 0, 0, 1)
    with pytest.raises(TypeError):
        pair.ctx_a.register(b"immutable bytes")
    with pytest.raises(ValueError):
        Context(request_slots=0)
    assert pair.b.stats().posted == 0


def test_receiver_rejects_out_of_bounds_put(pair: Pair):
    pair.b.set_fault(Fault.SKIP_SENDER_BOUNDS_CHECK, 1)  # TEST ONLY: let the peer's own check decide
    bad = pair.b.put_signal(0, 0, 0, (1 << 20) - 10, 100, signal_slot=1)
    good = pair.b.put_signal(0, 0, 0, 0, 100, signal_slot=2)
    with pytest.raises(RemoteRejected) as info:
        pair.b.wait(bad, timeout=TIMEOUT)
    assert "outside its regions" in info.value.detail
    pair.b.wait(good, timeout=TIMEOUT)
    assert pair.a.wait_signal(2, 1, timeout=TIMEOUT) == 1
    with pytest.raises(DataRejected):  # the slot the refused put named fails at once
        pair.a.wait_signal(1, 1, timeout=TIMEOUT)
    pair.a.reset_signal(1)
    assert pair.a.wait_signal(1, 0, timeout=0) == 0
    with pytest.raises(RemoteRejected):
        pair.b.flush(timeout=TIMEOUT)
    assert pair.b.stats().rejected == 1 and pair.b.state == Status.OK


def test_corrupted_put_is_refused_and_fails_the_waiter_at_once(pair: Pair):
    """A byte flipped on the way after the checksum (TEST ONLY fault): refused, counted, never signalled; the waiter
    raises DataRejected within a second instead of at its 10 s deadline."""
    pair.mem_b[:8192] = bytes(range(256)) * 32
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(pair.a.wait_signal, 4, 2, timeout=TIMEOUT)
        pair.b.set_fault(Fault.CORRUPT_PUTS, 1)
        start = time.monotonic()
        bad = pair.b.put_signal(0, 0, 0, 0, 4096, signal_slot=4)
        good = pair.b.put_signal(0, 4096, 0, 4096, 4096, signal_slot=4)
        with pytest.raises(DataRejected):
            waiting.result()
        assert time.monotonic() - start < 3.0
    with pytest.raises(RemoteRejected) as info:
        pair.b.wait(bad, timeout=TIMEOUT)
    assert "checksum" in info.value.detail
    pair.b.wait(good, timeout=TIMEOUT)
    assert pair.a.read_signal(4) == 1 and pair.mem_a[4096:8192] == pair.mem_b[4096:8192]
    stats = pair.a.stats()
    assert (stats.refused_checksum, stats.refused_unknown_transfer, stats.refused_out_of_window) == (1, 0, 0)
    assert stats.signals_received == 1 and stats.bytes_received == 4096
    assert pair.a.slot_refusal(4) == Refusal.CHECKSUM and pair.a.slot_refusal(5) == Refusal.NONE
    pair.a.reset_signal(4)
    assert pair.a.slot_refusal(4) == Refusal.NONE
    assert pair.a.state == Status.OK and pair.b.state == Status.OK


@pytest.fixture
def expecting_pair():
    """a: the receiving side, in expectation mode; b: the sender."""
    yield from _married(Context(token=5, expect_transfers=True, max_transfers=4, max_transfer_windows=8),
                        Context(token=5), 1 << 16)


def test_expectation_mode_accepts_only_declared_transfers(expecting_pair: Pair):
    p = expecting_pair
    p.mem_b[:] = bytes(range(256)) * 256
    p.a.expect(77, 3, 6, [(0, 4096, 4096), (p.ctx_a.regions[0], 8192, 4096)], expected_signals=4)  # [4096, 12288)
    assert p.a.stats().transfers_outstanding == 1
    p.b.put_signal(0, 0, 0, 4096, 4096, 6, transfer_id=77, generation=3)  # one put per window, each written once
    p.b.put_signal(0, 4096, 0, 8192, 4096, 6, transfer_id=77, generation=3)
    p.b.signal(6, transfer_id=77, generation=3)
    assert p.a.wait_signal(6, 3, timeout=TIMEOUT) == 3
    assert p.mem_a[4096:12288] == p.mem_b[:8192]
    refused = [
        dict(transfer_id=77, generation=2),   # stale generation
        dict(transfer_id=0, generation=0),    # untagged
        dict(transfer_id=78, generation=3),   # never declared
    ]
    for tag in refused:
        with pytest.raises(RemoteRejected) as info:
            p.b.wait(p.b.put_signal(0, 0, 0, 4096, 64, 6, **tag), timeout=TIMEOUT)
        assert "not a transfer it expects" in info.value.detail
    for dst, slot in ((0, 6), (12288 - 32, 6), (4096, 7)):  # before, across the end of the windows, another slot
        with pytest.raises(RemoteRejected) as info:
            p.b.wait(p.b.put_signal(0, 0, 0, dst, 64, slot, transfer_id=77, generation=3), timeout=TIMEOUT)
        assert "windows" in info.value.detail
    with pytest.raises(DataRejected):
        p.a.wait_signal(6, 3, timeout=TIMEOUT)  # reached 3, but refused puts named the slot
    stats = p.a.stats()
    assert (stats.refused_unknown_transfer, stats.refused_out_of_window, stats.refused_checksum) == (3, 3, 0)
    assert stats.bytes_received == 8192 and p.mem_a[:4096] == bytes(4096) and p.mem_a[12288:] == bytes(len(p.mem_a) - 12288)
    p.a.retire(77, 3, timeout=TIMEOUT)
    assert p.a.stats().transfers_outstanding == 0
    with pytest.raises(RemoteRejected):
        p.b.wait(p.b.put(0, 0, 0, 4096, 64, transfer_id=77, generation=3), timeout=TIMEOUT)
    p.a.expect(77, 4, 6, [(0, 0, 64)])  # the next generation of the id starts clean on the slot
    p.a.reset_signal(6)
    p.b.put_signal(0, 0, 0, 0, 64, 6, transfer_id=77, generation=4)
    assert p.a.wait_signal(6, 1, timeout=TIMEOUT) == 1
    assert p.a.state == Status.OK and p.b.state == Status.OK


def test_expectation_table_is_bounded(expecting_pair: Pair):
    p = expecting_pair
    with pytest.raises(TransportError) as info:
        p.a.expect(1, 0, 0, [(0, i * 128, 64) for i in range(9)])
    assert info.value.status == Status.EXHAUSTED
    for transfer in range(1, 5):
        p.a.expect(transfer, 0, transfer, [(0, transfer * 128, 64)])
    with pytest.raises(TransportError) as info:
        p.a.expect(5, 0, 5, [])
    assert info.value.status == Status.EXHAUSTED and "max_transfers" in info.value.detail
    with pytest.raises(TransportError) as info:
        p.a.expect(1, 1, 0, [])
    assert info.value.status == Status.INVALID_ARGUMENT and "already declared" in info.value.detail
    with pytest.raises(TransportError) as info:
        p.a.expect(9, 0, 0, [(0, (1 << 16) - 8, 16)])
    assert info.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(TransportError) as info:
        p.a.retire(1, 7, timeout=1)
    assert info.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(TypeError):
        p.a.expect(9, 0, 0, [(0, 1)])
    with pytest.raises(ValueError):
        p.a.expect(9, -1, 0, [])
    with pytest.raises(ValueError):
        p.a.retire(1, 0, timeout=-1)
    for transfer in range(1, 5):
        p.a.retire(transfer, 0, timeout=1)
    p.a.expect(5, 0, 5, [])
    with pytest.raises(TypeError):
        Context(expect_transfers=1)
    with pytest.raises(ValueError):
        Context(max_transfers=0)


def test_fault_injection_wait_times_out_at_deadline(pair: Pair):
    pair.b.set_fault(Fault.DROP_EVERY_NTH_SIGNAL, 4)
    for i in range(40):
        pair.b.put_signal(0, i * 64, 0, i * 64, 64, signal_slot=2)
    pair.b.flush(timeout=TIMEOUT)
    start = time.monotonic()
    with pytest.raises(WaitTimeout) as info:
        pair.a.wait_signal(2, 40, timeout=0.3)
    took = time.monotonic() - start
    assert 0.29 <= took < 1.5, took
    assert info.value.value == 30 and isinstance(info.value, TimeoutError)
    assert pair.b.stats().signals_dropped_by_fault == 10
    assert pair.a.state == Status.OK


def test_oversubscription_no_signal_lost(pair: Pair):
    # Each round stalls the link (TEST ONLY HOLD_SENDS) while 10x the slots are posted, so the backlog is the
    # same on any machine; then it drains through the 256 slots.
    pair.mem_b[:] = os.urandom(len(pair.mem_b))
    total, slots = 100_000, pair.b.stats().slots
    window = 10 * slots
    posted = expected_requeues = 0
    while posted < total:
        burst = min(window, total - posted)
        pair.b.set_fault(Fault.HOLD_SENDS, 1)
        for _ in range(burst):
            off = (posted * 256) % (1 << 20)
            pair.b.put_signal(0, off, 0, off, 256, signal_slot=9)
            posted += 1
        s = pair.b.stats()
        assert (s.queued, s.inflight, s.outstanding) == (burst, 0, burst)
        expected_requeues += max(0, burst - slots)
        pair.b.set_fault(Fault.HOLD_SENDS, 0)
        while (s := pair.b.stats()).completed < posted:
            assert s.inflight <= slots
        pair.b.flush(timeout=TIMEOUT)
    assert pair.a.wait_signal(9, total, timeout=60) == total
    with pytest.raises(WaitTimeout) as info:
        pair.a.wait_signal(9, total + 1, timeout=0.2)
    assert info.value.value == total
    stats = pair.b.stats()
    assert (stats.posted, stats.completed, stats.signals_sent) == (total, total, total)
    assert stats.requeues == expected_requeues > 0
    assert pair.a.stats().signals_received == total
    assert pair.mem_a == pair.mem_b


def test_blocking_wait_releases_the_gil(pair: Pair):
    result: list[object] = []
    waiter = threading.Thread(target=lambda: result.append(pair.a.wait_signal(4, 1, timeout=TIMEOUT)))
    waiter.start()
    spins, deadline = 0, time.monotonic() + 0.3
    while time.monotonic() < deadline:  # Python keeps running while the waiter sits in C
        spins += 1
    pair.b.signal(4)
    waiter.join(TIMEOUT)
    assert result == [1] and spins > 1000


def test_close_wakes_local_and_remote_waiters(pair: Pair):
    errors: dict[str, BaseException] = {}

    def wait(name: str, conn: native.Connection) -> None:
        try:
            conn.wait_signal(0, 1, timeout=30)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertions
            errors[name] = exc

    threads = [threading.Thread(target=wait, args=("local", pair.b)), threading.Thread(target=wait,
                                                                                      args=("remote", pair.a))]
    for t in threads:
        t.start()
    time.sleep(0.1)
    start = time.monotonic()
    pair.b.close()
    for t in threads:
        t.join(5)
    assert time.monotonic() - start < 2
    assert isinstance(errors["local"], Closed)
    assert isinstance(errors["remote"], PeerClosed) and errors["remote"].status_name == "PDPAIR_PEER_CLOSED"
    with pytest.raises(Closed):
        pair.b.signal(0)
    with pytest.raises(PeerClosed):
        pair.a.signal(0)


PEER_SENDER = """
import sys
from pdpair.native import Context
ctx = Context(token=5)
mem = bytearray(1 << 20)
ctx.register(mem)
conn = ctx.connect("127.0.0.1", int(sys.argv[1]), timeout=10)
i = 0
while True:
    conn.put_signal(0, 0, 0, 0, len(mem), signal_slot=0)
    i += 1
    if i % 16 == 0:
        conn.flush(timeout=10)
"""


def test_peer_killed_mid_transfer_errors_within_2s():
    ctx = Context(token=5)
    mem = bytearray(1 << 20)
    ctx.register(mem)
    with ctx.listen("127.0.0.1", 0) as listener:
        child = subprocess.Popen([sys.executable, "-c", PEER_SENDER, str(listener.port)])
        try:
            conn = listener.accept(timeout=30)
            conn.wait_signal(0, 5, timeout=30)  # data is flowing
            outcome: list[object] = []

            def wait_long() -> None:
                try:
                    conn.wait_signal(0, 2**63, timeout=30)
                except TransportError as exc:
                    outcome.append((exc, time.monotonic()))

            waiter = threading.Thread(target=wait_long)
            waiter.start()
            time.sleep(0.1)
            killed = time.monotonic()
            os.kill(child.pid, signal.SIGKILL)
            waiter.join(10)
        finally:
            child.kill()
            child.wait(10)
    assert outcome, "the waiter did not return"
    exc, returned = outcome[0]
    assert exc.status in (Status.PEER_CLOSED, Status.CONNECTION_ERROR)
    assert returned - killed < 2.0
    with pytest.raises(TransportError):  # and later waits fail at once
        conn.wait_signal(0, 2**63, timeout=30)
    conn.close()
    ctx.close()


def test_relisten_on_same_port_after_close():
    port = 0
    for round_ in range(3):
        ctx_a, ctx_b = Context(), Context()
        mem_a, mem_b = bytearray(64), bytearray([round_ + 1]) * 64
        ctx_a.register(mem_a)
        ctx_b.register(mem_b)
        a, b, used = marry(ctx_a, ctx_b, port)
        assert round_ == 0 or used == port
        port = used
        b.put_signal(0, 0, 0, 0, 64, signal_slot=0)
        a.wait_signal(0, 1, timeout=TIMEOUT)
        assert mem_a == mem_b
        a.close()
        b.close()
        ctx_a.close()
        ctx_b.close()


def test_accept_timeout_and_refused_connect():
    ctx = Context()
    listener = ctx.listen("127.0.0.1", 0)
    start = time.monotonic()
    with pytest.raises(WaitTimeout):
        listener.accept(timeout=0.15)
    assert 0.14 <= time.monotonic() - start < 1.0
    with pytest.raises(TransportError) as info:
        ctx.listen("127.0.0.1", listener.port)
    assert info.value.status == Status.ADDRESS_IN_USE
    port = listener.port
    listener.close()
    with pytest.raises(TransportError) as info:
        ctx.connect("127.0.0.1", port, timeout=2)
    assert info.value.status == Status.CONNECTION_REFUSED
    with pytest.raises(Closed):
        listener.accept(timeout=1)
    ctx.close()


def test_token_mismatch_is_refused():
    """The listener closes a peer with another token unanswered (the peer sees the hang-up) and keeps accepting; a
    token set after the listener was bound (set_token) applies to the next peer. About 1 s."""
    ctx_a, ctx_b = Context(token=1), Context(token=2)
    with ctx_a.listen("127.0.0.1", 0) as listener, ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(listener.accept, timeout=1.0)
        with pytest.raises(TransportError) as info:
            ctx_b.connect("127.0.0.1", listener.port, timeout=TIMEOUT)
        assert info.value.status == Status.PEER_CLOSED and "hung up" in info.value.detail
        with pytest.raises(TransportError) as info:
            accepted.result()
        assert "wrong hello" in info.value.detail and "token mismatch" in info.value.detail
        ctx_a.set_token(2)
        accepted = pool.submit(listener.accept, timeout=TIMEOUT)
        conn = ctx_b.connect("127.0.0.1", listener.port, timeout=TIMEOUT)
        accepted.result().close()
        conn.close()
    with pytest.raises(ValueError):
        ctx_a.set_token(-1)


def test_signal_slot_allocation(pair: Pair):
    slots = {pair.a.alloc_signal() for _ in range(10)}
    assert len(slots) == 10 and all(0 <= s < pair.a.signal_slots for s in slots)
    for s in slots:
        pair.a.free_signal(s)
    with pytest.raises(TransportError):
        pair.a.free_signal(next(iter(slots)))
    small = Context(signal_slots=2)
    small.register(bytearray(16))
    a, b, _ = marry(small, Context())
    a.alloc_signal()
    a.alloc_signal()
    with pytest.raises(TransportError) as info:
        a.alloc_signal()
    assert info.value.status == Status.EXHAUSTED
    a.close()
    b.close()


def test_listener_close_wakes_blocked_accept():
    ctx = Context()
    listener = ctx.listen("127.0.0.1", 0)
    with ThreadPoolExecutor(1) as pool:
        blocked = pool.submit(listener.accept, timeout=30)
        time.sleep(0.1)
        start = time.monotonic()
        listener.close()
        with pytest.raises(Closed):
            blocked.result(timeout=5)
        assert time.monotonic() - start < 2
    relisten = ctx.listen("127.0.0.1", listener.port)  # the port is free again at once
    relisten.close()
    ctx.close()


def test_dropped_connection_is_closed_by_its_finalizer():
    import gc

    ctx_a, ctx_b = Context(), Context()
    ctx_a.register(bytearray(64))
    a, b, _ = marry(ctx_a, ctx_b)
    del b
    gc.collect()
    start = time.monotonic()
    with pytest.raises(PeerClosed):
        a.wait_signal(0, 1, timeout=10)
    assert time.monotonic() - start < 2
    a.close()
