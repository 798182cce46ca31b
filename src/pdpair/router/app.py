"""The pdpair router: each request goes to prefill with max_tokens=1 and kv_transfer_params {do_remote_decode: true}
and the original request to decode: at the same moment, naming the transfer by a key the router makes (both legs at
once, the default, `_both_legs`), or once prefill answered, with the kv_transfer_params prefill returned (in
sequence: --no-concurrent-legs, and a prefill's first request); or, for a short prompt under selective
disaggregation (--local-prompt-tokens), to decode alone. Decode's answer (streamed or not) goes back to the client.
docs/design.md "The request path" has the three ways side by side.

Several instances of each role may be given (`--prefill` and `--decode` repeated; an instance's index is its place
among its role's flags). Per request the router chooses the decode first, then the prefill, by load (`Pool.choose`;
docs/xpyd.md section 5 is the design). The operator runs one of each today.

The pushed sets (docs/xpyd.md sections 3, 5, 6): with PDPAIR_PEERS_TOKEN set (the pair's Secret), the router serves
`PUT /pdpair/v1/peers` on its HTTP port, bearer that token (401 without it or with another; constant-time compare):
the whole desired set, level-triggered, `{"epoch": int, "generation": int, "prefills": [{"index": int, "url": str,
"readyUrl": str, "draining": bool (optional)}, ...], "decodes": [...]}`; 400 naming the malformed field, 409 for an
epoch older than the last accepted one (the same epoch again is applied again: the same body twice is a no-op).
Instances are kept by URL (requests in flight, cooldown and KV usage stay); a new URL is added; one marked draining or
gone from the set is never chosen again while its requests in flight finish, and one gone from the set is forgotten
when its last one ends. The swap is synchronous (no await between reading and replacing the pools). An empty or
all-draining role is accepted, but then /readyz fails and requests are answered 503. Forced routes
(X-Pdpair-Route) name the "index" fields of the instances that may be chosen. The answer, also to `GET`, is
`{"epoch", "generation", "prefills": [{"index", "url", "outstanding", "involved", "draining"}], "decodes": [...],
"leaving": [{"role", "url", "outstanding", "involved"}], "warnings": [str]}`. `outstanding` is the choice's load count (a prefill's covers only the
prefill phase of a request); `involved` counts the requests in flight that involve the instance for their whole
life: a prefill from its choice until that request's decode answer has ended or failed (prefill pushes the KV to
decode after answering, so a prefill with `outstanding` 0 may still be pushing), a decode as its `outstanding`. The
operator deletes a drained instance once the router no longer lists it as one that may be chosen and its `involved`
is 0 (operator/instances.py).
The flags' URLs are the set until the first push (with the token none is required). Without the token the path
answers 404 and the flags are the set.

Errors are explicit: an unreachable peer or a 5xx from it is a 502, a peer that exceeds its timeout a 504, each with
a JSON body naming the peer and the cause; a 4xx from a peer is the client's fault and is passed through. An instance
that failed a request (refused, reset before an answer, 5xx, timeout) is not chosen for `failure_cooldown_seconds`
while another instance of its role is not cooling down.

Kept-alive connections to the engines are reused only while idle for less than `idle_connection_seconds`, below
the engines' own keep-alive (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): a request written on a connection that the
engine is closing at that moment fails at once (a disconnect, a sporadic 502 under load). A prefill request that
fails that way, before any answer, is sent once more on a new connection, to another prefill when there is one:
prefill computes one token and keeps the KV for a decode that never comes, which the connector frees at its
deadline. A prefill that refused the connection, or accepted none within the connect timeout (a node cut off by a
partition drops the handshake), never saw the request, so it is sent to another prefill when there is one. A decode request is never sent twice (its KV may already be read).
X-Request-Id is taken from the client (or made) and sent to both engines and back to the client.

With VLLM_API_KEY set (spec.apiKeySecret, read once at start; empty: no key), every request but /health, /readyz and
`/pdpair/v1/peers` (its own token) must carry `Authorization: Bearer <key>`, compared as vLLM does (sha256 digests,
constant time); any other is answered 401 with a fixed OpenAI-style error that echoes nothing of the request, before
its body is read. The router then sends `Authorization: Bearer <key>` to prefill and decode (vLLM, given the same
variable, refuses a /v1 request without it), and to decode's /v1/models; never the client's own header.

/health is the router's liveness; /readyz its readiness: at least one prefill and one decode that may be chosen (not
draining) ready by their own readiness URLs (`probes.readiness`), so a router started beside loading engines gets no traffic
before they serve.

Modules (README.md): the settings in config.py, the instances and the choice in pools.py, the push endpoint in
peer_push.py, the API key in api_key.py; this module serves the routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import uuid
from collections.abc import Callable, Iterator

import aiohttp
from aiohttp import web

from pdpair.connector import timeline
from pdpair.contract import KV_PARAM_REMOTE_DECODE_URL, KV_PARAM_TRANSFER_KEY, MAX_PEERS_BODY_BYTES, METRICS_PATH, PEERS_PATH
from pdpair.contract import READYZ_PATH, ROLE_DECODE, ROLE_PREFILL  # READYZ_PATH: the router's readiness too: it has a prefill and a decode that are ready
from pdpair.router.api_key import api_key_guard
from pdpair.router.config import (
    HEALTH_PATH,
    RouterConfig,
    check_body_bytes,
    check_count,
    check_kv_events,
    check_ready_urls,
    check_timeout,
    check_urls,
)
from pdpair.router.metrics import METRICS_REGISTRY, metrics_handler, registry_for
from pdpair.router.peer_push import no_peers_handler, peers_handler, check_peers_token
from pdpair.router.kv_usage import scrape_kv_usage
from pdpair.router.prefix_index import prompt_hashes
from pdpair.router.probes import health, readyz
from pdpair.router.split import LOCAL, TOKENS_PER_CHUNK, prompt_tokens, uncached_tokens
from pdpair.router.pools import ROUTER, Instance, Pool, Router, no_instance

logger = logging.getLogger("pdpair.router")

# kv_transfer_params keys of decode's request when both legs go at once (the connector's names; vLLM's do_remote_*)
PARAM_DO_REMOTE_DECODE, PARAM_DO_REMOTE_PREFILL, PARAM_REMOTE_REQUEST_ID = \
    "do_remote_decode", "do_remote_prefill", "remote_request_id"

REQUEST_ID_HEADER = "X-Request-Id"
ROUTE_HEADER = "X-Pdpair-Route"
ROUTES = ("/v1/completions", "/v1/chat/completions")


class PeerError(Exception):
    def __init__(self, status: int, peer: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.peer = peer
        self.message = message

    def response(self, request_id: str) -> web.Response:
        body = {"error": {"message": self.message, "type": "peer_error", "peer": self.peer, "code": self.status}}
        return web.json_response(body, status=self.status, headers={REQUEST_ID_HEADER: request_id})


def prefill_body(body: dict, chat: bool, decode_url: str, transfer_key: str | None = None) -> dict:
    """The request prefill sees: one token, no streaming, and the request to keep the KV for decode, naming the
    decode chosen for it (prefill frees the KV it holds for a decode whose pair is lost) and, when both legs go at
    once, the transfer's key (decode's Pull names it)."""
    out = dict(body)  # shallow: only top-level keys change, and a deep copy of a large prompt costs its size again
    out["max_tokens"] = 1
    if chat and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                 KV_PARAM_REMOTE_DECODE_URL: decode_url}
    if transfer_key is not None:
        out["kv_transfer_params"][KV_PARAM_TRANSFER_KEY] = transfer_key
    return out


# The peer closed or reset the connection before answering: a kept-alive connection it was closing (a new one is
# worth one more try). Not a refused connection (ClientConnectorError, a subclass of ClientOSError): nothing listens.
def _disconnected(exc: BaseException | None) -> bool:
    return isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)) and \
        not isinstance(exc, aiohttp.ClientConnectorError)


def _refused(exc: BaseException | None) -> bool:
    """Nothing listens (refused), or nothing accepted the connection within the connect timeout (a node cut off by a
    partition drops the handshake): either way the peer never saw the request."""
    return isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))


async def _prefill(router: Router, first: Instance, decode: Instance, body: dict, path: str, headers: dict,
                   forced: bool, involved: contextlib.ExitStack, transfer_key: str | None = None) -> dict:
    """Prefill's kv_transfer_params, from `first` or from the one prefill the request is sent to once more. Each
    prefill it is sent to is entered into `involved` (`Pool.involve`): the caller's stack, left when decode's answer
    ended, since a prefill that answered may still be pushing the KV to decode (one that failed may have computed
    it too). Each answer teaches the router that prefill's identity (`Router.learn_prefill`). `forced`: sent once
    more only to `first` (a forced route, or both legs at once: decode already names that prefill)."""
    pool, config = router.prefills, router.config
    payload = prefill_body(body, path.endswith("/chat/completions"), decode.url, transfer_key)
    instance = first
    for attempt in range(2):
        involved.enter_context(pool.involve(instance))
        with pool.hold(instance):
            try:
                answer = await _post_json(router.session, "prefill", instance.url + path, payload,
                                          {**headers, **router.engine_headers}, config.prefill_timeout_seconds,
                                          config.connect_timeout_seconds)
                params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
                if not isinstance(params, dict):
                    raise PeerError(
                        502, "prefill",
                        f"prefill {instance.url} answered without kv_transfer_params (is it running the pdpair "
                        "connector as kv_producer?)",
                    )
                router.learn_prefill(instance.url, params)
                return params
            except PeerError as exc:
                if exc.status >= 500:
                    pool.failed(instance)
                cause = exc.__cause__
                # A forced route keeps its prefill. A refused connection is worth another try only elsewhere (not
                # on a draining prefill: `instances` are the ones that may be chosen, now).
                elsewhere = not forced and any(i is not instance for i in pool.instances)
                if attempt or not (_disconnected(cause) or (_refused(cause) and elsewhere)):
                    raise
                again = pool.choose(exclude=instance) if elsewhere else instance
                logger.warning("request %s: %s; sending it once more on a new connection, to prefill %d %s",
                               headers.get(REQUEST_ID_HEADER), exc.message, again.index, again.url)
        instance = again
    raise AssertionError("unreachable")


async def _post_json(session: aiohttp.ClientSession, peer: str, url: str, body: dict, headers: dict, timeout: float,
                     connect_timeout: float) -> dict:
    # The request's own ClientTimeout replaces the session's whole: the connect bound is restated here (without it a
    # peer that drops the handshake held the request for the full answer timeout)
    deadline = aiohttp.ClientTimeout(total=timeout, connect=connect_timeout)
    try:
        async with session.post(url, json=body, headers=headers, timeout=deadline) as resp:
            text = await resp.text()
            if resp.status >= 500:
                raise PeerError(502, peer, f"{peer} {url} answered {resp.status}: {text[:500]}")
            if resp.status >= 400:
                raise PeerError(resp.status, peer, f"{peer} refused the request ({resp.status}): {text[:500]}")
            try:
                return json.loads(text)
            except ValueError:
                raise PeerError(502, peer, f"{peer} {url} answered non-JSON: {text[:200]!r}") from None
    except aiohttp.ConnectionTimeoutError as exc:  # before TimeoutError, its base: the request was never sent
        raise PeerError(504, peer, f"{peer} {url} accepted no connection in time: {exc}") from exc
    except asyncio.TimeoutError:
        raise PeerError(504, peer, f"{peer} {url} did not answer within {timeout:.0f}s") from None
    except aiohttp.ClientError as exc:
        raise PeerError(502, peer, f"{peer} {url} unreachable: {exc}") from exc


def _forced_route(router: Router, request: web.Request) -> tuple[int, int] | None:
    """(prefill index, decode index) from X-Pdpair-Route, only under --debug-routing; a bad one is a 400."""
    raw = request.headers.get(ROUTE_HEADER)
    if raw is None or not router.config.debug_routing:
        return None
    try:
        prefill, decode = (int(part) for part in raw.split(","))
    except ValueError:
        raise PeerError(400, "router", f"{ROUTE_HEADER} must be '<prefill index>,<decode index>', got {raw!r}") from None
    for role, index, pool in (("prefill", prefill, router.prefills), ("decode", decode, router.decodes)):
        if pool.member(index) is None:
            indexes = [i.index for i in pool.instances]
            raise PeerError(400, "router", f"{ROUTE_HEADER} {raw!r}: {role} index {index} is out of range: this router "
                                           f"may choose the {role} indexes {indexes} (draining ones excluded)")
    return prefill, decode


def _log_choice(router: Router, request_id: str, prefill: Instance, decode: Instance, prefills_seen: list[int],
                decodes_seen: list[int], forced: bool) -> None:
    kv = [router.decodes.fresh_kv_usage(i) for i in router.decodes.instances]
    cooling = [f"{pool.role} {index}" for pool in (router.prefills, router.decodes) for index in pool.cooling()]
    logger.info(
        "request %s: prefill %d %s, decode %d %s%s; outstanding seen: prefill %s, decode %s; decode kv usage [%s]%s",
        request_id, prefill.index, prefill.url, decode.index, decode.url, f" (forced by {ROUTE_HEADER})" if forced else "",
        prefills_seen, decodes_seen, ", ".join("-" if u is None else f"{u:.3f}" for u in kv),
        f"; cooling down: {', '.join(cooling)}" if cooling else "",
    )


async def _proxy(request: web.Request) -> web.StreamResponse:
    received = timeline.now()
    router = request.app[ROUTER]
    request_id = request.headers.get(REQUEST_ID_HEADER) or f"pdpair-{uuid.uuid4().hex}"
    headers = {REQUEST_ID_HEADER: request_id}
    limit = router.config.max_body_bytes
    too_large = PeerError(413, "router", f"the request body is over the router's limit of {limit} bytes "
                                         f"(--max-body-bytes)")
    if (request.content_length or 0) > limit:
        return too_large.response(request_id)  # answered before a byte of it is read
    raw = await _read_body(request, limit)
    if raw is None:  # a chunked body that grew past the limit: not read further
        return too_large.response(request_id)
    try:
        body = json.loads(raw)
    except ValueError:
        return PeerError(400, "router", "request body is not JSON").response(request_id)
    if not isinstance(body, dict):
        return PeerError(400, "router", "request body must be a JSON object").response(request_id)
    try:
        forced = _forced_route(router, request)
    except PeerError as exc:
        return exc.response(request_id)
    for pool in (router.decodes, router.prefills):  # a pushed set may leave a role without one (no await from here)
        if not pool.instances:
            return PeerError(503, "router", no_instance(pool.role)).response(request_id)

    chat = request.path.endswith("/chat/completions")
    # the prompt's chunk hashes (prefix_index.py), once: for the decode's choice, the split decision and the prefill's
    hashes = prompt_hashes(body, chat) if router.config.prefix_affinity and not forced else []
    # its token ids (--tokenizer): exact lengths for the split, and the blocks the engines' KV events are matched on
    token_ids = router.tokenizer.token_ids(body, chat) if router.tokenizer is not None and not forced else None
    chains: dict[int, list[bytes]] = {}  # its block hashes by block size, made once for both roles' choices

    # Decode first: it holds the request for the whole answer, so its load matters most; a prefill is busy only for
    # the prompt.
    decodes_seen = router.decodes.outstanding()
    decode, held = (router.decodes.member(forced[1]), 0) if forced else \
        _choose(router, ROLE_DECODE, router.decodes, hashes, token_ids, chains)

    # Split or local (split.py): a forced route names a prefill, so it is split; only a streamed answer is measured.
    # The estimate is of what the chosen decode does not hold yet (all of it without --prefix-affinity).
    streamed = bool(body.get("stream"))
    tokens = uncached_tokens(len(token_ids) if token_ids is not None else prompt_tokens(body, chat), held) \
        if router.split.enabled and forced is None else None
    mode = router.split.decide(tokens, measured=streamed)
    if hashes:  # after the lookup above: decode's cache holds this prompt once it computed or loaded it
        router.prefix[ROLE_DECODE].record(decode.url, hashes)

    def first_chunk(at: float) -> None:
        if tokens is not None:
            router.split.observe(tokens, mode, at - received)

    if mode == LOCAL:
        with router.decodes.hold(decode), router.decodes.involve(decode):
            if router.config.log_choices:
                logger.info("request %s: decode %d %s alone (about %d prompt tokens it does not hold, below %d); outstanding seen: "
                            "decode %s", request_id, decode.index, decode.url, tokens, router.split.threshold,
                            decodes_seen)
            return await _decode(router, decode, request, body, None, headers, received, None, first_chunk)
    # `involved` (Pool.involve): the decode and every prefill the request is sent to, until decode's answer ended.
    with router.decodes.hold(decode), router.decodes.involve(decode), contextlib.ExitStack() as involved:
        prefills_seen = router.prefills.outstanding()
        prefill = router.prefills.member(forced[0]) if forced else \
            _choose(router, ROLE_PREFILL, router.prefills, hashes, token_ids, chains)[0]
        if hashes:
            router.prefix[ROLE_PREFILL].record(prefill.url, hashes)
        if router.config.log_choices:
            _log_choice(router, request_id, prefill, decode, prefills_seen, decodes_seen, forced is not None)
        identity = router.prefill_identity.get(prefill.url) if router.config.concurrent_legs else None
        if identity is not None:
            return await _both_legs(router, prefill, decode, request, body, headers, received, involved, identity,
                                    first_chunk)
        try:
            params = await _prefill(router, prefill, decode, body, request.path, headers, forced is not None, involved)
        except PeerError as exc:
            logger.error("request %s: %s", request_id, exc.message)
            return exc.response(request_id)
        prefill_answered = timeline.now()
        return await _decode(router, decode, request, body, params, headers, received, prefill_answered, first_chunk)


def _choose(router: Router, role: str, pool: Pool, hashes: list[bytes],
            token_ids: list[int] | None = None,
            chains: dict[int, list[bytes]] | None = None) -> tuple[Instance, int]:
    """The pool's choice and how many of the prompt's leading tokens it holds: by load, and with prefix affinity
    by the match within the load slack (Pool.choose): the blocks the engines' KV events say each holds, where every
    instance of the role has a subscriber (Router.block_chain), else the chunks of the prompt this router sent it
    before (prefix_index.py, 32 estimated tokens a chunk). Counts what was routed and matched for /metrics. Records
    nothing: the caller does, once the request goes there."""
    if not hashes:
        return pool.choose(), 0
    chain = router.block_chain(role, pool, token_ids, chains)
    if chain is not None:
        blocks, size = chain
        held_blocks: dict[str, int] = {}

        def blocks_held(instance: Instance) -> int:
            if instance.url not in held_blocks:
                held_blocks[instance.url] = router.kv_index.matched(instance.url, blocks)
            return held_blocks[instance.url]

        chosen = pool.choose(affinity=blocks_held)
        router.prefix_blocks[role]["routed"] += len(blocks)
        router.prefix_blocks[role]["matched"] += blocks_held(chosen)
        return chosen, blocks_held(chosen) * size
    index, matched = router.prefix[role], {}

    def affinity(instance: Instance) -> int:
        if instance.url not in matched:
            matched[instance.url] = index.matched(instance.url, hashes)
        return matched[instance.url]

    chosen = pool.choose(affinity=affinity)
    held = affinity(chosen)
    router.prefix_chunks[role]["routed"] += len(hashes)
    router.prefix_chunks[role]["matched"] += held
    return chosen, held * TOKENS_PER_CHUNK


async def _both_legs(router: Router, prefill: Instance, decode: Instance, request: web.Request, body: dict,
                     headers: dict, received: float, involved: contextlib.ExitStack, identity: dict,
                     on_first_chunk: Callable[[float], None]) -> web.StreamResponse:
    """Both legs at once (--concurrent-legs): decode gets its request with kv_transfer_params that name the transfer
    by a fresh key and the prefill by the identity it answered with before, so decode allocates its blocks and sends
    its Pull while prefill computes; prefill, given the same key, serves that Pull once its prompt is computed
    (connector/metadata.py PARAM_TRANSFER_KEY). Decode's answer is the client's. A prefill leg that fails before
    decode's answer began cancels decode's request and is answered as in sequential mode (the prefill's error); one
    that fails later leaves decode's load to fail at the parked Pull's bound (four hang timeouts)."""
    request_id = headers[REQUEST_ID_HEADER]
    key = f"t-{uuid.uuid4().hex}"
    params = {**identity, PARAM_DO_REMOTE_PREFILL: True, PARAM_DO_REMOTE_DECODE: False,
              PARAM_REMOTE_REQUEST_ID: key, KV_PARAM_TRANSFER_KEY: key}
    progress: dict[str, bool] = {"started": False}
    if router.config.log_choices:
        logger.info("request %s: both legs at once to prefill %d and decode %d, transfer key %s", request_id,
                    prefill.index, decode.index, key)
    prefill_leg = asyncio.ensure_future(_prefill(router, prefill, decode, body, request.path, headers, True, involved,
                                                 transfer_key=key))
    decode_leg = asyncio.ensure_future(_decode(router, decode, request, body, params, headers, received, None,
                                               on_first_chunk, progress))
    try:
        await asyncio.wait({prefill_leg, decode_leg}, return_when=asyncio.FIRST_COMPLETED)
        failure = prefill_leg.exception() if prefill_leg.done() and not prefill_leg.cancelled() else None
        if failure is not None and not decode_leg.done() and not progress["started"]:
            decode_leg.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await decode_leg
            error = failure if isinstance(failure, PeerError) else PeerError(502, "prefill", f"prefill failed: {failure!r}")
            logger.error("request %s: %s (decode's request cancelled)", request_id, error.message)
            return error.response(request_id)
        if failure is not None:
            logger.error("request %s: prefill failed while decode answered: %s", request_id, failure)
        return await decode_leg
    finally:
        for leg in (decode_leg, prefill_leg):
            if not leg.done():  # decode ended first (or the client left): prefill's KV is not wanted any more
                leg.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await leg
            elif not leg.cancelled():
                leg.exception()  # retrieved: logged above


async def _read_body(request: web.Request, limit: int) -> bytes | None:
    """The request's body, or None as soon as it is over `limit` bytes (the rest is never read)."""
    chunks, size = [], 0
    while chunk := await request.content.read(65536):
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


class _ClientGone(Exception):
    """The client closed its connection while decode's answer was being relayed: not decode's failure."""


@contextlib.contextmanager
def _to_client() -> Iterator[None]:
    try:
        yield
    except ConnectionResetError as exc:  # aiohttp's ClientConnectionResetError, which is also a ClientError
        raise _ClientGone() from exc


async def _decode(router: Router, decode: Instance, request: web.Request, body: dict, params: dict | None,
                  headers: dict, received: float, prefill_answered: float | None,
                  on_first_chunk: Callable[[float], None], progress: dict[str, bool] | None = None
                  ) -> web.StreamResponse:
    """Decode's answer to the client. `params`: prefill's kv_transfer_params, None for a request decode computes
    alone (a client's own kv_transfer_params never reach decode). `on_first_chunk`: called with the time of a
    streamed answer's first chunk. `progress["started"]` turns True once the answer began reaching the client."""
    config = router.config
    request_id = headers[REQUEST_ID_HEADER]
    if params is not None:
        decode_body = {**body, "kv_transfer_params": params}  # shallow, as prefill_body
    else:
        decode_body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    url = decode.url + request.path
    timeout = aiohttp.ClientTimeout(total=config.decode_timeout_seconds, connect=config.connect_timeout_seconds)
    stream = bool(body.get("stream"))
    response: web.StreamResponse | None = None
    try:
        # `headers` go back to the client too: the engines' Authorization only on the request to decode
        async with router.session.post(url, json=decode_body, headers={**headers, **router.engine_headers},
                                       timeout=timeout) as resp:
            if resp.status >= 400:
                text = await resp.text()
                status = 502 if resp.status >= 500 else resp.status
                raise PeerError(status, "decode", f"decode {url} answered {resp.status}: {text[:500]}")
            if not stream:
                answer = await resp.read()
                timeline.log("router", request_id, received=received, prefill_answered=prefill_answered,
                             done=timeline.now())
                return web.Response(body=answer, status=resp.status, content_type=resp.content_type, headers=headers)
            response = web.StreamResponse(status=resp.status, headers={**headers, "Content-Type": resp.headers.get("Content-Type", "text/event-stream")})
            if progress is not None:
                progress["started"] = True
            with _to_client():
                await response.prepare(request)
            first_chunk = None
            async for chunk in resp.content.iter_any():
                if first_chunk is None:
                    first_chunk = timeline.now()
                    on_first_chunk(first_chunk)
                with _to_client():
                    await response.write(chunk)
            with _to_client():
                await response.write_eof()
            timeline.log("router", request_id, received=received, prefill_answered=prefill_answered,
                         decode_first_chunk=first_chunk, done=timeline.now())
            return response
    except _ClientGone:
        logger.info("request %s: the client closed its connection during decode's answer", request_id)
        return response
    except asyncio.TimeoutError:
        error = PeerError(504, "decode", f"decode {url} did not finish within {config.decode_timeout_seconds:.0f}s")
    except aiohttp.ClientError as exc:
        error = PeerError(502, "decode", f"decode {url} failed: {exc}")
    except PeerError as exc:
        error = exc
    if error.status >= 500:
        router.decodes.failed(decode)
    logger.error("request %s: %s", request_id, error.message)
    if response is not None:  # headers already sent: end the stream with an error event
        with contextlib.suppress(ConnectionResetError):
            await response.write(f"data: {json.dumps({'error': {'message': error.message, 'code': error.status}})}\n\n".encode())
            await response.write_eof()
        return response
    return error.response(request_id)


async def _models(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    if not router.decodes.instances:
        return PeerError(503, "router", no_instance("decode")).response("-")
    cooling = set(router.decodes.cooling())
    decode = next((i for i in router.decodes.instances if i.index not in cooling), router.decodes.instances[0])
    try:
        async with router.session.get(decode.url + "/v1/models", headers=router.engine_headers,
                                      timeout=aiohttp.ClientTimeout(total=10)) as resp:
            return web.Response(body=await resp.read(), status=resp.status, content_type=resp.content_type)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return PeerError(502, "decode", f"decode unreachable: {exc}").response("-")


def make_app(config: RouterConfig) -> web.Application:
    pushed = config.peers_token is not None
    if pushed:
        check_peers_token(config.peers_token)
    config = dataclasses.replace(config, api_key=config.api_key or None)  # "": no key, as an empty VLLM_API_KEY
    middlewares = [api_key_guard(config.api_key)] if config.api_key is not None else []
    config = dataclasses.replace(config, prefill_urls=check_urls("--prefill", config.prefill_urls, allow_empty=pushed),
                                 decode_urls=check_urls("--decode", config.decode_urls, allow_empty=pushed))
    config = dataclasses.replace(
        config, prefill_ready_urls=check_ready_urls("--prefill-ready", config.prefill_ready_urls, config.prefill_urls),
        decode_ready_urls=check_ready_urls("--decode-ready", config.decode_ready_urls, config.decode_urls))
    check_timeout("--prefill-timeout", config.prefill_timeout_seconds)
    check_timeout("--decode-timeout", config.decode_timeout_seconds)
    check_timeout("--connect-timeout", config.connect_timeout_seconds)
    check_timeout("--idle-connection-timeout", config.idle_connection_seconds)
    check_timeout("--failure-cooldown", config.failure_cooldown_seconds)
    for field in ("kv_scrape_interval_seconds", "kv_scrape_timeout_seconds", "kv_usage_max_age_seconds",
                  "ready_check_timeout_seconds"):
        check_timeout(field, getattr(config, field))
    check_body_bytes("--max-body-bytes", config.max_body_bytes)
    check_count("--local-prompt-tokens", config.local_prompt_tokens)
    config = dataclasses.replace(
        config, prefill_kv_events=check_kv_events("--prefill-kv-events", config.prefill_kv_events, config.prefill_urls),
        decode_kv_events=check_kv_events("--decode-kv-events", config.decode_kv_events, config.decode_urls))
    if (config.prefill_kv_events or config.decode_kv_events) and not (config.prefix_affinity and config.tokenizer):
        raise ValueError("--prefill-kv-events and --decode-kv-events need --prefix-affinity and --tokenizer (the "
                         "events are matched against the prompt's token ids)")
    # aiohttp's own bound on a body read whole (request.read(): the pushed set, itself bounded lower); completions
    # are read by _read_body up to max_body_bytes.
    app = web.Application(client_max_size=max(config.max_body_bytes, MAX_PEERS_BODY_BYTES), middlewares=middlewares)
    router = app[ROUTER] = Router(config)
    app[METRICS_REGISTRY] = registry_for(router)

    async def client_ctx(app: web.Application):
        router.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(connect=config.connect_timeout_seconds),
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=config.idle_connection_seconds),
        )
        # With one decode there is no tie to break: no scrape (a pushed set may bring more).
        scraper = asyncio.create_task(scrape_kv_usage(router)) if len(config.decode_urls) > 1 or pushed else None
        subscribers = [s for role in router.kv_subscribers.values() for s in role.values()]
        try:
            for subscriber in subscribers:
                subscriber.start()
        except Exception:
            for subscriber in subscribers:
                await subscriber.stop()
            raise
        yield
        for subscriber in subscribers:
            await subscriber.stop()
        if scraper is not None:
            scraper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await scraper
        await router.session.close()

    app.cleanup_ctx.append(client_ctx)
    for route in ROUTES:
        app.router.add_post(route, _proxy)
    app.router.add_get(HEALTH_PATH, health)
    app.router.add_get(READYZ_PATH, readyz)
    app.router.add_get("/v1/models", _models)
    app.router.add_get(METRICS_PATH, metrics_handler)
    if pushed:
        app.router.add_get(PEERS_PATH, peers_handler)
        app.router.add_put(PEERS_PATH, peers_handler)
    else:
        app.router.add_route("*", PEERS_PATH, no_peers_handler)
    return app
