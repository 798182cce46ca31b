"""Decode's side channel against peers that are not the pair's own, with real threads, real ZMQ sockets on loopback
and the real tcp transport: the authenticated Hello (HMAC challenge-response with PDPAIR_SIDE_CHANNEL_KEY), refusals
that reveal nothing of decode, handshakes off the loop thread with their own deadline and cap, the edge cap, bad uids
and region tables, and a loop that stops being reported to readiness. Each test states its cost (2-core box, idle)."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import torch

from pdpair import contract
from pdpair.connector import decode_pairing, side_channel
from pdpair.connector.metadata import (
    BUSY,
    NOT_ACCEPTED,
    Accepted,
    Challenge,
    Hello,
    KvLayout,
    Pull,
    PullDone,
    Refused,
    Regions,
    Welcome,
    compatibility_factors,
    compatibility_hash,
    derive_secret,
    encode,
    proof_matches,
)
from pdpair.connector.pod_server import readiness
from pdpair.connector.decode_side_channel import DecodeSideChannel
from pdpair.connector.prefill_side_channel import PrefillSideChannel
from pdpair.connector.signals import SignalAccounts
from pdpair.connector.transports.base import RANK_PREFILL
from pdpair.connector.transports.tcp import TcpTransport
from devcluster.ports import free_port
from tests.side_channel_support import (
    OTHER_KEY_BYTES,
    TEST_KEY_BYTES,
    SilentListener,
    Stranger,
    answers_hello,
    hello_frames,
    wait_until,
)

FACTORS = compatibility_factors(KvLayout(["l0"], [4096], 32, "torch.float32", 1), "0.32.0")
HASH = compatibility_hash(FACTORS)
HASH_BYTES = HASH.encode()
GENERATION = 5


class CountingTransport(TcpTransport):
    """The real tcp transport, counting init_pair calls (an unauthenticated Hello must never reach one)."""

    def __init__(self) -> None:
        super().__init__()
        self.inits = 0

    def init_pair(self, unique_id, rank, deadline, secret=None):
        self.inits += 1
        return super().init_pair(unique_id, rank, deadline, secret)


class Side:
    def __init__(self, fill: float) -> None:
        self.buffer = torch.full((1024,), fill, dtype=torch.float32)
        self.indices: list[int] = []
        self.peer_indices: list[int] = []
        self.failed: list = []
        self.done: list = []

    def register(self, comm):
        self.indices = [comm.register_region(self.buffer.data_ptr(), 4096)]
        return comm.local_region_table(), self.indices, 1


def make_decode(port: int, side: Side, *, max_edges: int = 64, hang: float = 5.0):
    accounts = SignalAccounts("decode", hang, generation=GENERATION)
    transport = CountingTransport()
    channel = DecodeSideChannel(
        host="127.0.0.1", port=port, tp_rank=0, generation=GENERATION, transport=transport, hang_timeout_seconds=hang,
        local_hash=HASH, factors=FACTORS, key=TEST_KEY_BYTES, register_regions=side.register,
        on_pull_done=side.done.append, on_pull_failed=lambda failed, sender: side.failed.append(failed), on_disconnect=lambda edge, why: None,
        accounts=accounts, max_edges=max_edges,
    )
    return channel, accounts, transport


def make_prefill(port: int, side: Side, *, instance: str = "prefill-a", key: bytes = TEST_KEY_BYTES):
    accounts = SignalAccounts("prefill", 5.0, generation=GENERATION)
    holder: dict = {}

    def on_pull(pull: Pull):
        comm = holder["channel"].comm
        if pull.dst_block_ids:
            comm.put_signal(side.indices[0], 0, side.peer_indices[0], 0, 4096, pull.signal_slot)
            comm.flush(time.monotonic() + 5)
        return PullDone(pull.transfer_id, 4096)

    channel = PrefillSideChannel(
        peer_host="127.0.0.1", peer_port=port, tp_rank=0, generation=GENERATION, pair="p", instance=instance,
        transport=TcpTransport(), hang_timeout_seconds=5.0, local_hash=HASH, factors=FACTORS, key=key,
        register_regions=side.register, on_pull=on_pull, on_tick=lambda: [],
        on_connected=lambda welcome: setattr(side, "peer_indices", welcome.region_indices), accounts=accounts,
    )
    holder["channel"] = channel
    return channel, accounts


def handshakes(accounts: SignalAccounts, outcome: str) -> float:
    labels = {"role": accounts.role, "rank": accounts.rank, "outcome": outcome}
    return accounts.registry.get_sample_value("pdpair_handshakes_total", labels) or 0.0


def pull_flows(decode: DecodeSideChannel, instance: str, slot: int, seconds: float = 5.0) -> float:
    """One Pull on `instance`'s edge lands its signal; returns the seconds it took (raises if it did not)."""
    edge = decode.edge(instance)
    assert edge is not None, f"no edge for {instance}"
    base = edge.comm.read_signal(slot)
    started = time.monotonic()
    decode.post(Pull(f"t-{slot}-{started}", "r", 0, [0], slot, 1), edge)
    edge.comm.wait_signal(slot, base + 1, time.monotonic() + seconds)
    return time.monotonic() - started


