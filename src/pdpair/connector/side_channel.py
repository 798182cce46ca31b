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
  ZMTP heartbeats bound how long a decode whose host went silent goes unnoticed (DISCONNECT_GRACE_SECONDS)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import zmq

from pdpair import contract
from pdpair.connector.metadata import (
    MAX_MESSAGE_BYTES,
    Message,
)
from pdpair.connector.transports.base import PairComm

# The logger keeps the name it had before this module was renamed: log filters and readers of the logs know it.
logger = logging.getLogger("pdpair.connector.handshake")


POLL_MS = 100  # receive timeout of the side-channel loop: bounds how long stop() waits

# The Hello exchange must answer quickly; init_pair and region registration get the hang timeout.
HELLO_REPLY_TIMEOUT_SECONDS = 5.0

# Longest a side-channel send (or a receive) may block, e.g. when the peer stopped reading and the high-water mark
# is reached. Read when a socket is made.
SEND_TIMEOUT_SECONDS = 5.0

MIN_KEY_BYTES = 32  # config.MIN_SIDE_CHANNEL_KEY_CHARS, as bytes

# What the pair's secret is derived for (metadata.derive_secret): both sides pass it to init_pair, so the tcp data
# connection joins only the peer of this authenticated handshake.
PAIR_SECRET_PURPOSE = "pair"


def bounded_socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
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


class SideChannelThread(threading.Thread):
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


class LogLimit:
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


def quietly(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - cleanup of a failed handshake must not raise
        logger.exception("cleanup after a side-channel handshake failed")


def check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the side-channel key must be at least {MIN_KEY_BYTES} bytes ({contract.ENV_SIDE_CHANNEL_KEY})")
    return key
