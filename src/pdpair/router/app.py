"""The pdpair router: each request goes to prefill with max_tokens=1 and kv_transfer_params {do_remote_decode: true},
then the original request goes to decode with the kv_transfer_params prefill returned; decode's answer (streamed or
not) goes back to the client.

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
deadline. A prefill that refused the connection never saw the request, so it is sent to another prefill when there
is one. A decode request is never sent twice (its KV may already be read).
X-Request-Id is taken from the client (or made) and sent to both engines and back to the client.

With VLLM_API_KEY set (spec.apiKeySecret, read once at start; empty: no key), every request but /health, /readyz and
`/pdpair/v1/peers` (its own token) must carry `Authorization: Bearer <key>`, compared as vLLM does (sha256 digests,
constant time); any other is answered 401 with a fixed OpenAI-style error that echoes nothing of the request, before
its body is read. The router then sends `Authorization: Bearer <key>` to prefill and decode (vLLM, given the same
variable, refuses a /v1 request without it), and to decode's /v1/models; never the client's own header.

/health is the router's liveness; /readyz its readiness: at least one prefill and one decode that may be chosen (not
draining) ready by their own readiness URLs (`readiness`), so a router started beside loading engines gets no traffic
before they serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import math
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from pdpair.connector import timeline
from pdpair.contract import ENV_API_KEY, ENV_PEERS_TOKEN, MAX_PEERS_BODY_BYTES, PEERS_PATH
from pdpair.contract import READYZ_PATH  # the router's readiness too: it has a prefill and a decode that are ready
from pdpair.contract import PROBE_WAIT_PARAM, parse_probe_wait, probe_hold_pause
from pdpair.contract.router_peers import BODY_ROLES, RouterMember, count

logger = logging.getLogger("pdpair.router")

REQUEST_ID_HEADER = "X-Request-Id"
ROUTE_HEADER = "X-Pdpair-Route"
KV_USAGE_METRIC = "vllm:kv_cache_usage_perc"
ROUTES = ("/v1/completions", "/v1/chat/completions")
HEALTH_PATH = "/health"  # the router's liveness, and an engine's (vLLM's) readiness when no other URL is given


@dataclass(frozen=True)
class RouterConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    prefill_timeout_seconds: float = 120.0
    decode_timeout_seconds: float = 600.0
    connect_timeout_seconds: float = 10.0
    idle_connection_seconds: float = 2.0
    failure_cooldown_seconds: float = 5.0
    debug_routing: bool = False
    log_choices: bool = False
    # The largest request body accepted (--max-body-bytes); a larger one is answered 413 before it is read. A
    # completion needs its prompt and parameters: a 128k-token prompt is about 0.5 MiB as text and under 1 MiB as a
    # JSON list of token ids, and chat messages with tool definitions stay well below 4 MiB. The bound is what one
    # client can make the router hold (and parse into objects several times larger) per request; 64 MiB, aiohttp's
    # setting before, let a few clients take the router's memory. Images sent inline (base64) may need more: raise it.
    max_body_bytes: int = 4 * 2**20
    # Each instance's own readiness URL, in the order of its role's URLs (empty: its base URL + /health). The
    # router's /readyz passes while at least one prefill and one decode pass theirs (`readiness`).
    prefill_ready_urls: tuple[str, ...] = ()
    decode_ready_urls: tuple[str, ...] = ()
    # Not flags: the design's constants (docs/xpyd.md section 5), fields only so that a test can shorten them.
    kv_scrape_interval_seconds: float = 1.0
    kv_scrape_timeout_seconds: float = 0.5
    kv_usage_max_age_seconds: float = 5.0
    # Above an engine's own /readyz bound on its engine's /health (connector/pod_server.py, 2 s); with the probe's wait
    # (operator/pods.py PROBE_WAIT_SECONDS) below the kubelet's readiness timeout for the router (ROUTER_READINESS_PROBE):
    # every instance is asked at once, so one answer that never comes costs this, not the probe.
    ready_check_timeout_seconds: float = 2.5
    # PDPAIR_PEERS_TOKEN: set, the router serves `PUT /pdpair/v1/peers` (the operator's push of its instance sets,
    # bearer this token) and the flags' URLs are only the set until the first push (none may be given); None: 404.
    peers_token: str | None = dataclasses.field(default=None, repr=False)
    # VLLM_API_KEY (spec.apiKeySecret): set, clients must send it as a bearer token and the router sends it to the
    # engines (`api_key_guard`, `Router.engine_headers`); None or "": no key. Never logged (repr=False).
    api_key: str | None = dataclasses.field(default=None, repr=False)


class PeerError(Exception):
    def __init__(self, status: int, peer: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.peer = peer
        self.message = message

    def response(self, request_id: str) -> web.Response:
        body = {"error": {"message": self.message, "type": "peer_error", "peer": self.peer, "code": self.status}}
        return web.json_response(body, status=self.status, headers={REQUEST_ID_HEADER: request_id})


@dataclass(eq=False)
class Instance:
    role: str
    index: int
    url: str
    outstanding: int = 0  # requests in flight to it now: the choice's load count (`Pool.hold`)
    # Requests in flight that involve it for their whole life (`Pool.involve`): a prefill's from its choice until the
    # request's decode answer ended or failed (its KV push to decode may outlive its own answer), a decode's as
    # `outstanding`. Never the load (a prefill that answered is free for the next prompt): what a drain waits for.
    involved: int = 0
    cooldown_until: float = -math.inf  # on the pool's clock
    kv_usage: float | None = None
    kv_usage_at: float = -math.inf
    ready_url: str = ""  # where its own readiness is asked (the router's /readyz); "" = url + /health
    draining: bool = False  # pushed as draining, or gone from the pushed set: never chosen again


class Pool:
    """The instances of one role, the requests in flight to each through this router, and the choice among them.

    `instances` are the ones that may be chosen (in index order), `draining` the members of the pushed set marked
    draining, `leaving` (by URL) the instances that left the set with requests still in flight through this router
    (held or involved);
    `replace` swaps the set (docs/xpyd.md section 6)."""

    def __init__(self, role: str, urls: tuple[str, ...], cooldown_seconds: float,
                 kv_usage_max_age_seconds: float | None = None, clock: Callable[[], float] = time.monotonic,
                 ready_urls: tuple[str, ...] = ()) -> None:
        self.role = role
        ready_urls = ready_urls or tuple(url + HEALTH_PATH for url in urls)
        self.instances = [Instance(role, index, url, ready_url=ready)
                          for index, (url, ready) in enumerate(zip(urls, ready_urls, strict=True))]
        self.draining: list[Instance] = []
        self.leaving: dict[str, Instance] = {}
        self._cooldown = cooldown_seconds
        self._kv_max_age = kv_usage_max_age_seconds  # None: this role's choice ignores KV usage
        self._clock = clock
        self._cursor = 0  # round-robin: the index that wins the next exact tie

    def choose(self, exclude: Instance | None = None) -> Instance:
        """The instance with the fewest requests in flight; ties go to the lowest fresh KV-cache usage (when this
        pool tracks it), then round-robin. `exclude` (the instance a retry leaves) is chosen only if it is the only
        one."""
        now = self._clock()
        candidates = [i for i in self.instances if i is not exclude] or self.instances
        # Fail open: when every candidate is cooling down, choose among them anyway. Skipping a failed instance only
        # helps while another can take the request; with one instance per role (what the operator runs today)
        # refusing would turn one transient error (a reset kept-alive connection, an engine restarting) into
        # failure_cooldown_seconds of certain 503s for a pair that may already serve again.
        candidates = [i for i in candidates if i.cooldown_until <= now] or candidates
        least = min(i.outstanding for i in candidates)
        tied = [i for i in candidates if i.outstanding == least]
        if len(tied) > 1 and self._kv_max_age is not None:
            usages = [self.fresh_kv_usage(i, now) for i in tied]
            # Only when every tied decode has a fresh value: a missing or stale one says nothing about its load, and
            # ranking it above or below the known ones would starve it or prefer a decode whose /metrics fails.
            if None not in usages:
                low = min(usages)
                tied = [i for i, usage in zip(tied, usages) if usage == low]
        n = max(i.index for i in self.instances) + 1  # a pushed set's indexes may have gaps
        chosen = min(tied, key=lambda i: (i.index - self._cursor) % n)
        self._cursor = (chosen.index + 1) % n
        return chosen

    def member(self, index: int) -> Instance | None:
        """The instance that may be chosen with this index (X-Pdpair-Route), or None."""
        return next((i for i in self.instances if i.index == index), None)

    def replace(self, members: list[RouterMember]) -> None:
        """Makes `members` the role's set. Synchronous, so no request's choice sees half of it. An instance is kept
        by URL (its requests in flight, cooldown and KV usage stay); a new URL is a new instance; one marked
        draining, or gone from the set, is never chosen again while its requests in flight finish (`hold` and
        `involve` count them); one gone from the set is forgotten when its last one ends."""
        known = {i.url: i for i in (*self.instances, *self.draining, *self.leaving.values())}
        instances, draining = [], []
        for m in sorted(members, key=lambda m: m.index):
            instance = known.pop(m.url, None) or Instance(self.role, m.index, m.url)
            instance.index, instance.ready_url, instance.draining = m.index, m.ready_url, m.draining
            (draining if m.draining else instances).append(instance)
        for instance in known.values():
            instance.draining = True
        self.instances, self.draining = instances, draining
        self.leaving = {url: i for url, i in known.items() if i.outstanding > 0 or i.involved > 0}

    def hold(self, instance: Instance) -> contextlib.AbstractContextManager[Instance]:
        """Counts a request in flight to `instance` while the block runs (cancelled or failed included): its load
        (`outstanding`, what `choose` compares). Enter it right after `choose`, with no await between, so that
        concurrent requests see each other's choice."""
        return self._counting(instance, "outstanding")

    def involve(self, instance: Instance) -> contextlib.AbstractContextManager[Instance]:
        """Counts a request that involves `instance` while the block runs (cancelled or failed included):
        `involved`, what a drain waits for. `_proxy` enters it for the decode beside `hold`, and for each prefill a
        request is sent to from its choice until decode's answer ended (prefill's KV push outlives its answer)."""
        return self._counting(instance, "involved")

    @contextlib.contextmanager
    def _counting(self, instance: Instance, count: str) -> Iterator[Instance]:
        setattr(instance, count, getattr(instance, count) + 1)
        try:
            yield instance
        finally:
            setattr(instance, count, getattr(instance, count) - 1)
            if instance.outstanding == 0 and instance.involved == 0 and self.leaving.get(instance.url) is instance:
                del self.leaving[instance.url]  # it left the set and its last request ended: forgotten

    def failed(self, instance: Instance) -> None:
        instance.cooldown_until = self._clock() + self._cooldown

    def record_kv_usage(self, instance: Instance, usage: float) -> None:
        instance.kv_usage, instance.kv_usage_at = usage, self._clock()

    def fresh_kv_usage(self, instance: Instance, now: float | None = None) -> float | None:
        if self._kv_max_age is None or instance.kv_usage is None:
            return None
        now = self._clock() if now is None else now
        return instance.kv_usage if now - instance.kv_usage_at <= self._kv_max_age else None

    def outstanding(self) -> list[int]:
        return [i.outstanding for i in self.instances]

    def cooling(self) -> list[int]:
        now = self._clock()
        return [i.index for i in self.instances if i.cooldown_until > now]


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.prefills = Pool("prefill", config.prefill_urls, config.failure_cooldown_seconds,
                             ready_urls=config.prefill_ready_urls)
        self.decodes = Pool("decode", config.decode_urls, config.failure_cooldown_seconds,
                            kv_usage_max_age_seconds=config.kv_usage_max_age_seconds,
                            ready_urls=config.decode_ready_urls)
        self.session: aiohttp.ClientSession | None = None
        # Sent with every request to an engine's API (prefill, decode, decode's /v1/models): the pair's API key, which
        # vLLM requires under /v1 when it has one; nothing without a key. Not to readiness URLs or /metrics (open).
        self.engine_headers: dict[str, str] = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        # The last pushed set's epoch and generation (None: the flags' set, nothing pushed yet).
        self.epoch: int | None = None
        self.generation: int | None = None

    def apply_peers(self, epoch: int, generation: int, prefills: list[RouterMember], decodes: list[RouterMember]) -> None:
        """Both roles' sets at once: synchronous, so no request sees one role swapped and not the other."""
        self.prefills.replace(prefills)
        self.decodes.replace(decodes)
        self.epoch, self.generation = epoch, generation

    def peers_state(self) -> dict:
        """The answer of `PUT`/`GET /pdpair/v1/peers`: each role's members (draining included) with the requests in
        flight to each through this router (`outstanding`, the load) and those that involve it (`involved`: a
        prefill's until the request's decode answer ended), the instances that left the set with requests still in
        flight (`leaving`; one is gone from it when both counts reach 0), and `warnings` (a role with no instance
        that may be chosen: /readyz fails and requests are answered 503)."""
        def members(pool: Pool) -> list[dict]:
            return [{"index": i.index, "url": i.url, "outstanding": i.outstanding, "involved": i.involved,
                     "draining": i.draining}
                    for i in sorted((*pool.instances, *pool.draining), key=lambda i: i.index)]

        pools = (self.prefills, self.decodes)
        return {
            "epoch": self.epoch, "generation": self.generation,
            "prefills": members(self.prefills), "decodes": members(self.decodes),
            "leaving": [{"role": pool.role, "url": i.url, "outstanding": i.outstanding, "involved": i.involved}
                        for pool in pools for i in pool.leaving.values()],
            "warnings": [_no_instance(pool.role) for pool in pools if not pool.instances],
        }


