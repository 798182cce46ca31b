"""The router against real aiohttp servers standing in for the two vLLM engines (their HTTP side only)."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
import pytest_asyncio

from pdpair.router.__main__ import build_parser
from pdpair.router.__main__ import main as router_main
from pdpair.router.app import REQUEST_ID_HEADER, make_app
from pdpair.router.config import RouterConfig
from tests.router_support import PARAMS, Engine
from tests.router_support import engine_server as _engine_server
from tests.router_support import serve as _serve


@pytest_asyncio.fixture
async def stack():
    prefill, decode = Engine("prefill"), Engine("decode")
    runners = []
    p_runner, p_url = await _engine_server(prefill)
    d_runner, d_url = await _engine_server(decode)
    decode.url = d_url
    runners += [p_runner, d_runner]

    async def start_router(**overrides):
        config = RouterConfig(overrides.pop("prefill_urls", (p_url,)), overrides.pop("decode_urls", (d_url,)), **overrides)
        runner, url = await _serve(make_app(config))
        runners.append(runner)
        return url

    async with aiohttp.ClientSession() as client:
        yield prefill, decode, start_router, client
    for runner in runners:
        await runner.cleanup()


@pytest.mark.asyncio
async def test_completion_goes_prefill_then_decode_with_returned_params(stack):
    prefill, decode, start_router, client = stack
    router = await start_router()
    body = {"model": "m", "prompt": "hi", "max_tokens": 7, "temperature": 0}
    async with client.post(router + "/v1/completions", json=body, headers={REQUEST_ID_HEADER: "req-42"}) as resp:
        assert resp.status == 200
        assert resp.headers[REQUEST_ID_HEADER] == "req-42"
        assert (await resp.json())["id"] == "decode-answer"
    (p_path, p_body, p_headers), = prefill.received
    assert p_path == "/v1/completions"
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    # the decode chosen for it is named: prefill frees what it holds for a decode whose pair is lost
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                            "remote_decode_url": decode.url}
    assert p_headers[REQUEST_ID_HEADER] == "req-42"
    (d_path, d_body, d_headers), = decode.received
    assert d_body["max_tokens"] == 7 and d_body["prompt"] == "hi"
    assert d_body["kv_transfer_params"] == PARAMS
    assert d_headers[REQUEST_ID_HEADER] == "req-42"


@pytest.mark.asyncio
async def test_chat_streaming_relays_every_chunk_and_makes_a_request_id(stack):
    prefill, decode, start_router, client = stack
    router = await start_router()
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.post(router + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        request_id = resp.headers[REQUEST_ID_HEADER]
        data = await resp.read()
    assert data == b"".join(decode.stream_chunks)
    p_body = prefill.received[0][1]
    assert p_body["max_tokens"] == 1 and p_body["max_completion_tokens"] == 1 and p_body["stream"] is False
    assert "stream_options" not in p_body
    d_body = decode.received[0][1]
    assert d_body["stream"] is True and d_body["max_completion_tokens"] == 5
    assert prefill.received[0][2][REQUEST_ID_HEADER] == request_id == decode.received[0][2][REQUEST_ID_HEADER]


@pytest.mark.asyncio
async def test_unreachable_prefill_is_502_naming_it(stack):
    _, decode, start_router, client = stack
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: connection refused
        router = await start_router(prefill_urls=(dead,))
        async with client.post(router + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 502
            error = (await resp.json())["error"]
    assert error["peer"] == "prefill" and "unreachable" in error["message"]
    assert decode.received == []


@pytest.mark.asyncio
async def test_slow_prefill_is_504(stack):
    prefill, decode, start_router, client = stack
    prefill.delay = 2.0
    router = await start_router(prefill_timeout_seconds=0.3)
    async with client.post(router + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 504
        assert "did not answer within" in (await resp.json())["error"]["message"]
    assert decode.received == []
    prefill.release.set()  # its answer now: the teardown need not wait out the 2 s


@pytest.mark.asyncio
async def test_slow_decode_is_504(stack):
    prefill, decode, start_router, client = stack
    decode.delay = 2.0
    router = await start_router(decode_timeout_seconds=0.3)
    async with client.post(router + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 504
        assert (await resp.json())["error"]["peer"] == "decode"
    decode.release.set()  # its answer now: the teardown need not wait out the 2 s


@pytest.mark.asyncio
async def test_decode_5xx_is_502_and_prefill_4xx_passes_through(stack):
    prefill, decode, start_router, client = stack
    router = await start_router()
    decode.status = 500
    async with client.post(router + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 502
        assert "decode" in (await resp.json())["error"]["message"]
    prefill.status = 400
    async with client.post(router + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["peer"] == "prefill"


@pytest.mark.asyncio
async def test_prefill_without_kv_transfer_params_is_502(stack):
    prefill, decode, start_router, client = stack
    prefill.params = None
    router = await start_router()
    async with client.post(router + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 502
        assert "kv_transfer_params" in (await resp.json())["error"]["message"]
    assert decode.received == []


@pytest.mark.asyncio
async def test_non_json_body_is_400(stack):
    _, _, start_router, client = stack
    router = await start_router()
    async with client.post(router + "/v1/completions", data=b"not json") as resp:
        assert resp.status == 400


@pytest.mark.asyncio
async def test_a_body_over_the_limit_is_413_and_reaches_no_engine(stack):
    """--max-body-bytes: a body larger than the limit is answered 413 naming the limit, whether its Content-Length
    says so (answered before it is read) or it comes chunked and grows past it; one at the limit is served. Real
    router and engine stand-ins on loopback; cost: about 0.1 s."""
    prefill, decode, start_router, client = stack
    router = await start_router(max_body_bytes=1024)
    at_limit = b'{"model": "m", "prompt": "' + b"x" * (1024 - 28) + b'"}'
    assert len(at_limit) == 1024
    async with client.post(router + "/v1/completions", data=at_limit,
                           headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 200
    over = at_limit[:-2] + b'x"}'

    async def chunked():
        yield over[:512]
        yield over[512:]

    for data in (over, chunked()):
        async with client.post(router + "/v1/completions", data=data,
                               headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 413
            error = (await resp.json())["error"]
        assert error["code"] == 413 and "limit of 1024 bytes (--max-body-bytes)" in error["message"], error
    assert len(prefill.received) == len(decode.received) == 1  # only the request at the limit


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_a_body_limit_below_one_byte_is_refused(value):
    """--max-body-bytes takes an int >= 1 (make_app checks a RouterConfig built in code too). Cost: milliseconds."""
    with pytest.raises(ValueError, match="--max-body-bytes must be a number of bytes >= 1"):
        make_app(RouterConfig(("http://p",), ("http://d",), max_body_bytes=value))


def test_bad_url_is_refused_at_start():
    with pytest.raises(ValueError, match="--prefill must be an http"):
        make_app(RouterConfig(("localhost:8000",), ("http://x",)))


@pytest.mark.parametrize("field", ["prefill_timeout_seconds", "decode_timeout_seconds", "connect_timeout_seconds",
                                   "failure_cooldown_seconds"])
@pytest.mark.parametrize("seconds", [0, -1.0, float("nan"), float("inf"), float("-inf")])
def test_timeouts_without_a_deadline_are_refused(field, seconds):
    """aiohttp reads <= 0 as no deadline; nan and inf are none either."""
    flag = "--" + field.removesuffix("_seconds").replace("_", "-")
    config = RouterConfig(("http://p",), ("http://d",), **{field: seconds})
    with pytest.raises(ValueError, match=f"{flag} must be a finite number of seconds > 0"):
        make_app(config)


def _cli_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        router_main(argv)
    assert info.value.code == 2  # argparse's usage error, not a traceback
    return capsys.readouterr().err


BASE_ARGS = ["--prefill", "http://p:1", "--decode", "http://d:2"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "argument --port: 70000 is not a port in 0..65535"),
        (["--port", "-1"], "argument --port: -1 is not a port in 0..65535"),
        (["--port", "99999999999999999999"], "is not a port in 0..65535"),
        (["--port", "http"], "argument --port: 'http' is not a port number"),
        (["--port", "8000", "--prefill-timeout", "0"], "argument --prefill-timeout: '0': must be a finite number"),
        (["--port", "8000", "--decode-timeout", "-5"], "argument --decode-timeout: '-5': must be a finite number"),
        (["--port", "8000", "--connect-timeout", "nan"], "argument --connect-timeout: 'nan': must be a finite"),
        (["--port", "8000", "--decode-timeout", "inf"], "argument --decode-timeout: 'inf': must be a finite"),
        (["--port", "8000", "--prefill-timeout", "soon"], "argument --prefill-timeout: 'soon' is not a number"),
        (["--port", "8000", "--max-body-bytes", "0"], "argument --max-body-bytes: '0' is not a number of bytes >= 1"),
        (["--port", "8000", "--max-body-bytes", "4MiB"], "argument --max-body-bytes: '4MiB' is not a number of bytes"),
    ],
)
def test_cli_bad_port_or_timeout_is_a_usage_error(capsys, argv, message):
    assert message in _cli_error(capsys, [*argv, *BASE_ARGS])


def test_cli_bad_url_is_a_usage_error(capsys):
    err = _cli_error(capsys, ["--port", "8000", "--prefill", "p:1", "--decode", "http://d:2"])
    assert "--prefill must be an http(s) URL" in err


def test_cli_accepts_the_edge_values():
    args = build_parser().parse_args(["--port", "0", "--connect-timeout", "0.001", *BASE_ARGS])
    assert args.port == 0 and args.connect_timeout == 0.001 and args.decode_timeout == 600.0
    assert build_parser().parse_args(["--port", "65535", *BASE_ARGS]).port == 65535


def test_the_readme_table_lists_every_flag_with_its_default():
    """Docs checked from the one declaration: each router flag is a row of the connector README's "Router CLI" table,
    with the parser's default (RouterConfig's), "required", or "off" for a switch."""
    import pathlib
    import re

    readme = pathlib.Path(__file__).resolve().parents[3] / "src/pdpair/connector/README.md"
    table = readme.read_text().split("## Router CLI", 1)[1].split("\n## ", 1)[0]
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `(--[a-z-]+)` \| ([^|]+) \|", table, re.M)}
    for action in build_parser()._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag in (None, "--help"):
            continue
        if action.required:
            want = "required"
        elif isinstance(action.default, bool):
            want = "on" if action.default else "off"
        elif action.default is None:  # a repeatable flag given nowhere: the row says what stands in for it
            want = "–"
        elif isinstance(action.default, float):
            want = f"{action.default:g}"
        else:
            want = f"`{action.default}`"
        assert rows.get(flag, "").strip() == want, (flag, rows.get(flag), want)


@pytest.mark.asyncio
async def test_an_idle_connection_is_not_reused_past_its_timeout(stack):
    """A connection idle longer than idle_connection_seconds is not reused (vLLM closes its idle ones at 5 s: a
    request written on one it is closing fails); back-to-back requests do reuse one. Cost: ~1 s."""
    prefill, decode, start_router, client = stack
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    ports = []

    async def send(router):
        async with client.post(router + "/v1/completions", json=body) as resp:
            assert resp.status == 200
        ports.append(prefill.peers[-1])

    keeping = await start_router(idle_connection_seconds=30.0)
    await send(keeping)
    await send(keeping)
    assert ports[0] == ports[1], "back-to-back requests should share a kept-alive connection"
    ports.clear()
    short = await start_router(idle_connection_seconds=0.2)
    await send(short)
    await asyncio.sleep(1.0)
    await send(short)
    assert ports[0] != ports[1], "a connection idle past idle_connection_seconds was reused"


@pytest.mark.asyncio
@pytest.mark.parametrize("peer", ["prefill", "decode"])
async def test_a_connection_dropped_before_an_answer(stack, peer):
    """The engine drops the connection of its first request without answering (what a kept-alive connection closed
    under the request looks like): prefill's request is sent once more and the client gets its answer; decode's is
    not (its KV may be read already): the client gets a 502 naming decode. Cost: < 1 s."""
    prefill, decode, start_router, client = stack
    engine = prefill if peer == "prefill" else decode
    engine.drop_first = 1
    router = await start_router()
    async with client.post(router + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}) as resp:
        status, answer = resp.status, await resp.json()
    if peer == "prefill":
        assert status == 200 and answer["id"] == "decode-answer", answer
        assert len(prefill.received) == 2 and len(decode.received) == 1
    else:
        assert status == 502 and answer["error"]["peer"] == "decode", answer
        assert len(prefill.received) == 1 and len(decode.received) == 1


def test_the_router_runs_on_uvloop_where_it_is_installed():
    """The engine image has uvloop (vLLM's API server runs on it); the router's hop is a few callbacks per request on
    its loop. Where uvloop is missing it falls back to asyncio's loop."""
    import asyncio

    from pdpair.router.__main__ import _event_loop

    loop = _event_loop()
    try:
        try:
            import uvloop
        except ImportError:
            assert isinstance(loop, asyncio.AbstractEventLoop)
        else:
            assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
