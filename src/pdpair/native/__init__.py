"""pdpair.native: a thin Python binding of the C transport in native/ (see README.md in this folder).

    ctx = Context(request_slots=256, token=generation)
    kv = ctx.register(buffer)                                   # or ctx.register_pointer(t.data_ptr(), nbytes, t)
    listener = ctx.listen("0.0.0.0", port)                      # decode side
    conn = listener.accept(timeout=30)
    conn = ctx.connect(host, port, timeout=30)                  # prefill side
    conn.put_signal(kv, 0, remote_region=0, remote_offset=0, nbytes=n, signal_slot=s)
    conn.wait_signal(s, expected=k, timeout=60)                 # raises WaitTimeout at the deadline

    ctx = Context(expect_transfers=True)                        # receiving side: writes only where it asked
    conn.expect(transfer_id, generation, s, [(region, offset, length), ...])   # before asking for the transfer
    conn.put_signal(..., transfer_id=transfer_id, generation=generation)       # the sending side tags its puts
    conn.retire(transfer_id, generation, timeout=1)             # done/failed: no byte of it lands afterwards

Every blocking call takes a timeout in seconds and releases the GIL. Errors raise TransportError (or a subclass)
carrying the C status name and the handle's last error text.
"""

from __future__ import annotations

import enum
import math
import threading
import weakref
from dataclasses import dataclass, fields
from typing import Any

from ._pdpair_native import ffi, lib

__all__ = [
    "Closed",
    "Connection",
    "Context",
    "DataRejected",
    "DEFAULT_MAX_TRANSFERS",
    "DEFAULT_MAX_TRANSFER_WINDOWS",
    "DEFAULT_REQUEST_SLOTS",
    "DEFAULT_SIGNAL_SLOTS",
    "Fault",
    "Listener",
    "PeerClosed",
    "Region",
    "RemoteRejected",
    "Stats",
    "Status",
    "TransportError",
    "WaitTimeout",
    "version",
]

DEFAULT_REQUEST_SLOTS = 256
DEFAULT_SIGNAL_SLOTS = 4096
DEFAULT_MAX_REGIONS = 4096
DEFAULT_MAX_TRANSFERS = 4096
DEFAULT_MAX_TRANSFER_WINDOWS = 1 << 20

# Names and values come from the C enum itself (no retyped numbers).
Status = enum.IntEnum(
    "Status",
    {name.removeprefix("PDPAIR_"): value for value, name in sorted(ffi.typeof("pdpair_status").elements.items())},
)
Fault = enum.IntEnum(
    "Fault",
    {name.removeprefix("PDPAIR_FAULT_"): value for value, name in sorted(ffi.typeof("pdpair_fault").elements.items())},
)
Status.__doc__ = "pdpair_status codes; see native/include/pdpair/transport.h for each one's meaning."
Fault.__doc__ = "TEST ONLY fault injection kinds for Connection.set_fault."


def version() -> str:
    """The C library's version string, e.g. '0.1.0'."""
    return ffi.string(lib.pdpair_version_string()).decode()


class TransportError(Exception):
    """A transport call failed. `status` is the Status, `status_name` its C name, `detail` the last-error text."""

    def __init__(self, status: int, detail: str = "", operation: str = ""):
        self.status = Status(status) if status in Status._value2member_map_ else status
        self.status_name = ffi.string(lib.pdpair_status_name(status)).decode()
        self.detail = detail
        self.operation = operation
        reason = ffi.string(lib.pdpair_strerror(status)).decode()
        text = f"{operation}: " if operation else ""
        text += f"{self.status_name}: {reason}"
        if detail:
            text += f" ({detail})"
        super().__init__(text)


class WaitTimeout(TransportError, TimeoutError):
    """The deadline passed (Status.TIMEOUT); the handle is still usable."""


class PeerClosed(TransportError, ConnectionError):
    """The peer closed the connection or died (Status.PEER_CLOSED)."""


