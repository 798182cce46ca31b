"""Context (options, registered memory, the factory of connections) and Listener (a bound port that accepts them)."""

from __future__ import annotations

import weakref
from typing import Any

from ._connection import Connection
from ._errors import _last_error, _raise
from ._handle import Region, _Handle, _timeout_ms
from ._pdpair_native import ffi, lib

DEFAULT_REQUEST_SLOTS = 256
DEFAULT_SIGNAL_SLOTS = 4096
DEFAULT_MAX_REGIONS = 4096
DEFAULT_MAX_TRANSFERS = 4096
DEFAULT_MAX_TRANSFER_WINDOWS = 1 << 20


class Context(_Handle):
    """Options, registered regions, and the factory of listeners and connections.

    request_slots: per-connection request slots (posts beyond them queue, never drop; counted as requeues).
    signal_slots: 64-bit signal counters per connection. token: both peers must use the same value (e.g. the
    pair generation), so a stale peer is refused in the handshake. expect_transfers: connections accept puts only into
    transfers declared with Connection.expect (at most max_transfers of them per connection, max_transfer_windows
    windows in all). skip_checksums: BENCH ONLY, never in production: posts carry no CRC32C and this side checks none
    (tests/bench/bench_transport.py measures the checksums' cost with it; a checking peer refuses such puts).
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
        skip_checksums: bool = False,
    ):
        for name, value in (("request_slots", request_slots), ("signal_slots", signal_slots),
                            ("max_regions", max_regions), ("max_transfers", max_transfers),
                            ("max_transfer_windows", max_transfer_windows)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(token, int) or not 0 <= token < 2**64:
            raise ValueError(f"token must be an int in [0, 2**64), got {token!r}")
        for name, flag in (("expect_transfers", expect_transfers), ("skip_checksums", skip_checksums)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        opts = ffi.new("pdpair_context_options *")
        lib.pdpair_context_options_init(opts)
        opts.request_slots = request_slots
        opts.signal_slots = signal_slots
        opts.max_regions = max_regions
        opts.token = token
        opts.expect_transfers = int(expect_transfers)
        opts.max_transfers = max_transfers
        opts.max_transfer_windows = max_transfer_windows
        opts.skip_checksums = int(skip_checksums)
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
