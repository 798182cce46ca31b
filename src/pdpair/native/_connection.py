"""Connection: one peer's posts (put, put_signal, signal), declared transfers (expect, retire), completion, signal
slots, its Stats counters and the test-only fault injection (set_fault)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from ._errors import Fault, Refusal, Status, TransportError, _last_error, _raise
from ._handle import Region, _Handle, _region_index, _timeout_ms, _u32, _u64
from ._pdpair_native import ffi, lib

if TYPE_CHECKING:
    from ._context import Context


@dataclass(frozen=True)
class Stats:
    """Counters of one connection (pdpair_conn_stats); `inflight` <= `slots`, `queued` wait for a slot."""

    slots: int
    inflight: int
    queued: int
    requeues: int
    posted: int
    completed: int
    rejected: int
    bytes_sent: int
    bytes_received: int
    signals_sent: int
    signals_received: int
    signals_dropped_by_fault: int
    remote_regions: int
    refused_unknown_transfer: int
    refused_out_of_window: int
    refused_checksum: int
    transfers_outstanding: int
    refused_incomplete: int

    @property
    def outstanding(self) -> int:
        """Posted and not completed (inflight + queued): the contract's pdpair_transport_inflight."""
        return self.posted - self.completed


_STATS_FIELDS = [f.name for f in fields(Stats)]
assert _STATS_FIELDS == [name for name, _ in ffi.typeof("pdpair_conn_stats").fields], "Stats drifted from C"


def _close_conn(ptr: Any, keep: Any) -> None:
    # `keep` (the context's registered buffers) is referenced until the C threads have stopped writing.
    lib.pdpair_conn_close(ptr)