@pytest.fixture
def paired():
    """A decode listener with one real prefill (instance prefill-a) paired. About 0.5 s."""
    port = free_port()
    decode_side, prefill_side = Side(0.0), Side(7.0)
    decode, accounts, transport = make_decode(port, decode_side)
    prefill, _ = make_prefill(port, prefill_side)
    decode.start_and_wait()
    prefill.start()
    try:
        assert prefill.connected.wait(15) and decode.connected.wait(5)
        yield decode, accounts, transport, port, decode_side
    finally:
        prefill.stop()
        decode.stop()


def test_wrong_key_is_refused_without_pairing_and_reveals_nothing(paired, caplog):
    """A Hello with a wrong hash and a wrong generation, proved with another pair's key: decode answers a Challenge
    and then `not accepted`, both under the stranger's own hash frame; no reply names decode's hash, generation or
    rank; no transport call is made; the refusal is counted (unauthenticated) and logged locally with decode's values.
    A real prefill with the wrong key is refused the same way. About 1 s."""
    decode, accounts, transport, port, _ = paired
    inits = transport.inits
    their_hash = b"0123456789abcdef"
    with caplog.at_level(logging.WARNING, logger="pdpair"), Stranger(port) as stranger:
        answers, _ = stranger.hello(their_hash, OTHER_KEY_BYTES, generation=GENERATION + 4, instance="prefill-a")
        challenge, refusal = answers
        assert isinstance(challenge, Challenge) and isinstance(refusal, Refused)
        assert refusal.reason == NOT_ACCEPTED
        # Every frame decode sent: the stranger's hash, never decode's, and nothing else about decode.
        stranger.send([*encode(Pull("x", "y", 0, [], 0, 0), their_hash)])
        frames = stranger.recv()
        assert frames[0] == their_hash
    for text in (refusal.reason, frames[1].decode("latin-1")):
        assert HASH not in text and str(GENERATION) not in text and "rank" not in text
    assert transport.inits == inits, "an unauthenticated Hello reached the transport"
    assert handshakes(accounts, "unauthenticated") == 1
    assert "wrong proof of the side-channel key" in caplog.text and f"generation {GENERATION})" in caplog.text
    assert [e.instance for e in decode.edges()] == ["prefill-a"]

    impostor, impostor_accounts = make_prefill(port, Side(1.0), instance="prefill-b", key=OTHER_KEY_BYTES)
    impostor.start()
    try:
        assert wait_until(lambda: handshakes(impostor_accounts, "refused") >= 1, 10)
        assert not impostor.connected.is_set() and [e.instance for e in decode.edges()] == ["prefill-a"]
    finally:
        impostor.stop()
    assert transport.inits == inits


def test_a_hello_naming_a_paired_prefill_without_the_key_leaves_that_edge_serving(paired):
    """The hijack: a Hello with the right hash, generation, rank and transport naming the paired prefill's instance,
    with a random proof (and once with no Proof at all). The edge stays the same object and Pulls keep landing.
    About 1 s."""
    decode, accounts, transport, port, _ = paired
    edge = decode.edge("prefill-a")
    for _ in range(3):
        with Stranger(port) as stranger:
            uid = json.dumps({"host": "127.0.0.1", "port": free_port(), "token": 7}).encode()
            answers, _ = stranger.hello(HASH_BYTES, None, generation=GENERATION, unique_id=uid, instance="prefill-a")
            assert isinstance(answers[-1], Refused) and answers[-1].reason == NOT_ACCEPTED
        with Stranger(port) as stranger:  # a Hello and no Proof: a Challenge, and nothing changes
            hello = Hello(GENERATION, "p", 0, "tcp", uid, "prefill-a", b"n" * 32)
            stranger.send([*encode(hello, HASH), b"{}"])
            assert isinstance(stranger.recv_message(HASH_BYTES), Challenge)
        assert decode.edge("prefill-a") is edge
        assert pull_flows(decode, "prefill-a", slot=1) < 2.0
    assert transport.inits == 1  # the real prefill's only


