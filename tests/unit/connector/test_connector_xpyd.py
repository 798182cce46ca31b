"""Any prefill to any decode (docs/xpyd.md section 4), with the prefill and decode workers driven directly as in
test_connector_workers.py: real KV tensors, the real native tcp transport, real side-channel threads on localhost,
no engine and no mocks. Each test builds its own instances on free ports.

Bounds are wide (seconds where the code needs tens of milliseconds) and nothing asserts an interleaving of threads,
so the tests pass on a busy 2-core box.
"""

from __future__ import annotations

import select
import socket
import threading
import time

import pytest
import torch

from pdpair import contract, native
from pdpair.connector.config import PdPairConfig, PeerAddress
from pdpair.connector.scheduler import PdPairConnectorMetadata, RecvRequest, SendRequest
from pdpair.connector import prefill_side_channel
from pdpair.connector.prefill_side_channel import DISCONNECT_GRACE_SECONDS
from pdpair.connector.decode_worker import DecodeWorker
from pdpair.connector.prefill_worker import PrefillWorker
from pdpair.connector.deadlines import PEER_DEATH_SECONDS
from pdpair.connector.metadata import decode_api_address
from devcluster.ports import free_port
from tests.side_channel_support import TEST_SIDE_CHANNEL_KEY

NUM_BLOCKS = 8
LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
BLOCK_SHAPE = (2, 32, 2, 32)  # 16 KiB of float32 per block and layer
HANG_TIMEOUT = 30.0  # longer than any wait below: a test that needs it has failed
DEADLINE = 20.0
# A decode that disappears fails its edges' pushes once prefill's monitor sees the side channel drop: at once for a
# process that ends (its sockets close), within DISCONNECT_GRACE_SECONDS for a host that goes silent. Asserted with
# a wide margin for the busy box.
DISCONNECT_BOUND = DISCONNECT_GRACE_SECONDS + 5.0


def decode_config(port: int, api_port: int | None = None) -> PdPairConfig:
    return PdPairConfig(
        role=contract.ROLE_DECODE, generation=3, pair="unit", namespace="default", transport=contract.TRANSPORT_TCP,
        hang_timeout_seconds=HANG_TIMEOUT, metrics_port=None, listen_host="127.0.0.1", listen_port_base=port,
        peer_host=None, peer_port_base=None, side_channel_key=TEST_SIDE_CHANNEL_KEY, http_port=api_port,
    )


def prefill_config(instance: str, ports: list[int]) -> PdPairConfig:
    peers = tuple(PeerAddress("127.0.0.1", port) for port in ports)
    return PdPairConfig(
        role=contract.ROLE_PREFILL, generation=3, pair="unit", namespace="default", transport=contract.TRANSPORT_TCP,
        hang_timeout_seconds=HANG_TIMEOUT, metrics_port=None, listen_host="127.0.0.1", listen_port_base=None,
        peer_host=None, peer_port_base=None, peers=peers, instance=instance, side_channel_key=TEST_SIDE_CHANNEL_KEY,
    )


def peer(port: int) -> PeerAddress:
    return PeerAddress("127.0.0.1", port)


def prefill_kv(seed: int) -> dict[str, torch.Tensor]:
    """Every (layer, block) recognisable, and different per prefill (`seed`)."""
    caches = {}
    for layer, name in enumerate(LAYERS):
        tensor = torch.empty((NUM_BLOCKS, *BLOCK_SHAPE), dtype=torch.float32)
        for block in range(NUM_BLOCKS):
            tensor[block] = 100_000 * seed + 1000 * layer + block
        caches[name] = tensor
    return caches


def decode_kv() -> dict[str, torch.Tensor]:
    return {name: torch.full((NUM_BLOCKS, *BLOCK_SHAPE), -1.0) for name in LAYERS}


