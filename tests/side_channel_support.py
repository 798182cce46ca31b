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

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 5.0) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
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
