"""Prefill's worker (`PrefillWorker`): one edge per decode of its peer set (`PrefillEdge`: its own side channel and
transport; `set_peers` replaces the set at runtime); it serves each Pull on a pool of PUSH_WORKERS threads (put_signal
per layer and block, then flush) and reports the request's send finished. The shared parts and the whole flow are in
worker.py."""

from __future__ import annotations

import functools
import hmac
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from pdpair.connector import timeline
from pdpair.connector.config import PeerAddress, check_peer_set
from pdpair.connector.deadlines import flush_deadline, keyed_pull_deadline, parked_pull_deadline
from pdpair.connector.layer_streams import LayerStream, LayerStreams, pending_layers
from pdpair.connector.metadata import (
    Message,
    Pull,
    PullDone,
    PullFailed,
    PullStarted,
    TRANSFER_KEY_PATTERN,
    Welcome,
)
from pdpair.connector.prefill_side_channel import PrefillSideChannel
from pdpair.connector.scheduler import PdPairConnectorMetadata, SendRequest, StreamRequest
from pdpair.connector.staging import HostStaging, block_runs
from pdpair.connector.testing_knobs import TEST_CORRUPT_ALL_PUTS, put_fault_from_knob
from pdpair.connector.transports import (
    PairComm,
    PairTransport,
    TransportError,
    build_transport,
)
from pdpair.connector.worker import IDLE_WAIT_SECONDS, WorkerBase, wall_time

logger = logging.getLogger("pdpair.connector.worker")  # the name the worker's lines had before the split


# Prefill: threads that serve Pulls (puts + flush), so concurrent requests' transfers overlap and the side-channel
# thread only routes messages. The queue in front of them is bounded by decode's signal slots: each Pull in flight
# holds one until its signals are in.
PUSH_WORKERS = 4

# Prefill logs a warning when serving one Pull takes longer than this (waiting for the blocks, or putting and
# flushing them): decode's deadline (PDPAIR_HANG_TIMEOUT_SECONDS) counts from its Pull, so a slow push is the first
# thing to look for when a load times out.
SLOW_PUSH_SECONDS = 1.0


class PrefillEdge:
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
        # (host, api port) of the decode on the other end, from its Welcome: the router's `remote_decode_url` of the
        # requests meant for it (None until paired, or when decode sends no API port)
        self.decode_api: tuple[str, int] | None = None
        self.parked: dict[str, tuple[Pull, float, float]] = {}  # transfer id -> (pull, deadline, received)
        self.inflight = 0  # pushes submitted and not yet replied (under the worker's lock)
        self.draining = False  # left the peer set: no new Pull is served, the edge closes when inflight is 0


