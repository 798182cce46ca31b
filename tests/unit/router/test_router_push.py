"""The router's pushed instance sets (`PUT /pdpair/v1/peers`, docs/xpyd.md sections 3, 5, 6): the token, malformed
bodies, epochs, added, draining and leaving instances, readiness, and requests served while the sets are swapped.
Against real aiohttp servers standing in for the engines' HTTP side (tests/router_support.py) and the real router app
on a free port.

Cost: no engine, no cluster; about 2 s in all on a busy 2-core box. Nothing depends on timing: a request is held in flight
by an event the test sets, and every wait polls a condition under a wide deadline."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import pytest_asyncio

from pdpair.contract import ENV_PEERS_TOKEN, PEERS_PATH
from pdpair.router.__main__ import build_parser, config_from_args
from pdpair.contract.router_peers import RouterMember
from pdpair.router.app import ROUTE_HEADER, make_app
from pdpair.router.config import RouterConfig
from pdpair.router.pools import Pool
from tests.router_support import Engine, engine_server, serve

TOKEN = "router-unit-test-token-0123456789"
DEADLINE = 20.0  # seconds for a polled condition: far above what it takes on a loaded box


class GatedEngine(Engine):
    """An engine stand-in whose requests wait for `gate` (when set) before they are answered: a request in flight for
    as long as the test wants, with no timing in it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.gate: asyncio.Event | None = None
        self.arrived = 0  # requests that reached it (counted before the gate)
        self.waiting = 0  # requests waiting at the gate now

    async def handle(self, request):
        self.arrived += 1
        if self.gate is not None:
            self.waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1
        return await super().handle(request)


@pytest_asyncio.fixture
async def fleet():
    """start(n_prefill, n_decode, flags=(1, 1), token=TOKEN, **config) -> (router URL, prefills, decodes, urls); the
    router gets the first flags[0] prefills and flags[1] decodes as flags, the rest only through a push."""
    runners = []

    async def start(n_prefill: int, n_decode: int, flags=(1, 1), token: str | None = TOKEN, **overrides):
        prefills = [GatedEngine(f"prefill-{i}") for i in range(n_prefill)]
        decodes = [GatedEngine(f"decode-{i}") for i in range(n_decode)]
        urls = {}
        for engine in prefills + decodes:
            runner, urls[engine] = await engine_server(engine)
            runners.append(runner)
        config = RouterConfig(tuple(urls[e] for e in prefills[:flags[0]]), tuple(urls[e] for e in decodes[:flags[1]]),
                              peers_token=token, **overrides)
        runner, router = await serve(make_app(config))
        runners.append(runner)
        return router, prefills, decodes, urls

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
        yield start, client
    for runner in reversed(runners):
        await runner.cleanup()


def body(epoch: int, urls: dict, prefills: list, decodes: list, draining=(), generation: int = 2) -> dict:
    """A pushed body: each role's engines with index = place in the list (or (index, engine) pairs)."""
    def role(engines: list) -> list[dict]:
        out = []
        for place, item in enumerate(engines):
            index, engine = item if isinstance(item, tuple) else (place, item)
            out.append({"index": index, "url": urls[engine], "readyUrl": urls[engine] + "/readyz",
                        "draining": engine in draining})
        return out

    return {"epoch": epoch, "generation": generation, "prefills": role(prefills), "decodes": role(decodes)}


async def call(client: aiohttp.ClientSession, router: str, method: str, payload=None, token: str | None = TOKEN,
               scheme: str = "Bearer") -> tuple[int, dict]:
    headers = {} if token is None else {"Authorization": f"{scheme} {token}"}
    kwargs = {"data": payload} if isinstance(payload, (str, bytes)) else {"json": payload}
    async with client.request(method, router + PEERS_PATH, headers=headers, **kwargs) as resp:
        return resp.status, await resp.json()


async def complete(client: aiohttp.ClientSession, router: str, headers: dict | None = None) -> int:
    async with client.post(router + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, headers=headers) as resp:
        await resp.read()
        return resp.status


async def wait_for(what: str, condition) -> None:
    deadline = asyncio.get_running_loop().time() + DEADLINE
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not within {DEADLINE}s"
        await asyncio.sleep(0.02)


def by_url(state: dict, role: str) -> dict[str, dict]:
    return {entry["url"]: entry for entry in state[role]}