class RemoteRejected(TransportError):
    """The peer refused a put (outside its regions, not a transfer it declared, outside the transfer's windows, or a
    checksum mismatch): it added no signal and counted none of the bytes. `detail` names the peer's reason."""


class DataRejected(TransportError):
    """wait_signal: a put meant for this slot was refused on this side (checksum mismatch, unknown or stale transfer,
    outside its windows). Its data must not be used. Raised at once, not at the deadline; the slot stays failed until
    reset_signal, alloc_signal or a new expect on it."""


class Closed(TransportError):
    """The handle was closed locally."""


_ERROR_CLASSES: dict[int, type[TransportError]] = {
    Status.TIMEOUT: WaitTimeout,
    Status.PEER_CLOSED: PeerClosed,
    Status.REMOTE_REJECTED: RemoteRejected,
    Status.CLOSED: Closed,
    Status.DATA_REJECTED: DataRejected,
}


def _raise(status: int, detail: str, operation: str) -> None:
    raise _ERROR_CLASSES.get(status, TransportError)(status, detail, operation)


def _timeout_ms(timeout: float) -> int:
    """Seconds -> whole milliseconds (rounded up). Every wait needs a finite deadline."""
    if timeout is None or isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
    if not math.isfinite(timeout) or timeout < 0:
        raise ValueError(f"timeout must be finite and >= 0 seconds, got {timeout!r}")
    return math.ceil(timeout * 1000)


def _last_error(getter: Any, ptr: Any) -> str:
    buf = ffi.new("char[512]")
    getter(ptr, buf, len(buf))
    return ffi.string(buf).decode(errors="replace")


class _InUse:
    """`with handle._in_use() as ptr:` around every C call of a handle: counts the call in (`_enter`, which refuses a
    closed handle) and out (`_leave`) whatever happens, the one owner of that bracket."""

    __slots__ = ("_handle",)

    def __init__(self, handle: "_Handle") -> None:
        self._handle = handle

    def __enter__(self) -> Any:
        return self._handle._enter()

    def __exit__(self, *exc: object) -> None:
        self._handle._leave()


class _Handle:
    """Counts the Python threads inside a C call, so close() can wake them (C shutdown) and wait until they have
    left before the C object is freed: no call ever uses a freed pointer."""

    def __init__(self, ptr: Any, what: str):
        self._ptr = ptr
        self._what = what
        self._cv = threading.Condition()
        self._active = 0
        self._closed = False

    def _enter(self) -> Any:
        with self._cv:
            if self._closed:
                raise Closed(lib.PDPAIR_CLOSED, f"this {self._what} is closed")
            self._active += 1
            return self._ptr

    def _leave(self) -> None:
        with self._cv:
            self._active -= 1
            if self._active == 0:
                self._cv.notify_all()

    def _in_use(self) -> _InUse:
        return _InUse(self)

    def _begin_close(self) -> Any | None:
        with self._cv:
            if self._closed:
                return None
            self._closed = True
            return self._ptr

    def _wait_idle(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._active == 0)

    @property
    def closed(self) -> bool:
        return self._closed


@dataclass(frozen=True)
class Region:
    """A registered local memory region: pass it (or its index) as the local side of a put."""

    index: int
    address: int
    size: int


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

    @property
    def outstanding(self) -> int:
        """Posted and not completed (inflight + queued): the contract's pdpair_transport_inflight."""
        return self.posted - self.completed


_STATS_FIELDS = [f.name for f in fields(Stats)]
assert _STATS_FIELDS == [name for name, _ in ffi.typeof("pdpair_conn_stats").fields], "Stats drifted from C"


