"""Worker side: KV regions, the side channel, transfers and signal accounting. Runs in each vLLM worker (TP rank).

Decode: `register_kv_caches` registers nothing yet (regions belong to a pair communicator) but starts the side-channel
listener at once, so the operator's TCP probe sees it before prefill starts. For each request to load it takes a
signal slot, opens a wait for exactly layers x blocks signals with deadline PDPAIR_HANG_TIMEOUT_SECONDS, sends the
Pull and lets a waiter thread wait on the host. Success -> finished_recving; timeout, prefill's PullFailed or a broken
pair -> failed_recving, which vLLM turns into an error or a recompute (kv_load_failure_policy). A timed-out wait
stays open in the pod metrics (its deficit is real: signals went missing on this pair) and its slot is never reused,
so /healthz reports the pod hung until the pair is restarted or the late signals arrive.

Decode has one edge per paired prefill (side_channel.DecodeEdge, with its own pair communicator and signal slots): a
request's Pull goes on the edge of the prefill named in its kv_transfer_params, and fails at once when that prefill
is not paired. Prefill has one edge per decode of its peer set (`_PrefillEdge`, its own side channel and transport);
`set_peers` replaces the set at runtime. A Pull is served on the edge it came on.

Prefill: learns each finished request's blocks from the scheduler metadata, serves each Pull on a pool of
PUSH_WORKERS threads (put_signal per layer and block, then flush; the reply goes back through the side channel's
outbox) and reports the request's send finished, which frees its blocks. The side-channel thread only hands Pulls to
the pool, so transfers of concurrent requests overlap and the loop keeps watching for a disconnect. A Pull that
arrives before the metadata waits (bounded); blocks nobody pulls are freed when their lease expires.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pdpair import contract
from pdpair.connector import timeline
from pdpair.connector.config import PdPairConfig, PeerAddress, check_peer_set, check_side_channel_key
from pdpair.connector.deadlines import flush_deadline, parked_pull_deadline, signal_wait_deadline
from pdpair.connector.side_channel import DecodeSideChannel, PrefillSideChannel
from pdpair.connector.preflight import report_bind_failure
from pdpair.connector.metadata import KvLayout, Message, Pull, PullDone, PullFailed, Welcome, compatibility_factors, compatibility_hash
from pdpair.connector.metrics import (MetricsServer, PeerPush, PeerRanks, RankExporter, export_rank, rank_channel_key,
                                      serve)
from pdpair.connector.signals import SignalAccounts
from pdpair.connector.warmup import Warmup
from pdpair.connector.scheduler import PdPairConnectorMetadata, RecvRequest
from pdpair.connector.staging import HostStaging, block_runs
from pdpair.connector.stats import PdPairKVConnectorStats
from pdpair.connector.transports import PairComm, PairTransport, SignalWaitTimeout, TransportError, build_transport

# TEST ONLY (test_corrupt_kv_file): the byte the corruption knob writes over every received KV block.
TEST_CORRUPT_KV_BYTE = 0x3F
# TEST ONLY (test_slow_decode_file): the knob file is read at most this often, so an engine step costs a file read
# twice a second at most; a change shows within this long.
TEST_SLOW_DECODE_POLL_SECONDS = 0.5
# TEST ONLY (test_slow_decode_file): the largest delay the file may ask for. Seconds per step already make a decode
# useless to the router; a larger number is more likely a unit mistake, and would stall the engine instead.
TEST_SLOW_DECODE_MAX_MS = 10_000
logger = logging.getLogger("pdpair.connector.worker")

WAIT_SLICE_SECONDS = 0.05  # a waiter re-checks cancellation and reports progress this often
MAX_WAITERS = 64
# Prefill: threads that serve Pulls (puts + flush), so concurrent requests' transfers overlap and the side-channel
# thread only routes messages. The queue in front of them is bounded by decode's signal slots: each Pull in flight
# holds one until its signals are in.
PUSH_WORKERS = 4
# An engine step that ran no model (only waiting on transfers) blocks in get_finished until a transfer settles, at
# most this long, instead of returning at once: vLLM would otherwise spin empty steps (1 ms apart) that take the CPU
# and the GIL from the very threads that move the KV. It bounds how late an idle engine sees a new request.
IDLE_WAIT_SECONDS = 0.01
# Prefill logs a warning when serving one Pull takes longer than this (waiting for the blocks, or putting and
# flushing them): decode's deadline (PDPAIR_HANG_TIMEOUT_SECONDS) counts from its Pull, so a slow push is the first
# thing to look for when a load times out.
SLOW_PUSH_SECONDS = 1.0


@dataclass(frozen=True)
class KvRegions:
    """One region per layer: base address and bytes of one block, in the model's layer order. `staging`: pinned host
    mirrors the transport moves instead, when the KV is on a GPU and the transport takes host memory only (tcp)."""

    layer_names: list[str]
    ptrs: list[int]
    chunk_bytes: list[int]
    num_blocks: int
    staging: HostStaging | None = None

    @classmethod
    def from_kv_caches(cls, kv_caches: dict[str, torch.Tensor], num_blocks: int, stage_on_host: bool = False) -> KvRegions:
        names, ptrs, chunks = [], [], []
        for name, tensor in kv_caches.items():
            if tensor.shape[0] != num_blocks:
                raise ValueError(
                    f"KV cache of {name} has shape {tuple(tensor.shape)}; PdPairConnector needs the block dimension "
                    f"first ({num_blocks} blocks)"
                )
            if not tensor[0].is_contiguous():
                raise ValueError(f"KV cache of {name}: one block is not contiguous (strides {tensor.stride()})")
            names.append(name)
            ptrs.append(tensor.data_ptr())
            chunks.append(tensor.stride(0) * tensor.element_size())
        staging = None
        if stage_on_host:
            staging = HostStaging(list(kv_caches.values()), [chunk * num_blocks for chunk in chunks])
        return cls(names, ptrs, chunks, num_blocks, staging)

    def region_size(self, layer: int) -> int:
        return self.chunk_bytes[layer] * self.num_blocks

    def register(self, comm: PairComm) -> list[int]:
        ptrs = self.staging.host_ptrs if self.staging is not None else self.ptrs
        return [comm.register_region(ptrs[i], self.region_size(i)) for i in range(len(ptrs))]

    def runs(self, block_ids: list[int]) -> list[list[tuple[int, int]]]:
        """Per layer, the byte ranges of these blocks (adjacent blocks merged)."""
        return [block_runs(block_ids, chunk) for chunk in self.chunk_bytes]


@dataclass
class _Wait:
    recv: RecvRequest
    slot: int
    base: int
    expected: int
    nbytes: int
    started: float
    deadline: float
    comm: PairComm
    failed_reason: str | None = None  # set by PullFailed
    first_signal: float | None = None  # time.monotonic() stamps, for the timeline
    last_signal: float | None = None


class SlowDecodeKnob:
    """TEST ONLY (test_slow_decode_file): how long each decode model step sleeps, so a test can make one decode of
    several measurably slower (the router should then send it fewer requests).

    While the file exists its content is a number of milliseconds, finite, 0..TEST_SLOW_DECODE_MAX_MS; absent: no
    delay. Read at most every TEST_SLOW_DECODE_POLL_SECONDS (the answer is cached in between). A content that is not
    such a number means no delay and is logged once, never raised: a typo in a test must not take the engine down."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._read_at: float | None = None
        self._text: str | None = None  # the content last read; None: the file was absent
        self._delay_seconds = 0.0

    def delay_seconds(self) -> float:
        now = time.monotonic()
        if self._read_at is not None and now - self._read_at < TEST_SLOW_DECODE_POLL_SECONDS:
            return self._delay_seconds
        self._read_at = now
        try:
            with open(self.path) as knob:
                text: str | None = knob.read().strip()
        except FileNotFoundError:
            text = None
        except OSError as exc:  # e.g. a directory: a bad content like any other (no delay, said once)
            text = f"<unreadable: {exc.strerror or exc}>"
        if text == self._text:
            return self._delay_seconds
        self._text = text  # the log lines below come once per change of content, not once per step
        self._delay_seconds = 0.0
        if text is None:
            logger.warning("TEST KNOB %s removed: decode steps are no longer slowed", self.path)
            return 0.0
        milliseconds = _knob_milliseconds(text)
        if milliseconds is None:
            logger.warning("TEST KNOB %s: %r is not a number of milliseconds in 0..%d: ignored (decode steps are "
                           "not slowed)", self.path, text[:60], TEST_SLOW_DECODE_MAX_MS)
            return 0.0
        self._delay_seconds = milliseconds / 1000
        logger.warning("TEST KNOB %s present: every decode model step sleeps %g ms", self.path, milliseconds)
        return self._delay_seconds

    def sleep(self) -> None:
        delay = self.delay_seconds()
        if delay > 0:
            time.sleep(delay)


