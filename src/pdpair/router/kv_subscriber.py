"""Follows one engine's KV events (vLLM's ZMQ publisher: a PUB socket, and a ROUTER socket that replays its recent
batches) into the router's KvBlockIndex (kv_blocks.py), with gap detection and resync.

Each published message is three frames: topic, an 8-byte big-endian sequence number, the msgpack batch. The
sequence numbers say what was missed (a PUB socket drops what a slow subscriber cannot take, and a reconnect loses
what was sent meanwhile):
- the next number: applied;
- a number already seen: skipped (a replay and the live stream overlap); 0 after a higher one: the engine restarted
  (its cache is empty), so its blocks are forgotten and the batch applied;
- a gap: the missing batches are asked of the replay socket (from the first missing number) and applied in order,
  within REPLAY_SECONDS; should the replay not cover them (the engine's buffer moved on, no replay endpoint, no
  answer in time), the engine's blocks are forgotten (resync) and its index rebuilds from the events that follow.
  Until then that engine matches nothing, which only costs affinity, never an answer;
- the first message a router sees is a gap from nothing: the replay brings what the engine's buffer still holds.

Everything that arrives is hostile until it holds together: a message over MAX_MESSAGE_BYTES is dropped by ZMQ before
it is read (the connection is reset), a malformed message is counted and skipped, a batch that does not decode (or
a removal in it that does not) forgets the engine's blocks (resync: the index must never claim a block the engine
lost), and nothing a message holds can end the loop: only the router's shutdown (cancel) does. The loop yields
to the router's requests after every message. The replay socket is asked within REPLAY_SECONDS, read within it and
at most REPLAY_MAX_MESSAGES messages a request, and its batches must follow one another (a hole: resync). A live
number at or below the last one applied can only be a restarted engine (a replay never applies past the live
message that asked for it), whether or not its 0 was seen. ZMTP heartbeats (HEARTBEAT_SECONDS) find an engine that
vanished without closing its connection, and ZMQ reconnects; the numbers then say what was missed.

The endpoint is the engine's `--kv-events-config` `endpoint` as this router reaches it (tcp://HOST:PORT); its replay
endpoint is the same host at PORT + 1 (`replay_endpoint`), pdpair's convention.
"""

from __future__ import annotations

import asyncio
import logging
import random
import urllib.parse
from collections.abc import Callable

import zmq
import zmq.asyncio

from pdpair.router.kv_blocks import KvBlockIndex, decode_batch

logger = logging.getLogger("pdpair.router.kv_events")

