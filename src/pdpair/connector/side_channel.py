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
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from pdpair import contract
from pdpair.connector.deadlines import handshake_deadline
from pdpair.connector.preflight import report_bind_failure
from pdpair.connector.metadata import (
    Accepted,
    CompatibilityError,
    Hello,
    Message,
    Pull,
    PullDone,
    PullFailed,
    Refused,
    Regions,
    Welcome,
    decode,
    encode,
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


def _bounded_socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    timeout_ms = max(1, int(SEND_TIMEOUT_SECONDS * 1000))
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
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


class DecodeSideChannel(_SideChannel):
    """The ROUTER of one decode TP rank: accepts a handshake from every prefill (one edge per prefill instance)."""

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
        register_regions: RegisterRegions,
        on_pull_done: Callable[[PullDone], None],
        on_pull_failed: Callable[[PullFailed], None],
        on_disconnect: Callable[[DecodeEdge, str], None],
        accounts,
    ) -> None:
        super().__init__(f"pdpair-sidechannel-decode-r{tp_rank}", local_hash, accounts)
        self.host, self.port, self.tp_rank = host, port, tp_rank
        self.generation = generation
        self.transport = transport
        self.hang_timeout_seconds = hang_timeout_seconds
        self.factors = factors
        self.register_regions = register_regions
        self.on_pull_done = on_pull_done
        self.on_pull_failed = on_pull_failed
        self.on_disconnect = on_disconnect
        self._edges: dict[str, DecodeEdge] = {}  # prefill instance -> its edge; written by this thread only
        self._edges_lock = threading.Lock()
        self._stash: list[list[bytes]] = []  # other prefills' messages that came during a handshake
        self._outbox: queue.SimpleQueue[tuple[DecodeEdge | None, Message]] = queue.SimpleQueue()

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
                self._flush_outbox(sock)
                if sock in events or self._stash:
                    self._receive(sock)
        except Exception:  # noqa: BLE001 - the thread must report, not vanish
            logger.exception("%s: side-channel loop failed", self.name)
        finally:
            self.accounts.set_listener_ready(self.tp_rank, False)
            for edge in self.edges():
                self._drop_edge(edge, "decode's side channel stopped")
            sock.close(linger=0)
            logger.info("%s: listener on port %d closed", self.name, self.port)

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
        self.on_disconnect(edge, reason)

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
                        self.on_pull_failed(PullFailed(message.transfer_id, f"{why} to the side channel"))
                    continue
            elif not self.is_current(edge):
                why = f"prefill {edge.instance}'s edge closed (it left or re-paired) before the message was sent"
                logger.error("%s: dropping %s: %s", self.name, type(message).__name__, why)
                if isinstance(message, Pull):
                    self.on_pull_failed(PullFailed(message.transfer_id, why))
                continue
            failure = self._send(sock, edge.identity, message)
            if failure is not None and isinstance(message, Pull):
                self.on_pull_failed(PullFailed(message.transfer_id, f"Pull not delivered to prefill: {failure}"))

    def _send(self, sock: zmq.Socket, identity: bytes, message: Message) -> str | None:
        """Send to one prefill; None on success, else why it was not sent (logged). Bounded by SNDTIMEO."""
        try:
            sock.send_multipart([identity, *encode(message, self.local_hash)])
            return None
        except zmq.Again:
            reason = f"prefill did not take it within {SEND_TIMEOUT_SECONDS:g}s (its queue is full: not reading)"
        except zmq.ZMQError as exc:
            reason = f"prefill is gone ({exc})" if exc.errno == zmq.EHOSTUNREACH else f"send failed: {exc}"
        logger.error("%s: %s not sent: %s", self.name, type(message).__name__, reason)
        return reason

    def _next_frames(self, sock: zmq.Socket) -> list[bytes] | None:
        if self._stash:
            return self._stash.pop(0)
        try:
            return sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def _receive(self, sock: zmq.Socket) -> None:
        while (frames := self._next_frames(sock)) is not None:
            identity, body = frames[0], frames[1:]
            try:
                message = decode(body, self.local_hash)
            except CompatibilityError as exc:
                peer_factors = body[2].decode("utf-8", "replace") if len(body) > 2 else "(not sent)"
                logger.error(
                    "%s: refusing an incompatible prefill: %s. local factors %s; peer factors %s",
                    self.name, exc, json.dumps(self.factors, sort_keys=True), peer_factors,
                )
                self.accounts.on_handshake("refused")
                self._send(sock, identity, Refused(str(exc)))
                continue
            except Exception as exc:  # noqa: BLE001 - a malformed frame must not kill the listener
                logger.error("%s: undecodable side-channel message: %s", self.name, exc)
                continue
            if isinstance(message, Hello):
                self._handshake(sock, identity, message)
                continue
            edge = next((e for e in self.edges() if e.identity == identity), None)
            if edge is None:
                logger.warning("%s: %s from a peer that is not a paired prefill; ignored", self.name, type(message).__name__)
            elif isinstance(message, PullDone):
                self.on_pull_done(message)
            elif isinstance(message, PullFailed):
                self.on_pull_failed(message)
            else:
                logger.warning("%s: unexpected %s from prefill %s; ignored", self.name, type(message).__name__,
                               edge.instance)

    def _refuse(self, sock: zmq.Socket, identity: bytes, reason: str, outcome: str = "refused") -> None:
        logger.error("%s: handshake refused: %s", self.name, reason)
        self.accounts.on_handshake(outcome)
        self._send(sock, identity, Refused(reason))

    def _handshake(self, sock: zmq.Socket, identity: bytes, hello: Hello) -> None:
        if hello.generation != self.generation:
            self._refuse(
                sock, identity,
                f"generation mismatch: prefill {hello.pair or '?'} rank {hello.tp_rank} has {contract.ENV_GENERATION}="
                f"{hello.generation}, this decode has {self.generation} (a stale peer from another pair generation)",
            )
            return
        if hello.transport != self.transport.name:
            self._refuse(sock, identity, f"transport mismatch: prefill uses {hello.transport!r}, decode uses {self.transport.name!r}")
            return
        if hello.tp_rank != self.tp_rank:
            self._refuse(sock, identity, f"rank mismatch: prefill rank {hello.tp_rank} reached decode rank {self.tp_rank}")
            return
        instance = hello.instance or f"prefill-{identity.hex()}"
        # The same prefill again (it restarted, or re-paired after its side channel dropped): that edge only is
        # replaced; every other prefill's edge is untouched.
        for old in self.edges():
            if old.instance == instance or old.identity == identity:
                logger.warning("%s: prefill %s pairs again; closing its old edge", self.name, old.instance)
                self._drop_edge(old, f"replaced by a new Hello from prefill {instance}")
        if self._send(sock, identity, Accepted()) is not None:
            self.accounts.on_handshake(contract.OUTCOME_ERROR)
            return
        deadline = handshake_deadline(self.hang_timeout_seconds, time.monotonic())
        try:
            comm = self.transport.init_pair(hello.unique_id, RANK_DECODE, deadline)
        except TransportError as exc:
            self._refuse(sock, identity, f"transport init as rank {RANK_DECODE} failed: {exc}", outcome="error")
            return
        try:
            table, indices, num_blocks = self.register_regions(comm)
            regions = self._await_regions(sock, identity, deadline)
            comm.set_peer_region_table(regions.table)
        except Exception as exc:  # noqa: BLE001 - any failure here refuses this prefill, the listener lives on
            comm.close()
            self._refuse(sock, identity, f"pair setup failed: {exc}", outcome="error")
            return
        if self._send(sock, identity, Welcome(table, indices, num_blocks)) is not None:
            comm.close()
            self.accounts.on_handshake(contract.OUTCOME_ERROR)
            return
        with self._edges_lock:
            self._edges[instance] = DecodeEdge(instance, identity, comm, hello.pair)
            paired = len(self._edges)
        self.accounts.on_handshake(contract.OUTCOME_OK)
        self.connected.set()
        logger.info(
            "%s: paired with prefill %s rank %d (instance %s, generation %d, transport %s; %d prefill(s) paired)",
            self.name, hello.pair or "?", hello.tp_rank, instance, hello.generation, hello.transport, paired,
        )

    def _await_regions(self, sock: zmq.Socket, identity: bytes, deadline: float) -> Regions:
        while not self.stopped.is_set():
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise TimeoutError("prefill's region table did not arrive before the deadline")
            if not sock.poll(min(left_ms, POLL_MS)):
                continue
            frames = sock.recv_multipart(zmq.NOBLOCK)  # poll said a whole message is there
            if frames[0] != identity:
                self._stash.append(frames)  # another prefill's message: handled once this handshake is done
                continue
            message = decode(frames[1:], self.local_hash)
            if isinstance(message, Regions):
                return message
            raise HandshakeError(f"expected Regions, got {type(message).__name__}")
        raise HandshakeError("stopping")


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
        self.generation, self.pair, self.instance = generation, pair, instance
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
            hello = Hello(self.generation, self.pair, self.tp_rank, self.transport.name, uid, self.instance)
            sock.send_multipart([*encode(hello, self.local_hash), json.dumps(self.factors, sort_keys=True).encode()])
            reply = self._recv(sock, time.monotonic() + HELLO_REPLY_TIMEOUT_SECONDS)
            if reply is None:
                if self.stopped.is_set():
                    self._close_sock()  # a socket left open would make stop()'s context term wait forever
                    return None
                return self._failed(sock, "timeout", "no answer to Hello")
            if isinstance(reply, Refused):
                logger.error("%s: decode %s refused the handshake: %s", self.log_name, self.peer_label, reply.reason)
                return self._failed(sock, "refused", f"refused: {reply.reason}")
            if not isinstance(reply, Accepted):
                return self._failed(sock, contract.OUTCOME_ERROR, f"unexpected {type(reply).__name__}")
            deadline = handshake_deadline(self.hang_timeout_seconds, time.monotonic())
            comm = self.transport.init_pair(uid, RANK_PREFILL, deadline)
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
                            reply = self.on_pull(message)
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