def _knob_milliseconds(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and 0 <= value <= TEST_SLOW_DECODE_MAX_MS else None


def _wall(monotonic: float | None) -> float | None:
    """A time.monotonic() stamp as time.time(), for timeline lines that other processes' lines join."""
    return None if monotonic is None else monotonic + (time.time() - time.monotonic())


class _Worker:
    def __init__(self, config: PdPairConfig, tp_rank: int, tp_size: int, block_size: int, vllm_version: str) -> None:
        self.config = config
        # Every Hello is authenticated with the pair's key: no side channel starts without one (ConfigError).
        self.side_channel_key = check_side_channel_key(config.side_channel_key).encode()
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.block_size = block_size
        self.vllm_version = vllm_version
        self.transport: PairTransport = build_transport(config)
        self.accounts = SignalAccounts(config.role, config.hang_timeout_seconds, generation=config.generation,
                                       rank=tp_rank)
        # One metrics port per pod: rank 0 serves it and merges the other ranks' accounts, which each rank > 0
        # exports on a local socket (every rank runs in its own worker process).
        self.metrics_server: MetricsServer | None = None
        self.rank_exporter: RankExporter | None = None
        # Prefill with PDPAIR_PEERS_TOKEN: the operator's peer push (PUT /pdpair/v1/peers) on rank 0's metrics port,
        # forwarded to every other rank's exporter; each rank applies it to its own edges (`_apply_peer_push`).
        push = config.peers_token is not None and config.role == contract.ROLE_PREFILL
        if config.metrics_port is not None:
            # The ranks' channel is authenticated with a key derived from the pair's side-channel key
            # (metrics.rank_channel_key): on hostNetwork any pod of the node can reach the ranks' sockets.
            rank_key = rank_channel_key(config.side_channel_key or "") if tp_size > 1 else b""
            if tp_rank == 0:
                peers = PeerRanks(config.metrics_port, tuple(range(1, tp_size)), rank_key) if tp_size > 1 else None
                try:
                    api = f"http://127.0.0.1:{config.http_port}" if config.http_port else None
                    peer_push = PeerPush(config.peers_token, config.generation, self._apply_peer_push,
                                         peers) if push else None
                    self.metrics_server = serve(config.metrics_port, self.accounts, ranks=peers,
                                                engine_health_url=f"{api}/health" if api else None,
                                                warmup=Warmup(api) if api else None, peers=peer_push)
                except OSError as exc:  # taken after the pod's preflight: tell the operator, which re-leases
                    report_bind_failure(config.metrics_port, exc, "the connector's metrics server")
                    raise
            else:
                self.rank_exporter = export_rank(config.metrics_port, self.accounts, rank_key,
                                                 self._apply_peer_push if push else None)
        self.regions: KvRegions | None = None
        self.layout: KvLayout | None = None
        self.local_hash = ""
        self.factors: dict = {}
        self.stats = PdPairKVConnectorStats()
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)  # notified (under _lock) when a transfer settles
        self._counters_warned = False

    def _apply_peer_push(self, peers) -> dict[str, bool]:
        """The peer push's callback (metrics.PeerPush on rank 0, RankExporter on the others): apply `peers` (None:
        only read the state). Prefill only; PrefillWorker defines both methods."""
        return self.peer_state() if peers is None else self.set_peers(peers)

    def _prepare(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        first = next(iter(kv_caches.values()))
        on_gpu = first.device.type == "cuda"
        if on_gpu:
            # A transport whose library binds to the calling thread's device makes this one current in its threads.
            self.transport.set_device(first.device.index if first.device.index is not None else torch.cuda.current_device())
        stage = on_gpu and not self.transport.supports_device_memory
        self.regions = KvRegions.from_kv_caches(kv_caches, num_blocks, stage_on_host=stage)
        if stage:
            logger.info("KV caches on %s, transport %s moves host memory: staging through %.1f GiB of pinned host "
                        "memory", first.device, self.config.transport, self.regions.staging.nbytes / 2**30)
        self.layout = KvLayout(
            self.regions.layer_names, self.regions.chunk_bytes, self.block_size, str(first.dtype), self.tp_size
        )
        self.factors = compatibility_factors(self.layout, self.vllm_version)
        self.local_hash = compatibility_hash(self.factors)

    def _register(self, comm: PairComm) -> tuple[bytes, list[int], int]:
        assert self.regions is not None
        indices = self.regions.register(comm)
        return comm.local_region_table(), indices, self.regions.num_blocks

    def _publish_transport_counters(self, comm: PairComm | None, peer: str) -> None:
        if comm is None:
            return
        try:
            c = comm.counters()
            self.accounts.set_transport_counters(peer, c.inflight, c.slots, c.requeues)
        except Exception as exc:  # noqa: BLE001 - metrics must never take the engine step down
            if not self._counters_warned:
                self._counters_warned = True
                logger.warning("transport counters not exported (%s: %s); further failures are not logged",
                               type(exc).__name__, exc)

    def shutdown(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.stop()
            self.metrics_server = None
        if self.rank_exporter is not None:
            self.rank_exporter.stop()
            self.rank_exporter = None
        self.transport.close()


class DecodeWorker(_Worker):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.side: DecodeSideChannel | None = None
        self.peer_indices: list[int] = []
        self._waits: dict[str, _Wait] = {}
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._free_slots: dict[PairComm, list[int]] = {}  # per edge's pair communicator
        self._abandoned: dict[str, _Wait] = {}  # timed out, still open in the metrics
        self._waiters = ThreadPoolExecutor(MAX_WAITERS, thread_name_prefix=f"pdpair-signal-wait-r{self.tp_rank}")
        self._done_waits: list[_Wait] = []  # finished since the last get_transfer_results, for the timeline
        self._listener_lock = threading.Lock()
        self._stopping = threading.Event()
        self._delayed_listener: threading.Thread | None = None
        path = self.config.test_slow_decode_file
        self._slow_decode = SlowDecodeKnob(path) if path else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        self._prepare(kv_caches, num_blocks)
        self.side = DecodeSideChannel(
            host=self.config.listen_host,
            port=self.config.listen_port(self.tp_rank),
            tp_rank=self.tp_rank,
            generation=self.config.generation,
            transport=self.transport,
            hang_timeout_seconds=self.config.hang_timeout_seconds,
            local_hash=self.local_hash,
            factors=self.factors,
            key=self.side_channel_key,
            max_edges=self.config.max_edges,
            register_regions=self._register,
            on_pull_done=self._on_pull_done,
            on_pull_failed=self._on_pull_failed,
            on_disconnect=self._on_disconnect,
            accounts=self.accounts,
        )
        if self._listener_held_back():
            logger.warning("TEST KNOB %s present: rank %d's side-channel listener waits until the file is removed",
                           self.config.test_delay_listener_file, self.tp_rank)
            self._delayed_listener = threading.Thread(
                target=self._start_listener_when_released, name=f"pdpair-test-listen-delay-r{self.tp_rank}", daemon=True
            )
            self._delayed_listener.start()
        else:
            self.side.start_and_wait()

    def _listener_held_back(self) -> bool:
        """TEST ONLY (test_delay_listener_file): the file exists and names this rank (empty: every rank)."""
        path = self.config.test_delay_listener_file
        if not path or not os.path.exists(path):
            return False
        try:
            text = open(path).read().strip()
        except OSError:
            return False  # removed between the two calls
        return not text or str(self.tp_rank) in {part.strip() for part in text.split(",")}

    def _start_listener_when_released(self) -> None:
        while not self._stopping.wait(0.1):
            if self._listener_held_back():
                continue
            with self._listener_lock:
                if self._stopping.is_set():
                    return
                logger.warning("TEST KNOB %s released: starting rank %d's side-channel listener",
                               self.config.test_delay_listener_file, self.tp_rank)
                try:
                    self.side.start_and_wait()
                except Exception:  # noqa: BLE001 - logged; decode then fails its loads as unpaired
                    logger.exception("rank %d: the delayed side-channel listener did not start", self.tp_rank)
            return

    def _register(self, comm: PairComm) -> tuple[bytes, list[int], int]:
        result = super()._register(comm)
        with self._lock:  # a new edge (or a prefill that re-paired): its own signal slots
            self._free_slots[comm] = list(range(comm.num_signal_slots - 1, -1, -1))
        return result

    # --- per step --------------------------------------------------------------------------------
    def start_load_kv(self, meta: PdPairConnectorMetadata) -> None:
        # TEST ONLY (test_slow_decode_file). vLLM calls this once in every step, whether or not KV is received, so the
        # delay shows in the time per output token. A step that runs no model is not slowed: it produces no token.
        if self._slow_decode is not None and not meta.idle_step:
            self._slow_decode.sleep()
        side = self.side
        assert side is not None
        for instance, remote_id in meta.reqs_to_release:
            edge = side.edge(instance)
            if edge is None:  # that prefill is gone or never paired: its lease frees the blocks
                logger.info("prefill %s is not paired with rank %d: its request %s is not released (its lease frees "
                            "the blocks)", instance, self.tp_rank, remote_id)
                continue
            side.post(Pull(f"release-{remote_id}", remote_id, 0, [], 0, 0), edge)
        for recv in meta.reqs_to_recv:
            self._start_recv(side, recv)

    def _start_recv(self, side: DecodeSideChannel, recv: RecvRequest) -> None:
        assert self.regions is not None
        edge = side.edge(recv.remote_instance)
        if edge is None:  # fail now: no wait, nothing is sent
            paired = sorted(e.instance for e in side.edges())
            logger.error(
                "request %s: cannot load KV: prefill %r (which computed it as %s) is not paired with this decode's "
                "rank %d (paired: %s)", recv.request_id, recv.remote_instance, recv.remote_request_id, self.tp_rank,
                ", ".join(paired) or "none",
            )
            self.accounts.count_failed_transfer()
            self._fail(recv.request_id, timed_out=False)
            return
        comm = edge.comm
        with self._lock:  # _fail takes this lock too: decide here, fail outside
            free = self._free_slots.get(comm)
            slot = free.pop() if free else None
        if slot is None:
            logger.error("request %s: no free signal slot (all %d busy or quarantined)", recv.request_id, comm.num_signal_slots)
            self.accounts.count_failed_transfer()
            self._fail(recv.request_id, timed_out=False)
            return
        layers = len(self.regions.ptrs)
        expected = layers * len(recv.block_ids)
        nbytes = sum(self.regions.chunk_bytes) * len(recv.block_ids)
        try:
            base = comm.read_signal(slot)
        except TransportError as exc:
            logger.error("request %s: cannot load KV: the pair is broken: %s", recv.request_id, exc)
            self.accounts.count_failed_transfer()
            self._fail(recv.request_id, timed_out=False)
            return
        now = time.monotonic()
        deadline = signal_wait_deadline(self.config.hang_timeout_seconds, now)
        wait = _Wait(recv, slot, base, expected, nbytes, now, deadline, comm)
        with self._lock:
            self._waits[recv.request_id] = wait
        self.accounts.open_wait(recv.request_id, edge.label, expected, wait.deadline)
        side.post(Pull(recv.request_id, recv.remote_request_id, recv.first_block, recv.block_ids, slot, expected), edge)
        self._waiters.submit(self._wait_for_signals, wait)

    def _wait_for_signals(self, wait: _Wait) -> None:
        request_id = wait.recv.request_id
        received = 0
        try:
            # Two waits, so the timeline has the first signal's arrival; each returns as soon as its count is reached.
            for target in (wait.base + min(1, wait.expected), wait.base + wait.expected):
                received = self._wait_until(wait, target, received)
                if received < 0:
                    return  # timed out (reported)
                if wait.first_signal is None:
                    wait.first_signal = time.monotonic()
            wait.last_signal = time.monotonic()
        except TransportError as exc:
            logger.error("request %s: KV load failed: %s", request_id, exc)
            self._close(wait, contract.OUTCOME_ERROR, received)
            self._fail(request_id, timed_out=False)
            return
        except Exception:  # noqa: BLE001 - a waiter must always settle its request
            logger.exception("request %s: KV wait crashed", request_id)
            self._close(wait, contract.OUTCOME_ERROR, received)
            self._fail(request_id, timed_out=False)
            return
        self.accounts.on_signals(request_id, wait.expected)
        if self.regions is not None and self.regions.staging is not None:
            try:  # the bytes are in the host mirror; the load is done once they are on the device
                self.regions.staging.to_device(self.regions.runs(wait.recv.block_ids))
            except Exception as exc:  # noqa: BLE001 - a waiter must always settle its request
                logger.error("request %s: copying the staged KV to the device failed: %s", request_id, exc)
                self._close(wait, contract.OUTCOME_ERROR, wait.expected)
                self._fail(request_id, timed_out=False)
                return
        seconds = wait.last_signal - wait.started
        self._maybe_corrupt(wait)
        self._close(wait, contract.OUTCOME_OK, wait.expected, seconds=seconds, release_slot=True)
        with self._lock:
            self.stats.record_transfer(seconds, wait.nbytes)
            self.stats.record_stage("pull_to_first_signal", wait.first_signal - wait.started)
            self.stats.record_stage("first_to_last_signal", wait.last_signal - wait.first_signal)
            self._done_waits.append(wait)
            self._finished.add(request_id)
            self._progress.notify_all()

    def _wait_until(self, wait: _Wait, target: int, received: int) -> int:
        """Block until the slot reaches `target`; return the signals received, or -1 after reporting a timeout.
        The native wait wakes on the signal itself; the slices only bound how late a PullFailed or a closed pair
        (set by the side-channel thread) is noticed."""
        while True:
            if wait.failed_reason is not None:
                raise TransportError(f"prefill could not serve the pull: {wait.failed_reason}")
            now = time.monotonic()
            try:
                wait.comm.wait_signal(wait.slot, target, min(wait.deadline, now + WAIT_SLICE_SECONDS))
                return target - wait.base
            except SignalWaitTimeout as exc:
                got = exc.observed - wait.base
                if got != received:
                    received = got
                    self.accounts.on_signals(wait.recv.request_id, received)
                if time.monotonic() >= wait.deadline:
                    self._on_timeout(wait, received)
                    return -1

    def _on_timeout(self, wait: _Wait, received: int) -> None:
        request_id = wait.recv.request_id
        logger.error(
            "request %s: KV transfer from prefill request %s timed out after %.1fs (%s=%s): expected %d signals on "
            "slot %d, received %d, missing %d; failing the load (vLLM kv_load_failure_policy decides: error or "
            "recompute). The slot is quarantined and the deficit stays visible until the pair restarts.",
            request_id, wait.recv.remote_request_id, self.config.hang_timeout_seconds,
            contract.ENV_HANG_TIMEOUT_SECONDS, self.config.hang_timeout_seconds, wait.expected, wait.slot,
            received, wait.expected - received,
        )
        self.accounts.health()  # counts the timeout now, without waiting for a scrape
        with self._lock:
            self._waits.pop(request_id, None)
            self._abandoned[request_id] = wait
        self._fail(request_id, timed_out=True)

    def _close(self, wait: _Wait, outcome: str, received: int, seconds: float | None = None, release_slot: bool = False) -> None:
        request_id = wait.recv.request_id
        with self._lock:
            self._waits.pop(request_id, None)
            free = self._free_slots.get(wait.comm)  # None: that edge closed, its slots went with it
            if release_slot and free is not None:
                free.append(wait.slot)
        took = time.monotonic() - wait.started if seconds is None else seconds
        self.accounts.close_wait(request_id, outcome, wait.nbytes if outcome == contract.OUTCOME_OK else 0, took)

    def _fail(self, request_id: str, timed_out: bool) -> None:
        with self._lock:
            self.stats.record_failure(timed_out)
            self._failed.add(request_id)
            self._finished.add(request_id)
            self._progress.notify_all()

    def _maybe_corrupt(self, wait: _Wait) -> None:
        """TEST ONLY: overwrite the received blocks while the knob file exists, to prove the output uses them.

        A fixed byte, not random bytes: random bytes read as floats hold NaN/inf, which makes the outcome depend on
        how a backend propagates NaN. 0x3F in every byte is a finite value in float32/bf16/fp16, so every key and
        value of the received prompt becomes the same finite number (uniform attention, constant values)."""
        path = self.config.test_corrupt_kv_file
        if not path or not os.path.exists(path):
            return
        assert self.regions is not None
        logger.warning("request %s: TEST KNOB %s present: corrupting the received KV", wait.recv.request_id, path)
        for layer, ptr in enumerate(self.regions.ptrs):
            chunk = self.regions.chunk_bytes[layer]
            for block in wait.recv.block_ids:
                view = _byte_view(ptr + block * chunk, chunk)
                view.fill_(TEST_CORRUPT_KV_BYTE)

    def _on_pull_done(self, done: PullDone) -> None:
        pass  # completion is the signal count, not this message

    def _on_pull_failed(self, failed: PullFailed) -> None:
        if failed.transfer_id.startswith("release-"):
            return
        with self._lock:
            wait = self._waits.get(failed.transfer_id)
        if wait is not None:
            wait.failed_reason = failed.reason
        else:
            logger.warning("PullFailed for unknown transfer %s: %s", failed.transfer_id, failed.reason)

    def _on_disconnect(self, edge, reason: str) -> None:
        """Side-channel thread: `edge` closed (its prefill re-paired, or decode stops). Its waits fail now (the
        waiters notice within WAIT_SLICE_SECONDS); other edges' waits are untouched."""
        with self._lock:
            self._free_slots.pop(edge.comm, None)
            waits = [w for w in self._waits.values() if w.comm is edge.comm]
        for wait in waits:
            wait.failed_reason = f"pair with prefill {edge.instance} closed: {reason}"

    def _check_abandoned(self) -> None:
        with self._lock:
            abandoned = list(self._abandoned.values())
        for wait in abandoned:
            try:
                value = wait.comm.read_signal(wait.slot)
            except TransportError:
                continue
            received = min(value - wait.base, wait.expected)
            self.accounts.on_signals(wait.recv.request_id, received)
            if received >= wait.expected:
                logger.warning("request %s: the late signals arrived; closing its wait", wait.recv.request_id)
                with self._lock:
                    self._abandoned.pop(wait.recv.request_id, None)
                self._close(wait, contract.OUTCOME_TIMEOUT, received, release_slot=True)

    def get_transfer_results(self, idle: bool = False) -> tuple[set[str], set[str]]:
        """Requests whose load settled since the last call. idle: this step ran no model; wait (bounded by
        IDLE_WAIT_SECONDS) for an open load to settle rather than return empty."""
        if idle:
            with self._lock:
                if self._waits and not self._finished:
                    self._progress.wait(IDLE_WAIT_SECONDS)
        if self._abandoned:
            self._check_abandoned()
        if self.side is not None:
            for edge in self.side.edges():
                self._publish_transport_counters(edge.comm, edge.label)
        with self._lock:
            finished, failed = self._finished, self._failed
            self._finished, self._failed = set(), set()
            done, self._done_waits = self._done_waits, []
            handed = time.monotonic()
            for wait in done:
                self.stats.record_stage("last_signal_to_engine", handed - wait.last_signal)
        for wait in done:
            timeline.log("decode-worker", wait.recv.request_id, pull_sent=_wall(wait.started),
                         first_signal=_wall(wait.first_signal), last_signal=_wall(wait.last_signal),
                         handed_to_engine=_wall(handed))
        return finished, failed

    def shutdown(self) -> None:
        with self._listener_lock:
            self._stopping.set()  # a held-back listener (test knob) never starts after this
        if self._delayed_listener is not None:
            self._delayed_listener.join(5.0)
        if self.side is not None:
            with self._lock:
                for wait in self._waits.values():
                    wait.failed_reason = "shutting down"
            self.side.stop()
        self._waiters.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            open_waits = list(self._waits.values()) + list(self._abandoned.values())
            self._waits.clear()
            self._abandoned.clear()
        for wait in open_waits:
            try:
                self.accounts.close_wait(wait.recv.request_id, contract.OUTCOME_ERROR, 0, time.monotonic() - wait.started)
            except ValueError:
                pass
        super().shutdown()


class _PrefillEdge:
    """Prefill, one TP rank: its edge to one decode of the peer set: the side channel (DEALER thread), its own
    transport (a handshake's pending state is per edge), the peer's region indices, the Pulls parked on it and its
    pushes in flight (a removed decode's edge closes once these are done)."""

    def __init__(self, peer: PeerAddress) -> None:
        self.peer = peer
        self.side: PrefillSideChannel | None = None
        self.transport: PairTransport | None = None
        self.peer_indices: list[int] = []
        self.local_indices: list[int] = []
        self.peer_num_blocks = 0
        self.parked: dict[str, tuple[Pull, float, float]] = {}  # transfer id -> (pull, deadline, received)
        self.inflight = 0  # pushes submitted and not yet replied (under the worker's lock)
        self.draining = False  # left the peer set: no new Pull is served, the edge closes when inflight is 0


class PrefillWorker(_Worker):
    """Prefill, one TP rank: one edge per decode of its peer set (`set_peers` replaces the set at runtime)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._edges: dict[PeerAddress, _PrefillEdge] = {}
        self._peers_lock = threading.Lock()  # set_peers and register_kv_caches: one change of the set at a time
        self._desired: tuple[PeerAddress, ...] = check_peer_set(self.config.peer_set(), "the configured peers")
        self._registered = False
        self._device_index: int | None = None
        self._closing: list[threading.Thread] = []
        self._transport_taken = False
        self._sends: dict[str, tuple[list[int], float]] = {}  # request id -> (block ids, lease expiry)
        self._finished_sending: set[str] = set()
        self._pushers = ThreadPoolExecutor(PUSH_WORKERS, thread_name_prefix=f"pdpair-push-r{self.tp_rank}")

    # --- the peer set --------------------------------------------------------------------------------
    @property
    def side(self) -> PrefillSideChannel | None:
        """The side channel when the peer set has exactly one decode (1P1D), else None."""
        with self._peers_lock:
            edges = list(self._edges.values())
        return edges[0].side if len(edges) == 1 else None

    def edge_side(self, peer: PeerAddress) -> PrefillSideChannel | None:
        """The side channel of the edge to `peer` (None when `peer` is not in the set)."""
        with self._peers_lock:
            edge = self._edges.get(peer)
        return edge.side if edge is not None else None

    def peer_state(self) -> dict[str, bool]:
        """Each decode of the current set (its label, host:portBase) -> this rank is paired with it."""
        with self._peers_lock:
            edges = list(self._edges.values())
        return {edge.peer.label: edge.side is not None and edge.side.connected.is_set() for edge in edges}

    def set_peers(self, peers) -> dict[str, bool]:
        """Replace the whole peer set (level-triggered, what the operator's push will call): start an edge to each
        new decode, drop each decode that left once its pushes in flight end or fail (a Pull that comes on it
        meanwhile is refused with a PullFailed), keep the others untouched. Returns `peer_state()`. Before
        register_kv_caches it only records the set."""
        wanted = check_peer_set(peers)
        with self._peers_lock:
            self._desired = wanted
            if self._registered:
                self._apply_peers(wanted)
        return self.peer_state()

    def _apply_peers(self, wanted: tuple[PeerAddress, ...]) -> None:
        """Under _peers_lock."""
        for peer in [p for p in self._edges if p not in wanted]:
            edge = self._edges.pop(peer)
            logger.info("rank %d: decode %s left the peer set; its edge closes once its pushes end", self.tp_rank, peer)
            closer = threading.Thread(target=self._close_edge, args=(edge,), daemon=True,
                                      name=f"pdpair-edge-close-r{self.tp_rank}-{peer.label}")
            self._closing.append(closer)
            closer.start()
        for peer in wanted:
            if peer not in self._edges:
                self._edges[peer] = self._open_edge(peer)

    def _open_edge(self, peer: PeerAddress) -> _PrefillEdge:
        edge = _PrefillEdge(peer)
        # The worker's transport serves the first edge; every other edge builds its own (a prefill handshake's pending
        # state, e.g. tcp's listener for the uid, belongs to one edge).
        transport = self.transport if not self._transport_taken else build_transport(self.config)
        self._transport_taken = True
        if self._device_index is not None and transport is not self.transport:
            transport.set_device(self._device_index)
        edge.transport = transport
        edge.side = PrefillSideChannel(
            peer_host=peer.host,
            peer_port=peer.port(self.tp_rank),
            tp_rank=self.tp_rank,
            generation=self.config.generation,
            pair=self.config.pair,
            instance=self.config.instance_id,
            peer_label=peer.label,
            transport=transport,
            hang_timeout_seconds=self.config.hang_timeout_seconds,
            local_hash=self.local_hash,
            factors=self.factors,
            key=self.side_channel_key,
            register_regions=functools.partial(self._register_edge, edge),
            on_pull=functools.partial(self._on_pull, edge),
            on_tick=functools.partial(self._on_tick, edge),
            on_connected=functools.partial(self._on_connected, edge),
            accounts=self.accounts,
        )
        edge.side.start()
        return edge

    def _close_edge(self, edge: _PrefillEdge) -> None:
        """A decode that left the set: refuse new Pulls, wait (bounded) until the pushes in flight and the Pulls
        parked on it are settled, then stop its side channel (closing its pair) and forget its series."""
        bound = time.monotonic() + 2 * self.config.hang_timeout_seconds  # a parked Pull, then a push's flush
        with self._lock:
            edge.draining = True
            while (edge.inflight or edge.parked) and time.monotonic() < bound:
                self._progress.wait(0.1)
            left = edge.inflight
        if edge.side is not None:
            edge.side.post()  # parked Pulls are answered by its own thread; wake it
            edge.side.stop()
        if left:
            logger.warning("rank %d: decode %s's edge closed with %d push(es) still running (they fail now)",
                           self.tp_rank, edge.peer, left)
        if edge.transport is not None and edge.transport is not self.transport:
            edge.transport.close()
        if self.edge_side(edge.peer) is None:  # not re-added meanwhile
            self.accounts.forget_peer(edge.peer.label)
        logger.info("rank %d: edge to decode %s closed", self.tp_rank, edge.peer)

    # --- start ---------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        self._prepare(kv_caches, num_blocks)
        first = next(iter(kv_caches.values()))
        if first.device.type == "cuda":
            self._device_index = first.device.index if first.device.index is not None else torch.cuda.current_device()
        with self._peers_lock:
            self._registered = True
            self._apply_peers(self._desired)

    def _on_connected(self, edge: _PrefillEdge, welcome: Welcome) -> None:
        assert self.regions is not None
        if len(welcome.region_indices) != len(self.regions.ptrs):
            raise ValueError(f"decode has {len(welcome.region_indices)} KV regions, prefill {len(self.regions.ptrs)}")
        edge.peer_indices = list(welcome.region_indices)
        edge.peer_num_blocks = welcome.num_blocks

    def _register_edge(self, edge: _PrefillEdge, comm: PairComm) -> tuple[bytes, list[int], int]:
        table, indices, num_blocks = self._register(comm)
        edge.local_indices = indices
        return table, indices, num_blocks

    def _edges_now(self) -> list[_PrefillEdge]:
        with self._peers_lock:
            return list(self._edges.values())

    # --- per step (engine thread) -----------------------------------------------------------------
    def start_load_kv(self, meta: PdPairConnectorMetadata) -> None:
        if not meta.reqs_to_send:
            return
        with self._lock:
            for send in meta.reqs_to_send:
                self._sends[send.request_id] = (send.block_ids, send.expires_at)
            parked = [edge for edge in self._edges_now() if edge.parked]
        for edge in parked:
            edge.side.post()  # its parked pulls may be servable now

    def get_transfer_results(self, idle: bool = False) -> set[str]:
        """Sends finished (or expired) since the last call. idle: as DecodeWorker's, waits for a held send."""
        with self._lock:
            if idle and self._sends and not self._finished_sending:
                self._progress.wait(IDLE_WAIT_SECONDS)
        now = time.monotonic()
        with self._lock:
            for request_id in [r for r, (_, exp) in self._sends.items() if exp < now]:
                logger.warning("request %s: decode never pulled its KV within the lease; freeing the blocks", request_id)
                del self._sends[request_id]
                self._finished_sending.add(request_id)
            finished, self._finished_sending = self._finished_sending, set()
        for edge in self._edges_now():
            if edge.side is not None:
                self._publish_transport_counters(edge.side.comm, edge.peer.label)
        return finished

    # --- side-channel threads (one per edge) ------------------------------------------------------------
    def _on_pull(self, edge: _PrefillEdge, pull: Pull) -> Message | None:
        with self._lock:
            if edge.draining:
                return PullFailed(pull.transfer_id, f"decode {edge.peer} was removed from this prefill's peer set")
            entry = self._sends.get(pull.remote_request_id)
            if entry is None:
                now = time.monotonic()
                edge.parked[pull.transfer_id] = (pull, parked_pull_deadline(self.config.hang_timeout_seconds, now), now)
                return None
        self._submit(edge, pull, entry[0], time.monotonic())
        return None

    def _on_tick(self, edge: _PrefillEdge) -> list[Message]:
        replies: list[Message] = []
        if not edge.parked:
            return replies
        now = time.monotonic()
        servable = []
        with self._lock:
            for transfer_id, (pull, deadline, received) in list(edge.parked.items()):
                entry = self._sends.get(pull.remote_request_id)
                if entry is not None:
                    del edge.parked[transfer_id]
                    servable.append((pull, entry[0], received))
                elif now > deadline:
                    del edge.parked[transfer_id]
                    replies.append(PullFailed(transfer_id, f"prefill holds no KV for request {pull.remote_request_id} "
                                                           "(unknown, expired or already sent)"))
            self._progress.notify_all()
        for pull, block_ids, received in servable:
            self._submit(edge, pull, block_ids, received)
        return replies

    def _submit(self, edge: _PrefillEdge, pull: Pull, block_ids: list[int], received: float) -> None:
        """Side-channel thread: hand the Pull to a push worker; its reply goes out through the edge's side channel.
        The pair it came on is captured here: if decode re-pairs meanwhile, the push fails on the old, closed pair
        instead of writing into the new decode's blocks."""
        assert edge.side is not None
        route = (edge.side.comm, list(edge.peer_indices), list(edge.local_indices))
        with self._lock:
            edge.inflight += 1
        try:
            self._pushers.submit(self._serve_and_reply, edge, pull, block_ids, received, route)
        except RuntimeError:  # shutting down: the pool takes no more work
            with self._lock:
                edge.inflight -= 1
            edge.side.post(PullFailed(pull.transfer_id, "prefill is shutting down"))

    def _serve_and_reply(self, edge: _PrefillEdge, pull: Pull, block_ids: list[int], received: float, route) -> None:
        try:
            reply = self._serve(pull, block_ids, received, route)
        except Exception as exc:  # noqa: BLE001 - decode must hear back, not wait for its deadline
            logger.exception("transfer %s (prefill request %s) crashed", pull.transfer_id, pull.remote_request_id)
            reply = PullFailed(pull.transfer_id, f"prefill push crashed: {type(exc).__name__}: {exc}")
        assert edge.side is not None
        edge.side.post(reply)
        with self._lock:
            edge.inflight -= 1
            self._progress.notify_all()

    def _serve(self, pull: Pull, block_ids: list[int], received: float, route) -> Message:
        assert self.regions is not None
        try:
            if pull.dst_block_ids:
                return self._push(pull, block_ids, received, *route)
            return PullDone(pull.transfer_id, 0)
        finally:
            with self._lock:
                self._sends.pop(pull.remote_request_id, None)
                self._finished_sending.add(pull.remote_request_id)
                self._progress.notify_all()

    def _push(self, pull: Pull, block_ids: list[int], received: float, comm: PairComm | None,
              peer_indices: list[int], local_indices: list[int]) -> Message:
        assert self.regions is not None
        layers = len(self.regions.ptrs)
        count = len(pull.dst_block_ids)
        if pull.first_block < 0 or pull.first_block + count > len(block_ids):
            return PullFailed(pull.transfer_id, f"decode asks for blocks [{pull.first_block}, {pull.first_block + count}) "
                                                f"but prefill request {pull.remote_request_id} has {len(block_ids)}")
        if pull.expected_signals != layers * count:
            return PullFailed(pull.transfer_id, f"decode expects {pull.expected_signals} signals, prefill sends "
                                                f"{layers * count} ({layers} layers x {count} blocks)")
        if comm is None:
            return PullFailed(pull.transfer_id, "prefill has no pair communicator")
        nbytes = 0
        src_blocks = block_ids[pull.first_block : pull.first_block + count]
        staging = self.regions.staging
        try:
            self._apply_drop_knob(comm)
            # Staged: every layer's device -> host copy starts now; layer k is put once its copy is done.
            copies = staging.to_host(self.regions.runs(src_blocks)) if staging is not None else [None] * layers
            first_put = time.monotonic()
            for layer in range(layers):
                HostStaging.wait(copies[layer])
                chunk = self.regions.chunk_bytes[layer]
                for src_block, dst_block in zip(src_blocks, pull.dst_block_ids):
                    comm.put_signal(local_indices[layer], src_block * chunk, peer_indices[layer],
                                    dst_block * chunk, chunk, pull.signal_slot)
                    nbytes += chunk
            last_put = time.monotonic()
            comm.flush(flush_deadline(self.config.hang_timeout_seconds, last_put))
        except RuntimeError as exc:  # TransportError, or a CUDA error of the staging copies
            if not isinstance(exc, TransportError):
                logger.error("transfer %s: staging the KV to host memory failed: %s", pull.transfer_id, exc)
                return PullFailed(pull.transfer_id, f"prefill could not stage its KV to host memory: {exc}")
            logger.error("transfer %s (prefill request %s) failed: %s", pull.transfer_id, pull.remote_request_id, exc)
            return PullFailed(pull.transfer_id, f"prefill transport error: {exc}")
        flushed = time.monotonic()
        if flushed - received > SLOW_PUSH_SECONDS:
            logger.warning(
                "transfer %s (prefill request %s): served %.1fs after its Pull came (%.1fs until the first put, "
                "%.1fs putting and flushing %d bytes); decode's wait ends %.1fs after its Pull",
                pull.transfer_id, pull.remote_request_id, flushed - received, first_put - received,
                flushed - first_put, nbytes, self.config.hang_timeout_seconds,
            )
        with self._lock:
            self.stats.record_stage("pull_to_first_put", first_put - received)
            self.stats.record_stage("push", flushed - first_put)
        timeline.log("prefill-worker", pull.remote_request_id, pull_received=_wall(received), first_put=_wall(first_put),
                     last_put=_wall(last_put), flushed=_wall(flushed))
        return PullDone(pull.transfer_id, nbytes)

    def _apply_drop_knob(self, comm: PairComm) -> None:
        """TEST ONLY: while the knob file exists the native sender drops every N-th signal. Content `N` (empty: 1)
        on every TP rank, `N@R` on TP rank R only."""
        path = self.config.test_drop_signals_file
        if not path or not hasattr(comm, "set_signal_drop_fault"):
            return
        every = 0
        if os.path.exists(path):
            text = open(path).read().strip()
            count, _, rank = text.partition("@")
            if not rank or int(rank) == self.tp_rank:
                every = int(count) if count else 1
                logger.warning("TEST KNOB %s present: rank %d's transport drops every %d-th signal", path,
                               self.tp_rank, every)
        comm.set_signal_drop_fault(every)

    def shutdown(self) -> None:
        with self._peers_lock:
            edges, self._edges = list(self._edges.values()), {}
            self._registered = False
        for edge in edges:
            if edge.side is not None:
                edge.side.stop()  # closes the pair: a push still running fails fast instead of waiting for its flush
        self._pushers.shutdown(wait=True, cancel_futures=True)
        for closer in self._closing:
            closer.join(2 * self.config.hang_timeout_seconds + 5)
        for edge in edges:
            if edge.transport is not None and edge.transport is not self.transport:
                edge.transport.close()
        super().shutdown()


def _byte_view(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over host memory we own (the KV cache), for the test-only corruption knob."""
    import ctypes

    buffer = (ctypes.c_uint8 * nbytes).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.uint8)
