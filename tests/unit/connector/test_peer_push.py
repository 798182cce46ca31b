"""Prefill's `PUT /pdpair/v1/peers` (docs/xpyd.md section 3) on a TP = 2 prefill: two real PrefillWorkers (ranks 0
and 1) in this process, rank 0 serving the metrics port and forwarding the set to rank 1's exporter over its abstract
Unix socket, and two TP = 2 decodes of real DecodeWorkers; the native tcp transport and real side channels on
localhost. No engine, no mocks."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
import torch

from pdpair import contract
from pdpair.connector.config import PdPairConfig, PeerAddress
from pdpair.connector.pod_server import serve
from pdpair.connector.signals import SignalAccounts
from pdpair.connector.decode_worker import DecodeWorker
from pdpair.connector.prefill_worker import PrefillWorker
from devcluster.ports import free_port, port_is_free

NUM_BLOCKS = 4
LAYERS = ("model.layers.0.attn",)
TOKEN = "unit-test-token-0123456789"
SIDE_CHANNEL_KEY = "unit-test-side-channel-key-0123456789abcdef"  # the pair's; the TP ranks' channel key comes from it
GENERATION = 3
DEADLINE = 20.0


def two_free_ports() -> int:
    """A base port with base + 1 free too (a TP = 2 decode listens on both)."""
    for _ in range(50):
        base = free_port()
        if base < 65535 and port_is_free(base + 1):
            return base
    raise AssertionError("no two consecutive free ports")


def config(role: str, **kw) -> PdPairConfig:
    fields = dict(role=role, generation=GENERATION, pair="unit", namespace="default", transport=contract.TRANSPORT_TCP,
                  hang_timeout_seconds=30.0, metrics_port=None, listen_host="127.0.0.1", listen_port_base=None,
                  peer_host=None, peer_port_base=None, side_channel_key=SIDE_CHANNEL_KEY)
    fields.update(kw)
    return PdPairConfig(**fields)


def kv() -> dict[str, torch.Tensor]:
    return {name: torch.zeros((NUM_BLOCKS, 2, 16, 1, 8)) for name in LAYERS}


def request(port: int, method: str, body: dict | None = None, token: str | None = TOKEN) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{contract.PEERS_PATH}", method=method,
                                 data=None if body is None else json.dumps(body).encode())
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def push(port: int, epoch: int, decodes: list[int], generation: int = GENERATION) -> tuple[int, dict]:
    body = {"epoch": epoch, "generation": generation,
            "decodes": [{"index": i, "host": "127.0.0.1", "portBase": base, "tp": 2} for i, base in enumerate(decodes)]}
    return request(port, "PUT", body)


def wait_for(what: str, condition, seconds: float = DEADLINE) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds}s"
        time.sleep(0.05)


@pytest.fixture
def tp2():
    workers = []
    try:
        decodes = []
        for _ in range(2):
            base = two_free_ports()
            ranks = [DecodeWorker(config(contract.ROLE_DECODE, listen_port_base=base), r, 2, 16, "0.32.0")
                     for r in range(2)]
            workers += ranks
            for worker in ranks:
                worker.register_kv_caches(kv(), NUM_BLOCKS)
            decodes.append((base, ranks))
        metrics = free_port()
        prefill_config = config(contract.ROLE_PREFILL, metrics_port=metrics, peers_token=TOKEN, instance="prefill-a",
                                peers=(PeerAddress("127.0.0.1", decodes[0][0]),))
        prefill = [PrefillWorker(prefill_config, r, 2, 16, "0.32.0") for r in (1, 0)][::-1]
        workers = prefill + workers  # prefill shuts down first
        for worker in prefill:
            worker.register_kv_caches(kv(), NUM_BLOCKS)
        yield metrics, prefill, decodes
    finally:
        for worker in workers:
            worker.shutdown()


def test_the_operator_pushes_the_peer_set_to_every_rank(tp2):
    """The push adds a decode to a running TP = 2 prefill (both ranks pair with both of its ranks), is refused
    without the token, for another generation, for an older epoch and for a malformed decode, and removes a decode
    again; GET answers each rank's pairing and `paired` (a decode counts as paired when every rank is). Cost: about
    2 s (four handshakes per decode added)."""
    metrics, prefill, decodes = tp2
    (base0, d0), (base1, d1) = decodes
    peer0, peer1 = f"127.0.0.1:{base0}", f"127.0.0.1:{base1}"
    wait_for("both ranks paired with decode 0", lambda: request(metrics, "GET")[1].get("paired") == {peer0: True})
    assert request(metrics, "GET", token=None)[0] == 401
    assert request(metrics, "GET", token="wrong-token-0123456789")[0] == 401
    status, state = request(metrics, "GET")
    assert status == 200 and state["ranks"] == {"0": {peer0: True}, "1": {peer0: True}} and state["epoch"] is None

    status, state = push(metrics, 5, [base0, base1])
    assert status == 200 and state["epoch"] == 5 and set(state["ranks"]["1"]) == {peer0, peer1}, state
    wait_for("both ranks paired with decode 1",
             lambda: request(metrics, "GET")[1].get("paired") == {peer0: True, peer1: True})
    assert [sorted(e.instance for e in rank.side.edges()) for rank in d1] == [["prefill-a"], ["prefill-a"]]
    assert prefill[1].edge_side(PeerAddress("127.0.0.1", base1)).peer_port == base1 + 1  # rank 1 -> base + 1

    assert push(metrics, 4, [base1])[0] == 409  # an older epoch: a deposed leader's push
    status, body = push(metrics, 6, [base1], generation=GENERATION + 1)
    assert status == 409 and "generation" in body["error"]
    bad = {"epoch": 6, "generation": GENERATION, "decodes": [{"host": "fd00::zz", "portBase": base1}]}
    status, body = request(metrics, "PUT", bad)
    assert status == 400 and "decodes[0]" in body["error"], body
    assert request(metrics, "PUT", {"epoch": 6, "generation": GENERATION, "decodes": "x"})[0] == 400
    assert request(metrics, "POST", {})[0] == 405
    assert request(metrics, "GET")[1]["epoch"] == 5  # nothing refused was applied

    status, state = push(metrics, 6, [base1])  # decode 0 leaves
    assert status == 200 and set(state["ranks"]["0"]) == {peer1} and set(state["ranks"]["1"]) == {peer1}
    wait_for("decode 0's edges closed on both ranks",
             lambda: all(rank.edge_side(PeerAddress("127.0.0.1", base0)) is None for rank in prefill))
    assert request(metrics, "GET")[1]["paired"] == {peer1: True}


def test_no_peer_push_on_a_pod_without_it():
    """Decode, or a prefill without PDPAIR_PEERS_TOKEN: the path answers 404. Cost: milliseconds."""
    server = serve(0, SignalAccounts("decode", 10.0), addr="127.0.0.1")
    try:
        status, body = push(server.port, 1, [20000])
        assert status == 404 and contract.ENV_PEERS_TOKEN in body["error"]
    finally:
        server.stop()