class Cluster:
    """Workers made by a test, shut down at its end (prefills first, as a pod's engine would go)."""

    def __init__(self) -> None:
        self.prefills: list[PrefillWorker] = []
        self.decodes: list[DecodeWorker] = []

    def decode(self, port: int | None = None, api_port: int | None = None
               ) -> tuple[DecodeWorker, dict[str, torch.Tensor], int]:
        port = free_port() if port is None else port
        worker = DecodeWorker(decode_config(port, api_port), 0, 1, 32, "0.32.0")
        kv = decode_kv()
        self.decodes.append(worker)
        worker.register_kv_caches(kv, NUM_BLOCKS)
        return worker, kv, port

    def prefill(self, instance: str, ports: list[int], seed: int) -> tuple[PrefillWorker, dict[str, torch.Tensor]]:
        worker = PrefillWorker(prefill_config(instance, ports), 0, 1, 32, "0.32.0")
        kv = prefill_kv(seed)
        self.prefills.append(worker)
        worker.register_kv_caches(kv, NUM_BLOCKS)
        return worker, kv

    def close(self) -> None:
        for worker in self.prefills + self.decodes:
            worker.shutdown()


@pytest.fixture
def cluster():
    made = Cluster()
    try:
        yield made
    finally:
        made.close()


def wait_for(what: str, condition, seconds: float = DEADLINE) -> float:
    """Poll `condition` until true; returns the seconds it took."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < seconds, f"{what}: not within {seconds}s"
        time.sleep(0.02)
    return time.monotonic() - started


def paired(prefill: PrefillWorker, decode: DecodeWorker, port: int, instance: str) -> bool:
    side = prefill.edge_side(peer(port))
    return side is not None and side.connected.is_set() and decode.side.edge(instance) is not None


def send(prefill: PrefillWorker, request_id: str, blocks: list[int], decode_url: str | None = None) -> None:
    """As the scheduler hands a finished request to the workers; `decode_url`: the router's `remote_decode_url`."""
    prefill.start_load_kv(PdPairConnectorMetadata(reqs_to_send=[
        SendRequest(request_id, blocks, time.monotonic() + 60, decode_api_address(decode_url))]))


def recv(decode: DecodeWorker, request_id: str, remote_id: str, instance: str, blocks: list[int]) -> None:
    decode.start_load_kv(PdPairConnectorMetadata(
        reqs_to_recv=[RecvRequest(request_id, remote_id, 0, blocks, instance)]))


def settle(decode: DecodeWorker, wanted: set[str], seconds: float = DEADLINE) -> set[str]:
    """Poll get_transfer_results as the engine does every step until every wanted request settled; the failed ones."""
    finished, failed = set(), set()
    deadline = time.monotonic() + seconds
    while not wanted <= finished and time.monotonic() < deadline:
        done, bad = decode.get_transfer_results()
        finished |= done
        failed |= bad
        time.sleep(0.01)
    assert wanted <= finished, f"not settled within {seconds}s: {wanted - finished}"
    return failed & wanted


SENT: dict[int, set[str]] = {}  # id(prefill worker) -> sends it reported finished (each is reported once)


def sent_now(prefill: PrefillWorker) -> set[str]:
    done = SENT.setdefault(id(prefill), set())
    done |= prefill.get_transfer_results()
    return done


def sent(prefill: PrefillWorker, request_id: str, seconds: float = DEADLINE) -> float:
    """Seconds until prefill reports the send finished (its blocks freed: pushed, or failed)."""
    return wait_for(f"prefill reports {request_id}'s send finished", lambda: request_id in sent_now(prefill), seconds)


def assert_moved(dst: dict[str, torch.Tensor], dst_blocks: list[int], src: dict[str, torch.Tensor],
                 src_blocks: list[int]) -> None:
    for name in LAYERS:
        for d, s in zip(dst_blocks, src_blocks):
            assert torch.equal(dst[name][d], src[name][s]), (name, d, s)


def signals(decode: DecodeWorker, instance: str) -> tuple[float, float]:
    """(expected, received) signals of decode's edge to prefill `instance` (its `peer` label)."""
    labels = {"role": "decode", "rank": "0", "peer": instance}
    registry = decode.accounts.registry
    return (registry.get_sample_value("pdpair_signals_expected_total", labels) or 0.0,
            registry.get_sample_value("pdpair_signals_received_total", labels) or 0.0)


