"""Fuzz decode's side channel (hypothesis) with real ZMQ sockets on loopback against a real DecodeSideChannel on the
tcp transport: raw frames, every message type with fields of any type and size under any hash frame, and whole
handshakes (Hello, Challenge, Proof with or without the key) whose uids are out of range or point at a closed port.

After every case the listener still answers a Hello with a Challenge; every hundred cases a real PrefillSideChannel
still pairs (and a Pull on its edge lands). Cost: 2000 cases and 20 real pairings in 11.5-20.7 s (14-28 s with
pytest's start) on the shared 2-core box at load average 7-10. Derandomized: every run tries the same cases. CASES:
2000 in CI, 10000 (and 100 pairings) with PDPAIR_FULL_PROPERTY_TESTS=1 (tests/property_counts.py)."""

from __future__ import annotations

import json
import time

import msgspec
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdpair.connector.metadata import (
    Challenge,
    Hello,
    KvLayout,
    Proof,
    Pull,
    PullDone,
    compatibility_factors,
    compatibility_hash,
    encode,
    proof,
    transcript,
)
from pdpair.connector.decode_side_channel import DecodeSideChannel
from pdpair.connector.prefill_side_channel import PrefillSideChannel
from pdpair.connector.signals import SignalAccounts
from pdpair.connector.transports.tcp import TcpTransport
from devcluster.ports import free_port
from tests.property_counts import cases
from tests.side_channel_support import OTHER_KEY_BYTES, TEST_KEY_BYTES

CASES = cases(ci=2000, full=10000)
PAIR_EVERY = 100
FACTORS = compatibility_factors(KvLayout(["l0"], [4096], 32, "torch.float32", 1), "0.32.0")
HASH = compatibility_hash(FACTORS)
HASH_BYTES = HASH.encode()
GENERATION = 2
TAGS = ("hello", "challenge", "proof", "accepted", "regions", "welcome", "refused", "pull", "pull_done", "pull_failed")
FIELDS = ("generation", "pair", "tp_rank", "transport", "unique_id", "instance", "nonce", "mac", "proof", "table",
          "region_indices", "num_blocks", "reason", "transfer_id", "remote_request_id", "first_block", "dst_block_ids",
          "signal_slot", "expected_signals", "nbytes")

anything = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(allow_nan=True),
    st.text(max_size=40), st.binary(max_size=300), st.lists(st.integers(-5, 1 << 33), max_size=6),
    st.dictionaries(st.text(max_size=5), st.integers(-1000, 1000), max_size=3),
)
hash_frames = st.one_of(st.sampled_from([HASH_BYTES, b"", b"0" * 16]), st.binary(max_size=80))
message_bodies = st.builds(
    lambda tag, fields: msgspec.msgpack.encode({"type": tag, **fields}),
    st.sampled_from(TAGS), st.dictionaries(st.sampled_from(FIELDS), anything, max_size=8),
)
raw_frames = st.lists(st.binary(max_size=600), min_size=1, max_size=5)
typed_frames = st.builds(lambda h, b, extra: [h, b, *extra], hash_frames, message_bodies,
                         st.lists(st.binary(max_size=100), max_size=2))


def uids(closed_port: int):
    """tcp uids: well-formed ones that point at a closed port, and every way of being out of range or malformed."""
    fields = st.fixed_dictionaries({
        "host": st.one_of(st.sampled_from(["127.0.0.1", "", " ", "\x00", "a" * 300]), st.integers(), st.none()),
        "port": st.one_of(st.sampled_from([closed_port, 0, -1, 65536, 70000, 1 << 40]), st.text(max_size=3)),
        "token": st.one_of(st.integers(-(1 << 70), 1 << 70), st.sampled_from([-1, 0, (1 << 64) - 1, 1 << 64])),
    })
    return st.one_of(fields.map(lambda d: json.dumps(d).encode()), st.binary(max_size=300))


def handshakes(closed_port: int):
    """(Hello fields, which proof): the Hello is well-typed so decode challenges it; the Proof is made with the pair's
    key (the authenticated paths: checks, bad uids, handshake threads), another key, or random bytes."""
    hello = st.fixed_dictionaries({
        "generation": st.sampled_from([GENERATION, GENERATION + 1, 0]),
        "tp_rank": st.sampled_from([0, 1, 7]),
        "transport": st.sampled_from(["tcp", "flagcx", ""]),
        "unique_id": uids(closed_port),
        "instance": st.from_regex(r"[A-Za-z0-9_.:\-]{1,20}", fullmatch=True),
        "pair": st.text(max_size=20),
        "hash": st.sampled_from([HASH_BYTES, b"0123456789abcdef"]),
    })
    return st.tuples(hello, st.sampled_from(["key", "other", "random", "none"]))