class PrefillWorker(WorkerBase):
    """Prefill, one TP rank: one edge per decode of its peer set (`set_peers` replaces the set at runtime)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._edges: dict[PeerAddress, PrefillEdge] = {}
        self._peers_lock = threading.Lock()  # set_peers and register_kv_caches: one change of the set at a time
        self._desired: tuple[PeerAddress, ...] = check_peer_set(self.config.peer_set(), "the configured peers")
        self._registered = False
        self._device_index: int | None = None
        self._closing: list[threading.Thread] = []
        self._transport_taken = False
        # request id -> the finished request's blocks held for decode (until a serve ends or the lease expires)
        self._sends: dict[str, SendRequest] = {}
        # the router's transfer key -> request id, for the sends of both legs at once (a Pull names the key)
        self._keys: dict[str, str] = {}
        self._finished_sending: set[str] = set()
        # request id -> serves (pushes or releases) submitted and not yet ended: the blocks are reported sent once,
        # when the last of them ends (a release can come while a failed load's push still reads them).
        self._serving: dict[str, int] = {}
        # Layer-wise puts: the requests a step computes, servable while it runs (layer_streams.py), and each KV
        # layer's index by vLLM's layer name (save_kv_layer names it)
        self._streams = LayerStreams(self._progress)
        self._layer_of: dict[str, int] = {}
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

    def _open_edge(self, peer: PeerAddress) -> PrefillEdge:
        edge = PrefillEdge(peer)
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
            on_lost=functools.partial(self._on_edge_lost, edge),
        )
        edge.side.start()
        return edge

    def _close_edge(self, edge: PrefillEdge) -> None:
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
        self._layer_of = {name: layer for layer, name in enumerate(kv_caches)}
        first = next(iter(kv_caches.values()))
        if first.device.type == "cuda":
            self._device_index = first.device.index if first.device.index is not None else torch.cuda.current_device()
        with self._peers_lock:
            self._registered = True
            self._apply_peers(self._desired)

    def _on_connected(self, edge: PrefillEdge, welcome: Welcome) -> None:
        assert self.regions is not None
        if len(welcome.region_indices) != len(self.regions.ptrs):
            raise ValueError(f"decode has {len(welcome.region_indices)} KV regions, prefill {len(self.regions.ptrs)}")
        edge.peer_indices = list(welcome.region_indices)
        edge.decode_api = (edge.peer.host.lower(), welcome.api_port) if welcome.api_port else None
        edge.peer_num_blocks = welcome.num_blocks

    def _register_edge(self, edge: PrefillEdge, comm: PairComm) -> tuple[bytes, list[int], int]:
        table, indices, num_blocks = self._register(comm)
        edge.local_indices = indices
        return table, indices, num_blocks

    def _on_edge_lost(self, edge: PrefillEdge) -> None:
        """Side-channel thread: the pair with this edge's decode ended without a stop (its process died, its host
        went silent past the grace, or it stopped reading). Decode's loads on that pair have failed, so the requests
        held for it will never be pulled: their blocks are reported sent now instead of at their lease's end. Held
        for it: the requests the router named it for (`remote_decode_url`), and, when it was this prefill's only
        decode, the requests no decode was named for. Requests being served are left to their serve, which ends
        with the closed pair; the Pulls parked on the edge are dropped (decode's waits for them failed with it)."""
        with self._peers_lock:
            only = len(self._edges) == 1 and self._edges.get(edge.peer) is edge
        with self._lock:
            parked = len(edge.parked)
            edge.parked.clear()
            freed = [r for r, send in self._sends.items() if r not in self._serving and
                     ((send.decode is not None and send.decode == edge.decode_api) or (send.decode is None and only))]
            blocks = 0
            for request_id in freed:
                blocks += len(self._sends[request_id].block_ids)
                self._forget_send(request_id)
            self._progress.notify_all()
        if freed or parked:
            logger.warning("rank %d: the pair with decode %s was lost: freeing %d block(s) of %d request(s) held for "
                           "it, %d parked Pull(s) dropped", self.tp_rank, edge.peer, blocks, len(freed), parked)

    def _edges_now(self) -> list[PrefillEdge]:
        with self._peers_lock:
            return list(self._edges.values())

    # --- per step (engine thread) -----------------------------------------------------------------
    def start_load_kv(self, meta: PdPairConnectorMetadata) -> None:
        if not meta.reqs_to_send and not meta.reqs_to_stream:
            return
        self._begin_streams(meta.reqs_to_stream)
        with self._lock:
            for send in meta.reqs_to_send:
                if self._streams.end(send.request_id) or (send.aborted and send.request_id not in self._serving):
                    self._finished_sending.add(send.request_id)  # its streamed serve ended: nothing reads them
                    continue
                self._sends[send.request_id] = send
                if send.transfer_key is not None:
                    self._keys.setdefault(send.transfer_key, send.request_id)  # a key given twice keeps the first
            parked = [edge for edge in self._edges_now() if edge.parked]
        for edge in parked:
            edge.side.post()  # its parked pulls may be servable now

    def _begin_streams(self, requests) -> None:
        """Engine thread: the step's streamed requests become servable (at its first `layer_written`, as vLLM starts
        the step's loads after its forward); parked Pulls naming their keys are looked at again."""
        if not requests:
            return
        layers = len(self.regions.ptrs) if self.regions is not None else 0
        with self._lock:
            new = self._streams.begin(requests, layers)
        if new:
            for edge in self._edges_now():
                if edge.parked:
                    edge.side.post()  # a parked Pull may name one of them

    def layer_written(self, layer_name: str, streams: list[StreamRequest] | tuple = ()) -> None:
        """Engine thread (save_kv_layer): the model wrote this layer of the step's streamed requests (`streams`: the
        step's metadata; begun at the step's first layer)."""
        if streams and not self._streams.step:
            self._begin_streams(streams)
        if not self._streams.step:
            return
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        self._mark_written(self._streams.step, [layer])

    def step_computed(self) -> None:
        """Engine thread (wait_for_save): every layer of the step's streamed requests is written."""
        if not self._streams.step:
            return
        streams, self._streams.step = self._streams.step, []
        self._mark_written(streams, pending_layers(streams))
        with self._lock:
            self._streams.mark_computed(streams)

    def _mark_written(self, streams: list[LayerStream], layers: list[int]) -> None:
        events = {layer: self._layer_event(layer, streams) for layer in layers}
        with self._lock:
            self._streams.mark_written(streams, layers, events)

    def _layer_event(self, layer: int, streams: list[LayerStream]):
        """What a put of this layer waits for: on a GPU, the staging copy of the streams' blocks (tcp) or the
        model's write itself (a transport that reads device memory), both ordered after the model's stream; on CPU
        the write is done (None)."""
        assert self.regions is not None
        if self.regions.staging is not None:
            blocks = [block for stream in streams for block in stream.block_ids]
            return self.regions.staging.layer_to_host(layer, block_runs(blocks, self.regions.chunk_bytes[layer]))
        if self._device_index is not None:
            event = torch.cuda.Event()
            event.record()
            return event
        return None

    def get_transfer_results(self, idle: bool = False) -> set[str]:
        """Sends finished (or expired) since the last call. idle: as DecodeWorker's, waits for a held send."""
        with self._lock:
            if idle and self._sends and not self._finished_sending:
                self._progress.wait(IDLE_WAIT_SECONDS)
        now = time.monotonic()
        with self._lock:
            for request_id in [r for r, send in self._sends.items() if send.expires_at < now and r not in self._serving]:
                logger.warning("request %s: decode never pulled its KV within the lease; freeing the blocks", request_id)
                self._forget_send(request_id)
            self._streams.forget_older_than(now - self.config.send_lease_seconds)
            finished, self._finished_sending = self._finished_sending, set()
            held = sum(len(send.block_ids) for send in self._sends.values())
        self.accounts.set_blocks_held(held)
        for edge in self._edges_now():
            if edge.side is not None:
                self._publish_transport_counters(edge.side.comm, edge.peer.label)
        return finished

    # --- side-channel threads (one per edge) ------------------------------------------------------------
    def _on_pull(self, edge: PrefillEdge, pull: Pull) -> Message | None:
        with self._lock:
            if edge.draining:
                return PullFailed(pull.transfer_id, f"decode {edge.peer} was removed from this prefill's peer set")
            send = self._source_of(pull)
            if send is None:
                now = time.monotonic()
                # a keyed Pull comes before its prompt is computed: it may wait for the computation
                bound = keyed_pull_deadline if re.fullmatch(TRANSFER_KEY_PATTERN, pull.remote_request_id) \
                    else parked_pull_deadline
                edge.parked[pull.transfer_id] = (pull, bound(self.config.hang_timeout_seconds, now), now)
                return None
        self._submit(edge, pull, send, time.monotonic())
        return None

    def _send_of(self, pull: Pull) -> SendRequest | None:
        """Under the lock: the held request a Pull names, by the router's transfer key or by prefill's request id."""
        send = self._sends.get(self._keys.get(pull.remote_request_id, pull.remote_request_id))
        return None if send is None or send.aborted else send

    def _source_of(self, pull: Pull) -> SendRequest | LayerStream | None:
        """Under the lock: what serves a Pull: the held request it names, else (layer-wise puts) the stream of the
        request being computed under its transfer key, when no Pull is served from it yet."""
        send = self._send_of(pull)
        if send is not None:
            return send
        return self._streams.servable(pull.remote_request_id)

    def _forget_send(self, request_id: str) -> None:
        """Under the lock: the request's blocks are reported sent (freed), once."""
        send = self._sends.pop(request_id, None)
        if send is None:
            return
        if send.transfer_key is not None and self._keys.get(send.transfer_key) == request_id:
            del self._keys[send.transfer_key]
        self._finished_sending.add(request_id)

    def _on_tick(self, edge: PrefillEdge) -> list[Message]:
        replies: list[Message] = []
        if not edge.parked:
            return replies
        now = time.monotonic()
        servable = []
        with self._lock:
            for transfer_id, (pull, deadline, received) in list(edge.parked.items()):
                send = self._source_of(pull)
                if send is not None:
                    del edge.parked[transfer_id]
                    servable.append((pull, send, received))
                elif now > deadline:
                    del edge.parked[transfer_id]
                    replies.append(PullFailed(transfer_id, f"prefill holds no KV for request {pull.remote_request_id} "
                                                           "(unknown, expired or already sent)"))
            self._progress.notify_all()
        for pull, send, received in servable:
            self._submit(edge, pull, send, received)
        return replies

    def _submit(self, edge: PrefillEdge, pull: Pull, send: SendRequest | LayerStream, received: float) -> None:
        """Side-channel thread: hand the Pull to a push worker; its reply goes out through the edge's side channel.
        The pair it came on is captured here: if decode re-pairs meanwhile, the push fails on the old, closed pair
        instead of writing into the new decode's blocks. A Pull whose prompt digest is not the request's (or that
        names a transfer key without one) is refused: the KV is served only for the prompt it was computed for."""
        assert edge.side is not None
        route = (edge.side.comm, list(edge.peer_indices), list(edge.local_indices))
        request_id = send.request_id
        by_key = pull.remote_request_id != request_id
        if (pull.prompt_digest or by_key) and not (send.prompt_digest and pull.prompt_digest and
                                                   hmac.compare_digest(pull.prompt_digest, send.prompt_digest)):
            edge.side.post(PullFailed(pull.transfer_id, "the Pull's prompt is not the one prefill computed for "
                                                        f"{pull.remote_request_id}"))
            return
        with self._lock:
            if isinstance(send, LayerStream):
                if not self._streams.claim(send):  # its request finished meanwhile: served from its send, or
                    current = self._send_of(pull)  # parked until its bound as any Pull prefill holds nothing for
                    if current is None:
                        edge.parked[pull.transfer_id] = (pull, keyed_pull_deadline(self.config.hang_timeout_seconds,
                                                                                    received), received)
                        return
                    send = current
            elif self._sends.get(request_id) is not send:  # another serve of it ended (and reported its blocks)
                edge.side.post(PullFailed(pull.transfer_id, f"prefill holds no KV for request {pull.remote_request_id} "
                                                            "(unknown, expired or already sent)"))
                return
            edge.inflight += 1
            self._serving[request_id] = self._serving.get(request_id, 0) + 1
        if by_key:  # decode's transfer deadline and health accounts start now, not at its Pull
            edge.side.post(PullStarted(pull.transfer_id))
        try:
            self._pushers.submit(self._serve_and_reply, edge, pull, send, received, route)
        except RuntimeError:  # shutting down: the pool takes no more work
            with self._lock:
                edge.inflight -= 1
                self._end_serving(request_id)
            edge.side.post(PullFailed(pull.transfer_id, "prefill is shutting down"))

    def _end_serving(self, request_id: str) -> None:
        """Under the lock: one serve of `request_id` ended. The last one to end reports its blocks sent, exactly
        once (vLLM's scheduler asserts a request it frees is still its own: a second report kills the engine). A
        streamed serve may end before its request finished: its send is then reported when it comes."""
        left = self._serving.get(request_id, 1) - 1
        if left > 0:
            self._serving[request_id] = left
            return
        self._serving.pop(request_id, None)
        if request_id in self._sends:
            self._forget_send(request_id)
        else:
            self._streams.serve_ended(request_id)

    def _serve_and_reply(self, edge: PrefillEdge, pull: Pull, send: SendRequest | LayerStream, received: float,
                         route) -> None:
        try:
            reply = self._serve(pull, send, received, route)
        except Exception as exc:  # noqa: BLE001 - decode must hear back, not wait for its deadline
            logger.exception("transfer %s (prefill request %s) crashed", pull.transfer_id, pull.remote_request_id)
            reply = PullFailed(pull.transfer_id, f"prefill push crashed: {type(exc).__name__}: {exc}")
        assert edge.side is not None
        edge.side.post(reply)
        with self._lock:
            edge.inflight -= 1
            self._progress.notify_all()

    def _serve(self, pull: Pull, send: SendRequest | LayerStream, received: float, route) -> Message:
        assert self.regions is not None
        try:
            if pull.dst_block_ids:
                stream = send if isinstance(send, LayerStream) else None
                return self._push(pull, send.block_ids, received, *route, stream=stream)
            return PullDone(pull.transfer_id, 0)
        finally:
            with self._lock:
                self._end_serving(send.request_id)
                self._progress.notify_all()

    def _push(self, pull: Pull, block_ids: list[int], received: float, comm: PairComm | None,
              peer_indices: list[int], local_indices: list[int], stream: LayerStream | None = None) -> Message:
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
            self._apply_corrupt_puts_knob(comm)
            # Staged: every layer's device -> host copy starts now; layer k is put once its copy is done. Streamed:
            # layer k is put once the model wrote it (and, on a GPU, its copy or write event completed).
            if stream is None:
                copies = staging.to_host(self.regions.runs(src_blocks)) if staging is not None else [None] * layers
            first_put = None
            # decode's deadline for a keyed Pull counts from PullStarted, sent as this serve was submitted
            bound = time.monotonic() + self.config.hang_timeout_seconds
            for layer in range(layers):
                if stream is not None:
                    with self._lock:
                        written, event = self._streams.wait_written(stream, layer, bound)
                    if not written:
                        return PullFailed(pull.transfer_id, f"prefill did not compute layer {layer} of request "
                                                            f"{pull.remote_request_id} within "
                                                            f"{self.config.hang_timeout_seconds:g}s")
                    HostStaging.wait(event)
                else:
                    HostStaging.wait(copies[layer])
                if first_put is None:
                    first_put = time.monotonic()
                chunk = self.regions.chunk_bytes[layer]
                for src_block, dst_block in zip(src_blocks, pull.dst_block_ids):
                    comm.put_signal(local_indices[layer], src_block * chunk, peer_indices[layer],
                                    dst_block * chunk, chunk, pull.signal_slot, transfer_id=pull.transfer_tag,
                                    generation=pull.transfer_generation)
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
        streamed = {}
        if stream is not None and timeline.enabled():  # the compute the puts overlapped: the step's start, its first and last layer written
            with self._lock:
                written = [at for at in stream.written_at if at is not None]
            streamed = {"step_started": wall_time(stream.started),
                        "first_layer_written": wall_time(min(written, default=None)),
                        "last_layer_written": wall_time(max(written, default=None))}
        timeline.log("prefill-worker", pull.remote_request_id, pull_received=wall_time(received), first_put=wall_time(first_put),
                     last_put=wall_time(last_put), flushed=wall_time(flushed), **streamed)
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

    def _apply_corrupt_puts_knob(self, comm: PairComm) -> None:
        """TEST ONLY: while the knob file exists every put of this push (and of any push on the connection until the
        next one finds the file gone) goes out damaged as the file's content names (`put_fault_from_knob`: a byte
        flipped after the checksum was taken, misaddressed, stale-tagged or cut short), so decode refuses it and fails
        the load (`TransferRejected` with that reason). The config allows the knob on tcp only."""
        path = self.config.test_corrupt_puts_file
        if not path or not hasattr(comm, "set_put_fault"):
            return
        fault = put_fault_from_knob(path)
        if fault:
            logger.warning("TEST KNOB %s present: rank %d's transport corrupts every put on the way (%s)", path,
                           self.tp_rank, fault)
        comm.set_put_fault(fault, TEST_CORRUPT_ALL_PUTS if fault else 0)

    def shutdown(self) -> None:
        with self._lock:
            self._streams.close()  # a streamed serve waiting for a layer gives up
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