@pytest.mark.asyncio
async def test_the_endpoint_needs_the_token_and_is_absent_without_it(fleet):
    start, client = fleet
    plain, *_ = await start(1, 1, token=None)
    for method in ("GET", "PUT"):
        status, answer = await call(client, plain, method, {})
        assert status == 404 and ENV_PEERS_TOKEN in answer["error"], answer
    assert await complete(client, plain) == 200  # the flags' instances, as before

    router, [p0], [d0], urls = await start(1, 1)
    for token, scheme in ((None, "Bearer"), ("wrong-token-0123456789-abcdef", "Bearer"), (TOKEN, "Basic"),
                          (TOKEN[:-1], "Bearer"), (TOKEN + "x", "Bearer")):
        for method in ("GET", "PUT"):
            status, answer = await call(client, router, method, body(1, urls, [p0], [d0]), token=token, scheme=scheme)
            assert status == 401 and ENV_PEERS_TOKEN in answer["error"], (token, scheme, method, answer)
    status, state = await call(client, router, "GET")
    assert status == 200 and state["epoch"] is None and state["generation"] is None  # nothing pushed (nor applied)
    assert state["prefills"] == [{"index": 0, "url": urls[p0], "outstanding": 0, "involved": 0,
                                  "draining": False}]
    assert state["leaving"] == [] and state["warnings"] == []


def test_the_token_is_checked_at_start_and_the_flags_are_optional_with_it():
    for weak in ("short", "sixteen chars ok", "x" * 15, "é" * 20):
        with pytest.raises(ValueError, match=ENV_PEERS_TOKEN):
            make_app(RouterConfig(("http://p",), ("http://d",), peers_token=weak))
    args = build_parser().parse_args(["--port", "1"])
    config = config_from_args(args, environ={ENV_PEERS_TOKEN: TOKEN})
    assert config.prefill_urls == () and config.peers_token == TOKEN and TOKEN not in repr(config)
    assert make_app(config) is not None
    with pytest.raises(ValueError, match=f"--prefill: at least one URL is required.*{ENV_PEERS_TOKEN}"):
        make_app(config_from_args(args, environ={}))


@pytest.mark.asyncio
async def test_a_malformed_push_is_400_naming_the_field_and_an_older_epoch_409(fleet):
    start, client = fleet
    router, [p0], [d0, d1], urls = await start(1, 2)
    good = body(5, urls, [p0], [d0, d1])
    status, state = await call(client, router, "PUT", good)
    assert status == 200 and state["epoch"] == 5 and state["generation"] == 2, state

    def bad(change) -> dict:
        doc = body(6, urls, [p0], [d0])
        change(doc)
        return doc

    cases = [
        ("not json", "not JSON"),
        ("[1]", "JSON object"),
        (bad(lambda d: d.pop("epoch")), "epoch"),
        (bad(lambda d: d.update(epoch=True)), "epoch"),
        (bad(lambda d: d.update(generation=-1)), "generation"),
        (bad(lambda d: d.update(decodes={"0": {}})), "decodes must be a list"),
        (bad(lambda d: d.pop("prefills")), "prefills must be a list"),
        (bad(lambda d: d["decodes"].append("x")), "decodes[1] must be an object"),
        (bad(lambda d: d["decodes"][0].update(index="0")), "decodes[0].index"),
        (bad(lambda d: d["prefills"][0].update(url="10.0.0.5:8000")), "prefills[0].url"),
        (bad(lambda d: d["decodes"][0].pop("readyUrl")), "decodes[0].readyUrl"),
        (bad(lambda d: d["decodes"][0].update(draining="yes")), "decodes[0].draining"),
        (bad(lambda d: d["decodes"].append({**d["decodes"][0], "url": urls[d1]})), "decodes[1].index"),
        (bad(lambda d: d["decodes"].append({**d["decodes"][0], "index": 1, "url": urls[d0] + "/"})),
         "decodes[1].url"),
        (bad(lambda d: d["decodes"].append({**d["prefills"][0], "index": 1})), "prefills[0].url"),
    ]
    for payload, field in cases:
        status, answer = await call(client, router, "PUT", payload)
        assert status == 400 and field in answer["error"], (payload, answer)

    status, answer = await call(client, router, "PUT", body(4, urls, [p0], [d0]))
    assert status == 409 and answer["epoch"] == 5 and "older" in answer["error"], answer
    assert len((await call(client, router, "GET"))[1]["decodes"]) == 2  # nothing refused was applied
    for _ in range(2):  # the same epoch and body again: idempotent
        status, again = await call(client, router, "PUT", good)
        assert status == 200 and again == state
    status, state = await call(client, router, "PUT", body(5, urls, [p0], [d1]))  # the same epoch applies again
    assert status == 200 and list(by_url(state, "decodes")) == [urls[d1]], state


