"""The side channel: decode listens first, prefill connects, sends its unique id, both init the pair, decode says OK.

One named daemon thread per side and TP rank owns the ZMQ socket (ZMQ sockets are not thread-safe). Other threads
talk to it through `post()`, which queues an encoded message and wakes the thread through an inproc socket. Every
blocking call has a deadline or a receive timeout, so `stop()` always joins the thread and frees the port. Both
sockets carry SNDTIMEO/RCVTIMEO (SEND_TIMEOUT_SECONDS): a peer that stops reading (its queue at the high-water mark)
makes a send fail after that long instead of blocking the thread forever; decode's ROUTER is ROUTER_MANDATORY, so a
message to a prefill that is gone fails loudly (a Pull becomes a PullFailed) instead of being dropped silently.

- `DecodeSideChannel`: ROUTER bound on PDPAIR_LISTEN_PORT_BASE + tp_rank, started from register_kv_caches. On a
  Hello it checks generation and transport (a mismatch is refused with a log line naming both values), answers
  Accepted, inits its side of the pair, registers its regions (callback), waits for prefill's Regions and answers
  Welcome. Each prefill instance (Hello.instance) gets its own edge (`DecodeEdge`: routing id, pair communicator);
  a Hello from an instance that has one replaces that edge only. Afterwards it sends each Pull on the edge the
  worker names and forwards PullDone / PullFailed to the worker.
- `PrefillSideChannel`: DEALER to one decode's host:portBase + tp_rank (one per decode of the peer set and rank;
  the worker starts and stops them, `PrefillWorker.set_peers`). While decode does not accept TCP
  connections it retries with capped exponential backoff (logged at attempts 1, 2, 4, ...); it never blocks engine
  start-up. It reports the pairing (`SignalAccounts.set_paired`): prefill's readiness (/readyz) waits for it.
  Afterwards it hands each Pull to the worker. A ZMQ monitor on its socket, attached before it connects, reports
  decode's disconnect (decode restarted): prefill closes the pair and handshakes again, even when decode went away
  before the serve loop started (the DEALER alone would reconnect silently to the new decode, with a dead pair);
  ZMTP heartbeats bound how long a decode whose host went silent goes unnoticed (DISCONNECT_GRACE_SECONDS).
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from pdpair import contract
from pdpair.connector.deadlines import handshake_deadline
from pdpair.connector.preflight import report_bind_failure
from pdpair.connector.metadata import (
    MAX_MESSAGE_BYTES,
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
from pdpair.connector.transports.base import RANK_DECODE, RANK_PREFILL, PairComm, PairTransport, TransportError

# The logger keeps the name it had before this module was renamed: log filters and readers of the logs know it.
logger = logging.getLogger("pdpair.connector.handshake")

POLL_MS = 100  # receive timeout of the side-channel loop: bounds how long stop() waits
READY_TIMEOUT_SECONDS = 10.0
RETRY_INITIAL_SECONDS = 0.2
# Prefill starts beside decode (the operator no longer waits for decode's listener to create it), so it may retry for
# a whole engine cold start; the cap bounds the delay between decode's listener opening and the pairing, which is on
# the path to the pair's first answer (0.5 s on average at a 1 s cap). A refused TCP connect every 0.25 s is cheap
# (no ZMQ socket is made before decode accepts). A retry is logged on attempts 1, 2, 4, 8, ... (every one is counted
# in the metrics).
RETRY_MAX_SECONDS = 0.25
# The Hello exchange must answer quickly; init_pair and region registration get the hang timeout.
HELLO_REPLY_TIMEOUT_SECONDS = 5.0
# Longest a side-channel send (or a receive) may block, e.g. when the peer stopped reading and the high-water mark
# is reached. Read when a socket is made.
SEND_TIMEOUT_SECONDS = 5.0
# A decode that disappears: prefill's monitor sees its side channel drop at once when decode's process ends (the
# kernel closes the TCP connection), and within DISCONNECT_GRACE_SECONDS when decode's host goes silent (ZMTP
# heartbeats every HEARTBEAT_INTERVAL_SECONDS, answered by decode's ZMQ I/O thread, never by a Python thread).
# Then that edge's pair closes, which fails its pushes in flight at once; other edges are untouched.
# 30 s, half the default hang timeout: at 5 s, in CI at load 35 on 2 cores, both ranks of a TP = 2 prefill dropped a
# decode that was alive and serving (its I/O thread did not answer in time) and paired again, failing what was in
# flight. A host that really goes silent is still noticed well before the hang timeout.
HEARTBEAT_INTERVAL_SECONDS = 2.0
DISCONNECT_GRACE_SECONDS = 30.0
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
MIN_KEY_BYTES = 32  # config.MIN_SIDE_CHANNEL_KEY_CHARS, as bytes
# What the pair's secret is derived for (metadata.derive_secret): both sides pass it to init_pair, so the tcp data
# connection joins only the peer of this authenticated handshake.
PAIR_SECRET_PURPOSE = "pair"


def _bounded_socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    timeout_ms = max(1, int(SEND_TIMEOUT_SECONDS * 1000))
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    # A frame larger than any message of the protocol drops that peer's connection inside libzmq, before Python
    # allocates it (metadata.MAX_MESSAGE_BYTES says what the largest needs).
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    return sock

# (comm) -> (region table, region indices, num_blocks): the worker registers its KV regions on the new comm.
RegisterRegions = Callable[[PairComm], tuple[bytes, list[int], int]]


class HandshakeError(RuntimeError):
    pass


class _SideChannel(threading.Thread):
    """Shared plumbing: context, inproc wake-up, outgoing queue, stop/ready events."""

    def __init__(self, name: str, local_hash: str, accounts) -> None:
        super().__init__(name=name, daemon=True)
        self.local_hash = local_hash
        self.accounts = accounts
        self.ready = threading.Event()
        self.stopped = threading.Event()
        self.connected = threading.Event()
        self.error: BaseException | None = None
        self._ctx = zmq.Context()
        self._outbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._wake_addr = f"inproc://pdpair-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()

    def post(self, message: Message | None = None) -> None:
        """Queue a message for the peer (None only wakes the loop); safe from any thread."""
        if message is not None:
            self._outbox.put(message)
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # a wake-up is already pending
            except zmq.ZMQError:
                pass  # closed during shutdown

    def stop(self, timeout: float = 10.0) -> None:
        self.stopped.set()
        self.post()
        if self.is_alive():
            self.join(timeout)
            if self.is_alive():
                raise RuntimeError(f"side-channel thread {self.name} did not stop within {timeout}s")
        with self._wake_lock:
            self._wake_tx.close(linger=0)
        self._wake_rx.close(linger=0)
        self._ctx.destroy(linger=0)  # the thread is gone; closes anything it left open, so this cannot block

    def _drain_wake(self) -> None:
        while True:
            try:
                self._wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                return


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


class _LogLimit:
    """At most `burst` lines per `period` seconds per kind of peer failure: a peer that sends garbage in a loop must not
    fill the log (or take the loop's time formatting lines). The lines held back are counted in the next one."""

    def __init__(self, burst: int = 10, period: float = 60.0) -> None:
        self.burst, self.period = burst, period
        self._window: dict[str, tuple[float, int, int]] = {}  # kind -> (window start, lines, held back)

    def __call__(self, kind: str, level: int, msg: str, *args) -> None:
        now = time.monotonic()
        start, lines, held = self._window.get(kind, (now, 0, 0))
        if now - start >= self.period:
            start, lines = now, 0
        if lines >= self.burst:
            self._window[kind] = (start, lines, held + 1)
            return
        if held:
            msg += f" ({held} similar line(s) held back)"
        logger.log(level, msg, *args)
        self._window[kind] = (start, lines + 1, 0)


class DecodeSideChannel(_SideChannel):
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
    ) -> None:
        super().__init__(f"pdpair-sidechannel-decode-r{tp_rank}", local_hash, accounts)
        self.host, self.port, self.tp_rank = host, port, tp_rank
        self.generation = generation
        self.transport = transport
        self.hang_timeout_seconds = hang_timeout_seconds
        self.factors = factors
        self.key = _check_key(key)
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
        self._log = _LogLimit()

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
        sock = _bounded_socket(self._ctx, zmq.ROUTER)
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
            _quietly(abandon)

    def _call_on_loop(self, on_loop: Callable[[zmq.Socket], None], abandon: Callable[[], None]) -> None:
        """From a handshake thread: run `on_loop(sock)` on the loop thread, or `abandon()` here if the loop is gone."""
        with self._control_lock:
            if not self._loop_done:
                self._control.put((on_loop, abandon))
                super().post(None)
                return
        _quietly(abandon)

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
                _quietly(abandon)

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
        """Send to one peer; None on success, else why it was not sent (logged). Bounded by SNDTIMEO. `echo`: the
        peer's own hash frame instead of ours (every answer of the handshake before Welcome: see metadata.encode)."""
        try:
            sock.send_multipart([identity, *encode(message, self.local_hash if echo is None else echo)])
            return None
        except zmq.Again:
            reason = f"prefill did not take it within {SEND_TIMEOUT_SECONDS:g}s (its queue is full: not reading)"
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
                _quietly(failed.close)
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
            _quietly(comm.close)
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


