"""The router's readiness (/readyz): the operator creates the router while the engines still load (desired.py step
5b), so the router is Ready only while at least one prefill and one decode pass their own readiness. Against real
aiohttp servers standing in for the engines' HTTP side (tests/router_support.py) and the real router app.

Cost: no engine, no cluster; about 2 s on a 2-core box."""

from __future__ import annotations

import time

import aiohttp
import pytest
import pytest_asyncio

from pdpair.router.__main__ import build_parser, config_from_args
from pdpair.router.app import make_app
from pdpair.router.config import RouterConfig
from tests.router_support import serve, start_engines


@pytest_asyncio.fixture
async def fleet():
    """start(n_prefill, n_decode, ready_urls=True, **config) -> (router URL, prefills, decodes); with ready_urls
    each instance's readiness is given as its /readyz, else the router falls back to its /health."""
    runners = []

    async def start(n_prefill: int, n_decode: int, ready_urls: bool = True, **overrides):
        prefills, decodes, urls = await start_engines(n_prefill, n_decode, runners)
        ready = {name: url + "/readyz" for name, url in urls.items()} if ready_urls else {}
        config = RouterConfig(
            tuple(urls[e.name] for e in prefills), tuple(urls[e.name] for e in decodes),
            prefill_ready_urls=tuple(ready[e.name] for e in prefills if e.name in ready),
            decode_ready_urls=tuple(ready[e.name] for e in decodes if e.name in ready), **overrides)
        runner, router = await serve(make_app(config))
        runners.append(runner)
        return router, prefills, decodes

    async with aiohttp.ClientSession() as client:
        yield start, client
    for runner in reversed(runners):
        await runner.cleanup()


async def _readyz(client: aiohttp.ClientSession, router: str) -> tuple[int, dict]:
    async with client.get(router + "/readyz") as resp:
        return resp.status, await resp.json()


@pytest.mark.asyncio
async def test_ready_only_while_a_prefill_and_a_decode_are(fleet):
    start, client = fleet
    router, [prefill], [decode] = await start(1, 1)
    prefill.ready = decode.ready = False  # both loading
    status, body = await _readyz(client, router)
    assert status == 503 and body["ready"] is False
    assert body["prefill"][0]["ready"] is False and body["prefill"][0]["detail"] == "HTTP 503", body
    decode.ready = True  # decode serves, prefill not paired yet: still not Ready
    assert (await _readyz(client, router))[0] == 503
    prefill.ready = True
    status, body = await _readyz(client, router)
    assert status == 200 and body["ready"] is True
    assert [e["ready"] for e in body["prefill"] + body["decode"]] == [True, True]
    assert body["decode"][0]["url"].endswith("/readyz")
    # liveness is the router's own: it answers whatever its backends say
    decode.ready = False
    assert (await _readyz(client, router))[0] == 503
    async with client.get(router + "/health") as resp:
        assert resp.status == 200


@pytest.mark.asyncio
async def test_one_ready_instance_per_role_is_enough(fleet):
    start, client = fleet
    router, prefills, decodes = await start(2, 2)
    prefills[0].ready = decodes[1].ready = False
    status, body = await _readyz(client, router)
    assert status == 200, body
    assert [e["ready"] for e in body["prefill"]] == [False, True] and [e["ready"] for e in body["decode"]] == [True, False]
    prefills[1].ready = False
    assert (await _readyz(client, router))[0] == 503


@pytest.mark.asyncio
async def test_an_instance_that_does_not_answer_in_time_is_not_ready(fleet):
    """Every instance is asked at once, each bounded by ready_check_timeout_seconds (0.3 s here; 2.5 s by default,
    below the kubelet probe's 3 s): one that hangs costs that bound, not the probe. Bound asserted: 2.5 s."""
    start, client = fleet
    router, [prefill], decodes = await start(1, 2, ready_check_timeout_seconds=0.3)
    prefill.ready_delay = 5.0
    began = time.monotonic()
    status, body = await _readyz(client, router)
    took = time.monotonic() - began
    assert status == 503 and body["prefill"][0]["detail"].startswith(("TimeoutError", "ServerTimeoutError")), body
    assert all(e["ready"] for e in body["decode"]) and took < 2.5, (took, body)
    prefill.release.set()  # its answer now: the fixture's teardown need not wait out the 5 s


