"""Decode's worker (`DecodeWorker`): one per vLLM worker process (TP rank). It starts the side-channel listener from
register_kv_caches, and for each request to load takes a signal slot, opens a wait for exactly layers x blocks
signals with deadline PDPAIR_HANG_TIMEOUT_SECONDS, sends the Pull on the edge of the prefill named in the
request's kv_transfer_params and lets a waiter thread wait on the host. With a transport that checks transfers
(tcp), each load's transfer is declared before its Pull (its blocks' byte windows, a tag prefill puts on every put)
and retired before its blocks go back to the engine, so a put of another request, a stale attempt or a corrupted
payload is refused on arrival and fails that load at once. The shared parts (regions, waits, the base class) and the
whole flow are in worker.py."""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from pdpair import contract
from pdpair.connector import timeline
from pdpair.connector.deadlines import keyed_start_deadline, retire_deadline, signal_wait_deadline
from pdpair.connector.decode_side_channel import DecodeSideChannel
from pdpair.connector.metadata import (
    Pull,
    PullDone,
    PullFailed,
    PullStarted,
)
from pdpair.connector.scheduler import PdPairConnectorMetadata, RecvRequest
from pdpair.connector.testing_knobs import TEST_CORRUPT_KV_BYTE, SlowDecodeKnob
from pdpair.connector.transports import PairComm, SignalWaitTimeout, TransferRejected, TransportError
from pdpair.connector.worker import (
    IDLE_WAIT_SECONDS,
    SignalWait,
    WorkerBase,
    byte_view,
    wall_time,
)

logger = logging.getLogger("pdpair.connector.worker")  # the name the worker's lines had before the split


WAIT_SLICE_SECONDS = 0.05  # a waiter re-checks cancellation and reports progress this often

MAX_WAITERS = 64


def transfer_tag(request_id: str) -> int:
    """The transfer id a load's puts carry: 63 bits of a hash of decode's request id (a Pull field is at most 2^63-1),
    never 0 (untagged). Two live loads sharing one by chance cannot both be declared: the second load fails cleanly."""
    tag = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big") & ((1 << 63) - 1)
    return tag or 1