class Fuzzer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.ctx = zmq.Context()
        self.probe = self._socket()
        self.cases = 0
        self.pairings = 0

    def _socket(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 2000)
        sock.connect(f"tcp://127.0.0.1:{self.port}")
        return sock

    def send_all(self, sends: list[list[bytes]]) -> None:
        sock = self._socket()
        try:
            for frames in sends:
                sock.send_multipart(frames)
        finally:
            sock.close(linger=0)

    def handshake(self, fields: dict, which: str) -> None:
        sock = self._socket()
        try:
            hello = Hello(fields["generation"], fields["pair"], fields["tp_rank"], fields["transport"],
                          fields["unique_id"], fields["instance"], b"n" * 32)
            frames = encode(hello, fields["hash"])
            sock.send_multipart([*frames, b"{}"])
            if which == "none" or not sock.poll(2000):
                return
            reply = msgspec.msgpack.decode(sock.recv_multipart()[1])
            if reply.get("type") != "challenge":
                return
            said = transcript(frames[0], frames[1], Challenge(reply["nonce"]).nonce)
            key = {"key": TEST_KEY_BYTES, "other": OTHER_KEY_BYTES}.get(which)
            mac = proof(key, "prefill", said) if key else b"r" * 32
            sock.send_multipart(encode(Proof(mac), fields["hash"]))
            sock.poll(2000)  # Accepted or Refused; a handshake thread may go on after this socket is gone
        finally:
            sock.close(linger=0)

    def answers(self) -> bool:
        hello = Hello(GENERATION, "p", 0, "tcp", b"{}", "probe", b"p" * 32)
        self.probe.send_multipart([*encode(hello, HASH), b"{}"])
        if not self.probe.poll(5000):
            return False
        reply = msgspec.msgpack.decode(self.probe.recv_multipart()[1])
        return reply.get("type") == "challenge"

    def close(self) -> None:
        self.probe.close(linger=0)
        self.ctx.term()


def real_prefill_pairs_and_pulls(port: int, decode: DecodeSideChannel) -> None:
    buffer = torch.full((1024,), 3.0)
    registered: dict = {}

    def register(comm):
        registered["indices"] = [comm.register_region(buffer.data_ptr(), 4096)]
        return comm.local_region_table(), registered["indices"], 1

    holder: dict = {}

    def on_pull(pull: Pull):
        comm = holder["channel"].comm
        comm.put_signal(registered["indices"][0], 0, holder["peer"][0], 0, 4096, pull.signal_slot)
        comm.flush(time.monotonic() + 5)
        return PullDone(pull.transfer_id, 4096)

    prefill = PrefillSideChannel(
        peer_host="127.0.0.1", peer_port=port, tp_rank=0, generation=GENERATION, pair="p", instance="prefill-fuzz",
        transport=TcpTransport(), hang_timeout_seconds=5.0, local_hash=HASH, factors=FACTORS, key=TEST_KEY_BYTES,
        register_regions=register, on_pull=on_pull, on_tick=lambda: [],
        on_connected=lambda welcome: holder.__setitem__("peer", welcome.region_indices),
        accounts=SignalAccounts("prefill", 5.0, generation=GENERATION),
    )
    holder["channel"] = prefill
    old = decode.edge("prefill-fuzz")
    prefill.start()
    try:
        assert prefill.connected.wait(15), "a real prefill no longer pairs"
        deadline = time.monotonic() + 5
        while decode.edge("prefill-fuzz") in (None, old) and time.monotonic() < deadline:
            time.sleep(0.01)
        edge = decode.edge("prefill-fuzz")
        assert edge not in (None, old), "decode did not install the new edge"
        base = edge.comm.read_signal(0)
        decode.post(Pull(f"fuzz-{time.monotonic()}", "r", 0, [0], 0, 1), edge)
        edge.comm.wait_signal(0, base + 1, time.monotonic() + 5)
    finally:
        prefill.stop()


def test_fuzzed_peers_never_stop_the_listener():
    """See the module docstring: CASES cases, the listener answers after each, a real prefill pairs every
    PAIR_EVERY."""
    port, closed_port = free_port(), free_port()
    accounts = SignalAccounts("decode", 5.0, generation=GENERATION)
    buffer = torch.zeros(1024)

    def register(comm):  # the region first: the table announces how many there are
        indices = [comm.register_region(buffer.data_ptr(), 4096)]
        return comm.local_region_table(), indices, 1

    decode = DecodeSideChannel(
        host="127.0.0.1", port=port, tp_rank=0, generation=GENERATION, transport=TcpTransport(),
        hang_timeout_seconds=5.0, local_hash=HASH, factors=FACTORS, key=TEST_KEY_BYTES,
        register_regions=register,
        on_pull_done=lambda done: None, on_pull_failed=lambda failed, sender: None, on_disconnect=lambda edge, why: None,
        accounts=accounts,
    )
    decode.start_and_wait()
    fuzzer = Fuzzer(port)
    started = time.monotonic()
    try:
        @settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=st.one_of(
            st.lists(st.one_of(raw_frames, typed_frames), min_size=1, max_size=3).map(lambda sends: ("send", sends)),
            handshakes(closed_port).map(lambda h: ("handshake", h)),
        ))
        def one_case(case):
            kind, payload = case
            if kind == "send":
                fuzzer.send_all(payload)
            else:
                fuzzer.handshake(*payload)
            assert decode.alive, f"the loop stopped: {decode.error!r}"
            assert fuzzer.answers(), f"the listener did not answer after {case!r}"
            fuzzer.cases += 1
            if fuzzer.cases % PAIR_EVERY == 0:
                real_prefill_pairs_and_pulls(port, decode)
                fuzzer.pairings += 1

        one_case()
        elapsed = time.monotonic() - started
        assert fuzzer.cases >= CASES * 0.9 and fuzzer.pairings >= fuzzer.cases // PAIR_EVERY
        assert decode.alive and accounts.listener_failure is None
        print(f"{fuzzer.cases} fuzz cases, {fuzzer.pairings} real pairings in {elapsed:.1f}s")
    finally:
        fuzzer.close()
        decode.stop()
