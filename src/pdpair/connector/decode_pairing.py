"""Decode's side of pairing with one prefill: a Hello answered with a Challenge (`ChallengedHello` until its Proof), the Proof
checked, an authenticated Hello checked against this rank (compatibility hash, generation, transport, rank, unique
id, busy, the edge cap) and its pair set up on a handshake thread of its own (`PairingHandshake`: init_pair, registering
the regions, prefill's Regions), then Welcome and the new `DecodeEdge`. The protocol, its authentication and its
bounds are described in side_channel.py. Separate from decode_side_channel.py, whose loop owns the socket and routes
Pulls on the edges this module installs; `DecodePairing` is a part of `DecodeSideChannel` (its state lives there)."""

from __future__ import annotations

import json
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field

import zmq

from pdpair import contract
from pdpair.connector.metadata import (
    NONCE_BYTES,
    Accepted,
    Challenge,
    Hello,
    Proof,
    Refused,
    Regions,
    Welcome,
    derive_secret,
    proof,
    proof_matches,
    transcript,
)
from pdpair.connector.side_channel import (
    HELLO_REPLY_TIMEOUT_SECONDS,
    PAIR_SECRET_PURPOSE,
    POLL_MS,
    HandshakeError,
    quietly,
)
from pdpair.connector.transports.base import RANK_DECODE, PairComm, TransportError

# The same logger as decode_side_channel.py's: log filters and readers of the logs know its name.
logger = logging.getLogger("pdpair.connector.handshake")

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
class ChallengedHello:
    """A Hello answered with a Challenge, waiting for its Proof (decode's loop thread only)."""

    hello: Hello
    peer_hash: str
    hash_frame: bytes  # the peer's own hash frame, echoed in every answer before Welcome
    peer_factors: str
    transcript: bytes
    expires: float


@dataclass(eq=False)
class PairingHandshake:
    """An authenticated Hello whose pair a handshake thread is setting up. The loop thread hands it prefill's Regions
    (`regions`, at most one); the thread hands its result back through `DecodeSideChannel._call_on_loop`."""

    identity: bytes
    hello: Hello
    hash_frame: bytes
    transcript: bytes
    deadline: float
    regions: queue.Queue = field(default_factory=lambda: queue.Queue(maxsize=1))


class DecodePairing:
    """Mixed into DecodeSideChannel: Hello, Proof, the checks of an authenticated Hello, the handshake thread and its end."""

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
        self._pending[identity] = ChallengedHello(
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

    def _authenticated(self, sock: zmq.Socket, identity: bytes, pending: ChallengedHello) -> None:
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
        job = PairingHandshake(identity, hello, pending.hash_frame, pending.transcript, deadline)
        self._handshakes[identity] = job
        thread = threading.Thread(target=self._set_up_pair, args=(job,), daemon=True,
                                  name=f"pdpair-handshake-decode-r{self.tp_rank}")
        try:
            thread.start()
        except Exception as exc:  # noqa: BLE001 - e.g. no thread left in the process: this prefill only is refused
            del self._handshakes[identity]
            self._refuse(sock, identity, pending.hash_frame, f"cannot start a handshake thread: {exc}", outcome="error")

    # --- a handshake thread ----------------------------------------------------------------------------
    def _set_up_pair(self, job: PairingHandshake) -> None:
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

    def _await_regions(self, job: PairingHandshake) -> Regions:
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
    def _handshake_failed(self, sock: zmq.Socket, job: PairingHandshake, why: str) -> None:
        self._handshakes.pop(job.identity, None)
        self._refuse(sock, job.identity, job.hash_frame, why, outcome=contract.OUTCOME_ERROR)

    def _handshake_done(self, sock: zmq.Socket, job: PairingHandshake, comm: PairComm, table: bytes, indices: list[int],
                        num_blocks: int) -> None:
        self._handshakes.pop(job.identity, None)
        hello = job.hello
        if self.stopped.is_set() or self._send(sock, job.identity, Welcome(table, indices, num_blocks, self.api_port)) is not None:
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
