"""The pdpair router: each request goes to prefill with max_tokens=1 and kv_transfer_params {do_remote_decode: true},
then the original request goes to decode with the kv_transfer_params prefill returned; decode's answer (streamed or
not) goes back to the client.

Errors are explicit: an unreachable peer or a 5xx from it is a 502, a peer that exceeds its timeout a 504, each with
a JSON body naming the peer and the cause; a 4xx from a peer is the client's fault and is passed through.

Kept-alive connections to the engines are reused only while idle for less than `idle_connection_seconds`, below
the engines' own keep-alive (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): a request written on a connection that the
engine is closing at that moment fails at once (a disconnect, a sporadic 502 under load). A prefill request that
fails that way, before any answer, is sent once more on a new connection: prefill computes one token and keeps the
KV for a decode that never comes, which the connector frees at its deadline. A decode request is never sent twice
(its KV may already be read).
X-Request-Id is taken from the client (or made) and sent to both engines and back to the client.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import uuid
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from pdpair.connector import timeline

logger = logging.getLogger("pdpair.router")

REQUEST_ID_HEADER = "X-Request-Id"
ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class RouterConfig:
    prefill_url: str
    decode_url: str
    prefill_timeout_seconds: float = 120.0
    decode_timeout_seconds: float = 600.0
    connect_timeout_seconds: float = 10.0
    idle_connection_seconds: float = 2.0


class PeerError(Exception):
    def __init__(self, status: int, peer: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.peer = peer
        self.message = message

    def response(self, request_id: str) -> web.Response:
        body = {"error": {"message": self.message, "type": "peer_error", "peer": self.peer, "code": self.status}}
        return web.json_response(body, status=self.status, headers={REQUEST_ID_HEADER: request_id})


_CLIENT = web.AppKey("client", aiohttp.ClientSession)
_CONFIG = web.AppKey("config", RouterConfig)


def prefill_body(body: dict, chat: bool) -> dict:
    """The request prefill sees: one token, no streaming, and the request to keep the KV for decode."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if chat and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return out


# The peer closed or reset the connection before answering: a kept-alive connection it was closing (a new one is
# worth one more try). Not a refused connection (ClientConnectorError, a subclass of ClientOSError): nothing listens.
def _disconnected(exc: BaseException) -> bool:
    return isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)) and \
        not isinstance(exc, aiohttp.ClientConnectorError)


async def _post_prefill(session: aiohttp.ClientSession, url: str, body: dict, headers: dict, timeout: float) -> dict:
    try:
        return await _post_json(session, "prefill", url, body, headers, timeout)
    except PeerError as exc:
        if not _disconnected(exc.__cause__):
            raise
        logger.warning("request %s: %s; sending it once more on a new connection", headers.get(REQUEST_ID_HEADER),
                       exc.message)
        return await _post_json(session, "prefill", url, body, headers, timeout)


async def _post_json(session: aiohttp.ClientSession, peer: str, url: str, body: dict, headers: dict, timeout: float) -> dict:
    try:
        async with session.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            text = await resp.text()
            if resp.status >= 500:
                raise PeerError(502, peer, f"{peer} {url} answered {resp.status}: {text[:500]}")
            if resp.status >= 400:
                raise PeerError(resp.status, peer, f"{peer} refused the request ({resp.status}): {text[:500]}")
            try:
                return json.loads(text)
            except ValueError:
                raise PeerError(502, peer, f"{peer} {url} answered non-JSON: {text[:200]!r}") from None
    except asyncio.TimeoutError:
        raise PeerError(504, peer, f"{peer} {url} did not answer within {timeout:.0f}s") from None
    except aiohttp.ClientError as exc:
        raise PeerError(502, peer, f"{peer} {url} unreachable: {exc}") from exc