class Connection(_Handle):
    """One peer. Posts return a request id; completion is in order (test/wait/flush). Signals: the peer's
    put_signal adds exactly 1 to one of this connection's `signal_slots` counters after the bytes are in place."""

    def __init__(self, context: Context, ptr: Any):
        super().__init__(ptr, "connection")
        self.context = context
        self.signal_slots: int = lib.pdpair_conn_signal_slots(ptr)
        self._finalizer = weakref.finalize(self, _close_conn, ptr, (context, context._keepalive))

    def _error(self, status: int, operation: str, ptr: Any) -> None:
        _raise(status, _last_error(lib.pdpair_conn_last_error, ptr), operation)

    # --- posts (never block; full slots queue the post and count a requeue) ---
    def put(self, local: Region | int, local_offset: int, remote_region: int, remote_offset: int,
            nbytes: int, *, transfer_id: int = 0, generation: int = 0) -> int:
        """Write local[local_offset:+nbytes] to the peer's region at remote_offset. Returns the request id.
        Do not change the source bytes until the request completes. transfer_id/generation tag the put for a peer
        in expectation mode (0 = untagged, which such a peer refuses)."""
        args = (_u64("transfer_id", transfer_id), _u32("generation", generation), _region_index(local),
                _u64("local_offset", local_offset), _region_index(remote_region),
                _u64("remote_offset", remote_offset), _u64("nbytes", nbytes))
        # The hot path (one call per layer and block of a transfer): the bracket spelled out, not `_in_use()`, which
        # costs an object and two calls more (0.4 us a call measured; thousands of calls a request).
        ptr = self._enter()
        try:
            req = ffi.new("uint64_t *")
            st = lib.pdpair_put_tagged(ptr, *args, req)
            if st != lib.PDPAIR_OK:
                self._error(st, "put", ptr)
            return req[0]
        finally:
            self._leave()

    def put_signal(self, local: Region | int, local_offset: int, remote_region: int, remote_offset: int,
                   nbytes: int, signal_slot: int, *, transfer_id: int = 0, generation: int = 0) -> int:
        """put, then add exactly 1 to the peer's `signal_slot`, visible only after the bytes are in place and their
        checksum matched. transfer_id/generation: as for put."""
        args = (_u64("transfer_id", transfer_id), _u32("generation", generation), _region_index(local),
                _u64("local_offset", local_offset), _region_index(remote_region),
                _u64("remote_offset", remote_offset), _u64("nbytes", nbytes), _u32("signal_slot", signal_slot))
        # The hot path (one call per layer and block of a transfer): the bracket spelled out, not `_in_use()`, which
        # costs an object and two calls more (0.4 us a call measured; thousands of calls a request).
        ptr = self._enter()
        try:
            req = ffi.new("uint64_t *")
            st = lib.pdpair_put_signal_tagged(ptr, *args, req)
            if st != lib.PDPAIR_OK:
                self._error(st, "put_signal", ptr)
            return req[0]
        finally:
            self._leave()

    def signal(self, signal_slot: int, *, transfer_id: int = 0, generation: int = 0) -> int:
        """Add exactly 1 to the peer's `signal_slot`, after every earlier put is in place."""
        slot = _u32("signal_slot", signal_slot)
        tag = (_u64("transfer_id", transfer_id), _u32("generation", generation))
        with self._in_use() as ptr:
            req = ffi.new("uint64_t *")
            st = lib.pdpair_signal_tagged(ptr, *tag, slot, req)
            if st != lib.PDPAIR_OK:
                self._error(st, "signal", ptr)
            return req[0]

    # --- declared transfers (the receiving side of a context with expect_transfers) ---
    def expect(self, transfer_id: int, generation: int, signal_slot: int,
               windows: list[tuple[Region | int, int, int]] | tuple[tuple[Region | int, int, int], ...], *,
               expected_signals: int = 0) -> None:
        """Declare a transfer before asking the peer for it: its puts (tagged transfer_id, generation) are accepted
        only inside these (local region, offset, length) windows and may signal only `signal_slot`; with
        `expected_signals` > 0, none after that many of its signals came (a duplicate is refused unwritten). Clears
        the slot's failed mark. TransportError(INVALID_ARGUMENT) for id 0, a window outside the local regions, an id declared
        already; TransportError(EXHAUSTED) when the connection's max_transfers / max_transfer_windows would be
        exceeded."""
        tag = (_u64("transfer_id", transfer_id), _u32("generation", generation), _u32("signal_slot", signal_slot),
               _u64("expected_signals", expected_signals))
        items = list(windows)
        cw = ffi.new("pdpair_window[]", max(len(items), 1))
        for i, window in enumerate(items):
            try:
                region, offset, length = window
            except (TypeError, ValueError):
                raise TypeError(f"a window is (region, offset, length), got {window!r}") from None
            cw[i].region = _region_index(region)
            cw[i].offset = _u64("window offset", offset)
            cw[i].length = _u64("window length", length)
        with self._in_use() as ptr:
            st = lib.pdpair_conn_expect(ptr, *tag, cw, len(items))
            if st != lib.PDPAIR_OK:
                self._error(st, f"expect transfer {transfer_id}", ptr)

    def retire(self, transfer_id: int, generation: int, *, timeout: float) -> None:
        """End a declared transfer (done, failed or timed out): later puts with its tag are refused, and once this
        returns no byte of it lands any more, so its windows may go to another transfer. A put of it that is
        arriving is waited for up to `timeout`; past that the connection is broken (so the write stops) and
        WaitTimeout is raised. TransportError(INVALID_ARGUMENT) if the tag is not declared."""
        tag = (_u64("transfer_id", transfer_id), _u32("generation", generation))
        ms = _timeout_ms(timeout)
        with self._in_use() as ptr:
            st = lib.pdpair_conn_retire(ptr, *tag, ms)
            if st != lib.PDPAIR_OK:
                self._error(st, f"retire transfer {transfer_id}", ptr)

    # --- completion ---
    def test(self, request: int) -> bool:
        """True if the request completed, False if still in progress; raises if it was rejected or the
        connection broke."""
        request = _u64("request", request)
        with self._in_use() as ptr:
            st = lib.pdpair_conn_test(ptr, request)
            if st == lib.PDPAIR_IN_PROGRESS:
                return False
            if st != lib.PDPAIR_OK:
                self._error(st, f"test request {request}", ptr)
            return True

    def wait(self, request: int, *, timeout: float) -> None:
        """Wait until the request completes (WaitTimeout at the deadline)."""
        request = _u64("request", request)
        ms = _timeout_ms(timeout)
        with self._in_use() as ptr:
            st = lib.pdpair_conn_wait(ptr, request, ms)
            if st != lib.PDPAIR_OK:
                self._error(st, f"wait for request {request}", ptr)

    def flush(self, *, timeout: float) -> None:
        """Wait until every request posted so far has completed. RemoteRejected if one was refused since the
        previous flush."""
        ms = _timeout_ms(timeout)
        with self._in_use() as ptr:
            st = lib.pdpair_conn_flush(ptr, ms)
            if st != lib.PDPAIR_OK:
                self._error(st, "flush", ptr)

    # --- local signal slots ---
    def wait_signal(self, slot: int, expected: int, *, timeout: float) -> int:
        """Wait until signal `slot` >= expected and return its value. WaitTimeout at the deadline (the value
        reached is in the exception's `value`); DataRejected at once when a put meant for the slot was refused here;
        PeerClosed/TransportError once the connection is broken."""
        slot = _u32("slot", slot)
        expected = _u64("expected", expected)
        ms = _timeout_ms(timeout)
        with self._in_use() as ptr:
            value = ffi.new("uint64_t *")
            st = lib.pdpair_conn_wait_signal(ptr, slot, expected, ms, value)
            if st != lib.PDPAIR_OK:
                try:
                    self._error(st, f"wait_signal slot {slot} for {expected}", ptr)
                except TransportError as exc:
                    exc.value = value[0]  # type: ignore[attr-defined]
                    raise
            return value[0]

    def read_signal(self, slot: int) -> int:
        slot = _u32("slot", slot)
        with self._in_use() as ptr:
            value = ffi.new("uint64_t *")
            st = lib.pdpair_conn_read_signal(ptr, slot, value)
            if st != lib.PDPAIR_OK:
                _raise(st, f"slot {slot} is not below signal_slots={self.signal_slots}", "read_signal")
            return value[0]

    def slot_refusal(self, slot: int) -> Refusal:
        """Why `slot` is failed: the Refusal of the first put refused for it since it was last cleared (reset,
        allocated, or declared by expect); Refusal.NONE when it is not failed. Per slot, so one load's reason is its
        own while refusals of other loads are counted on the same connection."""
        slot = _u32("slot", slot)
        with self._in_use() as ptr:
            value = ffi.new("int *")
            st = lib.pdpair_conn_slot_refusal(ptr, slot, value)
            if st != lib.PDPAIR_OK:
                self._error(st, "slot_refusal", ptr)
            return Refusal(value[0])

    def reset_signal(self, slot: int) -> None:
        """Set the slot to 0 and clear its failed mark."""
        slot = _u32("slot", slot)
        with self._in_use() as ptr:
            st = lib.pdpair_conn_reset_signal(ptr, slot)
            if st == lib.PDPAIR_INVALID_ARGUMENT:
                _raise(st, f"slot {slot} is not below signal_slots={self.signal_slots}", "reset_signal")
            if st != lib.PDPAIR_OK:
                self._error(st, "reset_signal", ptr)

    def alloc_signal(self) -> int:
        """A free signal slot, reset to 0 (TransportError EXHAUSTED when all are taken)."""
        with self._in_use() as ptr:
            slot = ffi.new("uint32_t *")
            st = lib.pdpair_conn_alloc_signal(ptr, slot)
            if st != lib.PDPAIR_OK:
                self._error(st, "alloc_signal", ptr)
            return slot[0]

    def free_signal(self, slot: int) -> None:
        slot = _u32("slot", slot)
        with self._in_use() as ptr:
            st = lib.pdpair_conn_free_signal(ptr, slot)
            if st != lib.PDPAIR_OK:
                self._error(st, "free_signal", ptr)

    # --- the peer's regions ---
    @property
    def remote_regions(self) -> list[int]:
        """Sizes of the peer's regions known here, by index."""
        with self._in_use() as ptr:
            sizes = []
            size = ffi.new("uint64_t *")
            for i in range(lib.pdpair_conn_remote_region_count(ptr)):
                if lib.pdpair_conn_remote_region_size(ptr, i, size) == lib.PDPAIR_OK:
                    sizes.append(size[0])
            return sizes

    def wait_remote_regions(self, count: int, *, timeout: float) -> None:
        """Wait until the peer has announced at least `count` regions."""
        count = _u32("count", count)
        ms = _timeout_ms(timeout)
        with self._in_use() as ptr:
            st = lib.pdpair_conn_wait_remote_regions(ptr, count, ms)
            if st != lib.PDPAIR_OK:
                self._error(st, f"wait for {count} remote regions", ptr)

    # --- state and counters ---
    def stats(self) -> Stats:
        with self._in_use() as ptr:
            s = ffi.new("pdpair_conn_stats *")
            st = lib.pdpair_conn_get_stats(ptr, s, ffi.sizeof("pdpair_conn_stats"))
            if st != lib.PDPAIR_OK:
                self._error(st, "stats", ptr)
            return Stats(**{name: getattr(s, name) for name in _STATS_FIELDS})

    @property
    def state(self) -> Status:
        """Status.OK while usable, else the sticky error (PEER_CLOSED, CONNECTION_ERROR, ...)."""
        if self.closed:
            return Status.CLOSED
        with self._in_use() as ptr:
            return Status(lib.pdpair_conn_state(ptr))

    @property
    def last_error(self) -> str:
        with self._in_use() as ptr:
            return _last_error(lib.pdpair_conn_last_error, ptr)

    def set_fault(self, fault: Fault | int, n: int) -> None:
        """TEST ONLY: inject a fault (Fault.DROP_EVERY_NTH_SIGNAL with n; Fault.CORRUPT_PUTS, MISADDRESS_PUTS,
        STALE_TAG_PUTS or TRUNCATE_PUTS for the next n puts; n=0 disables that one, Fault.NONE all). Never in
        production."""
        n = _u64("n", n)
        with self._in_use() as ptr:
            st = lib.pdpair_conn_set_fault(ptr, int(fault), n)
            if st != lib.PDPAIR_OK:
                self._error(st, "set_fault", ptr)

    def close(self) -> None:
        """Break the connection (the peer sees PeerClosed), wake blocked calls (they raise Closed), free it.
        Pending requests are abandoned: flush() first to finish them."""
        ptr = self._begin_close()
        if ptr is None:
            return
        lib.pdpair_conn_shutdown(ptr)
        self._wait_idle()
        self._finalizer()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
