"""`flagcx` transport: PairTransport / PairComm over libflagcx's one-sided put-with-signal, either API generation.

The ctypes binding (symbol lookup, prototypes, both API generations, return codes, where the library is) is
`flagcx_abi.py`; this module is what the connector sees: pair setup, regions, puts, the host-side waits.

Semantics kept here (see base.py): exactly +1 per put; at most `slots` puts in flight (counted with
`flagcxReadCounter`, the number of this rank's completed one-sided ops), beyond that `put_signal` waits for a
completion and counts a requeue, never drops. `flagcxInternalError` from a post is permanent (upstream returns it
when the communicator has no RMA proxy; a full request ring blocks inside the library) and fails at once. Blocking C
calls that take no timeout (`flagcxCommInitRank`, the collective registrations) run in a helper thread so the
caller's deadline holds; a call that overruns leaves the comm unusable.

CUDA device: NCCL under FlagCX takes the CALLING THREAD's current device, and a fresh thread's is device 0. Every
call that may touch CUDA therefore first makes the worker's device current in its own thread (`device`, set from the
KV caches' device by the worker; None on a CPU-only process, where nothing is set and torch is never imported). How
a call runs (on that device, in a helper thread under a deadline, waits with backoff) is flagcx_calls.py.

Library: see `flagcx_abi.find_library_path`. CI loads a fake of the ABI (tests/flagcx_abi/); tests/gpu/ runs the
real one by hand.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdpair.connector.deadlines import transport_blocking_seconds
from pdpair.connector.transports.base import (
    DEFAULT_SIGNAL_SLOTS,
    RANK_DECODE,
    RANK_PREFILL,
    PairComm,
    PairTransport,
    SignalWaitTimeout,
    TransportCounters,
    TransportError,
)
from pdpair.connector.transports.flagcx_abi import (
    ENV_USE_HETERO_COMM,
    FLAGCX_MEM_CCL,
    FLAGCX_PTR_HOST,
    FLAGCX_UINT8,
    FLAGCX_WIN_COLL_SYMMETRIC,
    GENERATION_MR_INDEX,
    GENERATION_WINDOW,
    INVALID_ARGUMENT,
    NOT_SUPPORTED,
    SIGNAL_BYTES,
    SUCCESS,
    UNIQUE_ID_BYTES,
    WINDOW_SIGNAL_COUNTERS,
    FlagcxError,
    _libc_free,
    find_library_path,
    load_library,
    result_name,
)
from pdpair.connector.transports.flagcx_calls import DeviceBinding, Backoff, call_with_deadline
from pdpair.contract import ENV_TRANSPORT_SLOTS, MAX_FLAGCX_TRANSPORT_SLOTS, TRANSPORT_FLAGCX

if TYPE_CHECKING:
    from pdpair.connector.config import PdPairConfig

log = logging.getLogger(__name__)

DEFAULT_SLOTS = MAX_FLAGCX_TRANSPORT_SLOTS  # the most FlagCX holds per connection (pdpair.contract says why)
DEFAULT_BLOCKING_CALL_SECONDS = 60.0


# --- region tables -----------------------------------------------------------------------------------------------

_TABLE_MAGIC = b"PDFX"
_TABLE_HEADER = struct.Struct("<4sHIQ")  # magic, format version, region count, signal slots
_TABLE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class _PeerTable:
    region_sizes: tuple[int, ...]
    signal_slots: int


def _encode_table(region_sizes: list[int], signal_slots: int) -> bytes:
    header = _TABLE_HEADER.pack(_TABLE_MAGIC, _TABLE_FORMAT_VERSION, len(region_sizes), signal_slots)
    return header + struct.pack(f"<{len(region_sizes)}Q", *region_sizes)


def _decode_table(table: bytes) -> _PeerTable:
    if len(table) < _TABLE_HEADER.size:
        raise TransportError(f"flagcx peer region table too short ({len(table)} bytes)")
    magic, fmt, count, slots = _TABLE_HEADER.unpack_from(table)
    if magic != _TABLE_MAGIC or fmt != _TABLE_FORMAT_VERSION:
        raise TransportError(f"not a flagcx region table (magic {magic!r}, format {fmt}); is the peer on tcp?")
    if len(table) != _TABLE_HEADER.size + 8 * count:
        raise TransportError(f"flagcx peer region table: {count} regions but {len(table)} bytes")
    sizes = struct.unpack_from(f"<{count}Q", table, _TABLE_HEADER.size)
    return _PeerTable(tuple(sizes), slots)


# --- the transport -----------------------------------------------------------------------------------------------


class FlagcxTransport(PairTransport):
    """Pair communicators over libflagcx's one-sided API (either generation, see the module docstring).

    slots: most puts in flight towards the peer (default 256; at most 256, FlagCX's IB request pool and RMA ring
        size). blocking_seconds: bound on a put waiting for a slot, a flush, and a collective registration
        (default 60). The connector passes both from PdPairConfig (PDPAIR_TRANSPORT_SLOTS, PDPAIR_HANG_TIMEOUT_SECONDS);
        this class reads no environment of its own besides the library's location. device: the worker's CUDA device
        (also settable later with `set_device`, before `init_pair`); device_setter: how to make it current in a
        thread (default torch.cuda.set_device); device_flusher: how to flush GPUDirect RDMA writes after a wait
        (default the driver's cuFlushGPUDirectRDMAWrites).
    """

    name = TRANSPORT_FLAGCX
    supports_device_memory = True

    def __init__(
        self,
        library_path: str | None = None,
        slots: int | None = None,
        num_signal_slots: int = DEFAULT_SIGNAL_SLOTS,
        blocking_seconds: float | None = None,
        device: int | None = None,
        device_setter: Callable[[int], None] | None = None,
        device_flusher: Callable[[], None] | None = None,
    ):
        self.slots = DEFAULT_SLOTS if slots is None else slots
        if not 1 <= self.slots <= DEFAULT_SLOTS:
            # More slots than FlagCX's request pool is the upstream drop bug this cap exists to avoid.
            raise ValueError(
                f"flagcx slots ({ENV_TRANSPORT_SLOTS}) must be in 1..{DEFAULT_SLOTS} (FlagCX's IB request pool per "
                f"connection), got {self.slots}"
            )
        if num_signal_slots < 1:
            raise ValueError(f"num_signal_slots must be >= 1, got {num_signal_slots}")
        self.num_signal_slots = num_signal_slots
        self.blocking_seconds = DEFAULT_BLOCKING_CALL_SECONDS if blocking_seconds is None else blocking_seconds
        if self.blocking_seconds <= 0:
            raise ValueError(f"blocking_seconds must be > 0, got {self.blocking_seconds}")
        self.device = DeviceBinding(device, device_setter, device_flusher)
        self.lib = load_library(library_path)

    @property
    def generation(self) -> str:
        return self.lib.generation

    def set_device(self, index: int) -> None:
        self.device = DeviceBinding(index, self.device._setter, self.device._flusher)

    def create_unique_id(self) -> bytes:
        fn = self.lib.fn["flagcxGetUniqueId"]
        self.device.apply()
        if self.lib.caller_allocated_uid:
            buf = ctypes.create_string_buffer(UNIQUE_ID_BYTES)
            self.lib.check("flagcxGetUniqueId", fn(ctypes.addressof(buf)))
            return buf.raw
        ptr = ctypes.c_void_p()
        self.lib.check("flagcxGetUniqueId", fn(ctypes.byref(ptr)))
        try:
            return ctypes.string_at(ptr.value, UNIQUE_ID_BYTES)
        finally:
            _libc_free(ptr.value)  # the library calloc'ed it

    def check_unique_id(self, unique_id: bytes) -> None:
        if not isinstance(unique_id, bytes) or len(unique_id) != UNIQUE_ID_BYTES:
            got = len(unique_id) if isinstance(unique_id, bytes) else type(unique_id).__name__
            raise TransportError(f"a FlagCX unique id has {UNIQUE_ID_BYTES} bytes, got {got}")

    def init_pair(self, unique_id: bytes, rank: int, deadline: float, secret: bytes | None = None) -> FlagcxPairComm:
        # `secret` is not used: FlagCX's bootstrap has no token to bind. What holds is that only a peer that proved
        # the pair's key on the side channel is ever given this uid's pair (connector README, "The side channel's
        # guard").
        if rank not in (RANK_PREFILL, RANK_DECODE):
            raise ValueError(f"rank must be {RANK_PREFILL} (prefill) or {RANK_DECODE} (decode), got {rank}")
        self.check_unique_id(unique_id)  # a peer's input: TransportError, like every other refusal of the pair
        uid = ctypes.create_string_buffer(unique_id, UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        fn = self.lib.fn["flagcxCommInitRank"]
        what = f"flagcxCommInitRank(rank={rank})"
        detail: list[str] = []

        def call() -> int:
            code = fn(ctypes.byref(comm), 2, ctypes.addressof(uid), rank)
            if code != SUCCESS:  # the library's error text may be per thread: read it in the failing thread
                detail.append(self.lib.last_error(None))
            return code

        code = call_with_deadline(what, deadline, call, self.device)
        if code != SUCCESS:
            raise FlagcxError(what, code, detail[0] if detail else "")
        if not comm.value:
            raise FlagcxError(what, INVALID_ARGUMENT, "returned a NULL communicator")
        try:
            return FlagcxPairComm(self, comm.value, rank)
        except BaseException:
            self.device.apply()
            self.lib.fn["flagcxCommDestroy"](comm.value)
            raise




def build(config: PdPairConfig) -> FlagcxTransport:
    """The connector's flagcx transport (transports.build_transport, after FLAGCX_USE_HETERO_COMM got its default):
    libflagcx from the config's FLAGCX_LIB_PATH / FLAGCX_PATH, not from this process's environment."""
    hetero_comm = config.transport_env.get(ENV_USE_HETERO_COMM) or None
    if hetero_comm not in (None, "1"):
        log.warning("FLAGCX_USE_HETERO_COMM=%s set by the pod: one-sided puts need 1 on a same-vendor pair", hetero_comm)
    library_path = find_library_path(config.transport_env)  # a clear error naming both variables
    return FlagcxTransport(slots=config.transport_slots,
                           blocking_seconds=transport_blocking_seconds(config.hang_timeout_seconds),
                           library_path=library_path)


# Signal buffers of communicators that could not be destroyed; never unmapped (see FlagcxPairComm.close).
_abandoned: list[tuple[mmap.mmap, ctypes.Array]] = []

# FlagCX before PR #522 (all mr-index builds) skips the hetero teardown in flagcxCommDestroy when the comm is a
# same-vendor one with FLAGCX_USE_HETERO_COMM=1: each closed comm keeps its threads, connections and registrations.
# Counted per process so the log says how much has piled up.
_leaky_closes = 0
LEAKY_CLOSE_WARNING = (
    "flagcx: closed communicator #%d of this process on an mr-index FlagCX build; builds before FlagCX PR #522 skip "
    "the hetero teardown of same-vendor comms (threads, sockets and registrations stay: about 3-5 threads and 4-10 "
    "fds per re-pair measured on 2xH200), so re-pairs pile them up until the process restarts (docs/gpu.md)"
)

NO_ASYNC_ERRORS_HINT = (
    "libflagcx cannot report asynchronous errors on this communicator (flagcxCommGetAsyncError: {why}), so a failed "
    "transfer or a dead peer shows up only as this timeout; check the peer's log"
)


class FlagcxPairComm(PairComm):
    """One flagcx pair communicator. Thread-safe; puts are serialised (they are cheap posts)."""

    def __init__(self, transport: FlagcxTransport, comm: int, rank: int):
        self._lib = transport.lib
        self._device = transport.device
        self.generation = transport.lib.generation
        self._comm: int | None = comm
        self.rank = rank
        self.peer = 1 - rank
        self.slots = transport.slots
        # mr-index: our slots, one counter each. window: the library writes the counter at the SENDER's rank, one
        # per direction, so the pair has one slot (slot 0 = the counter the peer bumps).
        window = self.generation == GENERATION_WINDOW
        self.num_signal_slots = 1 if window else transport.num_signal_slots
        counters = WINDOW_SIGNAL_COUNTERS if window else self.num_signal_slots
        self._counter_of_slot0 = self.peer if window else 0
        self._blocking_seconds = transport.blocking_seconds
        self._lock = threading.Lock()  # puts, registration, close
        # Guards _posted together with the completion-counter read, so posted - completed is one consistent snapshot
        # (>= 0: nothing completes before its post is counted). Held only for a post or a counter read, never while
        # waiting, so counters() (a metrics scrape) never waits behind a put that waits for a slot.
        self._count_lock = threading.Lock()
        self._regions: list[tuple[int, int]] = []  # (ptr, size)
        self._windows: list[int] = []  # window API: the flagcxWindow_t of each region
        self._peer: _PeerTable | None = None
        self._posted = 0
        self._requeues = 0
        self._broken: str | None = None
        self._stuck = False  # a call overran its deadline: its helper thread may still be inside libflagcx
        self._async_errors: str | None = None  # why the library cannot report async errors, once known
        # Signal counters in host memory: the peer's RDMA atomics land here and we poll them (FLAGCX_PTR_HOST).
        # mmap gives page-aligned memory, as IB registration likes.
        self._signal_map = mmap.mmap(-1, counters * SIGNAL_BYTES)
        self._signals = (ctypes.c_uint64 * counters).from_buffer(self._signal_map)
        self._signal_counters = counters
        self._completed_base = 0
        try:
            self._completed_base = self._read_completions()
        except BaseException:
            self._comm = None  # init_pair destroys it; keep __del__ from doing so twice
            raise
        self._completed_seen = 0  # completions at the last read; posted - seen bounds in-flight from above

    # -- helpers --

    def _live_comm(self) -> int:
        if self._comm is None:
            raise TransportError("flagcx communicator is closed")
        if self._broken is not None:
            raise TransportError(f"flagcx communicator is unusable: {self._broken}")
        return self._comm

    def _read_completions(self) -> int:
        comm = self._live_comm()
        count = ctypes.c_uint64()
        self._lib.check("flagcxReadCounter", self._lib.fn["flagcxReadCounter"](comm, ctypes.byref(count)), comm)
        return count.value - self._completed_base

    def _inflight(self) -> int:
        with self._count_lock:
            self._completed_seen = self._read_completions()
            return self._posted - self._completed_seen

    def _check_async_error(self) -> None:
        fn = self._lib.fn.get("flagcxCommGetAsyncError")
        if fn is None:
            self._async_errors = "not exported"
            return
        comm = self._live_comm()
        async_error = ctypes.c_int(0)
        code = fn(comm, ctypes.byref(async_error))
        if code == SUCCESS and async_error.value != SUCCESS:
            raise FlagcxError("flagcxCommGetAsyncError", async_error.value, self._lib.last_error(comm))
        if code != SUCCESS:
            # NotSupported is what upstream answers for hetero comms: "no information", not an error.
            self._async_errors = f"{result_name(code)} ({code})"

    def _timeout_hint(self) -> str:
        if self._async_errors is None:
            return ""
        return NO_ASYNC_ERRORS_HINT.format(why=self._async_errors)

    def _collective(self, what: str, fn: Callable[[], int]) -> None:
        deadline = time.monotonic() + self._blocking_seconds
        try:
            code = call_with_deadline(what, deadline, fn, self._device)
        except TransportError as exc:
            self._stuck = True
            self._broken = f"{what} overran {self._blocking_seconds:g}s (is the peer registering the same regions?)"
            raise TransportError(f"{exc}: {self._broken}") from exc
        if code != SUCCESS:
            # The ranks' region indices may now disagree; nothing later on this comm can be trusted.
            error = FlagcxError(what, code, self._lib.last_error(self._comm))
            self._broken = str(error)
            raise error

    # -- PairComm --

    def register_region(self, ptr: int, size: int) -> int:
        """Collective in FlagCX: the peer must register its region with the same index at about the same time."""
        if ptr <= 0 or size <= 0:
            raise ValueError(f"register_region needs ptr > 0 and size > 0, got ptr={ptr:#x} size={size}")
        with self._lock:
            comm = self._live_comm()
            if any(base == ptr for base, _ in self._regions):
                # FlagCX would return success without a new index, shifting every later index by one.
                raise ValueError(f"address {ptr:#x} is already registered on this flagcx communicator")
            index = len(self._regions)
            if self.generation == GENERATION_WINDOW:
                self._register_window(comm, index, ptr, size)
            else:
                reg = self._lib.fn["flagcxOneSideRegister"]
                self._collective(f"flagcxOneSideRegister(region {index})", lambda: reg(comm, ptr, size))
            self._regions.append((ptr, size))
            if index == 0:  # FlagCX builds its connections with the first data region; the signal buffer follows.
                sig = self._lib.fn["flagcxOneSideSignalRegister"]
                addr = ctypes.addressof(self._signals)
                nbytes = self._signal_counters * SIGNAL_BYTES
                self._collective(
                    "flagcxOneSideSignalRegister", lambda: sig(comm, addr, nbytes, FLAGCX_PTR_HOST)
                )
            return index

    def _register_window(self, comm: int, index: int, ptr: int, size: int) -> None:
        win = ctypes.c_void_p()
        reg = self._lib.fn["flagcxCommWindowRegister"]
        what = f"flagcxCommWindowRegister(region {index})"
        self._collective(
            what, lambda: reg(comm, ptr, size, ctypes.byref(win), FLAGCX_WIN_COLL_SYMMETRIC, FLAGCX_MEM_CCL)
        )
        if not win.value:
            # Upstream returns success and no window when the comm is homogeneous (no symmetric one-sided path).
            self._broken = f"{what} returned no window"
            raise FlagcxError(
                what, NOT_SUPPORTED,
                "success but no window: one-sided windows need a heterogeneous communicator (FLAGCX_USE_HETERO_COMM=1)",
            )
        self._windows.append(win.value)
        # Upstream registers a symmetric window even when the net adaptor cannot do one-sided ops (no RDMA HCA): the
        # window then has no memory registration and every put answers flagcxInvalidArgument. flagcxOneSideRegister
        # on the same buffer tells the cases apart without side effects: it answers NotSupported at once when the
        # adaptor has no one-sided support, and success at once (duplicate address) when the window registered it.
        probe = self._lib.fn["flagcxOneSideRegister"]
        self._collective(f"{what}: flagcxOneSideRegister probe", lambda: probe(comm, ptr, size))

    def local_region_table(self) -> bytes:
        with self._lock:
            return _encode_table([size for _, size in self._regions], self.num_signal_slots)

    def set_peer_region_table(self, table: bytes) -> None:
        peer = _decode_table(table)
        with self._lock:
            self._peer = peer

    def _post(self, comm: int, src_region: int, src_offset: int, dst_region: int, dst_offset: int, size: int,
              signal_slot: int) -> int:
        post = self._lib.fn["flagcxPutSignal"]
        if self.generation == GENERATION_WINDOW:
            # Symmetric windows: our window k has the peer's MR index k; the library adds exactly 1 itself.
            local = self._regions[src_region][0] + src_offset
            return post(local, size, FLAGCX_UINT8, self.peer, self._windows[dst_region], dst_offset, 0, comm, None)
        return post(
            comm, self.peer, src_offset, dst_offset, size, signal_slot * SIGNAL_BYTES, src_region, dst_region,
            1,  # exactly +1 per put, never a running total
        )

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
        # The tag is not sent: flagcxPutSignal has no field for it and the receiving library checks nothing, so this
        # transport keeps supports_transfer_checks False (no expectations, no checksums; see transports/base.py).
        del transfer_id, generation
        with self._lock:
            comm = self._live_comm()
            self._check_put(src_region, src_offset, dst_region, dst_offset, size, signal_slot)
            deadline = time.monotonic() + self._blocking_seconds
            waited = False
            # Read the counter only when the cached bound says we might be full (saves a C call per put).
            if self._posted - self._completed_seen >= self.slots and self._inflight() >= self.slots:
                waited = True
                self._wait_for_slot(deadline)
            self._device.apply()  # the window API may touch the device; this thread may be any thread
            with self._count_lock:  # the post and its count are one step for _inflight()
                code = self._post(comm, src_region, src_offset, dst_region, dst_offset, size, signal_slot)
                if code == SUCCESS:
                    self._posted += 1
            if code != SUCCESS:
                # No retry: InternalError is permanent upstream (no RMA proxy); a full ring blocks in the library.
                call = "flagcxPutSignal (window API)" if self.generation == GENERATION_WINDOW else "flagcxPutSignal"
                raise FlagcxError(call, code, self._lib.last_error(comm))
            if waited:
                self._requeues += 1

    def _check_put(
        self, src_region: int, src_offset: int, dst_region: int, dst_offset: int, size: int, signal_slot: int
    ) -> None:
        if self._peer is None:
            raise TransportError("put_signal before set_peer_region_table: the peer's regions are unknown")
        if size < 0 or src_offset < 0 or dst_offset < 0:
            raise ValueError(f"negative size/offset: size={size} src_offset={src_offset} dst_offset={dst_offset}")
        if not 0 <= src_region < len(self._regions):
            raise ValueError(f"src_region {src_region} not registered here ({len(self._regions)} regions)")
        if src_offset + size > self._regions[src_region][1]:
            raise ValueError(
                f"source range {src_offset}+{size} exceeds local region {src_region} "
                f"({self._regions[src_region][1]} bytes)"
            )
        if not 0 <= dst_region < len(self._peer.region_sizes):
            raise ValueError(f"dst_region {dst_region} unknown to the peer ({len(self._peer.region_sizes)} regions)")
        if dst_offset + size > self._peer.region_sizes[dst_region]:
            raise ValueError(
                f"destination range {dst_offset}+{size} exceeds peer region {dst_region} "
                f"({self._peer.region_sizes[dst_region]} bytes)"
            )
        if not 0 <= signal_slot < self._peer.signal_slots:
            raise ValueError(f"signal_slot {signal_slot} outside the peer's {self._peer.signal_slots} slots")

    def _wait_for_slot(self, deadline: float) -> None:
        backoff = Backoff(deadline)
        while self._inflight() >= self.slots:
            self._check_async_error()
            if not backoff.sleep():
                hint = self._timeout_hint()
                raise TransportError(
                    f"flagcx: {self.slots} puts in flight towards rank {self.peer} and none completed in "
                    f"{self._blocking_seconds:.0f}s (completion counter stuck at {self._read_completions()})"
                    + (f"; {hint}" if hint else "")
                )

    def flush(self, deadline: float) -> None:
        with self._lock:
            backoff = Backoff(deadline)
            while self._inflight() > 0:
                self._check_async_error()
                if not backoff.sleep():
                    hint = self._timeout_hint()
                    raise TransportError(
                        f"flagcx flush: {self._inflight()} of {self._posted} puts still in flight at the deadline"
                        + (f"; {hint}" if hint else "")
                    )

    def wait_signal(self, signal_slot: int, expected: int, deadline: float) -> None:
        self._check_slot(signal_slot)
        if expected < 0:
            raise ValueError(f"expected must be >= 0, got {expected}")
        started = time.monotonic()
        backoff = Backoff(deadline)
        polls = 0
        while True:
            observed = self.read_signal(signal_slot)
            if observed >= expected:
                self._device.flush_rdma_writes()  # GPU data seen through a host counter: order it for the GPU
                return
            if polls % 64 == 0:
                self._check_async_error()
            polls += 1
            if not backoff.sleep():
                observed = self.read_signal(signal_slot)
                if observed >= expected:
                    self._device.flush_rdma_writes()
                    return
                raise SignalWaitTimeout(
                    signal_slot, expected, observed, time.monotonic() - started, hint=self._timeout_hint()
                )

    def read_signal(self, signal_slot: int) -> int:
        self._check_slot(signal_slot)
        if self._comm is None:
            raise TransportError("flagcx communicator is closed")
        return int(self._signals[self._counter_of_slot0 + signal_slot])  # one aligned 64-bit load

    def _check_slot(self, signal_slot: int) -> None:
        if not 0 <= signal_slot < self.num_signal_slots:
            raise ValueError(f"signal_slot {signal_slot} outside 0..{self.num_signal_slots - 1}")

    def counters(self) -> TransportCounters:
        # Not self._lock: a put waiting for a slot holds it, and a metrics scrape must not wait behind it.
        # _inflight() takes only _count_lock, so posted and completed are read as one snapshot (never negative).
        try:
            inflight = self._inflight()
        except TransportError:
            inflight = 0
        return TransportCounters(inflight=inflight, slots=self.slots, requeues=self._requeues)

    def close(self) -> None:
        with self._lock:
            comm, self._comm = self._comm, None
            if comm is None:
                return
            if self._stuck:
                # A helper thread may still be inside libflagcx with this comm, and the library may still write
                # into the signal buffer: keep it mapped for the life of the process.
                log.warning("flagcx comm left open because a call into it never returned: %s", self._broken)
                _abandoned.append((self._signal_map, self._signals))
                return
            self._device.apply()
            dereg = self._lib.fn.get("flagcxCommWindowDeregister")
            for win in self._windows:
                code = dereg(comm, win, FLAGCX_MEM_CCL)
                if code != SUCCESS:
                    log.warning("flagcxCommWindowDeregister: %s (%d)", result_name(code), code)
            self._windows = []
            code = self._lib.fn["flagcxCommDestroy"](comm)
            if self._broken is not None:
                # Failed with an error code (e.g. NotSupported at registration): every call has returned, so the
                # comm is destroyed (not leaked per re-pair); the small signal buffer stays mapped in case the
                # peer's registration of it outlives ours.
                _abandoned.append((self._signal_map, self._signals))
                return
            if self.generation == GENERATION_MR_INDEX:  # measured: it leaks with or without registrations
                global _leaky_closes
                _leaky_closes += 1
                log.warning(LEAKY_CLOSE_WARNING, _leaky_closes)
            if code != SUCCESS:
                log.warning("flagcxCommDestroy: %s (%d)", result_name(code), code)
                _abandoned.append((self._signal_map, self._signals))  # the library may still write into it
                return
            del self._signals
            self._signal_map.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass
