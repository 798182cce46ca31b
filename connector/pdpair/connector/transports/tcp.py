"""`tcp` transport: the native core (native/, C11) through its cffi binding `pdpair.native._pdpair_native`.

Mapping onto the FlagCX-shaped interface:
- `create_unique_id` (prefill, rank 0) makes a context with a random handshake token and listens on an ephemeral
  port; the id is {host, port, token}. The host is the address decode reaches prefill at: the side channel sets it
  from its own connection to decode (`set_local_address`).
- `init_pair` accepts (rank 0) or connects (rank 1) within the deadline; the listener is closed after the accept.
- Region tables: the native core announces registered regions to its peer itself, so the table only carries the
  region count and `set_peer_region_table` waits until that many peer regions are known.
- Every native call takes a timeout, derived from the caller's deadline.
"""

from __future__ import annotations

import json
import secrets
import threading
import time

from pdpair.connector.transports.base import (
    DEFAULT_SIGNAL_SLOTS,
    RANK_DECODE,
    RANK_PREFILL,
    PairComm,
    PairTransport,
    SignalWaitTimeout,
    TransportCounters,
    TransportError,
    seconds_left,
)

try:
    from pdpair.native._pdpair_native import ffi, lib
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        f"the tcp transport needs the native binding pdpair.native._pdpair_native (pip install -e . builds it): {exc}"
    ) from exc

# A put's bytes must arrive within this long after flush starts, or the pair is broken.
REGION_TABLE_TIMEOUT_SECONDS = 30.0


def _ms(deadline: float) -> int:
    return int(seconds_left(deadline) * 1000)


def _status_text(status: int) -> str:
    return f"{ffi.string(lib.pdpair_status_name(status)).decode()}: {ffi.string(lib.pdpair_strerror(status)).decode()}"


def _last_error(getter, handle) -> str:
    buf = ffi.new("char[]", 512)
    getter(handle, buf, 512)
    return ffi.string(buf).decode("utf-8", "replace")


def _check(status: int, what: str, detail: str = "") -> None:
    if status != lib.PDPAIR_OK:
        extra = f" ({detail})" if detail else ""
        raise TransportError(f"{what} failed: {_status_text(status)}{extra}")


class TcpPairComm(PairComm):
    def __init__(self, ctx, conn, rank: int) -> None:
        self._ctx = ctx
        self._conn = conn
        self.rank = rank
        self.num_signal_slots = int(lib.pdpair_conn_signal_slots(conn))
        self._closed = False
        self._close_lock = threading.Lock()

    def _conn_check(self, status: int, what: str) -> None:
        if status != lib.PDPAIR_OK:
            raise TransportError(f"{what} failed: {_status_text(status)} ({_last_error(lib.pdpair_conn_last_error, self._conn)})")

    def register_region(self, ptr: int, size: int) -> int:
        index = ffi.new("uint32_t *")
        status = lib.pdpair_context_register(self._ctx, ffi.cast("void *", ptr), size, index)
        _check(status, f"register_region(0x{ptr:x}, {size})", _last_error(lib.pdpair_context_last_error, self._ctx))
        return int(index[0])

    def local_region_table(self) -> bytes:
        return json.dumps({"regions": int(lib.pdpair_context_region_count(self._ctx))}).encode()

    def set_peer_region_table(self, table: bytes) -> None:
        count = int(json.loads(table)["regions"])
        status = lib.pdpair_conn_wait_remote_regions(self._conn, count, int(REGION_TABLE_TIMEOUT_SECONDS * 1000))
        self._conn_check(status, f"waiting for the peer's {count} region(s)")

    def put_signal(self, src_region: int, src_offset: int, dst_region: int, dst_offset: int, size: int, signal_slot: int) -> None:
        status = lib.pdpair_put_signal(self._conn, src_region, src_offset, dst_region, dst_offset, size, signal_slot, ffi.NULL)
        self._conn_check(status, f"put_signal(region {src_region}+{src_offset} -> peer region {dst_region}+{dst_offset}, "
                                 f"{size} B, slot {signal_slot})")

    def flush(self, deadline: float) -> None:
        self._conn_check(lib.pdpair_conn_flush(self._conn, _ms(deadline)), "flush")

    def wait_signal(self, signal_slot: int, expected: int, deadline: float) -> None:
        value = ffi.new("uint64_t *")
        started = time.monotonic()
        status = lib.pdpair_conn_wait_signal(self._conn, signal_slot, expected, _ms(deadline), value)
        if status == lib.PDPAIR_TIMEOUT:
            raise SignalWaitTimeout(signal_slot, expected, int(value[0]), time.monotonic() - started)
        self._conn_check(status, f"wait_signal(slot {signal_slot}, expected {expected})")

    def read_signal(self, signal_slot: int) -> int:
        value = ffi.new("uint64_t *")
        self._conn_check(lib.pdpair_conn_read_signal(self._conn, signal_slot, value), f"read_signal({signal_slot})")
        return int(value[0])

    def counters(self) -> TransportCounters:
        stats = ffi.new("pdpair_conn_stats *")
        self._conn_check(lib.pdpair_conn_get_stats(self._conn, stats, ffi.sizeof("pdpair_conn_stats")), "get_stats")
        return TransportCounters(inflight=int(stats.inflight), slots=int(stats.slots), requeues=int(stats.requeues))

    def set_signal_drop_fault(self, every_nth: int) -> None:
        """TEST ONLY: the native sender omits the signal of every n-th put_signal (0 disables)."""
        self._conn_check(lib.pdpair_conn_set_fault(self._conn, lib.PDPAIR_FAULT_DROP_EVERY_NTH_SIGNAL, every_nth), "set_fault")

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        lib.pdpair_conn_close(self._conn)
        lib.pdpair_context_destroy(self._ctx)