def test_decode_that_cannot_prove_the_key_is_not_paired_with():
    """Mutual: a listener on decode's address that challenges and then accepts with a proof it cannot make (it has
    no key) is not paired with; prefill never calls init_pair's accept for it. About 1 s."""
    import secrets

    import zmq

    port = free_port()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    prefill, accounts = make_prefill(port, Side(1.0))
    prefill.start()
    try:
        assert router.poll(10000)
        identity, hash_frame, _body, _factors = router.recv_multipart()
        router.send_multipart([identity, *encode(Challenge(secrets.token_bytes(32)), hash_frame)])
        assert router.poll(5000)
        identity, hash_frame, _proof = router.recv_multipart()
        router.send_multipart([identity, *encode(Accepted(secrets.token_bytes(32)), hash_frame)])
        assert wait_until(lambda: handshakes(accounts, "refused") >= 1, 5)
        assert not prefill.connected.is_set()
    finally:
        prefill.stop()
        router.close(linger=0)
        ctx.term()


def test_a_stalled_handshake_does_not_stall_pulls_and_extra_ones_are_refused_busy(paired, monkeypatch):
    """Holders of the key whose uids point at a listener that accepts and never answers: four handshakes hang on
    their handshake threads until HANDSHAKE_SECONDS (3 s here), a fifth is refused busy, and meanwhile every Pull on
    the existing edge lands in well under a second; afterwards each stalled one is refused naming why and the
    listener answers. About 4 s."""
    monkeypatch.setattr(decode_pairing, "HANDSHAKE_SECONDS", 3.0)
    decode, accounts, transport, port, _ = paired
    silent = SilentListener()
    strangers = [Stranger(port, timeout=10) for _ in range(decode_pairing.MAX_CONCURRENT_HANDSHAKES + 1)]
    try:
        results: list = [None] * len(strangers)

        def attack(k: int) -> None:
            results[k] = strangers[k].hello(HASH_BYTES, TEST_KEY_BYTES, generation=GENERATION,
                                            unique_id=silent.uid(), instance=f"slow-{k}")[0]

        threads = [threading.Thread(target=attack, args=(k,)) for k in range(len(strangers))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(5)
        accepted = [r for r in results if isinstance(r[-1], Accepted)]
        busy = [r for r in results if isinstance(r[-1], Refused)]
        assert len(accepted) == decode_pairing.MAX_CONCURRENT_HANDSHAKES and len(busy) == 1
        assert busy[0][-1].reason.startswith("busy")
        assert wait_until(lambda: len(silent.accepted) >= 1, 2), "decode never dialled the silent listener"
        slowest = max(pull_flows(decode, "prefill-a", slot=s) for s in range(5))
        assert slowest < 1.0, f"a Pull took {slowest:.2f}s while handshakes were stalled"
        for stranger, result in zip(strangers, results):
            if isinstance(result[-1], Accepted):
                refusal = stranger.recv_message(HASH_BYTES, timeout=5)
                assert isinstance(refusal, Refused) and "failed" in refusal.reason
        assert answers_hello(port, HASH_BYTES)
        assert handshakes(accounts, "busy") == 1 and handshakes(accounts, contract.OUTCOME_ERROR) == 4
        assert [e.instance for e in decode.edges()] == ["prefill-a"]
    finally:
        for stranger in strangers:
            stranger.close()
        silent.close()


def test_a_stranger_that_never_reads_its_answers_stalls_nothing(paired):
    """A stranger floods Hellos and never reads a Challenge, with as little receive room as it can ask for: decode's
    queue for it fills after about a thousand answers, and every further answer is dropped at once instead of holding
    the loop for SNDTIMEO (5 s each, which stalled every edge's Pulls for as long as the flood went on). Meanwhile a
    Pull on the paired edge lands and a fresh Hello is answered, each in under a second (with every answer waiting
    for room, the first Pull waited out its 5 s deadline). About 3 s."""
    decode, _, _, port, _ = paired
    deaf = Stranger(port, deaf=True)
    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        import zmq

        frames = hello_frames(b"0123456789abcdef")
        while not stop.is_set():
            try:
                deaf.sock.send_multipart(frames, zmq.NOBLOCK)
                sent[0] += 1
            except zmq.Again:
                time.sleep(0.001)

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        assert wait_until(lambda: sent[0] >= 3000, 10), f"only {sent[0]} Hellos sent"
        slowest = 0.0
        for slot in range(8):
            slowest = max(slowest, pull_flows(decode, "prefill-a", slot=slot))
            started = time.monotonic()
            assert answers_hello(port, HASH_BYTES, timeout=5)
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.1)
        assert slowest < 1.0, f"a Pull or a Hello took {slowest:.2f}s while a stranger flooded ({sent[0]} Hellos)"
    finally:
        stop.set()
        flooder.join(5)
        deaf.close()