def _quietly(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - cleanup of a failed handshake must not raise
        logger.exception("cleanup after a side-channel handshake failed")


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the side-channel key must be at least {MIN_KEY_BYTES} bytes ({contract.ENV_SIDE_CHANNEL_KEY})")
    return key


class PrefillSideChannel(_SideChannel):
    """The DEALER of one prefill TP rank towards one decode (one edge): a prefill with N decodes runs N of these per
    rank, each retrying, pairing and re-pairing on its own. Log lines start with `pdpair-sidechannel-prefill-r<rank>`
    and name the decode; the thread's name adds the decode's address."""

    def __init__(
        self,
        *,
        peer_host: str,
        peer_port: int,
        tp_rank: int,
        generation: int,
        pair: str,
        instance: str = "",
        peer_label: str | None = None,
        transport: PairTransport,
        hang_timeout_seconds: float,
        local_hash: str,
        factors: dict,
        key: bytes,
        register_regions: RegisterRegions,
        on_pull: Callable[[Pull], Message | None],
        on_tick: Callable[[], list[Message]],
        on_connected: Callable[[Welcome], None],
        accounts,
    ) -> None:
        label = peer_label or (f"[{peer_host}]:{peer_port}" if ":" in peer_host else f"{peer_host}:{peer_port}")
        super().__init__(f"pdpair-sidechannel-prefill-r{tp_rank}-{label}", local_hash, accounts)
        self.log_name = f"pdpair-sidechannel-prefill-r{tp_rank}"
        self.peer_host, self.peer_port, self.tp_rank = peer_host, peer_port, tp_rank
        # The instance names this prefill's edge on decode; a side channel built without one (direct use) gets a random
        # one, so it never replaces another prefill's edge.
        self.generation, self.pair = generation, pair
        self.instance = instance or f"prefill-{secrets.token_hex(8)}"
        self.key = _check_key(key)
        self.comm: PairComm | None = None
        self.transport = transport
        self.hang_timeout_seconds = hang_timeout_seconds
        self.factors = factors
        self.register_regions = register_regions
        self.on_pull = on_pull
        self.on_tick = on_tick
        self.on_connected = on_connected
        self.attempts = 0
        self.peer_label = label  # the `peer` label of this edge's series (pdpair_peer_paired, transport gauges)
        self.accounts.set_paired(False, label)  # 0 until this edge pairs

    def _close_comm(self) -> None:
        comm, self.comm = self.comm, None
        self.connected.clear()
        if comm is not None:
            try:
                comm.close()
            except Exception:  # noqa: BLE001 - closing must not kill the loop
                logger.exception("%s: closing the pair communicator with decode %s failed", self.log_name, self.peer_label)

    def run(self) -> None:
        self.ready.set()
        backoff = RETRY_INITIAL_SECONDS
        while not self.stopped.is_set():
            self.attempts += 1
            outcome = self._attempt()
            if outcome is None:  # stopped
                break
            if outcome == "connected":
                self.accounts.set_paired(True, self.peer_label)
                try:
                    self._serve()
                finally:
                    self.accounts.set_paired(False, self.peer_label)
                if self.stopped.is_set():
                    break
                backoff = RETRY_INITIAL_SECONDS
                continue
            if self.attempts & (self.attempts - 1) == 0:  # 1, 2, 4, 8, ...: a cold start is ~100-400 attempts
                logger.warning(
                    "%s: handshake attempt %d with decode %s:%d did not complete (%s); retrying in %.1fs",
                    self.log_name, self.attempts, self.peer_host, self.peer_port, outcome, backoff,
                )
            self.stopped.wait(backoff)
            backoff = min(backoff * 2, RETRY_MAX_SECONDS)
        self._close_comm()
        logger.info("%s: edge to decode %s stopped", self.log_name, self.peer_label)

    def _attempt(self) -> str | None:
        """One handshake; returns 'connected', None when stopping, or the reason it failed."""
        try:
            with socket.create_connection((self.peer_host, self.peer_port), timeout=1.0) as probe:
                # Decode accepts TCP: its listener is up. Our end of this connection is the address decode reaches.
                self.transport.set_local_address(probe.getsockname()[0])
        except OSError as exc:
            self.accounts.on_handshake("retry")
            return f"decode not listening: {exc}"
        self._sock = sock = _bounded_socket(self._ctx, zmq.DEALER)
        # ZMTP heartbeats: a decode whose host went silent (no FIN, no RST) drops the connection after
        # DISCONNECT_GRACE_SECONDS, which the monitor below reports like any other disconnect.
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_INTERVAL_SECONDS * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(DISCONNECT_GRACE_SECONDS * 1000))
        # Watch for decode going away from before the connection exists: a decode that restarts between the Welcome
        # and `_serve` must still be seen (the DEALER reconnects silently, so a monitor attached later never would).
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        if ":" in self.peer_host:  # an IPv6 literal
            sock.setsockopt(zmq.IPV6, 1)
            sock.connect(f"tcp://[{self.peer_host}]:{self.peer_port}")
        else:
            sock.connect(f"tcp://{self.peer_host}:{self.peer_port}")
        try:
            uid = self.transport.create_unique_id()
            hello = Hello(self.generation, self.pair, self.tp_rank, self.transport.name, uid, self.instance,
                          secrets.token_bytes(NONCE_BYTES))
            frames = encode(hello, self.local_hash)
            sock.send_multipart([*frames, json.dumps(self.factors, sort_keys=True).encode()])
            # Decode challenges every Hello; the Proof shows we hold the pair's key, Accepted's proof that decode does.
            reply = self._recv(sock, time.monotonic() + HELLO_REPLY_TIMEOUT_SECONDS)
            said = b""  # the transcript, once decode challenged: an Accepted without a Challenge proves nothing
            if isinstance(reply, Challenge):
                said = transcript(frames[0], frames[1], reply.nonce)
                sock.send_multipart(encode(Proof(proof(self.key, "prefill", said)), self.local_hash))
                reply = self._recv(sock, time.monotonic() + HELLO_REPLY_TIMEOUT_SECONDS)
            if isinstance(reply, Accepted) and (not said or not proof_matches(self.key, "decode", said, reply.proof)):
                logger.error("%s: the listener at %s did not prove this pair's side-channel key (another pair's "
                             "decode on this address, or an impostor); not pairing", self.log_name, self.peer_label)
                return self._failed(sock, "refused", "decode did not prove the pair's side-channel key")
            if reply is None:
                if self.stopped.is_set():
                    self._close_sock()  # a socket left open would make stop()'s context term wait forever
                    return None
                return self._failed(sock, "timeout", "no answer to Hello")
            if isinstance(reply, Refused):
                hint = (" (this prefill's side-channel key is not the decode's: another pair's decode on this "
                        f"address, or {contract.ENV_SIDE_CHANNEL_KEY} differs)" if reply.reason == NOT_ACCEPTED else "")
                logger.error("%s: decode %s refused the handshake: %s%s", self.log_name, self.peer_label, reply.reason,
                             hint)
                return self._failed(sock, "refused", f"refused: {reply.reason}")
            if not isinstance(reply, Accepted):
                return self._failed(sock, contract.OUTCOME_ERROR, f"unexpected {type(reply).__name__}")
            deadline = handshake_deadline(self.hang_timeout_seconds, time.monotonic())
            secret = derive_secret(self.key, said, PAIR_SECRET_PURPOSE)
            comm = self.transport.init_pair(uid, RANK_PREFILL, deadline, secret)
            try:
                table, indices, _ = self.register_regions(comm)
                sock.send_multipart(encode(Regions(table, indices), self.local_hash))
                welcome = self._recv(sock, deadline)
                if not isinstance(welcome, Welcome):
                    reason = welcome.reason if isinstance(welcome, Refused) else f"got {type(welcome).__name__}"
                    raise HandshakeError(f"no Welcome from decode: {reason}")
                comm.set_peer_region_table(welcome.table)
                self.on_connected(welcome)
            except BaseException:
                comm.close()
                raise
        except CompatibilityError as exc:
            logger.error("%s: decode %s is incompatible: %s; local factors %s", self.log_name, self.peer_label, exc, json.dumps(self.factors))
            return self._failed(sock, "refused", str(exc))
        except (TransportError, HandshakeError, TimeoutError) as exc:
            return self._failed(sock, contract.OUTCOME_ERROR, str(exc))
        except zmq.Again:
            return self._failed(sock, contract.OUTCOME_ERROR, f"decode took no message for {SEND_TIMEOUT_SECONDS:g}s")
        except zmq.ZMQError as exc:
            return self._failed(sock, contract.OUTCOME_ERROR, f"side-channel send failed: {exc}")
        except Exception as exc:  # noqa: BLE001 - whatever decode (or an impostor at its address) sent, retry
            return self._failed(sock, contract.OUTCOME_ERROR, f"{type(exc).__name__}: {exc}")
        self.comm = comm
        self.accounts.on_handshake(contract.OUTCOME_OK)
        self.connected.set()
        logger.info(
            "%s: paired with decode %s:%d after %d attempt(s) (generation %d, transport %s)",
            self.log_name, self.peer_host, self.peer_port, self.attempts, self.generation, self.transport.name,
        )
        return "connected"

    def _failed(self, sock: zmq.Socket, outcome: str, reason: str) -> str:
        self.accounts.on_handshake(outcome)
        self._close_sock()
        return reason

    def _close_sock(self) -> None:
        sock, monitor = self._sock, self._monitor
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)

    def _recv(self, sock: zmq.Socket, deadline: float) -> Message | None:
        while not self.stopped.is_set():
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                return None
            if sock.poll(min(left_ms, POLL_MS)):
                return decode(sock.recv_multipart(zmq.NOBLOCK), self.local_hash)  # poll said it is there
        return None

    def _serve(self) -> None:
        """Serve Pulls until stopped, or until decode's side channel drops (decode restarted): then close the pair
        and return, so `run` handshakes again (a restarted decode with the same generation pairs anew)."""
        sock, monitor = self._sock, self._monitor
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while not self.stopped.is_set():
                events = dict(poller.poll(POLL_MS))
                if monitor in events:
                    logger.warning("%s: decode %s:%d closed the side channel; closing the pair and handshaking again",
                                   self.log_name, self.peer_host, self.peer_port)
                    self._close_comm()
                    return
                if self._wake_rx in events:
                    self._drain_wake()
                replies: list[Message] = list(self.on_tick())
                if sock in events:
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            message = decode(frames, self.local_hash)
                        except Exception as exc:  # noqa: BLE001
                            logger.error("%s: undecodable message from decode: %s", self.log_name, exc)
                            continue
                        if isinstance(message, Pull):
                            try:
                                reply = self.on_pull(message)
                            except Exception as exc:  # noqa: BLE001 - one bad Pull must not end the edge's loop
                                logger.exception("%s: Pull %s from decode could not be handled", self.log_name,
                                                 message.transfer_id)
                                reply = PullFailed(message.transfer_id, f"prefill could not handle the Pull: {exc}")
                            if reply is not None:
                                replies.append(reply)
                        else:
                            logger.warning("%s: unexpected %s from decode; ignored", self.log_name, type(message).__name__)
                while True:
                    try:
                        replies.append(self._outbox.get_nowait())
                    except queue.Empty:
                        break
                for sent, reply in enumerate(replies):
                    try:
                        sock.send_multipart(encode(reply, self.local_hash))
                    except zmq.ZMQError as exc:  # zmq.Again: SNDTIMEO passed with decode's queue full
                        why = f"decode took nothing for {SEND_TIMEOUT_SECONDS:g}s" if isinstance(exc, zmq.Again) else exc
                        logger.error(
                            "%s: side channel to decode %s:%d is stuck (%s); %d reply(ies) not sent, decode's waits "
                            "for them end at their deadline; closing the pair and handshaking again",
                            self.log_name, self.peer_host, self.peer_port, why, len(replies) - sent,
                        )
                        self._close_comm()
                        return
        finally:
            self._close_sock()