async def _proxy(request: web.Request) -> web.StreamResponse:
    received = timeline.now()
    config = request.app[_CONFIG]
    session = request.app[_CLIENT]
    request_id = request.headers.get(REQUEST_ID_HEADER) or f"pdpair-{uuid.uuid4().hex}"
    headers = {REQUEST_ID_HEADER: request_id}
    try:
        body = await request.json()
    except ValueError:
        return PeerError(400, "router", "request body is not JSON").response(request_id)
    if not isinstance(body, dict):
        return PeerError(400, "router", "request body must be a JSON object").response(request_id)
    path = request.path
    chat = path.endswith("/chat/completions")
    try:
        first = await _post_prefill(
            session, config.prefill_url + path, prefill_body(body, chat), headers, config.prefill_timeout_seconds,
        )
        params = first.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise PeerError(
                502, "prefill",
                "prefill answered without kv_transfer_params (is it running the pdpair connector as kv_producer?)",
            )
    except PeerError as exc:
        logger.error("request %s: %s", request_id, exc.message)
        return exc.response(request_id)
    prefill_answered = timeline.now()

    decode_body = copy.deepcopy(body)
    decode_body["kv_transfer_params"] = params
    url = config.decode_url + path
    timeout = aiohttp.ClientTimeout(total=config.decode_timeout_seconds, connect=config.connect_timeout_seconds)
    stream = bool(body.get("stream"))
    response: web.StreamResponse | None = None
    try:
        async with session.post(url, json=decode_body, headers=headers, timeout=timeout) as resp:
            if resp.status >= 400:
                text = await resp.text()
                status = 502 if resp.status >= 500 else resp.status
                raise PeerError(status, "decode", f"decode {url} answered {resp.status}: {text[:500]}")
            if not stream:
                timeline.log("router", request_id, received=received, prefill_answered=prefill_answered,
                             done=timeline.now())
                return web.Response(
                    body=await resp.read(), status=resp.status,
                    content_type=resp.content_type, headers=headers,
                )
            response = web.StreamResponse(status=resp.status, headers={**headers, "Content-Type": resp.headers.get("Content-Type", "text/event-stream")})
            await response.prepare(request)
            first_chunk = None
            async for chunk in resp.content.iter_any():
                if first_chunk is None:
                    first_chunk = timeline.now()
                await response.write(chunk)
            await response.write_eof()
            timeline.log("router", request_id, received=received, prefill_answered=prefill_answered,
                         decode_first_chunk=first_chunk, done=timeline.now())
            return response
    except asyncio.TimeoutError:
        error = PeerError(504, "decode", f"decode {url} did not finish within {config.decode_timeout_seconds:.0f}s")
    except aiohttp.ClientError as exc:
        error = PeerError(502, "decode", f"decode {url} failed: {exc}")
    except PeerError as exc:
        error = exc
    logger.error("request %s: %s", request_id, error.message)
    if response is not None:  # headers already sent: end the stream with an error event
        await response.write(f"data: {json.dumps({'error': {'message': error.message, 'code': error.status}})}\n\n".encode())
        await response.write_eof()
        return response
    return error.response(request_id)


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _models(request: web.Request) -> web.Response:
    config = request.app[_CONFIG]
    try:
        async with request.app[_CLIENT].get(config.decode_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            return web.Response(body=await resp.read(), status=resp.status, content_type=resp.content_type)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return PeerError(502, "decode", f"decode unreachable: {exc}").response("-")


def check_timeout(flag: str, seconds: float) -> float:
    """`seconds` if it is a finite number > 0, else a ValueError naming `flag`. aiohttp reads 0 or a negative
    timeout as "no deadline", and nan/inf are no deadline either; the router never waits without one."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ValueError(f"{flag} must be a number of seconds, got {seconds!r}")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{flag} must be a finite number of seconds > 0, got {seconds!r}")
    return float(seconds)


def make_app(config: RouterConfig) -> web.Application:
    for name, url in (("prefill", config.prefill_url), ("decode", config.decode_url)):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--{name} must be an http(s) URL, got {url!r}")
    check_timeout("--prefill-timeout", config.prefill_timeout_seconds)
    check_timeout("--decode-timeout", config.decode_timeout_seconds)
    check_timeout("--connect-timeout", config.connect_timeout_seconds)
    check_timeout("--idle-connection-timeout", config.idle_connection_seconds)
    app = web.Application(client_max_size=64 * 2**20)
    app[_CONFIG] = RouterConfig(
        config.prefill_url.rstrip("/"), config.decode_url.rstrip("/"), config.prefill_timeout_seconds,
        config.decode_timeout_seconds, config.connect_timeout_seconds, config.idle_connection_seconds,
    )

    async def client_ctx(app: web.Application):
        app[_CLIENT] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(connect=config.connect_timeout_seconds),
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=config.idle_connection_seconds),
        )
        yield
        await app[_CLIENT].close()

    app.cleanup_ctx.append(client_ctx)
    for route in ROUTES:
        app.router.add_post(route, _proxy)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    return app