@pytest.mark.parametrize("uid", [
    {"host": "127.0.0.1", "port": 1234, "token": -1},
    {"host": "127.0.0.1", "port": 1234, "token": 1 << 64},
    {"host": "127.0.0.1", "port": 70000, "token": 1},
    {"host": "127.0.0.1", "port": 0, "token": 1},
    {"host": "", "port": 1234, "token": 1},
    {"host": 7, "port": 1234, "token": 1},
    {"port": 1234, "token": 1},
    "not json",
])
def test_a_bad_uid_leaves_the_listener_accepting(paired, uid):
    """tcp uids outside what the native core takes (the token of the listener kill among them), with and without the
    key: without it `not accepted`; with it a refusal naming the uid; the listener answers, no transport call is
    made, and the paired prefill's Pulls still land. About 0.5 s each."""
    decode, accounts, transport, port, _ = paired
    raw = uid.encode() if isinstance(uid, str) else json.dumps(uid).encode()
    for key in (None, TEST_KEY_BYTES):
        with Stranger(port) as stranger:
            answers, _ = stranger.hello(HASH_BYTES, key, generation=GENERATION, unique_id=raw, instance="prefill-a")
        assert isinstance(answers[-1], Refused)
        assert answers[-1].reason == NOT_ACCEPTED if key is None else "malformed unique id" in answers[-1].reason
    assert transport.inits == 1
    assert answers_hello(port, HASH_BYTES)
    assert pull_flows(decode, "prefill-a", slot=2) < 2.0


def test_regions_of_the_wrong_size_refuse_that_handshake_only(paired):
    """A key holder that really joins the pair (a tcp rank 0 of its own) and then sends a region table of the wrong
    size, then one that is not a table: each handshake is refused naming why, the listener lives on, and the
    paired prefill's edge is untouched. About 1 s."""
    decode, accounts, transport, port, _ = paired
    for regions in (Regions(json.dumps({"regions": 1}).encode(), [0, 1, 2]), Regions(b"\xff" * 40, [0])):
        ours = TcpTransport()
        uid = ours.create_unique_id()
        joined: list = []
        with Stranger(port) as stranger:
            answers, said = stranger.hello(HASH_BYTES, TEST_KEY_BYTES, generation=GENERATION, unique_id=uid,
                                           instance="prefill-z")
            assert isinstance(answers[-1], Accepted)
            secret = derive_secret(TEST_KEY_BYTES, said, side_channel.PAIR_SECRET_PURPOSE)
            joined.append(ours.init_pair(uid, RANK_PREFILL, time.monotonic() + 5, secret))
            stranger.send(encode(regions, HASH))
            refusal = stranger.recv_message(HASH_BYTES)
        assert isinstance(refusal, Refused) and "pair setup failed" in refusal.reason
        for comm in joined:
            comm.close()
        ours.close()
    assert answers_hello(port, HASH_BYTES)
    assert [e.instance for e in decode.edges()] == ["prefill-a"]
    assert pull_flows(decode, "prefill-a", slot=3) < 2.0


def test_the_edge_cap_refuses_a_further_prefill_and_keeps_the_paired_one():
    """max_edges=1: a second prefill instance is refused naming the cap (it holds the key, so it may be told), the
    first keeps serving, and the same instance may still pair again (its edge is replaced, not added). About 2 s."""
    port = free_port()
    decode, accounts, _ = make_decode(port, Side(0.0), max_edges=1)
    first, _ = make_prefill(port, Side(1.0), instance="prefill-a")
    second, second_accounts = make_prefill(port, Side(2.0), instance="prefill-b")
    again, _ = make_prefill(port, Side(3.0), instance="prefill-a")
    decode.start_and_wait()
    first.start()
    try:
        assert first.connected.wait(15)
        second.start()
        assert wait_until(lambda: handshakes(second_accounts, "refused") >= 1, 10)
        assert not second.connected.is_set() and handshakes(accounts, "busy") >= 1
        second.stop()
        assert [e.instance for e in decode.edges()] == ["prefill-a"]
        assert pull_flows(decode, "prefill-a", slot=4) < 2.0
        old = decode.edge("prefill-a")
        first.stop()
        again.start()
        # Decode sends Welcome before it installs the new edge: wait for the edge, not only for prefill's pairing.
        assert again.connected.wait(15) and wait_until(lambda: decode.edge("prefill-a") not in (None, old), 5)
        assert len(decode.edges()) == 1
    finally:
        for channel in (first, second, again):
            channel.stop()
        decode.stop()


