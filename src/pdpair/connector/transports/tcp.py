"""`tcp` transport: the native core (native/, C11) through its Python binding `pdpair.native`.

Mapping onto the FlagCX-shaped interface:
- `create_unique_id` (prefill, rank 0) makes a context and listens on an ephemeral port; the id is {host, port}.
  The host is the address decode reaches prefill at: the side channel sets it from its own TCP connection to decode
  (`set_local_address`).
- `init_pair` accepts (rank 0) or connects (rank 1) within the deadline; the listener is closed after the accept.
  The native handshake token is the first 8 bytes of `secret`, which both sides derive from their authenticated
  side-channel handshake (HMAC with the pair's key over its transcript): it is never sent in the id, the connecting
  side (decode) proves it first, and prefill's listener answers nothing until it has checked it (constant-time, in
  C), so a third party that reaches the listener first can neither join the pair nor learn the token. Without a
  secret (direct use) the token is derived from the id, which binds nothing.
- Region tables: the native core announces registered regions to its peer itself, so the table carries only the
  region count and `set_peer_region_table` waits (bounded) until that many peer regions are known.
- Every native call takes a timeout derived from the caller's deadline; native errors become TransportError.
- Transfer checks (`transfer_checks`, on for the connector): decode's context (rank 1, the side puts arrive at) runs in
  the native expectation mode, so it
  accepts a put only inside a transfer it declared (`expect_transfer`) and with a matching CRC32C; a refused put fails
  its slot, and `wait_signal` raises TransferRejected at once, with the reason the native core kept for that slot.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from typing import TYPE_CHECKING

from pdpair import contract
from pdpair.connector.transports.base import (
    DEFAULT_SIGNAL_SLOTS,
    RANK_DECODE,
    RANK_PREFILL,
    PairComm,
    PairTransport,
    SignalWaitTimeout,
    TransferRejected,
    TransportCounters,
    TransportError,
    seconds_left,
)

try:
    from pdpair import native
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(f"the tcp transport needs the native binding pdpair.native (pip install -e . builds it): {exc}") from exc

if TYPE_CHECKING:
    from pdpair.connector.config import PdPairConfig

REGION_TABLE_TIMEOUT_SECONDS = 30.0

# A refused put's native reason -> the reason label of pdpair_kv_transfers_rejected_total.
_REASON_OF_REFUSAL = {
    native.Refusal.CHECKSUM: contract.REJECTED_CHECKSUM,
    native.Refusal.WINDOW: contract.REJECTED_OUTSIDE_WINDOW,
    native.Refusal.TRANSFER: contract.REJECTED_UNEXPECTED_TRANSFER,
    native.Refusal.INCOMPLETE: contract.REJECTED_INCOMPLETE,
}

# TEST ONLY: the native faults that damage puts (set_put_fault), each reset by naming another.
PUT_FAULTS = ("CORRUPT_PUTS", "MISADDRESS_PUTS", "STALE_TAG_PUTS", "TRUNCATE_PUTS")


class TcpPairComm(PairComm):
    def __init__(self, context: native.Context, conn: native.Connection, rank: int) -> None:
        self._context = context
        self._conn = conn
        self.rank = rank
        self.num_signal_slots = context.signal_slots
        self.supports_transfer_checks = context.expect_transfers
        self._close_lock = threading.Lock()
        self._closed = False

    def register_region(self, ptr: int, size: int) -> int:
        try:
            return self._context.register_pointer(ptr, size).index
        except native.TransportError as exc:
            raise TransportError(f"register_region(0x{ptr:x}, {size}): {exc}") from exc

    def local_region_table(self) -> bytes:
        return json.dumps({"regions": len(self._context.regions)}).encode()

    def set_peer_region_table(self, table: bytes) -> None:
        try:
            count = json.loads(table)["regions"]
        except (ValueError, KeyError, TypeError) as exc:
            raise TransportError(f"malformed tcp region table {table[:80]!r}: {exc}") from None
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= native.DEFAULT_MAX_REGIONS:
            raise TransportError(f"tcp region table: region count {count!r} is not in 0..{native.DEFAULT_MAX_REGIONS}")
        try:
            self._conn.wait_remote_regions(count, timeout=REGION_TABLE_TIMEOUT_SECONDS)
        except native.TransportError as exc:
            raise TransportError(f"the peer's {count} region(s) were not announced: {exc}") from exc

    def put_signal(self, src_region: int, src_offset: int, dst_region: int, dst_offset: int, size: int, signal_slot: int,
                   *, transfer_id: int = 0, generation: int = 0) -> None:
        try:
            self._conn.put_signal(src_region, src_offset, dst_region, dst_offset, size, signal_slot,
                                  transfer_id=transfer_id, generation=generation)
        except native.TransportError as exc:
            raise TransportError(str(exc)) from exc

    def expect_transfer(self, transfer_id: int, generation: int, signal_slot: int,
                        windows: list[tuple[int, int, int]], expected_signals: int) -> None:
        try:
            self._conn.expect(transfer_id, generation, signal_slot, windows, expected_signals=expected_signals)
        except native.TransportError as exc:
            raise TransportError(str(exc)) from exc

    def retire_transfer(self, transfer_id: int, generation: int, deadline: float) -> None:
        try:
            self._conn.retire(transfer_id, generation, timeout=seconds_left(deadline))
        except native.TransportError as exc:
            raise TransportError(str(exc)) from exc

    def _rejection_reason(self, signal_slot: int) -> str:
        """Which refusal failed the slot: the first put refused for it (the native core keeps it per slot, so a
        load's reason is its own, whatever else the connection refused meanwhile)."""
        try:
            refusal = self._conn.slot_refusal(signal_slot)
        except native.TransportError:
            return contract.REJECTED_OTHER
        return _REASON_OF_REFUSAL.get(refusal, contract.REJECTED_OTHER)

    def flush(self, deadline: float) -> None:
        try:
            self._conn.flush(timeout=seconds_left(deadline))
        except native.TransportError as exc:
            raise TransportError(str(exc)) from exc

    def wait_signal(self, signal_slot: int, expected: int, deadline: float) -> None:
        started = time.monotonic()
        try:
            self._conn.wait_signal(signal_slot, expected, timeout=seconds_left(deadline))
        except native.WaitTimeout as exc:
            raise SignalWaitTimeout(signal_slot, expected, int(getattr(exc, "value", 0)), time.monotonic() - started) from None
        except native.DataRejected as exc:
            reason = self._rejection_reason(signal_slot)
            raise TransferRejected(f"a put for signal slot {signal_slot} was refused on arrival ({reason}): {exc}",
                                   reason) from exc
        except native.TransportError as exc:
            raise TransportError(str(exc)) from exc

    def read_signal(self, signal_slot: int) -> int:
        try:
            return int(self._conn.read_signal(signal_slot))
        except native.TransportError as exc:
            raise TransportError(str(exc)) from exc

    def counters(self) -> TransportCounters:
        try:
            stats = self._conn.stats()
        except native.TransportError as exc:
            raise TransportError(str(exc)) from exc
        return TransportCounters(inflight=stats.inflight, slots=stats.slots, requeues=stats.requeues)

    def set_signal_drop_fault(self, every_nth: int) -> None:
        """TEST ONLY: the native sender omits the signal of every n-th put_signal (0 disables)."""
        self._conn.set_fault(native.Fault.DROP_EVERY_NTH_SIGNAL, every_nth)

    def set_put_fault(self, fault: str | None, puts: int) -> None:
        """TEST ONLY: the next `puts` puts with data each go out damaged as the native fault named `fault` does
        (CORRUPT_PUTS: a byte flipped after the checksum was taken; MISADDRESS_PUTS, STALE_TAG_PUTS, TRUNCATE_PUTS),
        so decode's transport refuses them; None stops every put fault (the signal-drop fault is left as it is)."""
        try:
            for kind in PUT_FAULTS:
                self._conn.set_fault(native.Fault[kind], puts if kind == fault else 0)
        except native.TransportError as exc:
            raise TransportError(str(exc)) from exc

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._conn.close()
        self._context.close()


class TcpTransport(PairTransport):
    name = "tcp"

    def __init__(self, signal_slots: int = DEFAULT_SIGNAL_SLOTS, request_slots: int = native.DEFAULT_REQUEST_SLOTS,
                 transfer_checks: bool = False) -> None:
        for what, value in (("signal_slots", signal_slots), ("request_slots", request_slots)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"tcp transport {what} must be an int >= 1, got {value!r}")
        self._signal_slots = signal_slots
        self._request_slots = request_slots
        # Decode's side accepts only puts of transfers it declared (PairComm.expect_transfer); the connector sets it.
        self._transfer_checks = transfer_checks
        self._local_host = "127.0.0.1"
        self._pending: dict[bytes, tuple[native.Context, native.Listener]] = {}
        self._lock = threading.Lock()

    @property
    def request_slots(self) -> int:
        """Request slots per connection (PDPAIR_TRANSPORT_SLOTS); posts beyond them queue in the native core."""
        return self._request_slots

    def set_local_address(self, host: str) -> None:
        self._local_host = host

    def _make_context(self, token: int, expect_transfers: bool = False) -> native.Context:
        return native.Context(request_slots=self._request_slots, signal_slots=self._signal_slots, token=token,
                              expect_transfers=expect_transfers)

    def create_unique_id(self) -> bytes:
        self.close()  # one handshake at a time: an id from a failed attempt is never used again
        # A random token until init_pair sets the one derived from the handshake: nobody can join before that.
        context = self._make_context(secrets.randbits(64))
        try:
            listener = context.listen("0.0.0.0", 0)
        except native.TransportError as exc:
            context.close()
            raise TransportError(f"listen for the pair: {exc}") from exc
        uid = json.dumps({"host": self._local_host, "port": listener.port}).encode()
        with self._lock:
            self._pending[uid] = (context, listener)
        return uid

    def check_unique_id(self, unique_id: bytes) -> None:
        _parse_unique_id(unique_id)

    def init_pair(self, unique_id: bytes, rank: int, deadline: float, secret: bytes | None = None) -> PairComm:
        host, port, uid_token = _parse_unique_id(unique_id)
        if secret is not None and (not isinstance(secret, bytes) or len(secret) < 8):
            raise TransportError("the pair's secret must be at least 8 bytes")
        token = int.from_bytes(secret[:8], "big") if secret is not None else uid_token
        if rank == RANK_PREFILL:
            with self._lock:
                pending = self._pending.pop(unique_id, None)
            if pending is None:
                raise TransportError("init_pair as rank 0 needs a unique id made by this transport's create_unique_id")
            context, listener = pending
            try:
                context.set_token(token)
                conn = listener.accept(timeout=seconds_left(deadline))
            except native.TransportError as exc:
                context.close()
                raise TransportError(f"decode did not join the pair on port {port}: {exc}") from exc
            finally:
                listener.close()
            return TcpPairComm(context, conn, rank)
        if rank == RANK_DECODE:
            try:
                context = self._make_context(token, expect_transfers=self._transfer_checks)  # decode: puts arrive here
            except (native.TransportError, ValueError) as exc:
                raise TransportError(f"cannot make a context for prefill's pair: {exc}") from exc
            try:
                conn = context.connect(host, port, timeout=seconds_left(deadline))
            except (native.TransportError, ValueError, OSError) as exc:  # ValueError: a host the binding refuses
                context.close()
                raise TransportError(f"cannot join prefill's pair at {host}:{port}: {exc}") from exc
            return TcpPairComm(context, conn, rank)
        raise TransportError(f"rank must be {RANK_PREFILL} (prefill) or {RANK_DECODE} (decode), got {rank}")

    def close(self) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for context, listener in pending:
            listener.close()
            context.close()


def _parse_unique_id(unique_id: bytes) -> tuple[str, int, int]:
    """(host, port, token) of a tcp unique id, every field in range; TransportError otherwise (a peer's id is input).
    The token is the id's own "token" field if it has one (an id of direct use may), else derived from the id: either
    way it binds nothing, and init_pair uses the handshake's secret instead when it has one."""
    try:
        info = json.loads(unique_id)
        host, port = info["host"], info["port"]
        token = info.get("token", int.from_bytes(hashlib.sha256(unique_id).digest()[:8], "big"))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise TransportError(f"malformed tcp unique id {unique_id[:80]!r}: {exc}") from None
    if not isinstance(host, str) or not 0 < len(host) <= 253 or any(c.isspace() or c == "\0" for c in host):
        raise TransportError(f"tcp unique id: host {str(host)[:80]!r} is not a host name or address")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise TransportError(f"tcp unique id: port {str(port)[:30]!r} is not in 1..65535")
    if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < 1 << 64:
        raise TransportError(f"tcp unique id: token {str(token)[:30]!r} is not in [0, 2^64)")
    return host, port, token


def build(config: PdPairConfig) -> TcpTransport:
    """The connector's tcp transport (transports.build_transport): it reads no environment of its own. Transfer checks
    are on: the decode worker declares every transfer before its Pull."""
    return TcpTransport(request_slots=config.transport_slots, transfer_checks=True)