@pytest.mark.asyncio
async def test_an_added_decode_is_chosen_and_forced_routes_name_the_pushed_indexes(fleet):
    start, client = fleet
    router, [p0, p1], [d0, d1], urls = await start(2, 2, debug_routing=True)  # flags: p0 and d0 only
    assert [await complete(client, router) for _ in range(2)] == [200, 200]
    assert (d0.arrived, d1.arrived) == (2, 0)
    status, state = await call(client, router, "PUT", body(1, urls, [p0], [(0, d0), (7, d1)]))
    assert status == 200 and [e["index"] for e in state["decodes"]] == [0, 7], state
    assert [await complete(client, router) for _ in range(4)] == [200] * 4
    assert d1.arrived >= 1 and d0.arrived + d1.arrived == 6  # sequential requests tie: round-robin reaches it
    before = d1.arrived
    assert await complete(client, router, {ROUTE_HEADER: "0,7"}) == 200 and d1.arrived == before + 1
    async with client.post(router + "/v1/completions", json={"prompt": "x"}, headers={ROUTE_HEADER: "0,1"}) as resp:
        assert resp.status == 400 and "[0, 7]" in (await resp.json())["error"]["message"]
    assert await complete(client, router, {ROUTE_HEADER: "1,0"}) == 400  # p1 is not in the set


@pytest.mark.asyncio
async def test_a_draining_decode_gets_no_new_request_while_its_slow_one_completes(fleet):
    start, client = fleet
    router, [p0], [d0, d1], urls = await start(1, 2, flags=(1, 2), debug_routing=True)
    d0.gate = asyncio.Event()
    slow = asyncio.create_task(complete(client, router, {ROUTE_HEADER: "0,0"}))
    await wait_for("the slow request reached decode 0", lambda: d0.waiting == 1)

    status, state = await call(client, router, "PUT", body(1, urls, [p0], [d0, d1], draining={d0}))
    assert status == 200 and by_url(state, "decodes")[urls[d0]] == {"index": 0, "url": urls[d0], "outstanding": 1,
                                                                     "involved": 1, "draining": True}, state
    assert [await complete(client, router) for _ in range(6)] == [200] * 6
    assert d0.arrived == 1 and d1.arrived == 6  # no new request to the draining decode
    assert await complete(client, router, {ROUTE_HEADER: "0,0"}) == 400  # not even a forced one
    assert not slow.done()

    d0.gate.set()
    assert await slow == 200
    state = (await call(client, router, "GET"))[1]
    assert by_url(state, "decodes")[urls[d0]]["outstanding"] == 0 and state["leaving"] == []
    status, state = await call(client, router, "PUT", body(2, urls, [p0], [d0, d1]))  # back in service
    assert status == 200 and not by_url(state, "decodes")[urls[d0]]["draining"]
    await complete(client, router, {ROUTE_HEADER: "0,0"})
    assert d0.arrived == 2


@pytest.mark.asyncio
async def test_a_decode_that_left_is_leaving_until_its_last_request_ends(fleet):
    start, client = fleet
    router, [p0], [d0, d1], urls = await start(1, 2, flags=(1, 2), debug_routing=True)
    d0.gate = asyncio.Event()
    slow = [asyncio.create_task(complete(client, router, {ROUTE_HEADER: "0,0"})) for _ in range(2)]
    await wait_for("both slow requests reached decode 0", lambda: d0.waiting == 2)

    status, state = await call(client, router, "PUT", body(1, urls, [p0], [(1, d1)]))
    assert status == 200 and list(by_url(state, "decodes")) == [urls[d1]], state
    assert state["leaving"] == [{"role": "decode", "url": urls[d0], "outstanding": 2, "involved": 2}]
    assert [await complete(client, router) for _ in range(3)] == [200] * 3 and d0.arrived == 2

    d0.gate.set()
    assert await asyncio.gather(*slow) == [200, 200]
    state = (await call(client, router, "GET"))[1]
    assert state["leaving"] == [] and list(by_url(state, "decodes")) == [urls[d1]]