class Context(_Handle):
    """Options, registered regions, and the factory of listeners and connections.

    request_slots: per-connection request slots (posts beyond them queue, never drop; counted as requeues).
    signal_slots: 64-bit signal counters per connection. token: both peers must use the same value (e.g. the
    pair generation), so a stale peer is refused in the handshake. expect_transfers: connections accept puts only into
    transfers declared with Connection.expect (at most max_transfers of them per connection, max_transfer_windows
    windows in all).
    """

    def __init__(
        self,
        *,
        request_slots: int = DEFAULT_REQUEST_SLOTS,
        signal_slots: int = DEFAULT_SIGNAL_SLOTS,
        max_regions: int = DEFAULT_MAX_REGIONS,
        token: int = 0,
        expect_transfers: bool = False,
        max_transfers: int = DEFAULT_MAX_TRANSFERS,
        max_transfer_windows: int = DEFAULT_MAX_TRANSFER_WINDOWS,
    ):
        for name, value in (("request_slots", request_slots), ("signal_slots", signal_slots),
                            ("max_regions", max_regions), ("max_transfers", max_transfers),
                            ("max_transfer_windows", max_transfer_windows)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(token, int) or not 0 <= token < 2**64:
            raise ValueError(f"token must be an int in [0, 2**64), got {token!r}")
        if not isinstance(expect_transfers, bool):
            raise TypeError(f"expect_transfers must be a bool, got {expect_transfers!r}")
        opts = ffi.new("pdpair_context_options *")
        lib.pdpair_context_options_init(opts)
        opts.request_slots = request_slots
        opts.signal_slots = signal_slots
        opts.max_regions = max_regions
        opts.token = token
        opts.expect_transfers = int(expect_transfers)
        opts.max_transfers = max_transfers
        opts.max_transfer_windows = max_transfer_windows
        out = ffi.new("pdpair_context **")
        st = lib.pdpair_context_create(opts, out)
        if st != lib.PDPAIR_OK:
            _raise(st, "invalid context options", "Context")
        super().__init__(out[0], "context")
        self.request_slots = request_slots
        self.signal_slots = signal_slots
        self.token = token
        self.expect_transfers = expect_transfers
        self._regions: list[Region] = []
        # Objects whose memory is registered: kept alive as long as this context or any connection made from it.
        self._keepalive: list[Any] = []
        self._finalizer = weakref.finalize(self, lib.pdpair_context_destroy, out[0])

    def _error(self, status: int, operation: str) -> None:
        _raise(status, _last_error(lib.pdpair_context_last_error, self._ptr), operation)

    def register(self, buffer: Any) -> Region:
        """Register a writable buffer (bytearray, memoryview, numpy array, mmap...). It stays registered, and
        referenced, for the life of the context and its connections."""
        try:
            cdata = ffi.from_buffer("uint8_t[]", buffer, require_writable=True)
        except (BufferError, TypeError) as exc:
            raise TypeError(f"register needs a writable buffer, got {type(buffer).__name__}: {exc}") from exc
        if len(cdata) == 0:
            raise ValueError("cannot register an empty buffer")
        return self._register(cdata, len(cdata), (buffer, cdata))

    def register_pointer(self, address: int, size: int, keepalive: Any = None) -> Region:
        """Register raw memory, e.g. a CPU torch tensor: register_pointer(t.data_ptr(), t.numel() *
        t.element_size(), t). `keepalive` is referenced as long as the registration lives."""
        if not isinstance(address, int) or address <= 0:
            raise ValueError(f"address must be a positive int, got {address!r}")
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"size must be a positive int, got {size!r}")
        return self._register(ffi.cast("void *", address), size, keepalive)

    def _register(self, pointer: Any, size: int, keepalive: Any) -> Region:
        with self._in_use() as ptr:
            index = ffi.new("uint32_t *")
            st = lib.pdpair_context_register(ptr, pointer, size, index)
            if st != lib.PDPAIR_OK:
                self._error(st, "register")
            region = Region(index[0], int(ffi.cast("uintptr_t", pointer)), size)
            self._keepalive.append(keepalive)
            self._regions.append(region)
            return region

    @property
    def regions(self) -> tuple[Region, ...]:
        return tuple(self._regions)

    def set_token(self, token: int) -> None:
        """Replace the handshake token for every later connect and accept (a listener already bound included): e.g. a
        secret both sides derived after authenticating each other. The listener answers only a peer whose hello
        carries it."""
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < 2**64:
            raise ValueError(f"token must be an int in [0, 2**64), got {token!r}")
        with self._in_use() as ptr:
            st = lib.pdpair_context_set_token(ptr, token)
            if st != lib.PDPAIR_OK:
                self._error(st, "set_token")
            self.token = token

    def listen(self, host: str = "0.0.0.0", port: int = 0) -> Listener:
        """Listen on host:port (port 0 = ephemeral; see Listener.port). SO_REUSEADDR is set."""
        _check_port(port, allow_zero=True)
        with self._in_use() as ptr:
            out = ffi.new("pdpair_listener **")
            st = lib.pdpair_listen(ptr, host.encode(), port, out)
            if st != lib.PDPAIR_OK:
                self._error(st, f"listen on {host}:{port}")
            return Listener(self, out[0])

    def connect(self, host: str, port: int, *, timeout: float) -> Connection:
        """Connect to a listener and run the handshake, all within `timeout` seconds. Raises TransportError with
        Status.CONNECTION_REFUSED if nobody listens yet (retrying may succeed), WaitTimeout at the deadline."""
        _check_port(port, allow_zero=False)
        ms = _timeout_ms(timeout)
        with self._in_use() as ptr:
            out = ffi.new("pdpair_conn **")
            st = lib.pdpair_connect(ptr, host.encode(), port, ms, out)
            if st != lib.PDPAIR_OK:
                self._error(st, f"connect to {host}:{port}")
            return Connection(self, out[0])

    def close(self) -> None:
        """Drop the context. Connections already made keep working until closed; registered memory stays
        referenced until then."""
        if self._begin_close() is not None:
            self._wait_idle()
            self._finalizer()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_port(port: int, *, allow_zero: bool) -> None:
    if not isinstance(port, int) or isinstance(port, bool) or not (0 if allow_zero else 1) <= port <= 65535:
        raise ValueError(f"port must be an int in [{0 if allow_zero else 1}, 65535], got {port!r}")