def _no_instance(role: str) -> str:
    return (f"no {role} that may be chosen (the set is empty or every {role} is draining): the router's {READYZ_PATH} "
            f"fails and requests are answered 503 until one is pushed")


ROUTER = web.AppKey("router", Router)


def prefill_body(body: dict, chat: bool) -> dict:
    """The request prefill sees: one token, no streaming, and the request to keep the KV for decode."""
    out = dict(body)  # shallow: only top-level keys change, and a deep copy of a large prompt costs its size again
    out["max_tokens"] = 1
    if chat and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return out


# The peer closed or reset the connection before answering: a kept-alive connection it was closing (a new one is
# worth one more try). Not a refused connection (ClientConnectorError, a subclass of ClientOSError): nothing listens.
def _disconnected(exc: BaseException | None) -> bool:
    return isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)) and \
        not isinstance(exc, aiohttp.ClientConnectorError)


def _refused(exc: BaseException | None) -> bool:
    return isinstance(exc, aiohttp.ClientConnectorError)


async def _prefill(router: Router, first: Instance, body: dict, path: str, headers: dict, forced: bool,
                   involved: contextlib.ExitStack) -> dict:
    """Prefill's kv_transfer_params, from `first` or from the one prefill the request is sent to once more. Each
    prefill it is sent to is entered into `involved` (`Pool.involve`): the caller's stack, left when decode's answer
    ended, since a prefill that answered may still be pushing the KV to decode (one that failed may have computed
    it too)."""
    pool, config = router.prefills, router.config
    payload = prefill_body(body, path.endswith("/chat/completions"))
    instance = first
    for attempt in range(2):
        involved.enter_context(pool.involve(instance))
        with pool.hold(instance):
            try:
                answer = await _post_json(router.session, "prefill", instance.url + path, payload,
                                          {**headers, **router.engine_headers}, config.prefill_timeout_seconds)
                params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
                if not isinstance(params, dict):
                    raise PeerError(
                        502, "prefill",
                        f"prefill {instance.url} answered without kv_transfer_params (is it running the pdpair "
                        "connector as kv_producer?)",
                    )
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
            return PeerError(503, "router", _no_instance(pool.role)).response(request_id)

    # Decode first: it holds the request for the whole answer, so its load matters most; a prefill is busy only for
    # the prompt.
    decodes_seen = router.decodes.outstanding()
    decode = router.decodes.member(forced[1]) if forced else router.decodes.choose()
    # `involved` (Pool.involve): the decode and every prefill the request is sent to, until decode's answer ended.
    with router.decodes.hold(decode), router.decodes.involve(decode), contextlib.ExitStack() as involved:
        prefills_seen = router.prefills.outstanding()
        prefill = router.prefills.member(forced[0]) if forced else router.prefills.choose()
        if router.config.log_choices:
            _log_choice(router, request_id, prefill, decode, prefills_seen, decodes_seen, forced is not None)
        try:
            params = await _prefill(router, prefill, body, request.path, headers, forced is not None, involved)
        except PeerError as exc:
            logger.error("request %s: %s", request_id, exc.message)
            return exc.response(request_id)
        prefill_answered = timeline.now()
        return await _decode(router, decode, request, body, params, headers, received, prefill_answered)


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


