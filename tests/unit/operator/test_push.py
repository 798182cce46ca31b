"""The operator's push (operator/act/push.py; the bodies of contract/prefill_peers.py and contract/router_peers.py):
its bodies are what the real endpoints accept (prefill's connector PeerPush on its real metrics server, the real
router app), and `push` answers ok, 401, 409, a timeout within its bound and a refused connection without raising.
The Secret manifest and the digest.

Cost: no engine, no cluster, no worker (the connector's push is given a recording stand-in for PrefillWorker.set_peers);
about 2 s on a busy 2-core box, most of it the one push that waits for its timeout."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from pdpair import contract
from pdpair.connector.config import PeerAddress
from pdpair.connector.pod_server import PeerPush, serve
from pdpair.connector.signals import SignalAccounts
from pdpair.operator.build.pods import owned_labels
from pdpair.operator.act.push import (
    PushResult,
    body_digest,
    push,
    token_secret,
)
from pdpair.contract.prefill_peers import DecodePeer, prefill_body
from pdpair.contract.router_peers import RouterMember, router_body
from pdpair.router.app import make_app
from pdpair.router.config import RouterConfig
from pdpair.router.peer_push import check_peers_token, parse_peers_body
from tests.router_support import Engine, engine_server, serve as serve_app

TOKEN = "operator-push-unit-token-0123456789"
GENERATION = 4
PAIR = {"apiVersion": "pdpair.io/v1alpha1", "kind": "InferencePair",
        "metadata": {"name": "demo", "namespace": "ns1", "uid": "uid-1"}}
DECODES = [DecodePeer(1, "fd00::7", 20010, 2), DecodePeer(0, "10.0.0.6", 20000, 2)]


class RecordingPrefill:
    """Stands in for PrefillWorker's set_peers/peer_state behind the connector's real PeerPush: records each set."""

    def __init__(self) -> None:
        self.sets: list[tuple[PeerAddress, ...]] = []

    def apply(self, peers) -> dict[str, bool]:
        if peers is not None:
            self.sets.append(tuple(peers))
        return {peer.label: False for peer in (self.sets[-1] if self.sets else ())}


def test_the_prefill_body_is_what_the_connector_accepts():
    body = prefill_body(3, GENERATION, DECODES)
    assert body == {"epoch": 3, "generation": GENERATION, "decodes": [
        {"index": 0, "host": "10.0.0.6", "portBase": 20000, "tp": 2},
        {"index": 1, "host": "fd00::7", "portBase": 20010, "tp": 2}]}
    prefill = RecordingPrefill()
    endpoint = PeerPush(TOKEN, GENERATION, prefill.apply)
    status, answer = endpoint.handle("PUT", f"Bearer {TOKEN}", json.dumps(body).encode())
    assert status == 200 and answer["epoch"] == 3, answer
    assert prefill.sets == [(PeerAddress("10.0.0.6", 20000), PeerAddress("fd00::7", 20010))]
    assert set(answer["paired"]) == {"10.0.0.6:20000", "[fd00::7]:20010"}
    assert endpoint.handle("PUT", f"Bearer {TOKEN}", json.dumps(prefill_body(4, GENERATION, [])).encode())[0] == 200
    assert prefill.sets[-1] == ()
    assert endpoint.handle("PUT", f"Bearer {TOKEN}", json.dumps(prefill_body(2, GENERATION, [])).encode())[0] == 409

    for bad in ([DecodePeer(0, "h", 1, 1), DecodePeer(0, "g", 2, 1)],  # one index twice
                [DecodePeer(0, "h", 1, 1), DecodePeer(1, "[h]", 1, 1)],  # one decode twice
                [DecodePeer(0, "", 1, 1)], [DecodePeer(0, "h", 1, 0)], [DecodePeer(-1, "h", 1, 1)]):
        with pytest.raises(ValueError):
            prefill_body(1, GENERATION, bad)
    with pytest.raises(ValueError, match="epoch"):
        prefill_body(True, GENERATION, [])


def members() -> list[RouterMember]:
    return [RouterMember("decode", 1, "http://10.0.0.7:8000", "http://10.0.0.7:9100/readyz", draining=True),
            RouterMember("prefill", 0, "http://10.0.0.5:8000", "http://10.0.0.5:9100/readyz"),
            RouterMember("decode", 0, "http://10.0.0.6:8000", "http://10.0.0.6:9100/readyz")]


def test_the_router_body_is_what_the_router_accepts():
    body = router_body(7, GENERATION, members())
    assert [d["index"] for d in body["decodes"]] == [0, 1] and body["decodes"][1]["draining"] is True
    assert body["prefills"] == [{"index": 0, "url": "http://10.0.0.5:8000", "readyUrl": "http://10.0.0.5:9100/readyz",
                                 "draining": False}]
    epoch, generation, prefills, decodes = parse_peers_body(json.loads(json.dumps(body)))
    assert (epoch, generation) == (7, GENERATION)
    assert [(m.index, m.url, m.ready_url, m.draining) for m in decodes] == [
        (0, "http://10.0.0.6:8000", "http://10.0.0.6:9100/readyz", False),
        (1, "http://10.0.0.7:8000", "http://10.0.0.7:9100/readyz", True)]
    assert [m.url for m in prefills] == ["http://10.0.0.5:8000"]
    for bad in ([RouterMember("router", 0, "http://a", "http://a/r")],
                [RouterMember("decode", 0, "http://a", "http://a/r"), RouterMember("decode", 0, "http://b", "http://b/r")],
                [RouterMember("decode", 0, "http://a", "http://a/r"), RouterMember("prefill", 0, "http://a", "http://a/r")]):
        with pytest.raises(ValueError):
            router_body(1, GENERATION, bad)


def test_the_digest_is_stable_and_short():
    body = router_body(7, GENERATION, members())
    shuffled = json.loads(json.dumps(dict(reversed(list(body.items())))))
    assert body_digest(body) == body_digest(shuffled) == body_digest(router_body(7, GENERATION, members()[::-1]))
    assert len(body_digest(body)) == 16 and int(body_digest(body), 16) >= 0
    assert body_digest(body) != body_digest(router_body(8, GENERATION, members()))
    # pinned: the annotation an operator wrote must mean the same body after an upgrade
    assert body_digest({"epoch": 1, "generation": 0, "decodes": []}) == body_digest(
        json.loads('{"decodes": [], "generation": 0, "epoch": 1}'))


def test_the_token_and_its_secret():
    token = secrets.token_urlsafe(32)
    assert check_peers_token(token) == token
    secret = token_secret(PAIR, "demo-peers-token", token)
    assert secret["apiVersion"] == "v1" and secret["kind"] == "Secret" and secret["type"] == "Opaque"
    assert secret["stringData"] == {"token": token} and "data" not in secret
    meta = secret["metadata"]
    assert (meta["name"], meta["namespace"]) == ("demo-peers-token", "ns1")
    assert meta["labels"] == owned_labels(PAIR, "peers-token")
    [owner] = meta["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == ("InferencePair", "demo", "uid-1", True)


@pytest_asyncio.fixture
async def servers():
    """The real router app (with the token, one stand-in engine of each role) and a server that never answers."""
    runners = []
    prefill, decode = Engine("prefill-0"), Engine("decode-0")
    urls = {}
    for engine in (prefill, decode):
        runner, urls[engine.name] = await engine_server(engine)
        runners.append(runner)
    runner, router = await serve_app(make_app(RouterConfig((urls["prefill-0"],), (urls["decode-0"],),
                                                           peers_token=TOKEN)))
    runners.append(runner)
    never = asyncio.Event()

    async def silent(request: web.Request) -> web.Response:
        await never.wait()
        return web.Response()

    silent_app = web.Application()
    silent_app.router.add_put(contract.PEERS_PATH, silent)
    runner, silent_url = await serve_app(silent_app)
    runners.append(runner)
    async with aiohttp.ClientSession() as session:
        yield session, router, urls, silent_url
    never.set()
    for runner in reversed(runners):
        await runner.cleanup()


@pytest.mark.asyncio
async def test_push_to_the_real_router(servers):
    session, router, urls, _ = servers
    url = router + contract.PEERS_PATH
    body = router_body(2, GENERATION, [
        RouterMember("prefill", 0, urls["prefill-0"], urls["prefill-0"] + "/readyz"),
        RouterMember("decode", 0, urls["decode-0"], urls["decode-0"] + "/readyz", draining=True),
        RouterMember("decode", 1, "http://10.255.0.1:8000", "http://10.255.0.1:9100/readyz")])
    result = await push(session, url, TOKEN, body, 10)
    assert result.ok and result.status == 200 and result.error == "", result
    assert result.answer["epoch"] == 2 and [d["draining"] for d in result.answer["decodes"]] == [True, False]
    assert result.answer["leaving"] == []

    wrong = await push(session, url, "wrong-token-0123456789-abcdef", body, 10)
    assert (wrong.ok, wrong.status) == (False, 401) and contract.ENV_PEERS_TOKEN in wrong.error, wrong
    older = await push(session, url, TOKEN, router_body(1, GENERATION, []), 10)
    assert (older.ok, older.status) == (False, 409) and "older" in older.error and older.answer["epoch"] == 2, older
    malformed = await push(session, url, TOKEN, {**body, "decodes": [{"index": 0}]}, 10)
    assert (malformed.ok, malformed.status) == (False, 400) and "decodes[0].url" in malformed.error, malformed


@pytest.mark.asyncio
async def test_push_to_the_real_connector_endpoint(servers):
    session = servers[0]
    prefill = RecordingPrefill()
    server = serve(0, SignalAccounts("prefill", 30.0), addr="127.0.0.1",
                   peers=PeerPush(TOKEN, GENERATION, prefill.apply))
    try:
        url = f"http://127.0.0.1:{server.port}{contract.PEERS_PATH}"
        result = await push(session, url, TOKEN, prefill_body(1, GENERATION, DECODES), 10)
        assert result.ok and result.answer["epoch"] == 1 and len(prefill.sets[-1]) == 2, result
        other = await push(session, url, TOKEN, prefill_body(2, GENERATION + 1, DECODES), 10)
        assert (other.ok, other.status) == (False, 409) and "generation" in other.error, other
        assert (await push(session, url, "x" * 20, prefill_body(2, GENERATION, []), 10)).status == 401
    finally:
        server.stop()


@pytest.mark.asyncio
async def test_push_never_raises_for_the_network(servers):
    session, _, _, silent_url = servers
    bound = 0.5
    started = time.monotonic()
    result = await push(session, silent_url + contract.PEERS_PATH, TOKEN, {}, bound)
    took = time.monotonic() - started
    assert result == PushResult(False, None, None, result.error) and "no answer within 0.5 s" in result.error, result
    assert bound <= took + 0.05 and took < bound + 5  # bounded (the upper margin is for a loaded box)

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, never listening: connection refused
        refused = await push(session, f"http://127.0.0.1:{sock.getsockname()[1]}/x", TOKEN, {}, 5)
    assert (refused.ok, refused.status, refused.answer) == (False, None, None) and "Connect" in refused.error, refused
    invalid = await push(session, "not a url", TOKEN, {}, 5)
    assert not invalid.ok and invalid.status is None, invalid
    with pytest.raises(ValueError, match="timeout_seconds"):
        await push(session, silent_url, TOKEN, {}, 0)


def test_the_pure_part_loads_no_http_client():
    """A decision module may import the dataclasses and bodies: importing push.py loads no aiohttp (push imports it
    when it runs), no kopf, no kubernetes client, no connector. A subprocess, so this file's imports hide nothing."""
    import subprocess
    import sys

    code = ("import json, sys, pdpair.operator.act.push\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('aiohttp', 'kopf', 'kubernetes') "
            "or m.startswith('pdpair.connector'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_every_push_shares_one_session_of_its_event_loop():
    """Runtime.http: one aiohttp session for every pair's pushes and reads (a bounded pool, no keep-alive), made in
    the running loop; a new loop (a test's next asyncio.run) gets a new one, and close() closes it."""
    from pdpair.operator.act.reconciler import PEER_HTTP_CONNECTIONS, Runtime

    runtime = Runtime(config=None, core=None, custom=None, leaser=None)

    async def twice() -> aiohttp.ClientSession:
        first, second = runtime.http(), runtime.http()
        assert first is second and not first.closed
        assert first.connector.limit == PEER_HTTP_CONNECTIONS and first.connector.force_close
        return first

    one = asyncio.run(twice())
    two = asyncio.run(twice())
    assert two is not one

    async def close() -> None:
        await runtime.close()

    asyncio.run(close())
    assert two.closed