def test_one_prefill_pushes_to_two_decodes(cluster):
    """One prefill with PDPAIR_PEERS naming two decodes pairs with both (one DEALER each, its own pair) and pushes each
    request to the decode that pulled it; each decode counts exactly layers x blocks signals from it. Prefill exports
    pdpair_peer_paired{peer} per decode. Cost: under 1 s (two handshakes, two pushes), a few seconds on a busy box."""
    d0, kv0, port0 = cluster.decode()
    d1, kv1, port1 = cluster.decode()
    p, pkv = cluster.prefill("prefill-a", [port0, port1], seed=1)
    wait_for("both edges paired", lambda: paired(p, d0, port0, "prefill-a") and paired(p, d1, port1, "prefill-a"))
    assert p.edge_side(peer(port0)).comm is not p.edge_side(peer(port1)).comm
    assert p.peer_state() == {f"127.0.0.1:{port0}": True, f"127.0.0.1:{port1}": True}
    for port in (port0, port1):
        assert p.accounts.registry.get_sample_value(
            "pdpair_peer_paired", {"role": "prefill", "rank": "0", "peer": f"127.0.0.1:{port}"}) == 1.0

    send(p, "p-1", [1, 2])
    send(p, "p-2", [3, 4, 5])
    recv(d0, "d0-1", "p-1", "prefill-a", [6, 7])
    recv(d1, "d1-1", "p-2", "prefill-a", [0, 1, 2])
    assert settle(d0, {"d0-1"}) == set() and settle(d1, {"d1-1"}) == set()
    assert_moved(kv0, [6, 7], pkv, [1, 2])
    assert_moved(kv1, [0, 1, 2], pkv, [3, 4, 5])
    assert bool((kv0[LAYERS[0]][:6] == -1).all()) and bool((kv1[LAYERS[0]][3:] == -1).all())
    assert signals(d0, "prefill-a") == (2 * 2, 2 * 2)
    assert signals(d1, "prefill-a") == (2 * 3, 2 * 3)
    sent(p, "p-1")
    sent(p, "p-2")


def test_each_edge_retries_its_own_decode_until_it_listens(cluster):
    """Prefill's set names a listening decode and one that does not listen yet: the first edge pairs and serves
    (prefill is ready: its rank is paired with one decode) while the other edge keeps retrying, counted as retries;
    once the second decode listens, that edge pairs too, without touching the first. Cost: about 2 s."""
    d0, kv0, port0 = cluster.decode()
    port1 = free_port()
    p, pkv = cluster.prefill("prefill-a", [port0, port1], seed=1)
    wait_for("paired with decode 0", lambda: paired(p, d0, port0, "prefill-a"))
    wait_for("decode 1 retried", lambda: p.accounts.registry.get_sample_value(
        "pdpair_handshakes_total", {"role": "prefill", "rank": "0", "outcome": "retry"}) >= 2)
    assert p.peer_state() == {f"127.0.0.1:{port0}": True, f"127.0.0.1:{port1}": False} and p.accounts.paired
    send(p, "p-1", [1])
    recv(d0, "d0-1", "p-1", "prefill-a", [2])
    assert settle(d0, {"d0-1"}) == set()
    side0 = p.edge_side(peer(port0))
    comm0 = side0.comm

    d1, kv1, _ = cluster.decode(port1)
    wait_for("paired with decode 1", lambda: paired(p, d1, port1, "prefill-a"))
    assert p.edge_side(peer(port0)) is side0 and side0.comm is comm0  # the first edge never re-paired
    send(p, "p-2", [3])
    recv(d1, "d1-1", "p-2", "prefill-a", [4])
    assert settle(d1, {"d1-1"}) == set()
    assert_moved(kv0, [2], pkv, [1])
    assert_moved(kv1, [4], pkv, [3])