def test_a_loop_that_stops_is_reported_to_readiness_at_once(monkeypatch):
    """A bug that escapes the loop: `alive` turns False, `error` says why, and decode's /readyz answer
    (metrics.readiness) is 503 naming the listener at once. About 0.3 s."""
    port = free_port()
    decode, accounts, _ = make_decode(port, Side(0.0))
    assert readiness(accounts)[0] is True
    decode.start_and_wait()
    assert decode.alive
    monkeypatch.setattr(decode, "_expire_pending", lambda: (_ for _ in ()).throw(RuntimeError("a bug")))
    try:
        assert wait_until(lambda: not decode.alive, 3)
        assert "a bug" in repr(decode.error)
        ready, body = readiness(accounts)
        assert not ready and body["status"] == "side-channel listener stopped"
        assert "a bug" in body["listener_failure"]["0"]
        assert accounts.registry.get_sample_value("pdpair_listener_ready", {"role": "decode", "rank": "0"}) == 0
    finally:
        decode.stop()


def test_the_stop_listener_test_knob_ends_the_loop_as_a_bug_would(tmp_path):
    """TEST ONLY knob (testing_knobs.StopListenerKnob), the way the real-node tier stops a real decode's listener:
    absent, the loop serves; once the file appears, within a poll the loop leaves as an escaped exception would:
    `alive` False, /readyz 503 naming the knob, the port refuses connections. About 1 s."""
    import socket

    knob = tmp_path / "stop-listener"
    port = free_port()
    accounts = SignalAccounts("decode", 5.0, generation=GENERATION)
    side = Side(0.0)
    decode = DecodeSideChannel(
        host="127.0.0.1", port=port, tp_rank=0, generation=GENERATION, transport=TcpTransport(),
        hang_timeout_seconds=5.0, local_hash=HASH, factors=FACTORS, key=TEST_KEY_BYTES,
        register_regions=side.register, on_pull_done=side.done.append, on_pull_failed=lambda failed, sender: side.failed.append(failed),
        on_disconnect=lambda edge, why: None, accounts=accounts, test_stop_listener_file=str(knob),
    )
    decode.start_and_wait()
    try:
        time.sleep(0.6)  # more than one poll of the knob: absent, nothing happens
        assert decode.alive and answers_hello(port, HASH_BYTES)
        knob.write_text("")
        assert wait_until(lambda: not decode.alive, 5)
        ready, body = readiness(accounts)
        assert not ready and "test knob" in body["listener_failure"]["0"]

        def refused() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return False
            except ConnectionRefusedError:
                return True

        assert wait_until(refused, 3)
    finally:
        decode.stop()


def test_a_stopped_listener_is_not_a_failure():
    """stop() (the engine shutting down) is not reported as a failure. About 0.2 s."""
    decode, accounts, _ = make_decode(free_port(), Side(0.0))
    decode.start_and_wait()
    decode.stop()
    assert accounts.listener_failure is None and decode.error is None


def test_garbage_from_a_paired_prefill_does_not_end_the_loop(paired):
    """The paired prefill's connection is not special: garbage, a Pull in the wrong direction and a Welcome from it
    are logged and ignored; its edge keeps serving. About 0.5 s."""
    decode, accounts, _, port, _ = paired
    with Stranger(port) as stranger:
        for frames in ([b"x"], [HASH_BYTES, b"\xc1"], [HASH_BYTES, b"\x92\x01\x02"], encode(Welcome(b"", [], 0), HASH),
                       encode(PullDone("nobody", 1), HASH), [b"\xff" * 70, b"\x00"]):
            stranger.send(frames)
    assert answers_hello(port, HASH_BYTES)
    assert pull_flows(decode, "prefill-a", slot=5) < 2.0
    assert decode.alive


def test_proofs_are_bound_to_their_role():
    """Decode's proof over a transcript is not prefill's (a reflected proof is refused). Instant."""
    from pdpair.connector.metadata import proof, transcript

    said = transcript(HASH_BYTES, b"body", b"n" * 32)
    assert proof_matches(TEST_KEY_BYTES, "prefill", said, proof(TEST_KEY_BYTES, "prefill", said))
    assert not proof_matches(TEST_KEY_BYTES, "decode", said, proof(TEST_KEY_BYTES, "prefill", said))
    assert not proof_matches(OTHER_KEY_BYTES, "prefill", said, proof(TEST_KEY_BYTES, "prefill", said))
    assert BUSY.startswith("busy") and NOT_ACCEPTED == "not accepted"