class DecodeWorker(WorkerBase):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.side: DecodeSideChannel | None = None
        self.peer_indices: list[int] = []
        self._waits: dict[str, SignalWait] = {}
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        # Per edge's pair communicator, its free signal slots, oldest-freed first: a slot freed by a load that failed
        # (a refused put retired its transfer) is taken again only after every other free slot, so a late put of that
        # transfer, still on its way when the load failed, is refused long before a new load waits on the slot (taken
        # at once again, it failed the next load on the slot as an `unexpected_transfer`: CI, 2026-12-07).
        self._free_slots: dict[PairComm, deque[int]] = {}
        self._local_indices: dict[PairComm, list[int]] = {}  # per edge: the local region index of each layer
        # The generation of each declared transfer: every Pull of this worker gets a new one, so a late put of an
        # earlier attempt with the same request id is refused as stale.
        self._generations = itertools.count(1)
        self._abandoned: dict[str, SignalWait] = {}  # timed out, still open in the metrics
        self._waiters = ThreadPoolExecutor(MAX_WAITERS, thread_name_prefix=f"pdpair-signal-wait-r{self.tp_rank}")
        self._done_waits: list[SignalWait] = []  # finished since the last get_transfer_results, for the timeline
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
            on_pull_started=self._on_pull_started,
            on_disconnect=self._on_disconnect,
            accounts=self.accounts,
            test_stop_listener_file=self.config.test_stop_listener_file,
            api_port=self.config.http_port or 0,
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
            self._free_slots[comm] = deque(range(comm.num_signal_slots))
            self._local_indices[comm] = list(result[1])
        return result

    # --- per step --------------------------------------------------------------------------------
    def start_load_kv(self, meta: PdPairConnectorMetadata) -> None:
        # TEST ONLY (test_slow_decode_file). vLLM calls this once in every step, whether or not KV is received, so the
        # delay shows in the time per output token. A step that runs no model is not slowed: it produces no token.
        if self._slow_decode is not None and not meta.idle_step:
            self._slow_decode.sleep()
        side = self.side
        assert side is not None
        for instance, remote_id, digest in meta.reqs_to_release:
            edge = side.edge(instance)
            if edge is None:  # that prefill is gone or never paired: its lease frees the blocks
                logger.info("prefill %s is not paired with rank %d: its request %s is not released (its lease frees "
                            "the blocks)", instance, self.tp_rank, remote_id)
                continue
            side.post(Pull(f"release-{remote_id}", remote_id, 0, [], 0, 0, prompt_digest=digest), edge)
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
            slot = free.popleft() if free else None
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
        tag, generation = 0, 0
        if comm.supports_transfer_checks:
            tag, generation = transfer_tag(recv.request_id), next(self._generations) & 0xFFFFFFFF
            try:
                self._declare(comm, recv, tag, generation, slot, expected)
            except TransportError as exc:
                logger.error("request %s: cannot load KV: declaring its transfer failed: %s", recv.request_id, exc)
                with self._lock:
                    free = self._free_slots.get(comm)
                    if free is not None:
                        free.appendleft(slot)  # nothing was asked for on it: the next load may take it
                self.accounts.count_failed_transfer()
                self._fail(recv.request_id, timed_out=False)
                return
        now = time.monotonic()
        if recv.keyed:  # prefill may still be computing the prompt: the transfer's deadline starts at PullStarted
            deadline = keyed_start_deadline(self.config.hang_timeout_seconds, now)
        else:
            deadline = signal_wait_deadline(self.config.hang_timeout_seconds, now)
        wait = SignalWait(recv, slot, base, expected, nbytes, now, deadline, comm, tag, generation,
                          serving=not recv.keyed, peer=edge.label)
        with self._lock:
            self._waits[recv.request_id] = wait
        if wait.serving:
            self.accounts.open_wait(recv.request_id, edge.label, expected, wait.deadline)
        side.post(Pull(recv.request_id, recv.remote_request_id, recv.first_block, recv.block_ids, slot, expected,
                       tag, generation, recv.prompt_digest), edge)
        self._waiters.submit(self._settle, wait)

    def _declare(self, comm: PairComm, recv: RecvRequest, tag: int, generation: int, slot: int, expected: int) -> None:
        """Declare the load's transfer: each of its blocks in every layer's region as one window (the transport has
        each window written once, front to back, so one put per block and nothing written twice), the only place its
        puts may land, its slot, the only one they may signal, and its signal count, after which nothing more of it
        is accepted and before which every byte must have come."""
        assert self.regions is not None
        with self._lock:
            local = self._local_indices.get(comm)
        if local is None:
            raise TransportError("the pair has no registered regions (it closed meanwhile)")
        windows = [(local[layer], block * chunk, chunk)
                   for layer, chunk in enumerate(self.regions.chunk_bytes) for block in recv.block_ids]
        comm.expect_transfer(tag, generation, slot, windows, expected)

    def _retire(self, wait: SignalWait) -> bool:
        """End the load's transfer before its blocks go back to the engine (loaded, failed or timed out): from then on
        its puts are refused, so none lands in blocks that another request may get. Once per wait. True when this
        call retired a declared transfer: nothing of it can land or signal any more, so its slot may serve again."""
        tag, wait.transfer_tag = wait.transfer_tag, 0
        if not tag:
            return False
        try:
            wait.comm.retire_transfer(tag, wait.transfer_generation,
                                      retire_deadline(self.config.hang_timeout_seconds, time.monotonic()))
            return True
        except TransportError as exc:
            # A closed pair writes nothing more; one broken by the retire itself fails its other loads at once.
            logger.warning("request %s: retiring its transfer: %s", wait.recv.request_id, exc)
            return False

    def _settle(self, wait: SignalWait) -> None:
        """The waiter thread's whole job: every load settles, loaded or failed, whatever goes wrong here."""
        try:
            self._wait_for_signals(wait)
        except Exception:  # noqa: BLE001 - logged; the request fails instead of waiting forever
            logger.exception("request %s: settling its KV load failed", wait.recv.request_id)
            with self._lock:
                self._waits.pop(wait.recv.request_id, None)
            self._fail(wait.recv.request_id, timed_out=False)

    def _wait_for_signals(self, wait: SignalWait) -> None:
        request_id = wait.recv.request_id
        received = 0
        try:
            # Two waits, so the timeline has the first signal's arrival; each returns as soon as its count is reached.
            for target in (wait.base + min(1, wait.expected), wait.base + wait.expected):
                received = self._wait_until(wait, target, received)
                if received < 0:
                    return  # timed out (reported)
                self._begin_serving(wait)  # a keyed Pull's signals came before its PullStarted: it started
                if wait.first_signal is None:
                    wait.first_signal = time.monotonic()
            wait.last_signal = time.monotonic()
        except TransferRejected as exc:
            logger.error(
                "request %s: KV load from prefill request %s failed: a put of it was refused on arrival (%s); its "
                "bytes are never used (vLLM kv_load_failure_policy decides: error or recompute): %s",
                request_id, wait.recv.remote_request_id, exc.reason, exc,
            )
            self.accounts.count_rejected_transfer(exc.reason)
            self._close(wait, contract.OUTCOME_ERROR, received)
            self._fail(request_id, timed_out=False)
            return
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
        # Every signal is in: nothing more of this transfer may land (before the host mirror goes to the device).
        self._retire(wait)
        self.accounts.on_signals(request_id, wait.expected)
        if self.regions is not None and self.regions.staging is not None:
            try:  # the bytes are in the host mirror; the load is done once they are on the device
                self.regions.staging.to_device(self.regions.runs(wait.recv.block_ids))
            except Exception as exc:  # noqa: BLE001 - a waiter must always settle its request
                logger.error("request %s: copying the staged KV to the device failed: %s", request_id, exc)
                self._close(wait, contract.OUTCOME_ERROR, wait.expected)
                self._fail(request_id, timed_out=False)
                return
        seconds = max(0.0, wait.last_signal - wait.started)
        self._maybe_corrupt(wait)
        self._close(wait, contract.OUTCOME_OK, wait.expected, seconds=seconds, release_slot=True)
        with self._lock:
            self.stats.record_transfer(seconds, wait.nbytes)
            self.stats.record_stage("pull_to_first_signal", wait.first_signal - wait.started)
            self.stats.record_stage("first_to_last_signal", wait.last_signal - wait.first_signal)
            self._done_waits.append(wait)
            self._finished.add(request_id)
            self._progress.notify_all()

    def _wait_until(self, wait: SignalWait, target: int, received: int) -> int:
        """Block until the slot reaches `target`; return the signals received, or -1 after reporting a timeout.
        The native wait wakes on the signal itself; the slices only bound how late a PullFailed or a closed pair
        (set by the side-channel thread) is noticed."""
        while True:
            if wait.failed_reason is not None:
                self._raise_if_rejected(wait, target)
                raise TransportError(f"prefill could not serve the pull: {wait.failed_reason}")
            now = time.monotonic()
            try:
                wait.comm.wait_signal(wait.slot, target, min(wait.deadline, now + WAIT_SLICE_SECONDS))
                return target - wait.base
            except SignalWaitTimeout as exc:
                got = exc.observed - wait.base
                if got != received:
                    received = got
                    self._begin_serving(wait)  # a signal of a keyed Pull can come before its PullStarted
                    self.accounts.on_signals(wait.recv.request_id, received)
                if time.monotonic() >= wait.deadline:
                    if not wait.serving:  # prefill never started it: a clean failure, not a transfer's timeout
                        raise TransportError(f"prefill did not start serving the Pull within "
                                             f"{wait.deadline - wait.started:.0f}s")
                    self._on_timeout(wait, received)
                    return -1

    @staticmethod
    def _raise_if_rejected(wait: SignalWait, target: int) -> None:
        """Raise TransferRejected if a put of this load was refused here. Prefill answers PullFailed when decode
        refused one of its puts (its flush reports the refusal), and that answer can reach the waiter between two
        wait slices: the slot was failed before the refusal was sent, so a wait that returns at once still names the
        refusal and its reason instead of "prefill could not serve"."""
        if not wait.comm.supports_transfer_checks:
            return
        try:
            wait.comm.wait_signal(wait.slot, target, time.monotonic())  # deadline now: the slot's state, no wait
        except TransferRejected:
            raise
        except TransportError:
            pass  # short of its count with nothing refused (SignalWaitTimeout), or a closed or broken pair

    def _on_timeout(self, wait: SignalWait, received: int) -> None:
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
        # Before the blocks go back: a put of it arriving later is refused, not written into another request's blocks
        # (so on tcp the late signals never close this wait; the deficit stays visible until the pair restarts).
        self._retire(wait)
        with self._lock:
            self._waits.pop(request_id, None)
            self._abandoned[request_id] = wait
        self._fail(request_id, timed_out=True)

    def _close(self, wait: SignalWait, outcome: str, received: int, seconds: float | None = None,
               release_slot: bool = False) -> None:
        """Settle the wait's accounts and retire its transfer. Its slot goes back to the edge when the caller says so
        (every signal arrived), or when the retire closed a declared transfer: a failed load's late puts and signals
        are then refused, so the slot cannot be signalled by them (without transfer checks it stays out of use, as a
        late signal could still land on it)."""
        request_id = wait.recv.request_id
        retired = self._retire(wait)
        with self._lock:
            self._waits.pop(request_id, None)
            free = self._free_slots.get(wait.comm)  # None: that edge closed, its slots went with it
            if (release_slot or retired) and free is not None:
                free.append(wait.slot)
        took = time.monotonic() - wait.started if seconds is None else seconds
        if wait.serving:  # a keyed Pull that never started has no account open
            self.accounts.close_wait(request_id, outcome, wait.nbytes if outcome == contract.OUTCOME_OK else 0, took)

    def _fail(self, request_id: str, timed_out: bool) -> None:
        with self._lock:
            self.stats.record_failure(timed_out)
            self._failed.add(request_id)
            self._finished.add(request_id)
            self._progress.notify_all()

    def _maybe_corrupt(self, wait: SignalWait) -> None:
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
                view = byte_view(ptr + block * chunk, chunk)
                view.fill_(TEST_CORRUPT_KV_BYTE)

    def _on_pull_started(self, started: PullStarted, sender) -> None:
        """Side-channel thread: prefill started serving a keyed Pull (only the edge it was sent on counts)."""
        with self._lock:
            wait = self._waits.get(started.transfer_id)
        if wait is not None and wait.comm is sender.comm:
            self._begin_serving(wait)

    def _begin_serving(self, wait: SignalWait) -> None:
        """A keyed Pull is being served (PullStarted, or a signal of it came first): from now on it is a transfer
        like any other, with a hang timeout's deadline and an open health account. Once. The account is opened under
        the lock that marks the wait serving: the waiter, which may complete the load right after, closes it only
        once it is open (the side-channel thread and the waiter can both get here first)."""
        with self._lock:
            if wait.serving:
                return
            wait.serving = True
            wait.started = time.monotonic()
            wait.deadline = signal_wait_deadline(self.config.hang_timeout_seconds, wait.started)
            self.accounts.open_wait(wait.recv.request_id, wait.peer, wait.expected, wait.deadline)

    def _on_pull_done(self, done: PullDone) -> None:
        pass  # completion is the signal count, not this message

    def _on_pull_failed(self, failed: PullFailed, sender=None) -> None:
        """A Pull failed: sent back by the paired prefill of edge `sender`, or made here (`sender` None: the Pull
        could not be sent). A prefill's PullFailed fails only a wait on its own edge: transfer ids are not secret,
        and one paired prefill must not fail another's loads by naming their ids."""
        if failed.transfer_id.startswith("release-"):
            return
        with self._lock:
            wait = self._waits.get(failed.transfer_id)
        if wait is None:
            logger.warning("PullFailed for unknown transfer %s: %s", failed.transfer_id, failed.reason[:200])
        elif sender is not None and wait.comm is not sender.comm:
            logger.warning("prefill %s sent a PullFailed for transfer %s, which is another edge's: ignored",
                           sender.instance, failed.transfer_id)
        else:
            wait.failed_reason = failed.reason

    def _on_disconnect(self, edge, reason: str) -> None:
        """Side-channel thread: `edge` closed (its prefill re-paired, or decode stops). Its waits fail now (the
        waiters notice within WAIT_SLICE_SECONDS); other edges' waits are untouched."""
        with self._lock:
            self._free_slots.pop(edge.comm, None)
            self._local_indices.pop(edge.comm, None)
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
            timeline.log("decode-worker", wait.recv.request_id, pull_sent=wall_time(wait.started),
                         first_signal=wall_time(wait.first_signal), last_signal=wall_time(wait.last_signal),
                         handed_to_engine=wall_time(handed))
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