def test_two_prefills_push_to_one_decode(cluster):
    """A decode accepts a handshake from each prefill instance: two edges, each with its own pair communicator and
    signal slots. Each request's Pull goes on the edge of the prefill named in its kv_transfer_params, so each gets
    that prefill's bytes, and the signal accounts are per edge (peer = the prefill's instance). Cost: under 1 s, a few seconds on a busy box."""
    d, kv, port = cluster.decode()
    pa, kva = cluster.prefill("prefill-a", [port], seed=1)
    pb, kvb = cluster.prefill("prefill-b", [port], seed=2)
    wait_for("both prefills paired", lambda: paired(pa, d, port, "prefill-a") and paired(pb, d, port, "prefill-b"))
    edges = {e.instance: e for e in d.side.edges()}
    assert sorted(edges) == ["prefill-a", "prefill-b"] and edges["prefill-a"].comm is not edges["prefill-b"].comm
    assert d.side.comm is None  # not 1P1D any more: nothing may use "the" pair

    send(pa, "same-id", [1, 2])  # the two prefills' request ids may even be equal: the edge tells them apart
    send(pb, "same-id", [3])
    recv(d, "d-a", "same-id", "prefill-a", [4, 5])
    recv(d, "d-b", "same-id", "prefill-b", [6])
    assert settle(d, {"d-a", "d-b"}) == set()
    assert_moved(kv, [4, 5], kva, [1, 2])
    assert_moved(kv, [6], kvb, [3])
    assert signals(d, "prefill-a") == (2 * 2, 2 * 2) and signals(d, "prefill-b") == (2 * 1, 2 * 1)
    sent(pa, "same-id")
    sent(pb, "same-id")


def test_a_pull_for_a_prefill_decode_is_not_paired_with_fails_at_once(cluster):
    """kv_transfer_params naming a prefill this decode has no edge to (a hand-made request, or a prefill that left):
    the load fails in the same step, with no wait opened and nothing sent, and the error names the prefill. The
    paired prefill's edge still serves. Cost: under 1 s."""
    d, kv, port = cluster.decode()
    pa, kva = cluster.prefill("prefill-a", [port], seed=1)
    wait_for("paired", lambda: paired(pa, d, port, "prefill-a"))
    recv(d, "d-x", "p-x", "prefill-unknown", [1])
    done, failed = d.get_transfer_results()  # the very next call: no wait, no deadline
    assert "d-x" in failed and "d-x" in done
    assert d.accounts.open_transfers() == 0
    assert d.accounts.registry.get_sample_value(
        "pdpair_kv_transfers_total", {"role": "decode", "rank": "0", "outcome": "error"}) == 1.0
    send(pa, "p-1", [2])
    recv(d, "d-1", "p-1", "prefill-a", [3])
    assert settle(d, {"d-1"}) == set()
    assert_moved(kv, [3], kva, [2])


def test_a_decode_that_stops_fails_only_its_edges_pushes(cluster):
    """One prefill, two decodes. A push to decode 0 is held in flight (the native sender holds every send on that
    edge), then decode 0 stops: prefill's monitor sees its side channel drop, closes that edge's pair, and the held
    push fails; prefill reports the send finished (its blocks freed) within DISCONNECT_BOUND. Decode 1's edge is
    untouched: it stays paired and moves bytes before and after, and prefill stays ready (paired with one decode).
    Cost: under 1 s (decode 0 stops by closing its sockets), a few seconds on a busy box."""
    d0, kv0, port0 = cluster.decode()
    d1, kv1, port1 = cluster.decode()
    p, pkv = cluster.prefill("prefill-a", [port0, port1], seed=1)
    wait_for("both edges paired", lambda: paired(p, d0, port0, "prefill-a") and paired(p, d1, port1, "prefill-a"))
    p.edge_side(peer(port0)).comm._conn.set_fault(native.Fault.HOLD_SENDS, 1)  # TEST ONLY: nothing leaves this edge
    send(p, "p-held", [1, 2])
    send(p, "p-other", [3])
    recv(d0, "d0-held", "p-held", "prefill-a", [4, 5])
    recv(d1, "d1-1", "p-other", "prefill-a", [6])
    assert settle(d1, {"d1-1"}) == set()  # decode 1 is served while decode 0's push hangs
    wait_for("the push to decode 0 is in flight", lambda: p._edges[peer(port0)].inflight == 1)
    assert "p-held" not in sent_now(p)

    started = time.monotonic()
    d0.shutdown()
    cluster.decodes.remove(d0)
    took = sent(p, "p-held", DISCONNECT_BOUND)
    assert took < DISCONNECT_BOUND
    wait_for("prefill sees decode 0 unpaired", lambda: p.peer_state()[f"127.0.0.1:{port0}"] is False)
    assert time.monotonic() - started < DISCONNECT_BOUND + 1
    assert p.peer_state()[f"127.0.0.1:{port1}"] is True and p.accounts.paired  # still ready: one decode is paired

    send(p, "p-after", [0, 7])
    recv(d1, "d1-2", "p-after", "prefill-a", [1, 2])
    assert settle(d1, {"d1-2"}) == set()
    assert_moved(kv1, [6, 1, 2], pkv, [3, 0, 7])
    assert signals(d1, "prefill-a") == (2 * 3, 2 * 3)


