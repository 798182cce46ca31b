"""The router with the pair's API key (VLLM_API_KEY, spec.apiKeySecret): clients must send `Authorization: Bearer
<key>` (401 with a fixed body otherwise, before the body is read), the router sends its own to both engines, and the
paths the operator and the kubelet use stay open. Real router and real aiohttp engine stand-ins on loopback
(tests/router_support.py), no mock of the router."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from pdpair import contract
from pdpair.router.__main__ import build_parser, config_from_args
from pdpair.router.__main__ import main as router_main
from pdpair.router.api_key import API_KEY_REFUSAL, check_api_key
from pdpair.router.app import REQUEST_ID_HEADER, make_app
from pdpair.router.config import RouterConfig
from tests.router_support import Engine, engine_app, serve

KEY = "sk-pair-0123456789abcdef"
PEERS_TOKEN = "peers-token-0123456789"
BODY = {"model": "m", "prompt": "the-secret-prompt", "max_tokens": 3}


async def engine_with_models(engine: Engine) -> tuple[web.AppRunner, str]:
    """tests/router_support.py's stand-in plus vLLM's /v1/models, which records the headers it was asked with."""
    app = engine_app(engine)

    async def models(request: web.Request) -> web.Response:
        engine.received.append((request.path, {}, request.headers.copy()))
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    app.router.add_get("/v1/models", models)
    return await serve(app)


@pytest_asyncio.fixture
async def stack():
    prefill, decode = Engine("prefill"), Engine("decode")
    runners = []
    p_runner, p_url = await engine_with_models(prefill)
    d_runner, d_url = await engine_with_models(decode)
    runners += [p_runner, d_runner]

    async def start_router(**overrides):
        config = RouterConfig((p_url,), (d_url,), prefill_ready_urls=(p_url + "/readyz",),
                              decode_ready_urls=(d_url + "/readyz",), **overrides)
        runner, url = await serve(make_app(config))
        runners.append(runner)
        return url

    async with aiohttp.ClientSession() as client:
        yield prefill, decode, start_router, client
    for runner in runners:
        await runner.cleanup()


@pytest.mark.asyncio
async def test_without_the_key_every_api_request_is_401_with_a_fixed_body(stack):
    """No header, another scheme, a wrong key, the key with a byte more or less, an empty bearer: 401 with
    API_KEY_REFUSAL and `WWW-Authenticate: Bearer`, whatever the path under /v1 (a route or not) and the method; the
    answer holds nothing of the request (its body, its id, the key it sent); no engine is asked. Cost: ~0.1 s."""
    prefill, decode, start_router, client = stack
    router = await start_router(api_key=KEY)
    refusals = [None, f"Basic {KEY}", "Bearer wrong-key-echo-me", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}",
                "Bearer ", "Bearer", KEY, f"Bearer  {KEY}", f"Token {KEY}"]
    for authorization in refusals:
        headers = {REQUEST_ID_HEADER: "req-echo-me"}
        if authorization is not None:
            headers["Authorization"] = authorization
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("GET", "/v1/not-a-route"), ("POST", "/v2/anything"), ("GET", "/")):
            async with client.request(method, router + path, json=BODY, headers=headers) as resp:
                assert resp.status == 401, (authorization, path)
                text = await resp.text()
                assert json.loads(text) == API_KEY_REFUSAL
                assert resp.headers["WWW-Authenticate"] == "Bearer"
                assert REQUEST_ID_HEADER not in resp.headers
            for echoed in ("echo-me", "the-secret-prompt", KEY):
                assert echoed not in text and all(echoed not in v for v in resp.headers.values()), (echoed, path)
    assert prefill.received == decode.received == []


@pytest.mark.asyncio
async def test_the_right_key_is_served_and_the_engines_get_the_routers_own_header(stack):
    """`Bearer <key>` (the scheme in any case, as vLLM reads it): the completion goes through prefill and decode,
    streamed or not, and both engines received `Authorization: Bearer <key>` written by the router; the client gets
    no Authorization header back. /v1/models is forwarded to decode with it too. Cost: ~0.1 s."""
    prefill, decode, start_router, client = stack
    router = await start_router(api_key=KEY)
    for scheme in ("Bearer", "bearer", "BEARER"):
        async with client.post(router + "/v1/completions", json=BODY,
                               headers={"Authorization": f"{scheme} {KEY}", REQUEST_ID_HEADER: "r1"}) as resp:
            assert resp.status == 200 and (await resp.json())["id"] == "decode-answer"
            assert "Authorization" not in resp.headers and resp.headers[REQUEST_ID_HEADER] == "r1"
    async with client.post(router + "/v1/chat/completions", headers={"Authorization": f"bearer {KEY}"},
                           json={"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}) as resp:
        assert resp.status == 200 and await resp.read() == b"".join(decode.stream_chunks)
        assert "Authorization" not in resp.headers
    async with client.get(router + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status == 200 and (await resp.json())["data"][0]["id"] == "m"
    assert len(prefill.received) == 4 and len(decode.received) == 5
    for path, _, headers in prefill.received + decode.received:
        assert headers.getall("Authorization") == [f"Bearer {KEY}"], path  # the router's own, once
    assert decode.received[-1][0] == "/v1/models"


@pytest.mark.asyncio
async def test_the_refusal_comes_before_the_body_is_read(stack):
    """A request that declares a body and sends none of it is answered 401 at once: the router never waits for a
    body it would not serve (a stranger cannot make it buffer one). Raw HTTP on a socket; cost: ~0.1 s."""
    _, _, start_router, _ = stack
    router = await start_router(api_key=KEY)
    host, port = router.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000000\r\n\r\n")
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), 2.0)  # the body never comes
    assert status_line.startswith(b"HTTP/1.1 401"), status_line
    writer.close()


@pytest.mark.asyncio
async def test_the_open_paths_need_no_key(stack):
    """With the key set, /health and /readyz (the kubelet's probes) answer without it, and the peer push keeps its
    own bearer token: the API key is neither required nor enough there. Cost: ~0.1 s."""
    _, _, start_router, client = stack
    router = await start_router(api_key=KEY, peers_token=PEERS_TOKEN)
    async with client.get(router + "/health") as resp:
        assert resp.status == 200
    async with client.get(router + contract.READYZ_PATH) as resp:
        assert resp.status == 200, await resp.text()
    async with client.get(router + contract.PEERS_PATH, headers={"Authorization": f"Bearer {PEERS_TOKEN}"}) as resp:
        assert resp.status == 200
    async with client.get(router + contract.PEERS_PATH, headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status == 401 and "PDPAIR_PEERS_TOKEN" in await resp.text()  # the push's own refusal


@pytest.mark.asyncio
async def test_without_a_key_the_router_serves_as_before(stack):
    """No key (unset, or an empty VLLM_API_KEY): no header needed, none sent to the engines; a client's own
    Authorization header is not passed on. Cost: ~0.1 s."""
    prefill, decode, start_router, client = stack
    for config in ({}, {"api_key": ""}):
        router = await start_router(**config)
        async with client.post(router + "/v1/completions", json=BODY) as resp:
            assert resp.status == 200
        async with client.post(router + "/v1/completions", json=BODY,
                               headers={"Authorization": "Bearer client-own"}) as resp:
            assert resp.status == 200
        async with client.get(router + "/v1/not-a-route") as resp:
            assert resp.status == 404
    assert len(prefill.received) == len(decode.received) == 4
    assert all("Authorization" not in headers for _, _, headers in prefill.received + decode.received)


@pytest.mark.parametrize("bad", [KEY + "\n", " " + KEY, KEY + " ", "key\twith-tab", "clé-non-ascii", "\n"])
def test_a_key_no_client_could_send_is_refused_at_start_without_its_value(bad):
    """A key with surrounding whitespace (a Secret made from a file: a trailing newline), a control character or a
    non-ASCII one could never match a header: make_app refuses it naming VLLM_API_KEY, never the value. Cost:
    milliseconds."""
    with pytest.raises(ValueError, match=contract.ENV_API_KEY) as info:
        make_app(RouterConfig(("http://p",), ("http://d",), api_key=bad))
    assert bad.strip() not in str(info.value) or not bad.strip()
    assert check_api_key("a b:c/d=e+f") == "a b:c/d=e+f"  # inner spaces and punctuation are fine


def test_the_key_is_read_from_the_environment_once_and_never_shown(capsys, monkeypatch):
    """config_from_args takes VLLM_API_KEY from the environment it is given ("" is no key); the config's repr leaves
    it out (it is logged nowhere); a bad key is a usage error that does not print it. Cost: milliseconds."""
    args = build_parser().parse_args(["--port", "0", "--prefill", "http://p:1", "--decode", "http://d:2"])
    config = config_from_args(args, {contract.ENV_API_KEY: KEY})
    assert config.api_key == KEY and KEY not in repr(config)
    assert config_from_args(args, {contract.ENV_API_KEY: ""}).api_key is None
    assert config_from_args(args, {}).api_key is None
    monkeypatch.setenv(contract.ENV_API_KEY, KEY + "\n")  # main reads the process environment
    with pytest.raises(SystemExit) as info:
        router_main(["--port", "0", "--prefill", "http://p:1", "--decode", "http://d:2"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert contract.ENV_API_KEY in err and KEY not in err
