"""Decode's side channel: the ROUTER of one decode TP rank (`DecodeSideChannel`) and its edges, one per paired prefill
instance (`DecodeEdge`). The protocol, its authentication and its bounds are described in side_channel.py; this
module is decode's half: Challenge, Proof check, the handshake threads, Pull routing."""

from __future__ import annotations

import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from pdpair import contract
from pdpair.connector.metadata import (
    NONCE_BYTES,
    NOT_ACCEPTED,
    Accepted,
    Challenge,
    CompatibilityError,
    Hello,
    Message,
    Proof,
    Pull,
    PullDone,
    PullFailed,
    Refused,
    Regions,
    Welcome,
    decode,
    decode_handshake,
    derive_secret,
    encode,
    proof,
    proof_matches,
    transcript,
)
from pdpair.connector.preflight import report_bind_failure
from pdpair.connector.side_channel import (
    HELLO_REPLY_TIMEOUT_SECONDS,
    PAIR_SECRET_PURPOSE,
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
    RANK_DECODE,
    PairComm,
    PairTransport,
    TransportError,
)

# The logger keeps the name it had before this module was renamed: log filters and readers of the logs know it.
logger = logging.getLogger("pdpair.connector.handshake")


READY_TIMEOUT_SECONDS = 10.0

# Decode's pair setup for one authenticated Hello (init_pair, registering the regions, prefill's Regions) runs on a
# handshake thread within this bound (or the hang timeout, if shorter). It runs off the loop, so the bound does not
# protect the Pulls (nothing a handshake does delays them); it bounds how long a prefill that stalls its handshake
# holds one of the MAX_CONCURRENT_HANDSHAKES slots. A real pair needs well under a second on tcp (one TCP connect,
# pointer registrations); 10 s leaves room for a loaded node and for FlagCX's bootstrap. (FlagCX's collective
# registrations keep their own bound, the hang timeout, inside the transport.)
HANDSHAKE_SECONDS = 10.0

# Handshake threads at once per decode rank; a further authenticated Hello is refused busy (prefill retries). Pairings
# come one per prefill instance at start or after a restart, so 4 at once only queues large fleets starting together.
MAX_CONCURRENT_HANDSHAKES = 4

# Hellos answered with a Challenge and awaiting their Proof (each at most HELLO_REPLY_TIMEOUT_SECONDS); a further one
# evicts the oldest (see _on_hello). They cost a small record each and no thread.
MAX_PENDING_CHALLENGES = 64

# Messages the loop reads before it serves its outbox and the handshakes' results again.
RECEIVE_BATCH = 256


@dataclass(eq=False)
class DecodeEdge:
    """One prefill paired with this decode rank: its identity (PDPAIR_INSTANCE, sent in Hello), the ZMQ routing id of
    its side-channel connection, and the pair communicator of this edge (own uid, own regions, own signal slots)."""

    instance: str
    identity: bytes
    comm: PairComm
    pair: str = ""

    @property
    def label(self) -> str:
        """The `peer` label of this edge's series on decode: the prefill's instance."""
        return self.instance


@dataclass(eq=False)
class _Pending:
    """A Hello answered with a Challenge, waiting for its Proof (decode's loop thread only)."""

    hello: Hello
    peer_hash: str
    hash_frame: bytes  # the peer's own hash frame, echoed in every answer before Welcome
    peer_factors: str
    transcript: bytes
    expires: float


@dataclass(eq=False)
class _Handshake:
    """An authenticated Hello whose pair a handshake thread is setting up. The loop thread hands it prefill's Regions
    (`regions`, at most one); the thread hands its result back through `DecodeSideChannel._call_on_loop`."""

    identity: bytes
    hello: Hello
    hash_frame: bytes
    transcript: bytes
    deadline: float
    regions: queue.Queue = field(default_factory=lambda: queue.Queue(maxsize=1))