class TcpTransport(PairTransport):
    name = "tcp"

    def __init__(self, signal_slots: int = DEFAULT_SIGNAL_SLOTS, request_slots: int = 0) -> None:
        self._signal_slots = signal_slots
        self._request_slots = request_slots
        self._local_host = "127.0.0.1"
        self._pending: dict[bytes, tuple[object, object]] = {}  # uid -> (context, listener) made by create_unique_id
        self._lock = threading.Lock()

    def set_local_address(self, host: str) -> None:
        self._local_host = host

    def _context(self, token: int):
        opts = ffi.new("pdpair_context_options *")
        lib.pdpair_context_options_init(opts)
        opts.signal_slots = self._signal_slots
        opts.request_slots = self._request_slots
        opts.token = token
        out = ffi.new("pdpair_context **")
        _check(lib.pdpair_context_create(opts, out), "context_create")
        return out[0]

    def create_unique_id(self) -> bytes:
        token = secrets.randbits(63)
        ctx = self._context(token)
        listener = ffi.new("pdpair_listener **")
        status = lib.pdpair_listen(ctx, b"", 0, listener)
        if status != lib.PDPAIR_OK:
            lib.pdpair_context_destroy(ctx)
            _check(status, "listen")
        port = int(lib.pdpair_listener_port(listener[0]))
        uid = json.dumps({"host": self._local_host, "port": port, "token": token}).encode()
        with self._lock:
            self._pending[uid] = (ctx, listener[0])
        return uid

    def init_pair(self, unique_id: bytes, rank: int, deadline: float) -> PairComm:
        try:
            info = json.loads(unique_id)
            host, port, token = str(info["host"]), int(info["port"]), int(info["token"])
        except (ValueError, KeyError, TypeError) as exc:
            raise TransportError(f"malformed tcp unique id {unique_id[:80]!r}: {exc}") from None
        conn = ffi.new("pdpair_conn **")
        if rank == RANK_PREFILL:
            with self._lock:
                pending = self._pending.pop(unique_id, None)
            if pending is None:
                raise TransportError("init_pair as rank 0 needs a unique id made by this transport's create_unique_id")
            ctx, listener = pending
            try:
                status = lib.pdpair_accept(listener, _ms(deadline), conn)
                detail = _last_error(lib.pdpair_listener_last_error, listener)
            finally:
                lib.pdpair_listener_close(listener)
            if status != lib.PDPAIR_OK:
                lib.pdpair_context_destroy(ctx)
                _check(status, f"accept on port {port}", detail)
            return TcpPairComm(ctx, conn[0], rank)
        if rank == RANK_DECODE:
            ctx = self._context(token)
            status = lib.pdpair_connect(ctx, host.encode(), port, _ms(deadline), conn)
            if status != lib.PDPAIR_OK:
                detail = _last_error(lib.pdpair_context_last_error, ctx)
                lib.pdpair_context_destroy(ctx)
                _check(status, f"connect to {host}:{port}", detail)
            return TcpPairComm(ctx, conn[0], rank)
        raise TransportError(f"rank must be {RANK_PREFILL} (prefill) or {RANK_DECODE} (decode), got {rank}")

    def close(self) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for ctx, listener in pending:
            lib.pdpair_listener_close(listener)
            lib.pdpair_context_destroy(ctx)