MAX_MESSAGE_BYTES = 4 * 2**20  # a batch is one engine step's events: kilobytes, rarely more than a few hundred
MAX_SEQ = 2**63 - 1  # a number above it cannot be a publisher's (and wanted + 1 must fit the 8-byte request)
HEARTBEAT_SECONDS = 5.0  # a ZMTP ping this often; no answer within 3 of them: the connection is dropped and remade
REPLAY_SECONDS = 2.0
REPLAY_MAX_MESSAGES = 100_000  # vLLM's default replay buffer holds 10,000 batches
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker (vLLM's ZmqEventPublisher.END_SEQ)
RECONNECT_MS = 500  # ZMQ's reconnect interval to an engine that is not up yet or went away
STATS = ("applied", "gap", "replayed", "resync", "restart", "malformed", "dropped_by_test")


def replay_endpoint(endpoint: str) -> str:
    """tcp://HOST:PORT -> tcp://HOST:PORT+1 (a ValueError for anything else)."""
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None or parts.path or not 0 < parts.port < 65535:
        raise ValueError(f"a KV events endpoint must be tcp://HOST:PORT with PORT 1..65534, got {endpoint!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"tcp://{host}:{parts.port + 1}"


class KvEventSubscriber:
    """One engine's events into `index` under `url` (the engine's base URL, the key the router's choice uses)."""

    def __init__(self, url: str, endpoint: str, index: KvBlockIndex, topic: str = "",
                 context: zmq.asyncio.Context | None = None, drop_fraction: float = 0.0,
                 rng: random.Random | None = None, on_event: Callable[[str], None] | None = None) -> None:
        self.url, self.endpoint, self.index = url, endpoint, index
        self.replay = replay_endpoint(endpoint)
        self.topic = topic.encode()
        self.last: int | None = None  # the last sequence number applied
        self.stats = {name: 0 for name in STATS}
        self._context = context or zmq.asyncio.Context.instance()
        self._drop = drop_fraction  # TEST ONLY (testing_knobs.py): this share of live messages is thrown away
        self._rng = rng or random.Random(0)
        self._on_event = on_event  # for tests: called with each stats name as it is counted
        self._task: asyncio.Task | None = None
        self._socket: zmq.asyncio.Socket | None = None

    @property
    def in_sync(self) -> bool:
        """Whether the index holds this engine's blocks as its events say (False until a first batch applied)."""
        return self.last is not None

    def start(self) -> None:
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._socket.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
        self._socket.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_SECONDS * 1000))
        self._socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(3 * HEARTBEAT_SECONDS * 1000))
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._socket.connect(self.endpoint)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"pdpair-kv-events {self.url}")

    async def stop(self) -> None:
        """Never raises: the router's other cleanups run after it."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001
                logger.exception("KV events of %s: the subscriber had ended with an error", self.url)
            self._task = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def _count(self, name: str, n: int = 1) -> None:
        self.stats[name] += n
        if self._on_event is not None:
            self._on_event(name)

    async def _run(self) -> None:
        assert self._socket is not None
        while True:
            try:
                frames = await self._socket.recv_multipart()
                if self._drop and self._rng.random() < self._drop:
                    self._count("dropped_by_test")
                    continue
                await self._on_message(frames)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001  a bug or a socket error must not end the engine's subscription
                logger.exception("KV events of %s: a message could not be handled; skipped", self.url)
                self._count("malformed")
                await asyncio.sleep(RECONNECT_MS / 1000)
            # recv_multipart returns at once while messages are queued: without this the backlog would hold the
            # router's event loop from its requests
            await asyncio.sleep(0)

    def _parse(self, frames: list[bytes]) -> tuple[int, bytes] | None:
        if len(frames) != 3 or len(frames[1]) != 8 or frames[0] != self.topic or \
                int.from_bytes(frames[1], "big") > MAX_SEQ:
            self._count("malformed")
            return None
        return int.from_bytes(frames[1], "big"), frames[2]

    def _resync(self) -> None:
        self._count("resync")
        self.index.reset(self.url)

    async def _on_message(self, frames: list[bytes]) -> None:
        parsed = self._parse(frames)
        if parsed is None:
            return
        seq, payload = parsed
        if self.last is not None and seq <= self.last:
            # the engine restarted (its numbering, and its cache, start again): forget, then follow it as new
            self._count("restart")
            self.index.reset(self.url)
            self.last = None
        if seq != (0 if self.last is None else self.last + 1):
            self._count("gap")
            wanted = 0 if self.last is None else self.last + 1
            if not await self._replay_from(wanted, seq):
                self._resync()
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last = seq
        try:
            events, skipped, lost_removal = decode_batch(payload)
        except ValueError:
            self._count("malformed")
            self._resync()  # what it removed is unknown
            return
        if skipped:
            self.index.stats["unknown"] += skipped
        if lost_removal:
            self._resync()
        self.index.apply(self.url, events)
        self._count("applied")

    async def _replay_from(self, wanted: int, until: int) -> bool:
        """Asks the replay socket for every batch from `wanted` and applies those before `until` (the live message
        that showed the gap; the caller applies it). Should the replay begin after `wanted` (the engine's buffer moved
        on), the engine's blocks are forgotten first (resync) and the replayed batches rebuild them. False when no
        complete replay came within REPLAY_SECONDS: the caller resyncs."""
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)  # never this side's queue that drops a replayed batch (the sender's may)
        first = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REPLAY_SECONDS
        try:
            dealer.connect(self.replay)
            await asyncio.wait_for(dealer.send_multipart((b"", wanted.to_bytes(8, "big"))), REPLAY_SECONDS)
            for _ in range(REPLAY_MAX_MESSAGES):
                left = deadline - loop.time()
                if left <= 0 or not await dealer.poll(timeout=left * 1000):
                    break
                # from the publisher's ROUTER socket: (b"", topic, seq, batch), and (b"", b"", END_SEQ, b"") to end
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or frames[0] != b"":
                    self._count("malformed")
                    continue
                if frames[2] == END_SEQ:  # complete when every batch before the live one is applied now
                    if self.last == until - 1:
                        return True
                    break
                parsed = self._parse(frames[1:])
                if parsed is None:
                    continue
                seq, payload = parsed
                if first:
                    first = False
                    if seq > wanted:  # what was missed is no longer in the engine's buffer
                        logger.warning("KV events of %s: the replay starts at %d, after %d: resync", self.url, seq,
                                       wanted)
                        self._resync()
                        self.last = None  # rebuilt from this one on
                if seq >= until or (self.last is not None and seq <= self.last):
                    continue  # the live stream has it (or it was applied already)
                if self.last is not None and seq != self.last + 1:  # a hole: the publisher dropped a replayed one
                    break
                self._apply(seq, payload)
                self._count("replayed")
                await asyncio.sleep(0)  # the router's requests go on while a long replay is applied
        except asyncio.TimeoutError:
            pass
        finally:
            dealer.close(linger=0)
        logger.warning("KV events of %s: no complete replay from %d within %.1f s", self.url, wanted, REPLAY_SECONDS)
        return False