class DecodeSideChannel(SideChannelThread):
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
        on_pull_failed: Callable[[PullFailed], None],
        on_disconnect: Callable[[DecodeEdge, str], None],
        accounts,
        max_edges: int = contract.DEFAULT_MAX_EDGES,
        test_stop_listener_file: str | None = None,
    ) -> None:
        super().__init__(f"pdpair-sidechannel-decode-r{tp_rank}", local_hash, accounts)
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
        self.on_disconnect = on_disconnect
        self._edges: dict[str, DecodeEdge] = {}  # prefill instance -> its edge; written by this thread only
        self._edges_lock = threading.Lock()
        self._pending: dict[bytes, _Pending] = {}  # routing id -> Hello awaiting its Proof; loop thread only
        self._handshakes: dict[bytes, _Handshake] = {}  # routing id -> pair being set up; loop thread only
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
                        self._pull_failed(PullFailed(message.transfer_id, f"{why} to the side channel"))
                    continue
            elif not self.is_current(edge):
                why = f"prefill {edge.instance}'s edge closed (it left or re-paired) before the message was sent"
                logger.error("%s: dropping %s: %s", self.name, type(message).__name__, why)
                if isinstance(message, Pull):
                    self._pull_failed(PullFailed(message.transfer_id, why))
                continue
            failure = self._send(sock, edge.identity, message)
            if failure is not None and isinstance(message, Pull):
                self._pull_failed(PullFailed(message.transfer_id, f"Pull not delivered to prefill: {failure}"))

    def _pull_failed(self, failed: PullFailed) -> None:
        try:
            self.on_pull_failed(failed)
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
        elif isinstance(message, PullFailed):
            self._pull_failed(message)
        else:
            self._log("unexpected", logging.WARNING, "%s: unexpected %s from prefill %s; ignored", self.name,
                      type(message).__name__, edge.instance)

    def _edge_of(self, identity: bytes) -> DecodeEdge | None:
        with self._edges_lock:
            return next((e for e in self._edges.values() if e.identity == identity), None)

    def _expire_pending(self) -> None:
        if not self._pending:
            return
        now = time.monotonic()
        for identity in [i for i, p in self._pending.items() if p.expires <= now]:
            del self._pending[identity]

    def _on_hello(self, sock: zmq.Socket, identity: bytes, hello: Hello, peer_hash: str, body: list[bytes]) -> None:
        """Answer a Hello with a Challenge: nothing about decode is said and nothing changes until the Proof."""
        self._pending.pop(identity, None)  # a second Hello on one connection starts over
        if len(self._pending) >= MAX_PENDING_CHALLENGES:
            self._expire_pending()
        if len(self._pending) >= MAX_PENDING_CHALLENGES:
            # The oldest challenge goes, not the new Hello: a flood of Hellos then only evicts itself, while a real
            # prefill's Proof comes one round trip after its Challenge (MAX_PENDING_CHALLENGES Hellos would have to
            # arrive within that round trip to push it out).
            del self._pending[next(iter(self._pending))]
            self.accounts.on_handshake("busy")
            self._log("evict", logging.WARNING, "%s: %d Hellos await their Proof; the oldest is dropped", self.name,
                      MAX_PENDING_CHALLENGES)
        nonce = secrets.token_bytes(NONCE_BYTES)
        peer_factors = body[2].decode("utf-8", "replace")[:4096] if len(body) > 2 else "(not sent)"
        self._pending[identity] = _Pending(
            hello, peer_hash, body[0][:64], peer_factors, transcript(body[0], body[1], nonce),
            time.monotonic() + HELLO_REPLY_TIMEOUT_SECONDS,
        )
        self._send(sock, identity, Challenge(nonce), body[0][:64])

    def _on_proof(self, sock: zmq.Socket, identity: bytes, message: Proof, echo: bytes) -> None:
        pending = self._pending.pop(identity, None)
        if pending is None:
            self._refuse_stranger(sock, identity, echo, "unauthenticated", "a Proof without a Hello (or after %gs)",
                                  HELLO_REPLY_TIMEOUT_SECONDS)
            return
        if not proof_matches(self.key, "prefill", pending.transcript, message.mac):
            hello = pending.hello
            self._refuse_stranger(
                sock, identity, pending.hash_frame, "unauthenticated",
                "wrong proof of the side-channel key (a peer outside this pair) for a Hello naming instance %r, pair %r, "
                "rank %d, generation %d (decode: rank %d, generation %d)",
                hello.instance, hello.pair, hello.tp_rank, hello.generation, self.tp_rank, self.generation,
            )
            return
        self._authenticated(sock, identity, pending)

    def _refuse(self, sock: zmq.Socket, identity: bytes, echo: bytes, reason: str, outcome: str = "refused") -> None:
        """Refuse an authenticated prefill (one of this pair's): the reason may name decode's values. Sent under the
        prefill's own hash frame, so a prefill of another build still reads why."""
        logger.error("%s: handshake refused: %s", self.name, reason)
        self.accounts.on_handshake(outcome)
        self._send(sock, identity, Refused(reason), echo)

    def _authenticated(self, sock: zmq.Socket, identity: bytes, pending: _Pending) -> None:
        """A Hello whose sender proved the key: check it, then set the pair up on a handshake thread."""
        hello = pending.hello
        if pending.peer_hash != self.local_hash:
            logger.error("%s: refusing an incompatible prefill %s: peer compatibility hash %s != local %s. local "
                         "factors %s; peer factors %s", self.name, hello.instance, pending.peer_hash, self.local_hash,
                         json.dumps(self.factors, sort_keys=True), pending.peer_factors)
            self._refuse(sock, identity, pending.hash_frame, f"peer compatibility hash {pending.peer_hash} != local {self.local_hash} "
                         "(connector version, vLLM version or KV layout differ; see the factors in decode's log)")
            return
        if hello.generation != self.generation:
            self._refuse(
                sock, identity, pending.hash_frame,
                f"generation mismatch: prefill {hello.pair or '?'} rank {hello.tp_rank} has {contract.ENV_GENERATION}="
                f"{hello.generation}, this decode has {self.generation} (a stale peer from another pair generation)",
            )
            return
        if hello.transport != self.transport.name:
            self._refuse(sock, identity, pending.hash_frame, f"transport mismatch: prefill uses {hello.transport!r}, decode uses {self.transport.name!r}")
            return
        if hello.tp_rank != self.tp_rank:
            self._refuse(sock, identity, pending.hash_frame, f"rank mismatch: prefill rank {hello.tp_rank} reached decode rank {self.tp_rank}")
            return
        try:
            self.transport.check_unique_id(hello.unique_id)
        except TransportError as exc:
            self._refuse(sock, identity, pending.hash_frame, f"malformed unique id: {exc}", outcome="malformed")
            return
        instance = hello.instance
        if any(job.hello.instance == instance for job in self._handshakes.values()):
            self._refuse(sock, identity, pending.hash_frame, f"busy: a handshake of prefill {instance} is in progress", outcome="busy")
            return
        if len(self._handshakes) >= MAX_CONCURRENT_HANDSHAKES:
            self._refuse(sock, identity, pending.hash_frame, f"busy: {len(self._handshakes)} handshakes in progress (at most "
                         f"{MAX_CONCURRENT_HANDSHAKES} at once); retry", outcome="busy")
            return
        with self._edges_lock:
            paired = len(self._edges) - (1 if instance in self._edges else 0)
        if paired + len(self._handshakes) >= self.max_edges:
            self._refuse(sock, identity, pending.hash_frame, f"edge cap: this decode rank has {paired} prefill(s) paired and "
                         f"{len(self._handshakes)} pairing, at most {self.max_edges} ({contract.ENV_MAX_EDGES})",
                         outcome="busy")
            return
        if self._send(sock, identity, Accepted(proof(self.key, "decode", pending.transcript)), pending.hash_frame) is not None:
            self.accounts.on_handshake(contract.OUTCOME_ERROR)
            return
        deadline = time.monotonic() + min(HANDSHAKE_SECONDS, self.hang_timeout_seconds)
        job = _Handshake(identity, hello, pending.hash_frame, pending.transcript, deadline)
        self._handshakes[identity] = job
        thread = threading.Thread(target=self._set_up_pair, args=(job,), daemon=True,
                                  name=f"pdpair-handshake-decode-r{self.tp_rank}")
        try:
            thread.start()
        except Exception as exc:  # noqa: BLE001 - e.g. no thread left in the process: this prefill only is refused
            del self._handshakes[identity]
            self._refuse(sock, identity, pending.hash_frame, f"cannot start a handshake thread: {exc}", outcome="error")

    # --- a handshake thread ----------------------------------------------------------------------------
    def _set_up_pair(self, job: _Handshake) -> None:
        """init_pair, register, wait for prefill's Regions; the loop thread sends Welcome and installs the edge."""
        comm: PairComm | None = None
        try:
            secret = derive_secret(self.key, job.transcript, PAIR_SECRET_PURPOSE)
            comm = self.transport.init_pair(job.hello.unique_id, RANK_DECODE, job.deadline, secret)
            table, indices, num_blocks = self.register_regions(comm)
            regions = self._await_regions(job)
            if len(regions.region_indices) != len(indices):
                raise HandshakeError(f"prefill announced {len(regions.region_indices)} region(s), decode has "
                                     f"{len(indices)} (one per layer)")
            comm.set_peer_region_table(regions.table)
        except BaseException as exc:  # noqa: BLE001 - any failure refuses this prefill; the listener lives on
            failed = comm
            why = (f"transport init as rank {RANK_DECODE} failed: {exc}" if failed is None
                   else f"pair setup failed: {type(exc).__name__}: {exc}")
            if failed is not None:
                quietly(failed.close)
            self._call_on_loop(lambda sock: self._handshake_failed(sock, job, why), lambda: None)
            return
        self._call_on_loop(lambda sock: self._handshake_done(sock, job, comm, table, indices, num_blocks), comm.close)

    def _await_regions(self, job: _Handshake) -> Regions:
        while not self.stopped.is_set():
            left = job.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"prefill's region table did not arrive within {HANDSHAKE_SECONDS:g}s")
            try:
                return job.regions.get(timeout=min(left, POLL_MS / 1000))
            except queue.Empty:
                continue
        raise HandshakeError("stopping")

    # --- a handshake's end (loop thread) ---------------------------------------------------------------
    def _handshake_failed(self, sock: zmq.Socket, job: _Handshake, why: str) -> None:
        self._handshakes.pop(job.identity, None)
        self._refuse(sock, job.identity, job.hash_frame, why, outcome=contract.OUTCOME_ERROR)

    def _handshake_done(self, sock: zmq.Socket, job: _Handshake, comm: PairComm, table: bytes, indices: list[int],
                        num_blocks: int) -> None:
        self._handshakes.pop(job.identity, None)
        hello = job.hello
        if self.stopped.is_set() or self._send(sock, job.identity, Welcome(table, indices, num_blocks)) is not None:
            quietly(comm.close)
            self.accounts.on_handshake(contract.OUTCOME_ERROR)
            return
        # The same prefill again (it restarted, or re-paired after its side channel dropped): that edge only is
        # replaced, now that the new one is set up; every other prefill's edge is untouched.
        for old in self.edges():
            if old.instance == hello.instance or old.identity == job.identity:
                logger.warning("%s: prefill %s paired again; closing its old edge", self.name, old.instance)
                self._drop_edge(old, f"replaced by a new handshake of prefill {hello.instance}")
        with self._edges_lock:
            self._edges[hello.instance] = DecodeEdge(hello.instance, job.identity, comm, hello.pair)
            paired = len(self._edges)
        self.accounts.on_handshake(contract.OUTCOME_OK)
        self.connected.set()
        logger.info(
            "%s: paired with prefill %s rank %d (instance %s, generation %d, transport %s; %d prefill(s) paired)",
            self.name, hello.pair or "?", hello.tp_rank, hello.instance, hello.generation, hello.transport, paired,
        )