async def _decode(router: Router, decode: Instance, request: web.Request, body: dict, params: dict, headers: dict,
                  received: float, prefill_answered: float) -> web.StreamResponse:
    config = router.config
    request_id = headers[REQUEST_ID_HEADER]
    decode_body = {**body, "kv_transfer_params": params}  # shallow, as prefill_body
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
            with _to_client():
                await response.prepare(request)
            first_chunk = None
            async for chunk in resp.content.iter_any():
                if first_chunk is None:
                    first_chunk = timeline.now()
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


def parse_kv_usage(text: str) -> float | None:
    """The highest `vllm:kv_cache_usage_perc` sample of a Prometheus text page (a data-parallel engine has one per
    engine, and its fullest one is what refuses new work first), or None when it has none."""
    best = None
    for line in text.splitlines():
        if not line.startswith(KV_USAGE_METRIC):
            continue
        rest = line[len(KV_USAGE_METRIC):]
        if rest.startswith("{"):
            rest = rest[rest.rfind("}") + 1:] if "}" in rest else ""
        elif not rest[:1].isspace():
            continue  # another metric whose name starts with this one's
        fields = rest.split()
        try:
            value = float(fields[0]) if fields else math.nan
        except ValueError:
            continue
        if math.isfinite(value):
            best = value if best is None else max(best, value)
    return best