@pytest.mark.asyncio
async def test_without_readiness_urls_each_instance_health_is_asked(fleet):
    start, client = fleet
    router, [prefill], [decode] = await start(1, 1, ready_urls=False)
    status, body = await _readyz(client, router)
    assert status == 200 and body["prefill"][0]["url"].endswith("/health"), body
    assert prefill.ready_asked == decode.ready_asked == 1
    decode.ready = False
    assert (await _readyz(client, router))[0] == 503


def test_readiness_urls_must_match_their_instances():
    parser = build_parser()
    args = parser.parse_args(["--port", "1", "--prefill", "http://p0:8000", "--prefill", "http://p1:8000",
                              "--decode", "http://d0:8000", "--prefill-ready", "http://p0:9000/readyz",
                              "--prefill-ready", "http://p1:9000/readyz"])
    config = config_from_args(args)
    assert config.prefill_ready_urls == ("http://p0:9000/readyz", "http://p1:9000/readyz")
    assert config.decode_ready_urls == ()
    assert make_app(config) is not None
    for kwargs, match in (
        ({"prefill_ready_urls": ("http://p0:9000/readyz",)}, "given 1 time\\(s\\) for 2 instance"),
        ({"decode_ready_urls": ("http://d0:9000/readyz", "http://d1:9000/readyz")}, "given 2 time\\(s\\) for 1"),
        ({"decode_ready_urls": ("d0:9000",)}, "with a host"),
        ({"decode_ready_urls": "http://d0:9000/readyz"}, "takes a tuple"),
    ):
        with pytest.raises(ValueError, match=match):
            make_app(RouterConfig(("http://p0:8000", "http://p1:8000"), ("http://d0:8000",), **kwargs))


def test_the_bounds_nest_an_engine_inside_the_router_inside_the_kubelet():
    """An engine's /readyz waits up to ENGINE_HEALTH_TIMEOUT_SECONDS for its engine's /health; the router must wait
    longer than that for it (else a slow but healthy engine reads as not ready), and less than the kubelet waits for
    the router's own probe (else the probe times out before the router can answer 503 with the reason)."""
    from pdpair.connector.pod_server import ENGINE_HEALTH_TIMEOUT_SECONDS
    from pdpair.operator.build.pod_defaults import PROBE_WAIT_SECONDS, READINESS_PROBE

    # the probe is held up to PROBE_WAIT_SECONDS while it fails; its last ask may start just before that ends
    assert ENGINE_HEALTH_TIMEOUT_SECONDS < RouterConfig.ready_check_timeout_seconds < \
        READINESS_PROBE["timeoutSeconds"] - PROBE_WAIT_SECONDS


@pytest.mark.asyncio
async def test_a_held_probe_answers_when_the_engines_become_ready_and_a_bad_wait_is_refused(fleet):
    """`/readyz?wait=S` (the operator's probe asks for 1 s) is held while the router is not ready and answers 200 as
    soon as a re-check passes (every PROBE_WAIT_POLL_SECONDS), not after the hold: the kubelet sees the router Ready
    within a fraction of a second of its engines. One that stays not ready answers 503 once the hold is over. Costs
    about 1.5 s; bounds: the hold itself (3 s), never a re-check's timing."""
    import asyncio

    start, client = fleet
    router, [prefill], [decode] = await start(1, 1)
    prefill.ready = False
    began = time.monotonic()
    held = asyncio.ensure_future(client.get(router + "/readyz?wait=3"))
    await asyncio.sleep(0.5)
    assert not held.done()  # still held: nothing answered 503 early
    prefill.ready = True
    async with await held as resp:
        assert resp.status == 200, await resp.text()
    assert time.monotonic() - began < 3.0  # answered on a re-check, not when the hold ran out

    prefill.ready = False
    began = time.monotonic()
    async with client.get(router + "/readyz?wait=0.5") as resp:
        assert resp.status == 503 and (await resp.json())["ready"] is False
    assert time.monotonic() - began >= 0.5
    for bad in ("abc", "-1", "nan", "inf"):
        async with client.get(router + f"/readyz?wait={bad}") as resp:
            assert resp.status == 400 and "wait must be a number" in (await resp.json())["error"], bad