def test_a_decode_that_dies_has_the_blocks_held_for_it_freed_within_the_peer_death_bound(cluster):
    """One prefill, two decodes (each with its API port, sent in its Welcome). Prefill holds three finished requests
    nobody has pulled yet: one the router named decode 0 for (`remote_decode_url`), one named decode 1, one named
    none. Decode 0 dies (its sockets close): within deadlines.PEER_DEATH_SECONDS of that, prefill reports decode 0's
    request sent (its blocks freed; `pdpair_kv_blocks_held` drops by its blocks), not at its lease's end (60 s here);
    decode 1's request and the unnamed one stay held (prefill still has another decode that could pull them), and
    decode 1 still pulls its own. Cost: under 1 s."""
    api0, api1 = free_port(), free_port()
    d0, _, port0 = cluster.decode(api_port=api0)
    d1, kv1, port1 = cluster.decode(api_port=api1)
    p, pkv = cluster.prefill("prefill-a", [port0, port1], seed=1)
    wait_for("both edges paired", lambda: paired(p, d0, port0, "prefill-a") and paired(p, d1, port1, "prefill-a"))
    send(p, "p-for-d0", [1, 2], f"http://127.0.0.1:{api0}")
    send(p, "p-for-d1", [3], f"http://127.0.0.1:{api1}")
    send(p, "p-unnamed", [4])
    assert sent_now(p) == set()

    def held() -> float:
        sent_now(p)  # get_transfer_results publishes the gauge, as every engine step does
        return p.accounts.registry.get_sample_value("pdpair_kv_blocks_held", {"role": "prefill", "rank": "0"})

    assert held() == 4
    died = time.monotonic()
    d0.shutdown()
    cluster.decodes.remove(d0)
    took = sent(p, "p-for-d0", DEADLINE)
    print(f"\nblocks held for the dead decode freed {took:.2f}s after it died")
    assert time.monotonic() - died < PEER_DEATH_SECONDS, f"freed {took:.2f}s after the decode died"
    assert held() == 2
    assert {"p-for-d1", "p-unnamed"} & sent_now(p) == set()

    recv(d1, "d1-1", "p-for-d1", "prefill-a", [6])
    assert settle(d1, {"d1-1"}) == set()
    sent(p, "p-for-d1")
    assert_moved(kv1, [6], pkv, [3])
    assert "p-unnamed" not in sent_now(p) and held() == 1


def test_the_only_decode_dying_frees_the_requests_named_for_no_decode(cluster):
    """1P1D with a router (or proxy) that names no decode: when prefill's only decode dies, every request held for
    a Pull is freed within deadlines.PEER_DEATH_SECONDS, since no other decode could pull it. Cost: under 1 s."""
    d0, _, port0 = cluster.decode()
    p, _ = cluster.prefill("prefill-a", [port0], seed=1)
    wait_for("paired", lambda: paired(p, d0, port0, "prefill-a"))
    send(p, "p-unnamed", [1, 2])
    died = time.monotonic()
    d0.shutdown()
    cluster.decodes.remove(d0)
    took = sent(p, "p-unnamed", DEADLINE)
    assert time.monotonic() - died < PEER_DEATH_SECONDS, f"freed {took:.2f}s after the decode died"


