"""Prefill's side channel: the DEALER of one prefill TP rank towards one decode (`PrefillSideChannel`): connect with
backoff, the authenticated Hello, pairing, re-pairing when decode goes away, Pulls handed to the worker. The
protocol and its bounds are described in side_channel.py."""

from __future__ import annotations

import json
import logging
import queue
import secrets
import socket
import time
from collections.abc import Callable

import zmq

from pdpair import contract
from pdpair.connector.deadlines import handshake_deadline
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
    PullFailed,
    Refused,
    Regions,
    Welcome,
    decode,
    derive_secret,
    encode,
    proof,
    proof_matches,
    transcript,
)
from pdpair.connector.side_channel import (
    HELLO_REPLY_TIMEOUT_SECONDS,
    PAIR_SECRET_PURPOSE,
    POLL_MS,
    SEND_TIMEOUT_SECONDS,
    HandshakeError,
    RegisterRegions,
    SideChannelThread,
    bounded_socket,
    check_key,
)
from pdpair.connector.transports.base import (
    RANK_PREFILL,
    PairComm,
    PairTransport,
    TransportError,
)

# The logger keeps the name it had before this module was renamed: log filters and readers of the logs know it.
logger = logging.getLogger("pdpair.connector.handshake")


RETRY_INITIAL_SECONDS = 0.2

# Prefill starts beside decode (the operator no longer waits for decode's listener to create it), so it may retry for
# a whole engine cold start; the cap bounds the delay between decode's listener opening and the pairing, which is on
# the path to the pair's first answer (0.5 s on average at a 1 s cap). A refused TCP connect every 0.25 s is cheap
# (no ZMQ socket is made before decode accepts). A retry is logged on attempts 1, 2, 4, 8, ... (every one is counted
# in the metrics).
RETRY_MAX_SECONDS = 0.25

# A decode that disappears: prefill's monitor sees its side channel drop at once when decode's process ends (the
# kernel closes the TCP connection), and within DISCONNECT_GRACE_SECONDS when decode's host goes silent (ZMTP
# heartbeats every HEARTBEAT_INTERVAL_SECONDS, answered by decode's ZMQ I/O thread, never by a Python thread).
# Then that edge's pair closes, which fails its pushes in flight at once; other edges are untouched.
# 30 s, half the default hang timeout: at 5 s, in CI at load 35 on 2 cores, both ranks of a TP = 2 prefill dropped a
# decode that was alive and serving (its I/O thread did not answer in time) and paired again, failing what was in
# flight. A host that really goes silent is still noticed well before the hang timeout.
HEARTBEAT_INTERVAL_SECONDS = 2.0

DISCONNECT_GRACE_SECONDS = 30.0


class PrefillSideChannel(SideChannelThread):
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
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        label = peer_label or (f"[{peer_host}]:{peer_port}" if ":" in peer_host else f"{peer_host}:{peer_port}")
        super().__init__(f"pdpair-sidechannel-prefill-r{tp_rank}-{label}", local_hash, accounts)
        self.log_name = f"pdpair-sidechannel-prefill-r{tp_rank}"
        self.peer_host, self.peer_port, self.tp_rank = peer_host, peer_port, tp_rank
        # The instance names this prefill's edge on decode; a side channel built without one (direct use) gets a random
        # one, so it never replaces another prefill's edge.
        self.generation, self.pair = generation, pair
        self.instance = instance or f"prefill-{secrets.token_hex(8)}"
        self.key = check_key(key)
        self.comm: PairComm | None = None
        self.transport = transport
        self.hang_timeout_seconds = hang_timeout_seconds
        self.factors = factors
        self.register_regions = register_regions
        self.on_pull = on_pull
        self.on_tick = on_tick
        self.on_connected = on_connected
        self.on_lost = on_lost  # the pair ended without a stop (decode went away or stopped reading)
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
                if self.on_lost is not None:
                    try:
                        self.on_lost()
                    except Exception:  # noqa: BLE001 - the edge must go on handshaking
                        logger.exception("%s: handling the lost pair with decode %s failed", self.log_name,
                                         self.peer_label)
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
        self._sock = sock = bounded_socket(self._ctx, zmq.DEALER)
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
