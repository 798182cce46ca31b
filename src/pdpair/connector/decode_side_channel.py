"""Decode's side channel: the ROUTER of one decode TP rank (`DecodeSideChannel`) and its edges, one per paired prefill
instance (`DecodeEdge`). The protocol, its authentication and its bounds are described in side_channel.py; this
module is decode's half: the loop that owns the socket, Pull routing, the edges; pairing with a prefill (Challenge,
Proof check, the handshake threads) is decode_pairing.py's."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import zmq

from pdpair import contract
from pdpair.connector.decode_pairing import DecodeEdge, DecodePairing, PairingHandshake, ChallengedHello
from pdpair.connector.metadata import (
    NOT_ACCEPTED,
    CompatibilityError,
    Hello,
    Message,
    Proof,
    Pull,
    PullDone,
    PullFailed,
    PullStarted,
    Refused,
    Regions,
    decode,
    decode_handshake,
    encode,
)
from pdpair.connector.preflight import report_bind_failure
from pdpair.connector.side_channel import (
    POLL_MS,
    SEND_TIMEOUT_SECONDS,
    HandshakeError,
    LogLimit,
    RegisterRegions,
    SideChannelThread,
    bounded_socket,
    check_key,
    quietly,
)
from pdpair.connector.testing_knobs import StopListenerKnob
from pdpair.connector.transports.base import (
    PairComm,
    PairTransport,
)

# The logger keeps the name it had before this module was renamed: log filters and readers of the logs know it.
logger = logging.getLogger("pdpair.connector.handshake")


READY_TIMEOUT_SECONDS = 10.0

# Messages the loop reads before it serves its outbox and the handshakes' results again.
RECEIVE_BATCH = 256


class DecodeSideChannel(DecodePairing, SideChannelThread):
    """The ROUTER of one decode TP rank: accepts an authenticated handshake from every prefill of its pair (one edge
    per prefill instance, at most `max_edges`).

    Threads: the loop thread owns the socket and never blocks on a peer: it answers Hellos (Challenge), checks Proofs,
    routes Pulls and their answers, and hands Regions to the handshake that waits for them. Each authenticated Hello's
    pair setup (init_pair, registering the regions, waiting for prefill's Regions) runs on a handshake thread of its
    own, at most MAX_CONCURRENT_HANDSHAKES at once, within HANDSHAKE_SECONDS; the thread gives its result back to the
    loop (`_call_on_loop`: a queue and the inproc wake-up), which sends Welcome and installs the edge. So a peer that
    stalls its handshake stalls only its own handshake thread; Pulls on the existing edges keep flowing.

    Nothing a peer sends ends the loop: every message is handled under its own `except Exception`. If the loop stops
    anyway (a bug), `alive` turns False and `error` says why, and the accounts tell decode's /readyz at once
    (`SignalAccounts.set_listener_failed`)."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        tp_rank: int,
        generation: int,
        transport: PairTransport,
        hang_timeout_seconds: float,
        local_hash: str,
        factors: dict,
        key: bytes,
        register_regions: RegisterRegions,
        on_pull_done: Callable[[PullDone], None],
        on_pull_failed: Callable[[PullFailed, DecodeEdge | None], None],
        on_disconnect: Callable[[DecodeEdge, str], None],
        accounts,
        max_edges: int = contract.DEFAULT_MAX_EDGES,
        test_stop_listener_file: str | None = None,
        api_port: int = 0,
        on_pull_started: Callable[[PullStarted, DecodeEdge], None] | None = None,
    ) -> None:
        super().__init__(f"pdpair-sidechannel-decode-r{tp_rank}", local_hash, accounts)
        self.api_port = api_port  # sent in Welcome: how prefill matches the router's `remote_decode_url` to this edge
        # TEST ONLY (testing_knobs.StopListenerKnob): None in production
        self._stop_knob = StopListenerKnob(test_stop_listener_file) if test_stop_listener_file else None
        self.host, self.port, self.tp_rank = host, port, tp_rank
        self.generation = generation
        self.transport = transport
        self.hang_timeout_seconds = hang_timeout_seconds
        self.factors = factors
        self.key = check_key(key)
        if not isinstance(max_edges, int) or max_edges < 1:
            raise ValueError(f"max_edges must be an int >= 1, got {max_edges!r}")
        self.max_edges = max_edges
        self.register_regions = register_regions
        self.on_pull_done = on_pull_done
        self.on_pull_failed = on_pull_failed
        self.on_pull_started = on_pull_started
        self.on_disconnect = on_disconnect
        self._edges: dict[str, DecodeEdge] = {}  # prefill instance -> its edge; written by this thread only
        self._edges_lock = threading.Lock()
        self._pending: dict[bytes, ChallengedHello] = {}  # routing id -> Hello awaiting its Proof; loop thread only
        self._handshakes: dict[bytes, PairingHandshake] = {}  # routing id -> pair being set up; loop thread only
        self._outbox: queue.SimpleQueue[tuple[DecodeEdge | None, Message]] = queue.SimpleQueue()
        # (on the loop, if the loop is gone): results of handshake threads, run by the loop thread
        self._control: queue.SimpleQueue[tuple[Callable[[zmq.Socket], None], Callable[[], None]]] = queue.SimpleQueue()
        self._control_lock = threading.Lock()
        self._loop_done = False
        self._log = LogLimit()

    # --- the edges, for the worker (any thread) --------------------------------------------------------
    def edge(self, instance: str) -> DecodeEdge | None:
        """The edge of prefill `instance`, None when that prefill is not paired with this rank."""
        with self._edges_lock:
            return self._edges.get(instance)

    def edges(self) -> list[DecodeEdge]:
        with self._edges_lock:
            return list(self._edges.values())

    def is_current(self, edge: DecodeEdge) -> bool:
        with self._edges_lock:
            return self._edges.get(edge.instance) is edge

    @property
    def comm(self) -> PairComm | None:
        """The pair communicator when exactly one prefill is paired (1P1D), else None."""
        edges = self.edges()
        return edges[0].comm if len(edges) == 1 else None

    @property
    def alive(self) -> bool:
        """The loop is serving: started, bound, not stopped, not failed."""
        return self.ready.is_set() and self.is_alive() and self.error is None and not self.stopped.is_set()

    def post(self, message: Message | None = None, edge: DecodeEdge | None = None) -> None:
        """Queue a message for the prefill of `edge` (None: the only paired prefill, as in 1P1D); safe from any
        thread. A Pull whose edge is no longer current when it is sent becomes a PullFailed (`on_pull_failed`):
        its signal slot belongs to that edge's communicator, so it must never reach a re-paired prefill."""
        if message is not None:
            self._outbox.put((edge, message))
        super().post(None)

    def start_and_wait(self) -> None:
        """Start the thread; return once the port is bound, or raise the bind error (e.g. EADDRINUSE)."""
        self.start()
        if not self.ready.wait(READY_TIMEOUT_SECONDS):
            raise HandshakeError(f"{self.name}: listener not ready within {READY_TIMEOUT_SECONDS}s")
        if self.error is not None:
            raise HandshakeError(f"{self.name}: cannot listen on {self.host}:{self.port}: {self.error}") from self.error

    def run(self) -> None:
        sock = bounded_socket(self._ctx, zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable -> EHOSTUNREACH, never a silent drop
        try:
            sock.bind(f"tcp://{self.host}:{self.port}")
        except zmq.ZMQError as exc:
            self.error = exc
            # A port taken after the pod's preflight: tell the operator (termination message) so it re-leases.
            report_bind_failure(self.port, exc, f"{self.name} (side-channel listener)")
            sock.close(linger=0)
            self._finish_loop()
            self.ready.set()
            return
        logger.info("%s: side-channel listener on %s:%d (generation %d)", self.name, self.host, self.port, self.generation)
        self.accounts.set_listener_ready(self.tp_rank, True)
        self.ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        try:
            while not self.stopped.is_set():
                events = dict(poller.poll(POLL_MS))
                if self._wake_rx in events:
                    self._drain_wake()
                self._run_control(sock)
                self._flush_outbox(sock)
                if sock in events:
                    self._receive(sock)
                self._expire_pending()
                if self._stop_knob is not None:
                    self._stop_knob.check()
        except BaseException as exc:  # noqa: BLE001 - the thread must report, not vanish
            # /readyz answers 503 from now on, naming this (metrics.readiness): the operator replaces the pod. Set
            # before `error`, so whoever sees `alive` turn False finds readiness already failing.
            self.accounts.set_listener_failed(f"{self.name}: side-channel loop stopped: {exc!r}")
            self.accounts.set_listener_ready(self.tp_rank, False)
            self.error = exc
            logger.exception("%s: side-channel loop failed; this decode rank pairs no prefill until restarted", self.name)
        finally:
            self.accounts.set_listener_ready(self.tp_rank, False)
            self._finish_loop()
            for edge in self.edges():
                self._drop_edge(edge, "decode's side channel stopped")
            sock.close(linger=0)
            logger.info("%s: listener on port %d closed", self.name, self.port)

    # --- the loop's helpers (loop thread) --------------------------------------------------------------
    def _finish_loop(self) -> None:
        """No more results from handshake threads will run on the loop: the ones queued, and any that come later, are
        abandoned (their pair communicators closed)."""
        with self._control_lock:
            self._loop_done = True
        while True:
            try:
                _, abandon = self._control.get_nowait()
            except queue.Empty:
                return
            quietly(abandon)

    def _call_on_loop(self, on_loop: Callable[[zmq.Socket], None], abandon: Callable[[], None]) -> None:
        """From a handshake thread: run `on_loop(sock)` on the loop thread, or `abandon()` here if the loop is gone."""
        with self._control_lock:
            if not self._loop_done:
                self._control.put((on_loop, abandon))
                super().post(None)
                return
        quietly(abandon)

    def _run_control(self, sock: zmq.Socket) -> None:
        while True:
            try:
                on_loop, abandon = self._control.get_nowait()
            except queue.Empty:
                return
            try:
                on_loop(sock)
            except Exception:  # noqa: BLE001 - one handshake's end must not take the loop down
                logger.exception("%s: finishing a handshake failed", self.name)
                quietly(abandon)

    def _drop_edge(self, edge: DecodeEdge, reason: str) -> None:
        with self._edges_lock:
            if self._edges.get(edge.instance) is edge:
                del self._edges[edge.instance]
            if not self._edges:
                self.connected.clear()
        try:
            edge.comm.close()
        except Exception:  # noqa: BLE001 - closing must not kill the loop
            logger.exception("%s: closing the pair communicator of prefill %s failed", self.name, edge.instance)
        try:
            self.on_disconnect(edge, reason)
        except Exception:  # noqa: BLE001
            logger.exception("%s: on_disconnect for prefill %s failed", self.name, edge.instance)

    def _flush_outbox(self, sock: zmq.Socket) -> None:
        while True:
            try:
                edge, message = self._outbox.get_nowait()
            except queue.Empty:
                return
            if edge is None:
                edges = self.edges()
                edge = edges[0] if len(edges) == 1 else None
                if edge is None:
                    why = "no prefill connected" if not edges else f"{len(edges)} prefills paired and none named"
                    logger.error("%s: dropping %s: %s", self.name, type(message).__name__, why)
                    if isinstance(message, Pull):
                        self._pull_failed(PullFailed(message.transfer_id, f"{why} to the side channel"), None)
                    continue
            elif not self.is_current(edge):
                why = f"prefill {edge.instance}'s edge closed (it left or re-paired) before the message was sent"
                logger.error("%s: dropping %s: %s", self.name, type(message).__name__, why)
                if isinstance(message, Pull):
                    self._pull_failed(PullFailed(message.transfer_id, why), None)
                continue
            failure = self._send(sock, edge.identity, message)
            if failure is not None and isinstance(message, Pull):
                self._pull_failed(PullFailed(message.transfer_id, f"Pull not delivered to prefill: {failure}"), None)

    def _pull_failed(self, failed: PullFailed, sender: DecodeEdge | None) -> None:
        """`sender`: the paired prefill's edge the PullFailed came from; None when this side made it (a Pull that
        could not be sent)."""
        try:
            self.on_pull_failed(failed, sender)
        except Exception:  # noqa: BLE001 - the worker's callback must not take the loop down
            logger.exception("%s: on_pull_failed(%s) failed", self.name, failed.transfer_id)

    def _send(self, sock: zmq.Socket, identity: bytes, message: Message, echo: bytes | None = None) -> str | None:
        """Send to one peer; None on success, else why it was not sent (logged). `echo`: the peer's own hash frame
        instead of ours (every answer of the handshake before Welcome: see metadata.encode).

        A paired prefill's messages (Pulls, Welcome) may wait up to SNDTIMEO for room in its queue. A handshake's
        answers (Challenge, Refused, Accepted: those with `echo`) never wait: they go to peers not yet paired, any
        stranger among them, and a stranger that sends Hellos and never reads its answers fills its queue (the
        ROUTER is ROUTER_MANDATORY, so a full queue blocks a send instead of dropping it); each answer would then hold
        the loop, and every edge's Pulls, for SNDTIMEO. Such an answer is dropped instead: a real prefill reads it."""
        wait = echo is None
        try:
            sock.send_multipart([identity, *encode(message, self.local_hash if echo is None else echo)],
                                0 if wait else zmq.NOBLOCK)
            return None
        except zmq.Again:
            reason = (f"prefill did not take it within {SEND_TIMEOUT_SECONDS:g}s (its queue is full: not reading)"
                      if wait else "the peer's queue is full (it does not read its answers); dropped, not waited for")
        except zmq.ZMQError as exc:
            reason = f"prefill is gone ({exc})" if exc.errno == zmq.EHOSTUNREACH else f"send failed: {exc}"
        self._log("send", logging.ERROR, "%s: %s not sent: %s", self.name, type(message).__name__, reason)
        return reason

    def _receive(self, sock: zmq.Socket) -> None:
        # At most RECEIVE_BATCH messages per pass: the outbox (Pulls) and the handshakes' results are served between
        # batches even while a peer floods the socket.
        for _ in range(RECEIVE_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(sock, frames)
            except Exception as exc:  # noqa: BLE001 - nothing a peer sends may end the loop
                self.accounts.on_handshake("malformed")
                self._log("handle", logging.ERROR, "%s: a side-channel message could not be handled (%s: %s); the "
                          "listener goes on", self.name, type(exc).__name__, exc)

    def _refuse_stranger(self, sock: zmq.Socket, identity: bytes, echo: bytes, outcome: str, why: str, *args) -> None:
        """Refuse an unauthenticated peer: it is told NOT_ACCEPTED under its own hash frame (`echo`) and nothing else;
        `why` goes to the local log only."""
        self.accounts.on_handshake(outcome)
        self._log(outcome, logging.WARNING, "%s: refused an unauthenticated peer: " + why, self.name, *args)
        self._send(sock, identity, Refused(NOT_ACCEPTED), echo)

    def _handle(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        identity, body = frames[0], frames[1:]
        echo = body[0][:64] if body else b""
        edge = self._edge_of(identity)
        try:
            message = decode(body, self.local_hash)
            peer_hash = self.local_hash
        except CompatibilityError:
            # Only a Hello and a Proof are read whatever their hash: the hash is named once the peer proved the key.
            try:
                message, peer_hash = decode_handshake(body)
            except ValueError as exc:
                if edge is not None:
                    self._log("incompatible", logging.ERROR, "%s: incompatible message from prefill %s: %s", self.name,
                              edge.instance, exc)
                    return
                self._refuse_stranger(sock, identity, echo, "malformed", "incompatible message (%s)", exc)
                return
        except ValueError as exc:  # msgspec: not msgpack, unknown tag, a field of the wrong type or out of bounds
            if edge is not None:
                self._log("undecodable", logging.ERROR, "%s: undecodable message from prefill %s: %s", self.name,
                          edge.instance, exc)
                return
            self._refuse_stranger(sock, identity, echo, "malformed", "undecodable message (%s)", exc)
            return
        if isinstance(message, Hello):
            self._on_hello(sock, identity, message, peer_hash, body)
        elif isinstance(message, Proof):
            self._on_proof(sock, identity, message, echo)
        elif isinstance(message, Regions) and identity in self._handshakes:
            try:
                self._handshakes[identity].regions.put_nowait(message)
            except queue.Full:
                self._log("regions", logging.WARNING, "%s: a second Regions during one handshake; ignored", self.name)
        elif edge is None:
            self._refuse_stranger(sock, identity, echo, "malformed", "%s from a peer that is not a paired prefill",
                                  type(message).__name__)
        elif isinstance(message, PullDone):
            self.on_pull_done(message)
        elif isinstance(message, PullStarted):
            if self.on_pull_started is not None:
                try:
                    self.on_pull_started(message, edge)
                except Exception:  # noqa: BLE001 - a peer's message never ends the loop
                    logger.exception("%s: on_pull_started(%s) failed", self.name, message.transfer_id)
        elif isinstance(message, PullFailed):
            self._pull_failed(message, edge)
        else:
            self._log("unexpected", logging.WARNING, "%s: unexpected %s from prefill %s; ignored", self.name,
                      type(message).__name__, edge.instance)

    def _edge_of(self, identity: bytes) -> DecodeEdge | None:
        with self._edges_lock:
            return next((e for e in self._edges.values() if e.identity == identity), None)
