"""The transport interface the connector codes against: one pair communicator per engine worker (TP rank).

Shaped after FlagCX's pair setup (`flagcxGetUniqueId` on rank 0, `flagcxCommInitRank(2, uid, rank)` on both sides)
and its one-sided put-with-signal. Prefill is rank 0, decode is rank 1. The connector's handshake carries the
unique id, the opaque region tables and the region indices over the side channel; the transport never opens a
side channel of its own for that.

Signal semantics every implementation must keep (the seed's bugs are exactly these):
- `put_signal` moves the data and THEN adds exactly 1 to the peer's signal slot; the receiver never sees the +1
  before the bytes.
- When the transport is out of request slots it defers (backpressure, counted in `requeues`); it never drops.
- `wait_signal` waits on the host with a deadline and raises `SignalWaitTimeout` when it passes; never unbounded.

Transfer checks (`supports_transfer_checks`; tcp has them, FlagCX's put carries no tag or checksum the receiver could
check, so it keeps the defaults, which check nothing): decode declares each transfer before its Pull
(`expect_transfer`: tag, signal slot, the byte windows of its blocks), prefill tags its puts with it, and the receiving
side refuses any put that is not inside a declared transfer's windows or whose checksum does not match; the waiter
then gets `TransferRejected` at once. `retire_transfer` ends a transfer before its blocks go back to the engine.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

RANK_PREFILL = 0  # makes the unique id, sends KV
RANK_DECODE = 1  # listens first, receives KV

# Signal slots per pair communicator. The decode side hands one slot to each in-flight request and never reuses a
# slot whose wait timed out (a late +1 would otherwise let a later wait pass early), so this is generous.
DEFAULT_SIGNAL_SLOTS = 4096


class TransportError(RuntimeError):
    """A transport call failed; the message names the call and the transport's own error text."""


class TransferRejected(TransportError):
    """`wait_signal`: a put meant for this slot was refused on arrival (the transfer's data must not be used).
    `reason` is one of pdpair.contract.REJECTED_REASONS."""

    def __init__(self, message: str, reason: str):
        self.reason = reason
        super().__init__(message)


class SignalWaitTimeout(TransportError):
    """`wait_signal` passed its deadline before the slot reached the expected count."""

    def __init__(self, signal_slot: int, expected: int, observed: int, waited_seconds: float, hint: str = ""):
        self.signal_slot = signal_slot
        self.expected = expected
        self.observed = observed
        self.waited_seconds = waited_seconds
        self.hint = hint  # e.g. that the transport cannot report errors, so a failure looks like this timeout
        super().__init__(
            f"signal slot {signal_slot}: expected {expected}, observed {observed} after {waited_seconds:.1f}s "
            f"(missing {expected - observed} signal(s))" + (f"; {hint}" if hint else "")
        )


@dataclass(frozen=True)
class TransportCounters:
    """Backpressure gauges of one pair communicator, exported as pdpair_transport_* metrics."""

    inflight: int  # puts posted and not yet completed
    slots: int  # request-slot capacity towards the peer
    requeues: int  # posts deferred because every slot was busy (monotonic)


