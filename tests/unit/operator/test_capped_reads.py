"""The operator reads at most a capped number of bytes of any pod's answer (operator/act/capped_read.py): a pod whose
/metrics, /healthz or push answer is larger (declared by Content-Length, or streamed without end and no length) is
judged unreachable (scrape) or refusing (push) with a message naming the cap, the operator drops the connection
instead of draining it, and the read still ends within its deadline when a pod drips bytes under the cap.

Real aiohttp servers on loopback play the pods. Cost: no engine, no cluster; about 2 s (the 4 MiB caps are crossed
for real, twice, on loopback)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from pdpair import contract
from pdpair.operator.act import push as push_mod
from pdpair.operator.act import scrape
from pdpair.operator.act.capped_read import AnswerTooLarge, format_bytes, read_capped
from pdpair.operator.decide.health import PodState, ScrapeTarget
from tests.router_support import serve as serve_app

TOKEN = "capped-read-unit-token-0123456789abcdef"
GOOD_METRICS = (f"# TYPE {contract.PAIR_GENERATION.name} gauge\n{contract.PAIR_GENERATION.name} 3\n"
                f"# TYPE {contract.SIGNAL_WAIT_OLDEST_SECONDS.name} gauge\n"
                f'{contract.SIGNAL_WAIT_OLDEST_SECONDS.name}{{role="decode",rank="0"}} 0\n'
                f"# TYPE {contract.HANG_TIMEOUT_SECONDS.name} gauge\n"
                f'{contract.HANG_TIMEOUT_SECONDS.name}{{role="decode"}} 30\n')
# A hung pod: its /metrics is fine, its /healthz (read for the stuck transfer) is the oversized part.
HUNG_METRICS = GOOD_METRICS.replace(f"{contract.SIGNAL_WAIT_OLDEST_SECONDS.name}{{role=\"decode\",rank=\"0\"}} 0",
                                    f"{contract.SIGNAL_WAIT_OLDEST_SECONDS.name}{{role=\"decode\",rank=\"0\"}} 99") + (
    f"# TYPE {contract.SIGNAL_DEFICIT.name} gauge\n"
    f'{contract.SIGNAL_DEFICIT.name}{{role="decode",rank="0",peer="10.0.0.1:20000"}} 2\n')


class Flood:
    """A handler that streams `chunk` without a Content-Length until the client goes away (or `cap` bytes: a
    safety stop for a broken reader, far above every limit); records how much it wrote and how the stream ended."""

    def __init__(self, status: int = 200, cap: int = 256 << 20, drip: float = 0.0):
        self.status, self.cap, self.drip = status, cap, drip
        self.sent = 0
        self.ended: str | None = None

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=self.status, headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        chunk = b"#" * 1023 + b"\n"  # comment lines: any prefix of the stream is valid exposition text
        try:
            while self.sent < self.cap:
                await resp.write(chunk)
                self.sent += len(chunk)
                if self.drip:
                    await asyncio.sleep(self.drip)
            self.ended = "cap"
        except (ConnectionError, RuntimeError) as exc:  # aiohttp: ClientConnectionResetError / closing transport
            self.ended = type(exc).__name__
        except asyncio.CancelledError:  # aiohttp cancels the handler when the peer disconnects
            self.ended = "cancelled"
            raise
        return resp


def declared(size: int, status: int = 200, content_type: str = "text/plain"):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=status, body=b"{" + b" " * (size - 2) + b"}", content_type=content_type)
    return handler


def fixed(text: str, status: int = 200, content_type: str = "text/plain"):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=status, text=text, content_type=content_type)
    return handler


@pytest_asyncio.fixture
async def pod():
    """Serves one app per test on loopback; yields (add_route, base_url)."""
    app = web.Application()
    routes: dict[tuple[str, str], object] = {}

    async def dispatch(request: web.Request):
        return await routes[(request.method, request.path)](request)

    app.router.add_route("*", "/{tail:.*}", dispatch)
    runner, url = await serve_app(app)
    async with aiohttp.ClientSession() as session:
        yield session, url, (lambda method, path, handler: routes.__setitem__((method, path), handler))
    await runner.cleanup()


def target(url: str) -> ScrapeTarget:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return ScrapeTarget("decode", "p-decode-0", host, int(port))


async def wait_ended(flood: Flood, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while flood.ended is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def test_the_caps_are_named_and_sized():
    assert scrape.METRICS_ANSWER_LIMIT == 4 << 20
    assert scrape.HEALTHZ_ANSWER_LIMIT == push_mod.ANSWER_LIMIT == 64 << 10
    assert format_bytes(4 << 20) == "4 MiB" and format_bytes(64 << 10) == "64 KiB" and format_bytes(1000) == "1000 bytes"


@pytest.mark.asyncio
async def test_metrics_under_the_cap_still_judge_the_pod(pod):
    session, url, route = pod
    route("GET", contract.METRICS_PATH, fixed(GOOD_METRICS))
    result = await scrape.scrape_pod(session, target(url), expected_generation=3, timeout=5)
    assert result.state is PodState.HEALTHY, result.message


@pytest.mark.asyncio
async def test_metrics_larger_than_declared_cap_is_unreachable(pod):
    session, url, route = pod
    route("GET", contract.METRICS_PATH, declared(scrape.METRICS_ANSWER_LIMIT + 1))
    result = await scrape.scrape_pod(session, target(url), expected_generation=3, timeout=5)
    assert result.state is PodState.UNREACHABLE
    assert "answer larger than 4 MiB" in result.message and f"Content-Length {(4 << 20) + 1}" in result.message


@pytest.mark.asyncio
async def test_an_endless_metrics_stream_is_cut_at_the_cap(pod):
    """No Content-Length, bytes without end: the scrape ends at 4 MiB, the connection is dropped (the pod's writes
    fail), and what the pod got out is the cap plus what the sockets buffer, not its 256 MiB."""
    session, url, route = pod
    flood = Flood()
    route("GET", contract.METRICS_PATH, flood)
    started = time.monotonic()
    result = await scrape.scrape_pod(session, target(url), expected_generation=3, timeout=10)
    assert time.monotonic() - started < 8
    assert result.state is PodState.UNREACHABLE and "answer larger than 4 MiB: not read" in result.message, result
    await wait_ended(flood)
    assert flood.ended not in (None, "cap"), flood.ended
    assert flood.sent < 64 << 20, flood.sent


@pytest.mark.asyncio
async def test_a_dripping_metrics_answer_ends_at_the_deadline(pod):
    session, url, route = pod
    route("GET", contract.METRICS_PATH, Flood(drip=0.05))
    started = time.monotonic()
    result = await scrape.scrape_pod(session, target(url), expected_generation=3, timeout=0.5)
    assert time.monotonic() - started < 3
    assert result.state is PodState.UNREACHABLE and "did not answer within 0.5s" in result.message, result


@pytest.mark.asyncio
async def test_an_oversized_healthz_leaves_the_hung_verdict_without_a_transfer(pod):
    session, url, route = pod
    route("GET", contract.METRICS_PATH, fixed(HUNG_METRICS))
    flood = Flood()
    route("GET", contract.HEALTHZ_PATH, flood)
    result = await scrape.scrape_pod(session, target(url), expected_generation=3, timeout=5)
    assert result.state is PodState.HUNG and "transfer" not in result.details and "stuck" not in result.message
    await wait_ended(flood)
    assert flood.ended not in (None, "cap") and flood.sent < 64 << 20, (flood.ended, flood.sent)


@pytest.mark.asyncio
async def test_an_oversized_push_answer_is_a_refusal(pod):
    """The push's answer (PUT) and read_peers (GET): over 64 KiB, declared or streamed, is an answered failure (a
    status, no answer, the cap named): the executor retries it on events and resyncs, not at the probe interval."""
    session, url, route = pod
    route("PUT", contract.PEERS_PATH, declared(push_mod.ANSWER_LIMIT + 1, content_type="application/json"))
    flood = Flood()
    route("GET", contract.PEERS_PATH, flood)
    pushed = await push_mod.push(session, url + contract.PEERS_PATH, TOKEN, {"epoch": 1}, 5)
    assert (pushed.ok, pushed.status, pushed.answer) == (False, 200, None), pushed
    assert "answer larger than 64 KiB" in pushed.error, pushed
    read = await push_mod.read_peers(session, url + contract.PEERS_PATH, TOKEN, 5)
    assert (read.ok, read.status, read.answer) == (False, 200, None) and "64 KiB: not read" in read.error, read
    await wait_ended(flood)
    assert flood.ended not in (None, "cap") and flood.sent < 64 << 20, (flood.ended, flood.sent)


@pytest.mark.asyncio
async def test_a_push_answer_at_the_cap_is_read(pod):
    session, url, route = pod
    route("PUT", contract.PEERS_PATH, declared(push_mod.ANSWER_LIMIT, content_type="application/json"))
    pushed = await push_mod.push(session, url + contract.PEERS_PATH, TOKEN, {"epoch": 1}, 5)
    assert pushed.ok and pushed.answer == {}, pushed


@pytest.mark.asyncio
async def test_read_capped_counts_what_arrives_not_what_is_declared(pod):
    session, url, route = pod
    route("GET", "/flood", Flood())
    async with session.get(url + "/flood") as resp:
        assert resp.content_length is None
        with pytest.raises(AnswerTooLarge, match="larger than 1 MiB: not read"):
            await read_capped(resp, 1 << 20)
