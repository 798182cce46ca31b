"""Helpers of the side-channel tests: the key every test that starts a connector or a side channel uses
(PDPAIR_SIDE_CHANNEL_KEY: both sides of a pair hold the same one, and the connector refuses to start without one of
at least 32 characters), and a peer that is not a connector (`Stranger`: a raw ZMQ DEALER that sends whatever a test
or a fuzzer makes, with or without the key)."""

from __future__ import annotations

import json
import secrets
import threading
import time

import msgspec
import zmq

TEST_SIDE_CHANNEL_KEY = "pdpair-test-side-channel-key-0123456789abcdef"
TEST_KEY_BYTES = TEST_SIDE_CHANNEL_KEY.encode()
OTHER_KEY_BYTES = b"another-pair-s-side-channel-key-0123456789"


class Stranger:
    """A process that is not one of the pair's pods: one DEALER connection to decode's side channel."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 5.0, *, deaf: bool = False) -> None:
        """`deaf`: a peer that does not read its answers, with as little room for them as it can ask for (one
        message queued by ZMQ, a 1 KiB kernel receive buffer), so decode's queue for it fills after about its
        send high-water mark of answers."""
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        if deaf:
            self.sock.setsockopt(zmq.RCVHWM, 1)
            self.sock.setsockopt(zmq.RCVBUF, 1024)
        self.timeout = timeout
        self.sock.connect(f"tcp://{host}:{port}")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def __enter__(self) -> Stranger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout: float | None = None) -> list[bytes] | None:
        if not self.sock.poll(int((self.timeout if timeout is None else timeout) * 1000)):
            return None
        return self.sock.recv_multipart()

    def recv_message(self, local_hash: bytes, timeout: float | None = None):
        """The next message, decoded under `local_hash` (the hash frame this peer sent: decode echoes it)."""
        from pdpair.connector.metadata import decode

        frames = self.recv(timeout)
        return None if frames is None else decode(frames, local_hash.decode("ascii", "replace"))

    def hello(self, local_hash: bytes, key: bytes | None, *, generation: int, tp_rank: int = 0, pair: str = "p",
              transport: str = "tcp", unique_id: bytes = b"{}", instance: str = "stranger-0", mac: bytes | None = None,
              factors: bytes = b"{}"):
        """Hello, then (when decode challenges) a Proof made with `key` (None: `mac`, or random bytes). Returns
        (every message decode answered, the transcript)."""
        from pdpair.connector.metadata import Challenge, Hello, Proof, encode, proof, transcript

        hello = Hello(generation, pair, tp_rank, transport, unique_id, instance, secrets.token_bytes(32))
        frames = encode(hello, local_hash)
        self.send([*frames, factors])
        answers = [self.recv_message(local_hash)]
        if not isinstance(answers[0], Challenge):
            return answers, b""
        said = transcript(frames[0], frames[1], answers[0].nonce)
        made = proof(key, "prefill", said) if key is not None else (mac or secrets.token_bytes(32))
        self.send(encode(Proof(made), local_hash))
        answers.append(self.recv_message(local_hash))
        return answers, said


def hello_frames(local_hash: bytes, *, generation: int = 0, instance: str = "stranger-0") -> list[bytes]:
    """One Hello's frames (hash, body, factors), as a peer that will never send its Proof sends them."""
    from pdpair.connector.metadata import Hello, encode

    hello = Hello(generation, "p", 0, "tcp", b"{}", instance, secrets.token_bytes(32))
    return [*encode(hello, local_hash), b"{}"]


def answers_hello(port: int, local_hash: bytes, timeout: float = 5.0) -> bool:
    """The listener is alive: a fresh connection's Hello is answered with a Challenge within `timeout`."""
    from pdpair.connector.metadata import Challenge

    with Stranger(port, timeout=timeout) as probe:
        answers, _ = probe.hello(local_hash, None, generation=0)
        return isinstance(answers[0], Challenge)