class PairComm(ABC):
    """A connected pair (prefill rank 0, decode rank 1) with registered memory regions and signal slots."""

    rank: int
    num_signal_slots: int
    # Whether expect_transfer/retire_transfer are enforced by the receiving side (see the module docstring).
    supports_transfer_checks: bool = False

    @abstractmethod
    def register_region(self, ptr: int, size: int) -> int:
        """Register `size` bytes at host/device address `ptr`; returns the local region index (0, 1, 2, ...)."""

    @abstractmethod
    def local_region_table(self) -> bytes:
        """Opaque description of the registered regions (keys, addresses) that the peer needs; sent by the handshake."""

    @abstractmethod
    def set_peer_region_table(self, table: bytes) -> None:
        """Accept the peer's `local_region_table()`; after this, puts may name the peer's region indices."""

    @abstractmethod
    def put_signal(
        self,
        src_region: int,
        src_offset: int,
        dst_region: int,
        dst_offset: int,
        size: int,
        signal_slot: int,
        *,
        transfer_id: int = 0,
        generation: int = 0,
    ) -> None:
        """Write `size` bytes from a local region into a peer region, then add exactly 1 to the peer's `signal_slot`.

        Asynchronous: may return before the bytes arrive. Blocks (bounded by the transport's own timeouts) only
        while every request slot is busy. Raises TransportError on a bad argument or a broken connection.
        `transfer_id`/`generation`: the tag of the transfer the put belongs to (the peer's `expect_transfer`); a
        transport without transfer checks ignores it.
        """

    @abstractmethod
    def flush(self, deadline: float) -> None:
        """Block until every put posted so far has completed locally (the source may be reused or freed)."""

    @abstractmethod
    def wait_signal(self, signal_slot: int, expected: int, deadline: float) -> None:
        """Block until the local `signal_slot` is >= `expected`; raise SignalWaitTimeout at `deadline`
        (a `time.monotonic()` value)."""

    def expect_transfer(self, transfer_id: int, generation: int, signal_slot: int,
                        windows: list[tuple[int, int, int]], expected_signals: int) -> None:
        """Receiving side: accept puts tagged (transfer_id, generation) only into these (local region, offset, length)
        windows, only signalling `signal_slot` and none after `expected_signals` signals, until retire_transfer. Call before asking the peer for the
        transfer. Raises TransportError when the transfer cannot be declared (table full, bad window). The default
        (no transfer checks) does nothing."""

    def retire_transfer(self, transfer_id: int, generation: int, deadline: float) -> None:
        """Receiving side: end a declared transfer (done, failed, timed out). Once this returns no byte of it lands
        any more, so its blocks may go back to the engine. A put of it still arriving at `deadline` breaks the
        connection (TransportError). The default does nothing."""

    @abstractmethod
    def read_signal(self, signal_slot: int) -> int:
        """The current value of a local signal slot (monotonic; never reset while the comm lives)."""

    @abstractmethod
    def counters(self) -> TransportCounters:
        """Current backpressure gauges."""

    @abstractmethod
    def close(self) -> None:
        """Release regions, connections and threads. Idempotent."""

    def __enter__(self) -> PairComm:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class PairTransport(ABC):
    """Factory of pair communicators; one per engine worker (TP rank)."""

    name: str
    # Whether register_region accepts device (GPU) memory. False: the caller stages GPU KV through host memory
    # (pdpair.connector.staging).
    supports_device_memory: bool = False

    @abstractmethod
    def create_unique_id(self) -> bytes:
        """Rank 0 (prefill) makes the id; the handshake sends it to decode. Opaque, at most a few KiB."""

    @abstractmethod
    def init_pair(self, unique_id: bytes, rank: int, deadline: float, secret: bytes | None = None) -> PairComm:
        """Join the pair named by `unique_id` as `rank` (0 prefill, 1 decode), like `flagcxCommInitRank(2, uid,
        rank)`. Both sides call it concurrently; raises TransportError if the peer has not joined by `deadline`.
        `secret`: bytes both sides derived from their authenticated handshake (the side channel passes
        `metadata.derive_secret(..., "pair")`); a transport whose own connection can be bound to it (tcp) joins only
        a peer that holds it. Without one (direct use) nothing binds the connection."""

    def check_unique_id(self, unique_id: bytes) -> None:
        """Raise TransportError when a peer's `unique_id` is not one this transport's `init_pair` can take (decode
        checks a Hello's id with it before answering; init_pair must still never raise anything but TransportError
        for a bad id). The default checks nothing."""

    def set_local_address(self, host: str) -> None:  # noqa: B027 - optional hook
        """The address the peer reaches this process at; prefill learns it from its side-channel connection to
        decode and calls this before `create_unique_id`. Transports whose id already carries it ignore it."""

    def set_device(self, index: int) -> None:  # noqa: B027 - optional hook
        """The CUDA device of this worker's KV caches; called before `init_pair`. Transports whose library binds to
        the calling thread's current device (FlagCX/NCCL) make it current in every thread they call from."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release process-wide resources (a loaded library, a listener). Idempotent."""


def deadline_in(seconds: float) -> float:
    """A `time.monotonic()` deadline `seconds` from now."""
    return time.monotonic() + seconds


def seconds_left(deadline: float) -> float:
    """Seconds until `deadline`, never negative."""
    return max(0.0, deadline - time.monotonic())