def test_the_peer_set_is_replaced_at_runtime(cluster):
    """set_peers takes the whole desired set. A decode added to a running prefill pairs and is served without any
    restart; a decode removed while a push to it is in flight keeps its edge until that push ends (here: completes,
    once the held sends are released), then the edge closes and its pdpair_peer_paired series goes; the other edge is
    untouched throughout. Cost: about 1 s (0.5 s of it the check that the draining edge waits)."""
    d0, kv0, port0 = cluster.decode()
    d1, kv1, port1 = cluster.decode()
    p, pkv = cluster.prefill("prefill-a", [port0], seed=1)
    wait_for("paired with decode 0", lambda: paired(p, d0, port0, "prefill-a"))
    assert p.edge_side(peer(port1)) is None and d1.side.edges() == []

    state = p.set_peers([peer(port0), peer(port1)])  # add decode 1
    assert set(state) == {f"127.0.0.1:{port0}", f"127.0.0.1:{port1}"}
    wait_for("paired with decode 1", lambda: paired(p, d1, port1, "prefill-a"))
    send(p, "p-1", [1])
    recv(d1, "d1-1", "p-1", "prefill-a", [2])
    assert settle(d1, {"d1-1"}) == set()
    assert_moved(kv1, [2], pkv, [1])

    side0 = p.edge_side(peer(port0))
    side0.comm._conn.set_fault(native.Fault.HOLD_SENDS, 1)  # TEST ONLY: decode 0's push stays in flight
    send(p, "p-2", [4, 5])
    recv(d0, "d0-1", "p-2", "prefill-a", [6, 7])
    wait_for("the push to decode 0 is in flight", lambda: p._edges[peer(port0)].inflight == 1)
    state = p.set_peers([peer(port1)])  # remove decode 0: returns at once, the edge drains
    assert state == {f"127.0.0.1:{port1}": True}
    time.sleep(0.5)
    assert side0.is_alive(), "the removed edge closed with its push still in flight"
    side0.comm._conn.set_fault(native.Fault.HOLD_SENDS, 0)
    assert settle(d0, {"d0-1"}) == set()  # the in-flight push completed on the removed edge
    assert_moved(kv0, [6, 7], pkv, [4, 5])
    wait_for("the removed edge closed", lambda: not side0.is_alive())
    assert p.accounts.registry.get_sample_value(
        "pdpair_peer_paired", {"role": "prefill", "rank": "0", "peer": f"127.0.0.1:{port0}"}) is None

    send(p, "p-3", [0])  # decode 1 was untouched
    recv(d1, "d1-2", "p-3", "prefill-a", [3])
    assert settle(d1, {"d1-2"}) == set()
    assert_moved(kv1, [3], pkv, [0])


def test_a_prefill_started_without_a_decode_pairs_once_the_push_names_one(cluster):
    """The parallel start (desired.py step 4): the operator creates prefill beside a decode that has no address yet,
    so prefill registers its KV with an empty peer set, is not paired (its /readyz fails), and is told the decode by
    the push. Pushed before that decode listens, its edge retries until the listener accepts, then pairs and moves
    KV. Cost: about 0.5 s."""
    p, pkv = cluster.prefill("prefill-a", [], seed=1)
    assert p.peer_state() == {} and not p.accounts.paired
    port = free_port()
    assert p.set_peers([peer(port)]) == {f"127.0.0.1:{port}": False}  # nothing listens there yet
    time.sleep(0.3)
    assert not p.accounts.paired
    d, kv, _ = cluster.decode(port)
    wait_for("paired once decode listens", lambda: paired(p, d, port, "prefill-a"))
    assert p.accounts.paired and p.peer_state() == {f"127.0.0.1:{port}": True}
    send(p, "p-1", [1, 2])
    recv(d, "d-1", "p-1", "prefill-a", [3, 4])
    assert settle(d, {"d-1"}) == set()
    assert_moved(kv, [3, 4], pkv, [1, 2])