class SilentListener:
    """A TCP listener that accepts and never answers (the kernel completes the handshake; nothing is ever sent)."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
                self.accepted.append(conn)
            except OSError:
                continue

    def uid(self, token: int = 1) -> bytes:
        return json.dumps({"host": "127.0.0.1", "port": self.port, "token": token}).encode()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for conn in self.accepted:
            conn.close()
        self.sock.close()


def wait_until(predicate, seconds: float = 5.0, step: float = 0.02) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def raw(message) -> bytes:
    """A message's body as msgpack, bypassing the wire types (so a test can send fields of any type)."""
    return msgspec.msgpack.encode(message)


def attack_side_channel(port: int, decode_hash: bytes, *, generation: int, key: bytes, handshakes: int,
                        stop: threading.Event, ready: threading.Event, pooled_per_second: float = 50.0,
                        deaf_per_second: float = 300.0, wrong_proofs_per_second: float = 5.0) -> dict:
    """Everything a process that is not one of the pair's pods can throw at decode's side channel at once, until
    `stop`; `ready` once every part has been seen to work (returns its counts):
    - strangers without the key: Hellos that never send their Proof from a pool of connections larger than
      decode's MAX_PENDING_CHALLENGES (so challenges are evicted), reading their Challenges; a deaf one that never
      reads (its answers fill decode's queue for it, then are dropped); Hellos with a Proof made without the key;
    - a holder of `key` (a compromised peer, the worst case) whose Hellos, under decode's own hash and generation,
      point the tcp uid at a listener that accepts and never answers, from `handshakes` connections at once (decode's
      MAX_CONCURRENT_HANDSHAKES + 1: each handshake stalls a handshake thread until its deadline, the extra one is
      refused busy); each goes again once refused. After `stop` the stalled ones are waited for (their refusal).
    The rates are per second, paced (a flood at line rate is a CPU load on decode's process, not a stall)."""
    from pdpair.connector.metadata import NOT_ACCEPTED, Accepted, Refused

    counts = {"pooled_sent": 0, "challenges_read": 0, "deaf_sent": 0, "wrong_proofs_refused": 0,
              "keyholder_accepted": 0, "keyholder_busy": 0, "keyholder_evicted": 0, "keyholder_stalled_then_refused": 0,
              "stall_seconds_min": None, "stall_seconds_max": None, "silent_accepted": 0, "errors": []}
    lock = threading.Lock()
    silent = SilentListener()

    def count(name: str, n: int = 1) -> None:
        with lock:
            counts[name] += n

    def keyholder(k: int) -> None:
        while not stop.is_set():
            try:
                with Stranger(port, timeout=30) as peer:
                    # From before the Hello: decode's handshake deadline starts once it has the Proof, so this never
                    # measures less than the stall decode imposes (timed from the Accepted's arrival instead, a busy
                    # box's delivery delay was taken off it: 3.98 s against a 4 s bound in CI on 2026-12-07)
                    started = time.monotonic()
                    answers, _ = peer.hello(decode_hash, key, generation=generation, unique_id=silent.uid(k + 1),
                                            instance=f"compromised-{k}")
                    if isinstance(answers[-1], Accepted):
                        count("keyholder_accepted")
                        refusal = peer.recv_message(decode_hash, timeout=30)
                        took = time.monotonic() - started
                        if not (isinstance(refusal, Refused) and "failed" in refusal.reason):
                            raise AssertionError(f"a stalled handshake ended with {refusal!r}")
                        with lock:
                            counts["keyholder_stalled_then_refused"] += 1
                            counts["stall_seconds_min"] = min(took, counts["stall_seconds_min"] or took)
                            counts["stall_seconds_max"] = max(took, counts["stall_seconds_max"] or 0.0)
                        continue
                    if isinstance(answers[-1], Refused) and answers[-1].reason.startswith("busy"):
                        count("keyholder_busy")
                    elif isinstance(answers[-1], Refused) and answers[-1].reason == NOT_ACCEPTED:
                        # its Challenge was evicted by the Proof-less Hellos (MAX_PENDING_CHALLENGES of them came
                        # before its Proof did: a busy box), so its Proof had no Hello to answer
                        count("keyholder_evicted")
                    else:
                        raise AssertionError(f"a key holder's Hello was answered {answers!r}")
            except Exception as exc:  # noqa: BLE001 - reported in the counts, the attack goes on
                with lock:
                    counts["errors"].append(f"keyholder {k}: {exc!r}"[:300])
            stop.wait(0.2)

    def wrong_proofs() -> None:
        while not stop.wait(1.0 / wrong_proofs_per_second):
            try:
                with Stranger(port, timeout=10) as peer:
                    answers, _ = peer.hello(b"0123456789abcdef", None, generation=generation, instance="outsider")
                if isinstance(answers[-1], Refused):
                    count("wrong_proofs_refused")
            except Exception as exc:  # noqa: BLE001
                with lock:
                    counts["errors"].append(f"wrong proof: {exc!r}"[:300])

    pool = [Stranger(port) for _ in range(80)]
    deaf = Stranger(port, deaf=True)
    threads = [threading.Thread(target=keyholder, args=(k,), daemon=True) for k in range(handshakes)]
    threads.append(threading.Thread(target=wrong_proofs, daemon=True))
    for thread in threads:
        thread.start()
    tick, started, turn = 0.01, time.monotonic(), 0
    try:
        while not stop.is_set():
            elapsed = time.monotonic() - started
            for _ in range(int(elapsed * pooled_per_second) - counts["pooled_sent"]):
                pool[turn % len(pool)].sock.send_multipart(hello_frames(decode_hash, generation=generation,
                                                                        instance=f"pooled-{turn}"), zmq.NOBLOCK)
                turn += 1
                count("pooled_sent")
            for _ in range(int(elapsed * deaf_per_second) - counts["deaf_sent"]):
                try:
                    deaf.sock.send_multipart(hello_frames(b"deaf-stranger-00"), zmq.NOBLOCK)
                    count("deaf_sent")
                except zmq.Again:
                    break
            for peer in pool:
                while peer.sock.poll(0):
                    peer.sock.recv_multipart()
                    count("challenges_read")
            with lock:
                counts["silent_accepted"] = len(silent.accepted)
                if (counts["keyholder_accepted"] >= handshakes - 1 and counts["keyholder_busy"] >= 1
                        and counts["silent_accepted"] >= 1 and counts["challenges_read"] >= 1
                        and counts["wrong_proofs_refused"] >= 1 and counts["deaf_sent"] >= 1500):
                    ready.set()
            time.sleep(tick)
        for thread in threads:
            thread.join(40)  # a stalled handshake's refusal comes by its deadline
    finally:
        for peer in [*pool, deaf]:
            peer.close()
        counts["silent_accepted"] = len(silent.accepted)
        silent.close()
    return counts


if __name__ == "__main__":  # python -m tests.side_channel_support '<json args>': the attack in a process of its own
    import sys

    def _main() -> None:
        """Prints "ready" once the attack is under way, stops at a line (or EOF) on stdin, prints its counts as
        JSON."""
        args = json.loads(sys.argv[1])
        stop, ready = threading.Event(), threading.Event()
        result: dict = {}

        def run() -> None:
            result.update(attack_side_channel(
                args["port"], args["decode_hash"].encode(), generation=args["generation"],
                key=args["key"].encode(), handshakes=args["handshakes"], stop=stop, ready=ready))

        attacker = threading.Thread(target=run, daemon=True)
        attacker.start()
        while not ready.wait(0.1):
            if not attacker.is_alive():
                break
        print("ready" if ready.is_set() else "not ready", flush=True)
        sys.stdin.readline()
        stop.set()
        attacker.join(60)
        print(json.dumps(result), flush=True)

    _main()