def _close_listener(ptr: Any, keep: Any) -> None:
    lib.pdpair_listener_close(ptr)


class Listener(_Handle):
    """A bound TCP port. close() frees the port at once (it can be listened on again)."""

    def __init__(self, context: Context, ptr: Any):
        super().__init__(ptr, "listener")
        self.context = context
        self.port: int = lib.pdpair_listener_port(ptr)
        self._finalizer = weakref.finalize(self, _close_listener, ptr, context)

    def accept(self, *, timeout: float) -> Connection:
        """Wait up to `timeout` seconds for one peer and run the handshake. WaitTimeout if nobody came;
        TransportError(PROTOCOL_ERROR) for a peer with another token/version (the listener stays usable)."""
        ms = _timeout_ms(timeout)
        with self._in_use() as ptr:
            out = ffi.new("pdpair_conn **")
            st = lib.pdpair_accept(ptr, ms, out)
            if st != lib.PDPAIR_OK:
                _raise(st, _last_error(lib.pdpair_listener_last_error, ptr), f"accept on port {self.port}")
            return Connection(self.context, out[0])

    def close(self) -> None:
        ptr = self._begin_close()
        if ptr is None:
            return
        lib.pdpair_listener_shutdown(ptr)  # wakes threads blocked in accept()
        self._wait_idle()
        self._finalizer()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_conn(ptr: Any, keep: Any) -> None:
    # `keep` (the context's registered buffers) is referenced until the C threads have stopped writing.
    lib.pdpair_conn_close(ptr)


def _region_index(region: Region | int) -> int:
    if isinstance(region, Region):
        return region.index
    if isinstance(region, int) and not isinstance(region, bool) and 0 <= region < 2**32:
        return region
    raise TypeError(f"a region is a Region or a region index, got {region!r}")


def _u64(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {value!r}")
    return value


def _u32(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**32:
        raise ValueError(f"{name} must be an int in [0, 2**32), got {value!r}")
    return value


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
        """TEST ONLY: inject a fault (Fault.DROP_EVERY_NTH_SIGNAL with n, Fault.CORRUPT_PUTS for the next n puts,
        ...; n=0 disables). Never in production."""
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
