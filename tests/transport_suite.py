"""Transfer tests every PairTransport must pass (tcp and flagcx run the same ones).

Use: subclass `TransportSuite` in a test module and implement `new_transport(slots)`, returning a fresh
PairTransport whose puts keep at most `slots` in flight. Both ranks run in this process, on two threads where the
API blocks (init_pair, and register_region, which is collective for FlagCX).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from pdpair.connector.transports.base import (
    RANK_DECODE,
    RANK_PREFILL,
    PairComm,
    PairTransport,
    SignalWaitTimeout,
    TransportError,
    deadline_in,
)

SETUP_SECONDS = 30.0
TRANSFER_SECONDS = 60.0


@dataclass
class Pair:
    """Rank 0 (sender) and rank 1 (receiver), each with one registered buffer."""

    sender: PairComm
    receiver: PairComm
    src: ctypes.Array
    dst: ctypes.Array
    src_region: int
    dst_region: int
    transports: list[PairTransport] = field(default_factory=list)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
        for transport in self.transports:
            transport.close()


def connect_pair(t0: PairTransport, t1: PairTransport, src_size: int, dst_size: int) -> Pair:
    """Init both ranks concurrently, register one buffer on each, exchange region tables."""
    uid = t0.create_unique_id()
    deadline = deadline_in(SETUP_SECONDS)
    src = (ctypes.c_char * src_size)()
    dst = (ctypes.c_char * dst_size)()
    with ThreadPoolExecutor(2) as pool:
        f0 = pool.submit(t0.init_pair, uid, RANK_PREFILL, deadline)
        f1 = pool.submit(t1.init_pair, uid, RANK_DECODE, deadline)
        sender, receiver = f0.result(), f1.result()
        r0 = pool.submit(sender.register_region, ctypes.addressof(src), src_size)
        r1 = pool.submit(receiver.register_region, ctypes.addressof(dst), dst_size)
        src_region, dst_region = r0.result(), r1.result()
    sender.set_peer_region_table(receiver.local_region_table())
    receiver.set_peer_region_table(sender.local_region_table())
    return Pair(sender, receiver, src, dst, src_region, dst_region, [t0, t1])


def fill_random(buf: ctypes.Array) -> bytes:
    data = os.urandom(len(buf))
    ctypes.memmove(buf, data, len(data))
    return data


class TransportSuite:
    """The shared transfer tests. Subclasses implement `new_transport`."""

    def new_transport(self, slots: int) -> PairTransport:
        raise NotImplementedError

    def make_pair(self, src_size: int, dst_size: int | None = None, slots: int = 256) -> Pair:
        t0 = self.new_transport(slots)
        t1 = self.new_transport(slots)
        return connect_pair(t0, t1, src_size, src_size if dst_size is None else dst_size)

    @pytest.fixture
    def pair_factory(self):
        made: list[Pair] = []

        def make(src_size: int, dst_size: int | None = None, slots: int = 256) -> Pair:
            pair = self.make_pair(src_size, dst_size, slots)
            made.append(pair)
            return pair

        yield make
        for pair in made:
            pair.close()

    def test_put_signal_then_wait(self, pair_factory):
        pair = pair_factory(1 << 16)
        data = fill_random(pair.src)
        pair.sender.put_signal(pair.src_region, 0, pair.dst_region, 0, len(data), signal_slot=3)
        pair.receiver.wait_signal(3, 1, deadline_in(TRANSFER_SECONDS))
        assert bytes(pair.dst) == data
        assert pair.receiver.read_signal(3) == 1
        assert pair.receiver.read_signal(2) == 0
        pair.sender.flush(deadline_in(TRANSFER_SECONDS))
        assert pair.sender.counters().inflight == 0

    def test_offsets_land_where_asked(self, pair_factory):
        pair = pair_factory(4096, 8192)
        data = fill_random(pair.src)
        pair.sender.put_signal(pair.src_region, 1000, pair.dst_region, 5000, 3000, signal_slot=0)
        pair.receiver.wait_signal(0, 1, deadline_in(TRANSFER_SECONDS))
        dst = bytes(pair.dst)
        assert dst[5000:8000] == data[1000:4000]
        assert dst[:5000] == bytes(5000) and dst[8000:] == bytes(192)

    def test_data_visible_before_its_signal(self, pair_factory):
        chunk, count = 256 * 1024, 48
        pair = pair_factory(chunk * count)
        data = fill_random(pair.src)
        problems: list[str] = []

        def receive() -> None:
            deadline = deadline_in(TRANSFER_SECONDS)
            for k in range(count):
                pair.receiver.wait_signal(k, 1, deadline)
                # read right after the signal: every byte of chunk k must already be there
                got = ctypes.string_at(ctypes.addressof(pair.dst) + k * chunk, chunk)
                if got != data[k * chunk : (k + 1) * chunk]:
                    problems.append(f"chunk {k} incomplete when its signal arrived")

        receiver = threading.Thread(target=receive)
        receiver.start()
        for k in range(count):
            pair.sender.put_signal(pair.src_region, k * chunk, pair.dst_region, k * chunk, chunk, signal_slot=k)
        receiver.join(TRANSFER_SECONDS + 5)
        assert not receiver.is_alive()
        assert problems == []
        assert [pair.receiver.read_signal(k) for k in range(count)] == [1] * count

    def test_counted_waits_on_one_slot(self, pair_factory):
        chunk, count = 64 * 1024, 32
        pair = pair_factory(chunk * count)
        data = fill_random(pair.src)
        problems: list[str] = []

        def receive() -> None:
            deadline = deadline_in(TRANSFER_SECONDS)
            for n in range(1, count + 1):
                pair.receiver.wait_signal(7, n, deadline)
                done = ctypes.string_at(ctypes.addressof(pair.dst), n * chunk)
                if done != data[: n * chunk]:
                    problems.append(f"after {n} signals the first {n} chunks are not all there")

        receiver = threading.Thread(target=receive)
        receiver.start()
        for k in range(count):
            pair.sender.put_signal(pair.src_region, k * chunk, pair.dst_region, k * chunk, chunk, signal_slot=7)
        receiver.join(TRANSFER_SECONDS + 5)
        assert not receiver.is_alive()
        assert problems == []

    def test_oversubscription_all_arrive_and_inflight_capped(self, pair_factory):
        slots, puts, size = 4, 2000, 64
        pair = pair_factory(puts * size, slots=slots)
        data = fill_random(pair.src)
        max_inflight = 0
        for k in range(puts):
            pair.sender.put_signal(pair.src_region, k * size, pair.dst_region, k * size, size, signal_slot=1)
            max_inflight = max(max_inflight, pair.sender.counters().inflight)
        pair.receiver.wait_signal(1, puts, deadline_in(TRANSFER_SECONDS))
        pair.sender.flush(deadline_in(TRANSFER_SECONDS))
        assert bytes(pair.dst) == data
        assert pair.receiver.read_signal(1) == puts
        counters = pair.sender.counters()
        assert max_inflight <= slots
        assert counters.slots == slots
        assert counters.inflight == 0
        assert counters.requeues > 0, "2000 puts through 4 slots never had to wait: the cap is not enforced"

    def test_exactly_one_per_put(self, pair_factory):
        pair = pair_factory(4096)
        fill_random(pair.src)
        plan = {0: 1, 1: 2, 2: 3, 5: 10}
        for slot, n in plan.items():
            for _ in range(n):
                pair.sender.put_signal(pair.src_region, 0, pair.dst_region, 0, 16, signal_slot=slot)
        pair.sender.flush(deadline_in(TRANSFER_SECONDS))
        for slot, n in plan.items():
            pair.receiver.wait_signal(slot, n, deadline_in(TRANSFER_SECONDS))
        time.sleep(0.2)  # anything extra (a running total) would have landed by now
        assert {slot: pair.receiver.read_signal(slot) for slot in range(8)} == {
            0: 1, 1: 2, 2: 3, 3: 0, 4: 0, 5: 10, 6: 0, 7: 0
        }

    def test_zero_byte_put_signals(self, pair_factory):
        pair = pair_factory(64)
        pair.sender.put_signal(pair.src_region, 0, pair.dst_region, 0, 0, signal_slot=9)
        pair.receiver.wait_signal(9, 1, deadline_in(TRANSFER_SECONDS))
        assert pair.receiver.read_signal(9) == 1

    def test_wait_deadline_raises_signal_wait_timeout(self, pair_factory):
        pair = pair_factory(64)
        started = time.monotonic()
        with pytest.raises(SignalWaitTimeout) as info:
            pair.receiver.wait_signal(4, 1, deadline_in(0.3))
        waited = time.monotonic() - started
        assert 0.29 <= waited < 3.0
        assert (info.value.signal_slot, info.value.expected, info.value.observed) == (4, 1, 0)

        pair.sender.put_signal(pair.src_region, 0, pair.dst_region, 0, 8, signal_slot=4)
        pair.receiver.wait_signal(4, 1, deadline_in(TRANSFER_SECONDS))
        with pytest.raises(SignalWaitTimeout) as info:
            pair.receiver.wait_signal(4, 2, deadline_in(0.2))
        assert (info.value.expected, info.value.observed) == (2, 1)

    def test_out_of_bounds_put_refused_and_nothing_arrives(self, pair_factory):
        pair = pair_factory(1024, 512)
        fill_random(pair.src)
        with pytest.raises((ValueError, TransportError)):
            pair.sender.put_signal(pair.src_region, 0, pair.dst_region, 0, 1024, signal_slot=0)
        with pytest.raises((ValueError, TransportError)):
            pair.sender.put_signal(pair.src_region, 0, pair.dst_region + 1, 0, 8, signal_slot=0)
        time.sleep(0.1)
        assert pair.receiver.read_signal(0) == 0
        assert bytes(pair.dst) == bytes(512)

    def test_bad_signal_slot_refused(self, pair_factory):
        pair = pair_factory(64)
        fill_random(pair.src)
        with pytest.raises((ValueError, TransportError)):
            pair.receiver.wait_signal(pair.receiver.num_signal_slots, 1, deadline_in(1))
        with pytest.raises((ValueError, TransportError)):
            too_far = pair.receiver.num_signal_slots
            pair.sender.put_signal(pair.src_region, 0, pair.dst_region, 0, 8, signal_slot=too_far)
        with pytest.raises((ValueError, TransportError)):
            pair.sender.put_signal(pair.src_region, 0, pair.dst_region, 0, 8, signal_slot=-1)
        time.sleep(0.1)
        assert bytes(pair.dst) == bytes(len(pair.dst))  # nothing was written by the refused puts

    def test_close_is_idempotent(self, pair_factory):
        pair = pair_factory(64)
        pair.sender.close()
        pair.sender.close()
        with pytest.raises(TransportError):
            pair.sender.put_signal(pair.src_region, 0, pair.dst_region, 0, 8, signal_slot=0)
