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
is not paired. Prefill has one edge per decode of its peer set (`PrefillEdge`, its own side channel and transport);
`set_peers` replaces the set at runtime. A Pull is served on the edge it came on.

Prefill: learns each finished request's blocks from the scheduler metadata, serves each Pull on a pool of
PUSH_WORKERS threads (put_signal per layer and block, then flush; the reply goes back through the side channel's
outbox) and reports the request's send finished, which frees its blocks. The side-channel thread only hands Pulls to
the pool, so transfers of concurrent requests overlap and the loop keeps watching for a disconnect. A Pull that
arrives before the metadata waits (bounded); blocks nobody pulls are freed when their lease expires."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from pdpair import contract
from pdpair.connector.config import PdPairConfig, check_side_channel_key
from pdpair.connector.metadata import (
    KvLayout,
    compatibility_factors,
    compatibility_hash,
)
from pdpair.connector.pod_server import MetricsServer, PeerPush, serve
from pdpair.connector.rank_channel import PeerRanks, RankExporter, export_rank, rank_channel_key
from pdpair.connector.preflight import report_bind_failure
from pdpair.connector.scheduler import RecvRequest
from pdpair.connector.signals import SignalAccounts
from pdpair.connector.staging import HostStaging, block_runs
from pdpair.connector.stats import PdPairKVConnectorStats
from pdpair.connector.transports import PairComm, PairTransport, build_transport
from pdpair.connector.warmup import Warmup

logger = logging.getLogger("pdpair.connector.worker")

# An engine step that ran no model (only waiting on transfers) blocks in get_finished until a transfer settles, at
# most this long, instead of returning at once: vLLM would otherwise spin empty steps (1 ms apart) that take the CPU
# and the GIL from the very threads that move the KV. It bounds how late an idle engine sees a new request.
IDLE_WAIT_SECONDS = 0.01


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
class SignalWait:
    recv: RecvRequest
    slot: int
    base: int
    expected: int
    nbytes: int
    started: float
    deadline: float
    comm: PairComm
    transfer_tag: int = 0  # the tag declared with comm.expect_transfer (0: none declared, nothing to retire)
    transfer_generation: int = 0
    failed_reason: str | None = None  # set by PullFailed
    # False for a keyed Pull (both legs at once) until prefill starts serving it (PullStarted, or its first signal):
    # until then `deadline` is the start's (deadlines.keyed_start_deadline) and no health account is open
    serving: bool = True
    peer: str = ""  # the edge's label, for the health account opened when serving starts
    first_signal: float | None = None  # time.monotonic() stamps, for the timeline
    last_signal: float | None = None


def wall_time(monotonic: float | None) -> float | None:
    """A time.monotonic() stamp as time.time(), for timeline lines that other processes' lines join."""
    return None if monotonic is None else monotonic + (time.time() - time.monotonic())


class WorkerBase:
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
                                                warmup=Warmup(api, api_key=config.api_key) if api else None,
                                                peers=peer_push)
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

    def layer_written(self, layer_name: str, streams=()) -> None:
        """Engine thread, after the model wrote `layer_name`'s KV in this step (save_kv_layer). Prefill's layer-wise
        puts use it; decode has nothing to do."""

    def step_computed(self) -> None:
        """Engine thread, at the end of the step's forward (wait_for_save). Prefill's layer-wise puts use it."""

    def shutdown(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.stop()
            self.metrics_server = None
        if self.rank_exporter is not None:
            self.rank_exporter.stop()
            self.rank_exporter = None
        self.transport.close()


def byte_view(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over host memory we own (the KV cache), for the test-only corruption knob."""
    import ctypes

    buffer = (ctypes.c_uint8 * nbytes).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.uint8)