@pytest.mark.asyncio
async def test_readiness_fails_while_every_decode_is_draining(fleet):
    start, client = fleet
    router, [p0], [d0, d1], urls = await start(1, 2, flags=(0, 0))  # no flags: nothing until the first push

    async def readyz() -> tuple[int, dict]:
        async with client.get(router + "/readyz") as resp:
            return resp.status, await resp.json()

    status, answer = await readyz()
    assert status == 503 and len(answer["warnings"]) == 2, answer
    assert await complete(client, router) == 503
    status, state = await call(client, router, "PUT", body(1, urls, [p0], [d0, d1], draining={d0, d1}))
    assert status == 200 and len(state["warnings"]) == 1 and "no decode" in state["warnings"][0], state
    status, answer = await readyz()
    assert status == 503 and answer["decode"] == [] and "no decode" in answer["warnings"][0], answer
    async with client.post(router + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 503 and "no decode" in (await resp.json())["error"]["message"]
    assert d0.ready_asked == d1.ready_asked == 0  # a draining instance's readiness is not asked

    status, state = await call(client, router, "PUT", body(2, urls, [p0], [d0, d1], draining={d1}))
    assert status == 200 and state["warnings"] == []
    status, answer = await readyz()
    assert status == 200 and [e["url"] for e in answer["decode"]] == [urls[d0] + "/readyz"], answer
    assert await complete(client, router) == 200


@pytest.mark.asyncio
async def test_requests_in_flight_and_new_ones_all_succeed_while_the_sets_are_pushed(fleet):
    """0 failed of at least 80 requests at concurrency 8, sent from before the first push until after the fifth, while
    the pushes add, drain, remove and re-add instances (every engine stays up; each set keeps one instance of each
    role that may be chosen)."""
    start, client = fleet
    router, [p0, p1], [d0, d1, d2], urls = await start(2, 3, flags=(2, 2))
    for engine in (p0, p1, d0, d1, d2):
        engine.delay = 0.01  # requests overlap the pushes
    sets = [
        body(1, urls, [p0, p1], [d0, d1, d2]),
        body(2, urls, [p0, p1], [d0, d1, d2], draining={d0, p0}),
        body(3, urls, [(1, p1)], [(1, d1), (2, d2)]),
        body(4, urls, [p0, p1], [d0, d1, d2], draining={d2}),
        body(5, urls, [p0], [d0, (2, d2)]),
    ]
    statuses: list[int] = []
    started = 0
    pushed: list[int] = []

    async def worker() -> None:  # until every push is done and at least 80 requests were sent
        nonlocal started
        while len(pushed) < len(sets) or started < 80:
            started += 1
            statuses.append(await complete(client, router))

    async def pusher() -> None:
        for doc in sets:
            await wait_for("requests in flight", lambda: len(statuses) >= 8)
            pushed.append((await call(client, router, "PUT", doc))[0])
            await asyncio.sleep(0.05)

    await asyncio.gather(pusher(), *(worker() for _ in range(8)))
    assert pushed == [200] * 5
    assert len(statuses) >= 80 and statuses == [200] * len(statuses)
    state = (await call(client, router, "GET"))[1]
    assert state["epoch"] == 5 and state["leaving"] == []
    assert all(e["outstanding"] == 0 and e["involved"] == 0 for role in ("prefills", "decodes") for e in state[role]), state


@pytest.mark.asyncio
async def test_the_kv_usage_scrape_covers_the_decodes_that_may_be_chosen(fleet):
    start, client = fleet
    router, [p0], [d0, d1, d2], urls = await start(1, 3, flags=(1, 1), kv_scrape_interval_seconds=0.05)
    for d in (d0, d1, d2):
        d.kv_usage = 0.5
    await call(client, router, "PUT", body(1, urls, [p0], [d0, d1, d2], draining={d2}))
    await wait_for("decodes 0 and 1 scraped", lambda: d0.metrics_scrapes >= 2 and d1.metrics_scrapes >= 2)
    assert d2.metrics_scrapes == 0  # draining: not scraped


def test_a_replaced_set_keeps_each_instance_by_url():
    now = [0.0]
    pool = Pool("decode", ("http://a", "http://b"), cooldown_seconds=5, kv_usage_max_age_seconds=5,
                clock=lambda: now[0])
    a, b = pool.instances
    pool.failed(a)
    pool.record_kv_usage(b, 0.25)
    with pool.hold(b):
        pool.replace([RouterMember("decode", 3, "http://a", "http://a/readyz"),
                      RouterMember("decode", 4, "http://c", "http://c/readyz")])
        assert pool.instances[0] is a and a.index == 3 and a.ready_url == "http://a/readyz" and a.cooldown_until == 5
        assert pool.leaving == {"http://b": b} and b.draining and b.outstanding == 1
        pool.replace([RouterMember("decode", 0, "http://b", "http://b/h", draining=True)])  # b back, as draining
        assert pool.draining == [b] and pool.leaving == {} and pool.fresh_kv_usage(b) == 0.25 and pool.instances == []
        pool.replace([])
        assert pool.leaving == {"http://b": b}
    assert pool.leaving == {} and b.outstanding == 0  # its last request ended: forgotten


@pytest.mark.asyncio
async def test_a_prefill_is_involved_until_its_requests_decode_answer_ends(fleet):
    """A drain waits for `involved`, not `outstanding`: prefill pushes the KV to decode after it answered, so a prefill
    counts as involved in a request until that request's decode answer ended (or failed); one that left the set stays
    `leaving` until then. Cost: ~0.3 s, no engine (gated stand-ins, no timing)."""
    start, client = fleet
    router, [p0, p1], [d0], urls = await start(2, 1, flags=(2, 1), debug_routing=True)
    d0.gate = asyncio.Event()
    slow = asyncio.create_task(complete(client, router, {ROUTE_HEADER: "1,0"}))
    await wait_for("the request reached decode", lambda: d0.waiting == 1)

    state = (await call(client, router, "GET"))[1]
    assert by_url(state, "prefills")[urls[p1]] == {"index": 1, "url": urls[p1], "outstanding": 0, "involved": 1,
                                                   "draining": False}, state
    assert by_url(state, "prefills")[urls[p0]]["involved"] == 0
    assert by_url(state, "decodes")[urls[d0]]["outstanding"] == 1 and by_url(state, "decodes")[urls[d0]]["involved"] == 1

    status, state = await call(client, router, "PUT", body(1, urls, [p0], [d0]))  # prefill 1 leaves the set
    assert status == 200 and list(by_url(state, "prefills")) == [urls[p0]], state
    assert state["leaving"] == [{"role": "prefill", "url": urls[p1], "outstanding": 0, "involved": 1}]
    status, state = await call(client, router, "PUT", body(2, urls, [p0, p1], [d0], draining={p1}))  # back, draining
    assert by_url(state, "prefills")[urls[p1]]["involved"] == 1 and state["leaving"] == []
    status, state = await call(client, router, "PUT", body(3, urls, [p0], [d0]))
    assert [e["url"] for e in state["leaving"]] == [urls[p1]]

    d0.gate.set()
    assert await slow == 200
    state = (await call(client, router, "GET"))[1]
    assert state["leaving"] == [] and list(by_url(state, "prefills")) == [urls[p0]], state
    assert all(e["involved"] == 0 and e["outstanding"] == 0 for role in ("prefills", "decodes") for e in state[role])


@pytest.mark.asyncio
async def test_involved_ends_when_decode_fails_and_covers_both_prefills_of_a_retried_request(fleet):
    """A request sent to prefill once more (a dropped connection) involves both prefills until decode's answer ends;
    a decode that fails ends the count too. Cost: ~0.3 s, no engine (gated stand-ins, no timing)."""
    start, client = fleet
    router, [p0, p1], [d0], urls = await start(2, 1, flags=(2, 1))
    p0.drop_first = 1  # round-robin sends the first request to prefill 0, which drops it: then prefill 1
    d0.gate = asyncio.Event()
    slow = asyncio.create_task(complete(client, router))
    await wait_for("the request reached decode", lambda: d0.waiting == 1)
    state = (await call(client, router, "GET"))[1]
    assert [(e["outstanding"], e["involved"]) for e in state["prefills"]] == [(0, 1), (0, 1)], state
    d0.status = 500
    d0.gate.set()
    assert await slow == 502
    state = (await call(client, router, "GET"))[1]
    assert all(e["involved"] == 0 and e["outstanding"] == 0 for role in ("prefills", "decodes") for e in state[role])


def test_a_leaving_instance_is_forgotten_once_neither_count_holds_it():
    """Pool.hold (the load) and Pool.involve (what a drain waits for) both keep an instance that left the set `leaving`;
    it is forgotten when the last of them ends. Cost: microseconds, pure."""
    pool = Pool("prefill", ("http://a", "http://b"), cooldown_seconds=5)
    a, b = pool.instances
    with pool.involve(a):
        with pool.hold(a):
            pool.replace([RouterMember("prefill", 1, "http://b", "http://b/readyz")])
            assert pool.leaving == {"http://a": a} and a.draining
        assert pool.leaving == {"http://a": a} and a.outstanding == 0 and a.involved == 1  # still pushing its KV
    assert pool.leaving == {} and a.involved == 0 and pool.instances == [b]