def test_a_prefill_that_pairs_again_replaces_its_own_edge_only(cluster):
    """Two prefills on one decode; prefill a restarts (a new worker with the same PDPAIR_INSTANCE, as a restarted pod
    has): its new Hello replaces edge a (a new pair communicator) and leaves edge b as it was (the same communicator,
    still serving). Cost: about 1 s."""
    d, kv, port = cluster.decode()
    pa, _ = cluster.prefill("prefill-a", [port], seed=1)
    pb, kvb = cluster.prefill("prefill-b", [port], seed=2)
    wait_for("both prefills paired", lambda: paired(pa, d, port, "prefill-a") and paired(pb, d, port, "prefill-b"))
    old_a, edge_b = d.side.edge("prefill-a"), d.side.edge("prefill-b")

    pa.shutdown()
    cluster.prefills.remove(pa)
    pa2, kva2 = cluster.prefill("prefill-a", [port], seed=3)
    wait_for("prefill a paired again", lambda: paired(pa2, d, port, "prefill-a") and d.side.edge("prefill-a") is not old_a)
    assert d.side.edge("prefill-b") is edge_b and sorted(e.instance for e in d.side.edges()) == ["prefill-a", "prefill-b"]

    send(pa2, "p-a", [1])
    send(pb, "p-b", [2])
    recv(d, "d-a", "p-a", "prefill-a", [3])
    recv(d, "d-b", "p-b", "prefill-b", [4])
    assert settle(d, {"d-a", "d-b"}) == set()
    assert_moved(kv, [3], kva2, [1])
    assert_moved(kv, [4], kvb, [2])


class FreezableProxy:
    """A TCP forwarder in front of a decode's side-channel port. `freeze()` stops moving bytes both ways while every
    connection stays open: to prefill, decode's host went silent (no FIN, no RST), as in a network partition."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.frozen = threading.Event()
        self.stopped = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        self.threads = [threading.Thread(target=self._accept, daemon=True, name="test-proxy-accept")]
        self.threads[0].start()

    def freeze(self) -> None:
        self.frozen.set()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                client, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=2)
            except OSError:
                client.close()
                continue
            self.sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                thread = threading.Thread(target=self._pump, args=(src, dst), daemon=True, name="test-proxy-pump")
                self.threads.append(thread)
                thread.start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while not self.stopped.is_set():
            if self.frozen.is_set():
                time.sleep(0.05)  # hold everything: read nothing, send nothing, close nothing
                continue
            ready, _, _ = select.select([src], [], [], 0.05)
            if not ready or self.frozen.is_set():
                continue
            try:
                data = src.recv(65536)
                if not data:
                    return
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(5)
        for sock in self.sockets:
            sock.close()


def test_a_decode_whose_host_goes_silent_fails_only_its_edges_pushes_within_the_grace(cluster, monkeypatch):
    """Decode 0's side channel runs through a proxy that then freezes (bytes stop, connections stay open: no FIN, no
    RST, as when a node drops off the network). Prefill's ZMTP heartbeat times out, its monitor reports the
    disconnect, the edge's pair closes and the push held in flight on it fails: the send is reported finished within
    the grace (1 s here, 5 s in production) plus the heartbeat interval, asserted with 5 s of margin. Decode 1's edge
    serves throughout. Cost: about 3 s."""
    monkeypatch.setattr(prefill_side_channel, "HEARTBEAT_INTERVAL_SECONDS", 0.5)
    monkeypatch.setattr(prefill_side_channel, "DISCONNECT_GRACE_SECONDS", 1.0)
    d0, kv0, port0 = cluster.decode()
    d1, kv1, port1 = cluster.decode()
    proxy = FreezableProxy(port0)
    try:
        p, pkv = cluster.prefill("prefill-a", [proxy.port, port1], seed=1)
        wait_for("both edges paired", lambda: paired(p, d0, proxy.port, "prefill-a") and paired(p, d1, port1, "prefill-a"))
        p.edge_side(peer(proxy.port)).comm._conn.set_fault(native.Fault.HOLD_SENDS, 1)  # TEST ONLY
        send(p, "p-held", [1, 2])
        recv(d0, "d0-held", "p-held", "prefill-a", [4, 5])
        wait_for("the push to decode 0 is in flight", lambda: p._edges[peer(proxy.port)].inflight == 1)

        proxy.freeze()
        took = sent(p, "p-held", 1.0 + 0.5 + 5.0)
        assert took < 1.0 + 0.5 + 5.0
        assert p.peer_state()[f"127.0.0.1:{port1}"] is True
        send(p, "p-other", [3])
        recv(d1, "d1-1", "p-other", "prefill-a", [6])
        assert settle(d1, {"d1-1"}) == set()
        assert_moved(kv1, [6], pkv, [3])
    finally:
        for worker in cluster.prefills:  # prefill first: its edge must not wait on the frozen proxy
            worker.shutdown()
        cluster.prefills.clear()
        proxy.close()
