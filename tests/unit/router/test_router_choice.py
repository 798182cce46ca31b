"""The router's choice among several prefill and decode instances (docs/xpyd.md section 5), against real aiohttp
servers standing in for the engines' HTTP side (tests/router_support.py) and the real router app on a free port.

Cost: no engine, no cluster; about 5 s in all on a 2-core box. Counts are asserted with wide margins (a loaded box
delays every fake engine alike; the choice depends on requests in flight, not on timing)."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
import pytest_asyncio

from pdpair.router.__main__ import build_parser, config_from_args
from pdpair.router.app import ROUTE_HEADER, make_app
from pdpair.router.kv_usage import parse_kv_usage
from pdpair.router.config import RouterConfig
from pdpair.router.pools import Pool
from tests.router_support import serve, start_engines


@pytest_asyncio.fixture
async def fleet():
    """start(n_prefill, n_decode, **config) -> (router URL, prefills, decodes); dead_url() -> a refused URL."""
    runners, sockets = [], []

    async def start(n_prefill: int, n_decode: int, prefill_urls=(), decode_urls=(), **overrides):
        prefills, decodes, urls = await start_engines(n_prefill, n_decode, runners)
        # Extra URLs (dead ones) come first: index 0 is a fresh router's first choice.
        config = RouterConfig(tuple(prefill_urls) + tuple(urls[e.name] for e in prefills),
                              tuple(decode_urls) + tuple(urls[e.name] for e in decodes), **overrides)
        runner, router = await serve(make_app(config))
        runners.append(runner)
        return router, prefills, decodes

    def dead_url() -> str:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))  # bound, never listening: connection refused
        sockets.append(s)
        return f"http://127.0.0.1:{s.getsockname()[1]}"

    async with aiohttp.ClientSession() as client:
        yield start, dead_url, client
    for runner in reversed(runners):
        await runner.cleanup()
    for s in sockets:
        s.close()


async def _complete(client: aiohttp.ClientSession, router: str, headers: dict | None = None) -> int:
    async with client.post(router + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, headers=headers) as resp:
        await resp.read()
        return resp.status


async def _load(client: aiohttp.ClientSession, router: str, total: int, concurrency: int) -> list[int]:
    queue = list(range(total))
    statuses: list[int] = []

    async def worker() -> None:
        while queue:
            queue.pop()
            statuses.append(await _complete(client, router))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return statuses


@pytest.mark.asyncio
async def test_equal_instances_share_the_load_evenly(fleet):
    start, _, client = fleet
    router, prefills, decodes = await start(2, 2)
    for engine in prefills + decodes:
        engine.delay = 0.02
    statuses = await _load(client, router, total=96, concurrency=16)
    assert statuses == [200] * 96
    for role in (prefills, decodes):
        counts = [len(e.received) for e in role]
        assert sum(counts) == 96
        assert all(38 <= c <= 58 for c in counts), counts  # 48 each, within 20 %


@pytest.mark.asyncio
async def test_a_slow_decode_gets_fewer_requests(fleet):
    """Decode 1 answers in 0.4 s, decode 0 at once: the one with fewer requests in flight wins each choice."""
    start, _, client = fleet
    router, _, decodes = await start(1, 2)
    decodes[1].delay = 0.4
    statuses = await _load(client, router, total=60, concurrency=8)
    assert statuses == [200] * 60
    fast, slow = (len(e.received) for e in decodes)
    assert fast + slow == 60
    # Round-robin would give 30 each; by load the slow one holds ~0.4 s per request while the fast one frees at once.
    assert slow <= 20 < fast, (fast, slow)


@pytest.mark.asyncio
async def test_a_refused_decode_is_tried_once_within_the_cooldown(fleet):
    start, dead_url, client = fleet
    router, _, decodes = await start(1, 1, decode_urls=[dead_url()], failure_cooldown_seconds=60)
    statuses = [await _complete(client, router) for _ in range(12)]
    # A decode request is never sent twice (its KV may be read): the one request that met the dead decode fails,
    # every later one goes to the live decode while the dead one cools down.
    assert statuses.count(502) <= 1 and statuses.count(200) >= 11, statuses
    assert len(decodes[0].received) == statuses.count(200)


@pytest.mark.asyncio
async def test_a_refused_prefill_is_skipped_and_its_requests_go_to_another(fleet):
    start, dead_url, client = fleet
    router, prefills, decodes = await start(1, 1, prefill_urls=[dead_url()], failure_cooldown_seconds=60)
    statuses = [await _complete(client, router) for _ in range(8)]
    # The dead prefill never saw a request it refused: each one that met it went on to the live prefill.
    assert statuses == [200] * 8
    assert len(prefills[0].received) == 8 and len(decodes[0].received) == 8


@pytest.mark.asyncio
async def test_a_dropped_prefill_connection_is_sent_once_more_to_another_prefill(fleet):
    start, _, client = fleet
    router, prefills, decodes = await start(2, 1)
    prefills[0].drop_first = 1  # a fresh router chooses index 0 first
    assert await _complete(client, router) == 200
    assert [len(p.received) for p in prefills] == [1, 1]
    assert len(decodes[0].received) == 1


@pytest.mark.asyncio
async def test_one_instance_per_role_fails_open_after_an_error(fleet):
    """With nothing else to choose, a decode cooling down after a 500 still takes the next request."""
    start, _, client = fleet
    router, _, decodes = await start(1, 1, failure_cooldown_seconds=60)
    decodes[0].status = 500
    assert await _complete(client, router) == 502
    decodes[0].status = 200
    assert await _complete(client, router) == 200


@pytest.mark.asyncio
async def test_kv_cache_usage_breaks_ties_between_idle_decodes(fleet):
    start, _, client = fleet
    router, _, decodes = await start(1, 2, kv_scrape_interval_seconds=0.05)
    decodes[0].kv_usage, decodes[1].kv_usage = 0.9, 0.1
    deadline = asyncio.get_running_loop().time() + 10
    while min(d.metrics_scrapes for d in decodes) < 2:  # each scraped and recorded at least once
        assert asyncio.get_running_loop().time() < deadline, "the router did not scrape the decodes' /metrics"
        await asyncio.sleep(0.05)
    for _ in range(6):  # sequential: every choice is a tie on requests in flight
        assert await _complete(client, router) == 200
    assert [len(d.received) for d in decodes] == [0, 6]


@pytest.mark.asyncio
async def test_without_kv_usage_from_every_decode_ties_go_round_robin(fleet):
    """A decode whose /metrics has no usage says nothing about its load: ranking it would starve it or favour it."""
    start, _, client = fleet
    router, _, decodes = await start(1, 2, kv_scrape_interval_seconds=0.05)
    decodes[0].kv_usage = 0.9  # decode 1 answers /metrics 404
    deadline = asyncio.get_running_loop().time() + 10
    while min(d.metrics_scrapes for d in decodes) < 2:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)
    for _ in range(6):
        assert await _complete(client, router) == 200
    assert [len(d.received) for d in decodes] == [3, 3]


@pytest.mark.asyncio
async def test_a_forced_route_reaches_exactly_that_pair_only_under_debug_routing(fleet):
    start, _, client = fleet
    router, prefills, decodes = await start(2, 3, debug_routing=True)
    for p in range(2):
        for d in range(3):
            assert await _complete(client, router, {ROUTE_HEADER: f"{p},{d}"}) == 200
            assert len(prefills[p].received) == d + 1 and len(decodes[d].received) == p + 1
    assert [len(p.received) for p in prefills] == [3, 3]
    assert [len(d.received) for d in decodes] == [2, 2, 2]
    for bad in ("2,0", "0,3", "-1,0", "0", "a,b", "0,1,2"):
        async with client.post(router + "/v1/completions", json={"prompt": "x"}, headers={ROUTE_HEADER: bad}) as resp:
            assert resp.status == 400, bad
            assert ROUTE_HEADER in (await resp.json())["error"]["message"]
    assert sum(len(e.received) for e in prefills + decodes) == 12  # a refused route reached no engine

    plain, prefills, decodes = await start(2, 1)  # without --debug-routing the header is ignored
    for _ in range(4):
        assert await _complete(client, plain, {ROUTE_HEADER: "1,0"}) == 200
    assert [len(p.received) for p in prefills] == [2, 2]


def test_pool_prefers_instances_not_cooling_down_and_skips_the_excluded_one():
    now = [0.0]
    pool = Pool("prefill", ("http://a", "http://b", "http://c"), cooldown_seconds=5, clock=lambda: now[0])
    a, b, c = pool.instances
    pool.failed(a)
    assert {pool.choose().url for _ in range(4)} == {"http://b", "http://c"}
    assert pool.choose(exclude=b) is c
    now[0] = 5.01  # a's cooldown is over
    assert a in [pool.choose() for _ in range(3)]
    only = Pool("decode", ("http://d",), cooldown_seconds=5, clock=lambda: now[0])
    only.failed(only.instances[0])
    assert only.choose() is only.instances[0] and only.choose(exclude=only.instances[0]) is only.instances[0]


def test_parse_kv_usage_reads_the_fullest_engine_and_nothing_else():
    page = (
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="a}b"} 0.5\n'
        "vllm:kv_cache_usage_perc_other 0.99\n"
        'vllm:num_requests_running{engine="0"} 7\n'
    )
    assert parse_kv_usage(page) == 0.5
    assert parse_kv_usage("vllm:kv_cache_usage_perc 0.125\n") == 0.125
    assert parse_kv_usage("vllm:kv_cache_usage_perc NaN\n") is None
    assert parse_kv_usage("# nothing\n") is None


def test_cli_repeats_flags_into_instances_and_refuses_one_instance_twice(capsys):
    parser = build_parser()
    args = parser.parse_args(["--port", "1", "--prefill", "http://p0:8000", "--prefill", "http://p1:8000/",
                              "--decode", "http://d0:8000"])
    config = config_from_args(args)
    assert config.prefill_urls == ("http://p0:8000", "http://p1:8000/") and config.decode_urls == ("http://d0:8000",)
    app = make_app(config)
    assert app is not None
    for urls, match in (
        (("http://d0", "http://D0:80/"), "names one instance twice"),
        (("http://",), "with a host"),
        (("ftp://d0",), "http\\(s\\) URL"),
        ((), "at least one URL"),
    ):
        with pytest.raises(ValueError, match=match):
            make_app(RouterConfig(("http://p",), urls))


@pytest.mark.asyncio
async def test_a_prefill_that_accepts_no_connection_is_skipped_like_a_refused_one(fleet):
    """A prefill on a partitioned node drops the handshake: the connect times out, the request never reached it,
    so it goes on to the live prefill (and the silent one cools down). The silence: a listening socket whose
    accept queue is full (Linux drops further SYNs). Costs about 1 s."""
    start, _, client = fleet
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(0)
    fillers = []
    for _ in range(3):  # backlog 0 holds one connection; the rest wait in SYN retries
        f = socket.socket()
        f.setblocking(False)
        f.connect_ex(silent.getsockname())
        fillers.append(f)
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        router, prefills, decodes = await start(1, 1, prefill_urls=[url], failure_cooldown_seconds=60,
                                                connect_timeout_seconds=0.5)
        statuses = [await _complete(client, router) for _ in range(4)]
        assert statuses == [200] * 4
        assert len(prefills[0].received) == 4 and len(decodes[0].received) == 4
    finally:
        for f in fillers:
            f.close()
        silent.close()
