"""Both legs at once (the router's --concurrent-legs): decode gets its request together with prefill's, naming the
transfer by the router's key and the prefill by the identity it answered with before; real aiohttp servers stand in
for the engines. The engine tier runs the same through real engines. Cost: about 2 s, no engine."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest

from pdpair.connector.metadata import TRANSFER_KEY_PATTERN
from pdpair.router.app import make_app
from pdpair.router.config import RouterConfig
from pdpair.router.pools import ROUTER
from tests.router_support import Engine
from tests.router_support import engine_server as _engine_server
from tests.router_support import serve as _serve

IDENTITY = {"remote_instance": "prefill-0", "remote_pair": "demo", "remote_generation": 4}


async def start(**overrides):
    prefill, decode = Engine("prefill"), Engine("decode")
    prefill.params = {"do_remote_prefill": True, "remote_request_id": "cmpl-p-1", **IDENTITY}
    runners = []
    for engine in (prefill, decode):
        runner, url = await _engine_server(engine)
        engine.url = url
        runners.append(runner)
    app = make_app(RouterConfig((prefill.url,), (decode.url,), concurrent_legs=True, **overrides))
    runner, router = await _serve(app)
    runners.append(runner)
    return prefill, decode, router, app, runners


@pytest.mark.asyncio
async def test_after_a_prefills_first_answer_both_legs_go_at_once_naming_one_key():
    prefill, decode, router, app, runners = await start()
    try:
        async with aiohttp.ClientSession() as client:
            body = {"prompt": "p", "max_tokens": 3}
            async with client.post(router + "/v1/completions", json=body) as resp:  # learns the identity: sequential
                assert resp.status == 200
            assert decode.received[0][1]["kv_transfer_params"] == prefill.params
            assert app[ROUTER].prefill_identity == {prefill.url: IDENTITY}
            prefill.delay = 0.5  # the second prefill answer comes late: decode must have its request before it
            async with client.post(router + "/v1/completions", json=body) as resp:
                assert resp.status == 200 and (await resp.json())["id"] == "decode-answer"
        p_params = prefill.received[1][1]["kv_transfer_params"]
        d_params = decode.received[1][1]["kv_transfer_params"]
        key = p_params["pdpair_transfer_key"]
        assert re.fullmatch(TRANSFER_KEY_PATTERN, key)
        assert d_params == {**IDENTITY, "do_remote_prefill": True, "do_remote_decode": False,
                            "remote_request_id": key, "pdpair_transfer_key": key}
    finally:
        prefill.release.set()
        for runner in runners:
            await runner.cleanup()


@pytest.mark.asyncio
async def test_a_prefill_that_fails_first_cancels_decodes_request_and_is_the_answer():
    prefill, decode, router, app, runners = await start(prefill_timeout_seconds=0.5)
    app[ROUTER].prefill_identity[prefill.url] = dict(IDENTITY)
    decode.delay = 30.0  # decode waits for KV that never comes
    prefill.status = 500
    try:
        async with aiohttp.ClientSession() as client:
            started = asyncio.get_running_loop().time()
            async with client.post(router + "/v1/completions", json={"prompt": "p", "max_tokens": 3}) as resp:
                assert resp.status == 502
                assert (await resp.json())["error"]["peer"] == "prefill"
            assert asyncio.get_running_loop().time() - started < 10, "decode's request must not be waited out"
        assert len(decode.received) == 1  # it was sent, then cancelled
    finally:
        decode.release.set()
        for runner in runners:
            await runner.cleanup()


@pytest.mark.asyncio
async def test_an_answer_without_an_identity_keeps_that_prefill_sequential():
    prefill, decode, router, app, runners = await start()
    prefill.params = {"do_remote_prefill": True, "remote_request_id": "cmpl-p-1", "remote_generation": 0}
    try:
        async with aiohttp.ClientSession() as client:
            for _ in range(2):
                async with client.post(router + "/v1/completions", json={"prompt": "p"}) as resp:
                    assert resp.status == 200
        assert app[ROUTER].prefill_identity == {}
        assert all("pdpair_transfer_key" not in body["kv_transfer_params"] for _, body, _ in prefill.received)
    finally:
        for runner in runners:
            await runner.cleanup()