async def _scrape_kv_usage(router: Router) -> None:
    """Every kv_scrape_interval_seconds, each decode's KV-cache usage from its /metrics. A scrape that fails leaves the
    last value to age out: the scrape feeds only the tie-break, never the cooldown (requests decide what failed)."""
    config, pool = router.config, router.decodes

    async def scrape(instance: Instance) -> None:
        try:
            async with router.session.get(instance.url + "/metrics",
                                          timeout=aiohttp.ClientTimeout(total=config.kv_scrape_timeout_seconds)) as resp:
                if resp.status != 200:
                    logger.debug("decode %d %s: /metrics answered %d", instance.index, instance.url, resp.status)
                    return
                usage = parse_kv_usage(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            logger.debug("decode %d %s: /metrics not scraped: %r", instance.index, instance.url, exc)
            return
        if usage is not None:
            pool.record_kv_usage(instance, usage)

    while True:
        # The decodes that may be chosen now (a pushed set changes them); with one there is no tie to break.
        if len(pool.instances) > 1:
            await asyncio.gather(*(scrape(instance) for instance in pool.instances))
        await asyncio.sleep(config.kv_scrape_interval_seconds)


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _instance_ready(router: Router, instance: Instance) -> tuple[bool, str]:
    timeout = aiohttp.ClientTimeout(total=router.config.ready_check_timeout_seconds)
    try:
        async with router.session.get(instance.ready_url, timeout=timeout) as resp:
            await resp.read()
            return resp.status == 200, f"HTTP {resp.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def readiness(router: Router) -> tuple[bool, dict]:
    """Ready while at least one prefill and one decode answer 200 on their own readiness URLs (the operator gives
    each engine pod's /readyz: paired, serving, warmed up), all asked at once, each within
    ready_check_timeout_seconds. The operator creates the router while the engines still load, so this is what keeps
    the pair's Service off it until a request through it can be served. Only instances that may be chosen count
    (a draining one is not asked): a pushed set with none of a role makes the router not ready (`warnings`)."""
    instances = [*router.prefills.instances, *router.decodes.instances]
    answers = await asyncio.gather(*(_instance_ready(router, i) for i in instances))
    body: dict = {"prefill": [], "decode": []}
    for instance, (ok, detail) in zip(instances, answers):
        body[instance.role].append({"index": instance.index, "url": instance.ready_url, "ready": ok, "detail": detail})
    ready = all(any(entry["ready"] for entry in body[role]) for role in ("prefill", "decode"))
    warnings = [_no_instance(role) for role in ("prefill", "decode") if not body[role]]
    return ready, {**body, "warnings": warnings} if warnings else body


async def _readyz(request: web.Request) -> web.Response:
    """readiness(), held while it fails for the probe's `?wait=SECONDS` (contract.PROBE_WAIT_PARAM; 400 for a bad
    value): asked again every PROBE_WAIT_POLL_SECONDS, no new ask after the wait, so the kubelet sees the router
    ready within that of its engines being ready, not a probe period later."""
    try:
        wait = parse_probe_wait(request.query.get(PROBE_WAIT_PARAM))
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    deadline = time.monotonic() + wait
    while True:
        ready, body = await readiness(request.app[ROUTER])
        pause = probe_hold_pause(ready, deadline - time.monotonic())
        if pause is None:
            return web.json_response({"ready": ready, **body}, status=200 if ready else 503)
        await asyncio.sleep(pause)


async def _models(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    if not router.decodes.instances:
        return PeerError(503, "router", _no_instance("decode")).response("-")
    cooling = set(router.decodes.cooling())
    decode = next((i for i in router.decodes.instances if i.index not in cooling), router.decodes.instances[0])
    try:
        async with router.session.get(decode.url + "/v1/models", headers=router.engine_headers,
                                      timeout=aiohttp.ClientTimeout(total=10)) as resp:
            return web.Response(body=await resp.read(), status=resp.status, content_type=resp.content_type)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return PeerError(502, "decode", f"decode unreachable: {exc}").response("-")


# --- the pair's API key (spec.apiKeySecret, VLLM_API_KEY) -------------------------------------------------------
# The router's paths that need no API key: its liveness and readiness (the kubelet's probes) and the peer push, which
# has its own token. Every other path, the OpenAI API under /v1 and any path the router does not serve, needs the key.
OPEN_PATHS = frozenset({HEALTH_PATH, READYZ_PATH, PEERS_PATH})
# The answer to a request without the key or with another: fixed, in the OpenAI error shape; nothing of the request.
API_KEY_REFUSAL = {"error": {"message": "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                             "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


def check_api_key(key: str) -> str:
    """VLLM_API_KEY as a client can send it: printable ASCII without leading or trailing whitespace, else a ValueError
    naming the variable (never the value). An HTTP header carries nothing else intact (a header's surrounding
    whitespace is stripped, and vLLM reads non-ASCII bytes as Latin-1 but hashes the key as UTF-8), so every
    request would be refused; the likeliest cause is a Secret made from a file that ends with a newline."""
    if not key or not key.isascii() or not key.isprintable() or key != key.strip():
        raise ValueError(f"{ENV_API_KEY} (the Secret of spec.apiKeySecret) is not printable ASCII without leading or "
                         f"trailing whitespace ({len(key)} characters): no client could send it in an Authorization "
                         "header, so every request would be refused (a Secret made from a file often ends with a "
                         "newline: make it with kubectl create secret generic --from-literal)")
    return key


def bearer_matches(header: str | None, digest: bytes) -> bool:
    """Whether an Authorization header is `Bearer <key>` for the key whose sha256 is `digest`: vLLM's rule
    (AuthenticationMiddleware: the scheme case-insensitive, the rest of the header after one space is the key),
    compared as digests in constant time, so neither the key's length nor a prefix leaks through timing."""
    if not header:
        return False
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    try:
        raw = given.encode("utf-8", "surrogateescape")  # the header's bytes as they came (aiohttp's decoding undone)
    except UnicodeError:
        return False
    return hmac.compare_digest(hashlib.sha256(raw).digest(), digest)


def api_key_guard(key: str):
    """The middleware that answers 401 (API_KEY_REFUSAL) to a request outside OPEN_PATHS without the bearer key,
    before its handler runs: before a byte of its body is read."""
    digest = hashlib.sha256(check_api_key(key).encode()).digest()

    @web.middleware
    async def guard(request: web.Request, handler):
        if request.path not in OPEN_PATHS and not bearer_matches(request.headers.get("Authorization"), digest):
            return web.json_response(API_KEY_REFUSAL, status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return guard


# --- the operator's push of the instance sets: PUT /pdpair/v1/peers ----------------------------------------------
def check_peers_token(token: str) -> str:
    """The connector's rule for PDPAIR_PEERS_TOKEN (connector/config.py): at least 16 printable ASCII characters
    without spaces, else a ValueError."""
    if not isinstance(token, str) or len(token) < 16 or not token.isascii() or not token.isprintable() or \
            any(c.isspace() for c in token):
        raise ValueError(f"{ENV_PEERS_TOKEN} must be at least 16 printable ASCII characters without spaces")
    return token


def parse_peers_body(doc: object) -> tuple[int, int, list[RouterMember], list[RouterMember]]:
    """(epoch, generation, prefills, decodes) of a pushed body `{"epoch": int, "generation": int, "prefills":
    [{"index": int, "url": str, "readyUrl": str, "draining": bool (optional, false)}, ...], "decodes": [...]}`;
    else a ValueError naming the field. An index is unique within its role, a URL (however spelled) within the body;
    other keys are ignored. An empty or all-draining role is accepted (the router is then not ready)."""
    if not isinstance(doc, dict):
        raise ValueError("the body must be a JSON object {epoch, generation, prefills, decodes}")
    epoch, generation = count(doc.get("epoch"), "epoch"), count(doc.get("generation"), "generation")
    urls: dict[tuple, str] = {}
    roles: dict[str, list[RouterMember]] = {}
    for member_role, role in BODY_ROLES.items():
        items = doc.get(role)
        if not isinstance(items, list):
            raise ValueError(f"{role} must be a list of {{index, url, readyUrl, draining}}, got {items!r:.100}")
        members: list[RouterMember] = []
        indexes: dict[int, str] = {}
        for n, item in enumerate(items):
            where = f"{role}[{n}]"
            if not isinstance(item, dict):
                raise ValueError(f"{where} must be an object {{index, url, readyUrl, draining}}, got {item!r:.100}")
            index = count(item.get("index"), f"{where}.index")
            if index in indexes:
                raise ValueError(f"{where}.index {index} is {indexes[index]}'s too")
            url, key = check_url(f"{where}.url", item.get("url"))
            if key in urls:
                raise ValueError(f"{where}.url {url!r} names the instance of {urls[key]} too")
            ready_url, _ = check_url(f"{where}.readyUrl", item.get("readyUrl"))
            draining = item.get("draining", False)
            if not isinstance(draining, bool):
                raise ValueError(f"{where}.draining must be true or false, got {draining!r:.100}")
            indexes[index], urls[key] = where, f"{where}.url"
            members.append(RouterMember(member_role, index, url, ready_url, draining))
        roles[role] = members
    return epoch, generation, roles["prefills"], roles["decodes"]


def _authorized(router: Router, request: web.Request) -> bool:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    try:
        given = token.strip().encode("utf-8", "surrogateescape")
    except UnicodeError:
        return False
    return scheme.lower() == "bearer" and hmac.compare_digest(given, router.config.peers_token.encode())


async def _peers(request: web.Request) -> web.Response:
    """`PUT /pdpair/v1/peers`: the whole desired set of both roles, level-triggered (docs/xpyd.md sections 3, 5, 6);
    `GET`: the same answer without a change. Bearer PDPAIR_PEERS_TOKEN (constant-time compare) else 401; a malformed
    body 400 naming the field; an epoch older than the last accepted one 409 (a deposed operator leader cannot undo
    its successor's push; the same epoch again is applied again, so the same body twice is a no-op). The answer is
    `Router.peers_state()`."""
    router = request.app[ROUTER]
    if not _authorized(router, request):
        return web.json_response({"error": f"a valid bearer token is required (the pair's {ENV_PEERS_TOKEN})"},
                                 status=401, headers={"WWW-Authenticate": "Bearer"})
    if request.method != "PUT":
        return web.json_response(router.peers_state())
    if (request.content_length or 0) > MAX_PEERS_BODY_BYTES:
        return web.json_response({"error": f"the body is over {MAX_PEERS_BODY_BYTES} bytes"}, status=413)
    raw = await request.read()
    if len(raw) > MAX_PEERS_BODY_BYTES:
        return web.json_response({"error": f"the body is over {MAX_PEERS_BODY_BYTES} bytes"}, status=413)
    try:
        epoch, generation, prefills, decodes = parse_peers_body(json.loads(raw))
    except ValueError as exc:  # json.JSONDecodeError included
        return web.json_response({"error": f"{exc}" if not isinstance(exc, json.JSONDecodeError)
                                  else f"the body is not JSON: {exc}"}, status=400)
    # From the epoch check to the swap there is no await: no request's choice runs in between.
    if router.epoch is not None and epoch < router.epoch:
        return web.json_response({"error": f"epoch {epoch} is older than the last one accepted ({router.epoch})",
                                  "epoch": router.epoch}, status=409)
    changed = (epoch, generation) != (router.epoch, router.generation) or \
        _as_members(router.prefills) != _by_index(prefills) or _as_members(router.decodes) != _by_index(decodes)
    router.apply_peers(epoch, generation, prefills, decodes)
    state = router.peers_state()
    if changed:
        logger.info("instance sets pushed: epoch %d, generation %d, prefills %s, decodes %s, leaving %s%s", epoch,
                    generation, _summary(state["prefills"]), _summary(state["decodes"]),
                    [f"{e['role']} {e['url']} ({e['involved']} in flight)" for e in state["leaving"]],
                    "".join(f"; {w}" for w in state["warnings"]))
    return web.json_response(state)


def _as_members(pool: Pool) -> list[RouterMember]:
    return [RouterMember(pool.role, i.index, i.url, i.ready_url, i.draining)
            for i in sorted((*pool.instances, *pool.draining), key=lambda i: i.index)]


def _by_index(members: list[RouterMember]) -> list[RouterMember]:
    return sorted(members, key=lambda m: m.index)


def _summary(entries: list[dict]) -> list[str]:
    return [f"{e['index']} {e['url']}{' (draining)' if e['draining'] else ''}" for e in entries]


async def _no_peers(request: web.Request) -> web.Response:
    return web.json_response({"error": f"no peer push on this router ({ENV_PEERS_TOKEN} is not set): its instances "
                                       "are its flags'"}, status=404)


def check_timeout(flag: str, seconds: float) -> float:
    """`seconds` if it is a finite number > 0, else a ValueError naming `flag`. aiohttp reads 0 or a negative
    timeout as "no deadline", and nan/inf are no deadline either; the router never waits without one."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ValueError(f"{flag} must be a number of seconds, got {seconds!r}")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{flag} must be a finite number of seconds > 0, got {seconds!r}")
    return float(seconds)


def check_body_bytes(flag: str, value: int) -> int:
    """`value` if it is an int >= 1, else a ValueError naming `flag`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag} must be a number of bytes >= 1, got {value!r}")
    return value


def check_urls(flag: str, urls: tuple[str, ...], allow_empty: bool = False) -> tuple[str, ...]:
    """`urls` without trailing slashes, else a ValueError naming `flag`: none given (unless `allow_empty`), one that
    is not an http(s) URL with a host, or one instance given twice (the same scheme, host, port and path, however spelled: the choice by
    load would count it as two instances and send it twice its share)."""
    if isinstance(urls, str) or not isinstance(urls, (tuple, list)):
        raise ValueError(f"{flag} takes a tuple of URLs, got {urls!r}")
    if not urls and not allow_empty:
        raise ValueError(f"{flag}: at least one URL is required (or set {ENV_PEERS_TOKEN} and push the set)")
    seen: dict[tuple, int] = {}
    out = []
    for index, url in enumerate(urls):
        url, key = check_url(flag, url)
        if key in seen:
            raise ValueError(f"{flag} names one instance twice: {urls[seen[key]]!r} (#{seen[key] + 1}) and "
                             f"{urls[index]!r} (#{index + 1})")
        seen[key] = index
        out.append(url)
    return tuple(out)


def check_url(what: str, url: object) -> tuple[str, tuple]:
    """(`url` without trailing slashes, the instance it names: scheme, host, port, path), else a ValueError naming
    `what`: not an http(s) URL with a host."""
    bad = f"{what} must be an http(s) URL with a host, e.g. http://10.0.0.5:8000, got {url!r}"
    if not isinstance(url, str) or any(c.isspace() for c in url):
        raise ValueError(bad)
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise ValueError(bad) from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(bad)
    key = (parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), parts.path.rstrip("/"))
    return url.rstrip("/"), key


def check_ready_urls(flag: str, ready_urls: tuple[str, ...], urls: tuple[str, ...]) -> tuple[str, ...]:
    """() (each instance's /health), or one readiness URL per instance of the role, in the same order: a
    ValueError naming `flag` otherwise (a count that differs would pair a readiness with the wrong instance)."""
    if isinstance(ready_urls, str) or not isinstance(ready_urls, (tuple, list)):
        raise ValueError(f"{flag} takes a tuple of URLs, got {ready_urls!r}")
    if not ready_urls:
        return ()
    if len(ready_urls) != len(urls):
        raise ValueError(f"{flag} is given {len(ready_urls)} time(s) for {len(urls)} instance(s): give it once per "
                         f"instance, in the same order, or not at all (then each instance's {HEALTH_PATH})")
    return check_urls(flag, ready_urls)


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
    # aiohttp's own bound on a body read whole (request.read(): the pushed set, itself bounded lower); completions
    # are read by _read_body up to max_body_bytes.
    app = web.Application(client_max_size=max(config.max_body_bytes, MAX_PEERS_BODY_BYTES), middlewares=middlewares)
    router = app[ROUTER] = Router(config)

    async def client_ctx(app: web.Application):
        router.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(connect=config.connect_timeout_seconds),
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=config.idle_connection_seconds),
        )
        # With one decode there is no tie to break: no scrape (a pushed set may bring more).
        scraper = asyncio.create_task(_scrape_kv_usage(router)) if len(config.decode_urls) > 1 or pushed else None
        yield
        if scraper is not None:
            scraper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await scraper
        await router.session.close()

    app.cleanup_ctx.append(client_ctx)
    for route in ROUTES:
        app.router.add_post(route, _proxy)
    app.router.add_get(HEALTH_PATH, _health)
    app.router.add_get(READYZ_PATH, _readyz)
    app.router.add_get("/v1/models", _models)
    if pushed:
        app.router.add_get(PEERS_PATH, _peers)
        app.router.add_put(PEERS_PATH, _peers)
    else:
        app.router.add_route("*", PEERS_PATH, _no_peers)
    return app
