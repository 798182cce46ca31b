"""The pdpair router: each request goes to prefill with max_tokens=1 and kv_transfer_params {do_remote_decode: true},
then the original request goes to decode with the kv_transfer_params prefill returned; decode's answer (streamed or
not) goes back to the client.

Several instances of each role may be given (`--prefill` and `--decode` repeated; an instance's index is its place
among its role's flags). Per request the router chooses the decode first, then the prefill, by load (`Pool.choose`;
docs/xpyd.md section 5 is the design). The operator runs one of each today.

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

/health is the router's liveness; /readyz its readiness: at least one prefill and one decode ready by their own
readiness URLs (`readiness`), so a router started beside loading engines gets no traffic before they serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
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
from pdpair.contract import READYZ_PATH  # the router's readiness too: it has a prefill and a decode that are ready

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
    # Each instance's own readiness URL, in the order of its role's URLs (empty: its base URL + /health). The
    # router's /readyz passes while at least one prefill and one decode pass theirs (`readiness`).
    prefill_ready_urls: tuple[str, ...] = ()
    decode_ready_urls: tuple[str, ...] = ()
    # Not flags: the design's constants (docs/xpyd.md section 5), fields only so that a test can shorten them.
    kv_scrape_interval_seconds: float = 1.0
    kv_scrape_timeout_seconds: float = 0.5
    kv_usage_max_age_seconds: float = 5.0
    # Above an engine's own /readyz bound on its engine's /health (connector/metrics.py, 2 s), below the kubelet's
    # readiness timeout for the router (operator/pods.py ROUTER_READINESS_PROBE, 3 s): every instance is asked at
    # once, so one answer that never comes costs this, not the probe.
    ready_check_timeout_seconds: float = 2.5


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
    outstanding: int = 0
    cooldown_until: float = -math.inf  # on the pool's clock
    kv_usage: float | None = None
    kv_usage_at: float = -math.inf
    ready_url: str = ""  # where its own readiness is asked (the router's /readyz); "" = url + /health


class Pool:
    """The instances of one role, the requests in flight to each through this router, and the choice among them."""

    def __init__(self, role: str, urls: tuple[str, ...], cooldown_seconds: float,
                 kv_usage_max_age_seconds: float | None = None, clock: Callable[[], float] = time.monotonic,
                 ready_urls: tuple[str, ...] = ()) -> None:
        self.role = role
        ready_urls = ready_urls or tuple(url + HEALTH_PATH for url in urls)
        self.instances = [Instance(role, index, url, ready_url=ready)
                          for index, (url, ready) in enumerate(zip(urls, ready_urls, strict=True))]
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
        n = len(self.instances)
        chosen = min(tied, key=lambda i: (i.index - self._cursor) % n)
        self._cursor = (chosen.index + 1) % n
        return chosen

    @contextlib.contextmanager
    def hold(self, instance: Instance) -> Iterator[Instance]:
        """Counts a request in flight to `instance` while the block runs (cancelled or failed included). Enter it
        right after `choose`, with no await between, so that concurrent requests see each other's choice."""
        instance.outstanding += 1
        try:
            yield instance
        finally:
            instance.outstanding -= 1

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


ROUTER = web.AppKey("router", Router)


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
def _disconnected(exc: BaseException | None) -> bool:
    return isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)) and \
        not isinstance(exc, aiohttp.ClientConnectorError)


def _refused(exc: BaseException | None) -> bool:
    return isinstance(exc, aiohttp.ClientConnectorError)


async def _prefill(router: Router, first: Instance, body: dict, path: str, headers: dict, forced: bool) -> dict:
    """Prefill's kv_transfer_params, from `first` or from the one prefill the request is sent to once more."""
    pool, config = router.prefills, router.config
    payload = prefill_body(body, path.endswith("/chat/completions"))
    instance = first
    for attempt in range(2):
        with pool.hold(instance):
            try:
                answer = await _post_json(router.session, "prefill", instance.url + path, payload, headers,
                                          config.prefill_timeout_seconds)
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
                # A forced route keeps its prefill. A refused connection is worth another try only elsewhere.
                elsewhere = not forced and len(pool.instances) > 1
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
        n = len(pool.instances)
        if not 0 <= index < n:
            raise PeerError(400, "router", f"{ROUTE_HEADER} {raw!r}: {role} index {index} is out of range: this router "
                                           f"has {n} {role} instance{'s' if n > 1 else ''} (0..{n - 1})")
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
    try:
        body = await request.json()
    except ValueError:
        return PeerError(400, "router", "request body is not JSON").response(request_id)
    if not isinstance(body, dict):
        return PeerError(400, "router", "request body must be a JSON object").response(request_id)
    try:
        forced = _forced_route(router, request)
    except PeerError as exc:
        return exc.response(request_id)

    # Decode first: it holds the request for the whole answer, so its load matters most; a prefill is busy only for
    # the prompt.
    decodes_seen = router.decodes.outstanding()
    decode = router.decodes.instances[forced[1]] if forced else router.decodes.choose()
    with router.decodes.hold(decode):
        prefills_seen = router.prefills.outstanding()
        prefill = router.prefills.instances[forced[0]] if forced else router.prefills.choose()
        if router.config.log_choices:
            _log_choice(router, request_id, prefill, decode, prefills_seen, decodes_seen, forced is not None)
        try:
            params = await _prefill(router, prefill, body, request.path, headers, forced is not None)
        except PeerError as exc:
            logger.error("request %s: %s", request_id, exc.message)
            return exc.response(request_id)
        prefill_answered = timeline.now()
        return await _decode(router, decode, request, body, params, headers, received, prefill_answered)


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
    decode_body = copy.deepcopy(body)
    decode_body["kv_transfer_params"] = params
    url = decode.url + request.path
    timeout = aiohttp.ClientTimeout(total=config.decode_timeout_seconds, connect=config.connect_timeout_seconds)
    stream = bool(body.get("stream"))
    response: web.StreamResponse | None = None
    try:
        async with router.session.post(url, json=decode_body, headers=headers, timeout=timeout) as resp:
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
    the pair's Service off it until a request through it can be served."""
    instances = [*router.prefills.instances, *router.decodes.instances]
    answers = await asyncio.gather(*(_instance_ready(router, i) for i in instances))
    body: dict = {"prefill": [], "decode": []}
    for instance, (ok, detail) in zip(instances, answers):
        body[instance.role].append({"index": instance.index, "url": instance.ready_url, "ready": ok, "detail": detail})
    ready = all(any(entry["ready"] for entry in body[role]) for role in ("prefill", "decode"))
    return ready, body


async def _readyz(request: web.Request) -> web.Response:
    ready, body = await readiness(request.app[ROUTER])
    return web.json_response({"ready": ready, **body}, status=200 if ready else 503)


async def _models(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    cooling = set(router.decodes.cooling())
    decode = next((i for i in router.decodes.instances if i.index not in cooling), router.decodes.instances[0])
    try:
        async with router.session.get(decode.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
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


def check_urls(flag: str, urls: tuple[str, ...]) -> tuple[str, ...]:
    """`urls` without trailing slashes, else a ValueError naming `flag`: none given, one that is not an http(s) URL
    with a host, or one instance given twice (the same scheme, host, port and path, however spelled: the choice by
    load would count it as two instances and send it twice its share)."""
    if isinstance(urls, str) or not isinstance(urls, (tuple, list)):
        raise ValueError(f"{flag} takes a tuple of URLs, got {urls!r}")
    if not urls:
        raise ValueError(f"{flag}: at least one URL is required")
    seen: dict[tuple, int] = {}
    out = []
    for index, url in enumerate(urls):
        bad = f"{flag} must be an http(s) URL with a host, e.g. http://10.0.0.5:8000, got {url!r}"
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
        if key in seen:
            raise ValueError(f"{flag} names one instance twice: {urls[seen[key]]!r} (#{seen[key] + 1}) and {url!r} "
                             f"(#{index + 1})")
        seen[key] = index
        out.append(url.rstrip("/"))
    return tuple(out)


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
    config = dataclasses.replace(config, prefill_urls=check_urls("--prefill", config.prefill_urls),
                                 decode_urls=check_urls("--decode", config.decode_urls))
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
    app = web.Application(client_max_size=64 * 2**20)
    router = app[ROUTER] = Router(config)

    async def client_ctx(app: web.Application):
        router.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(connect=config.connect_timeout_seconds),
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=config.idle_connection_seconds),
        )
        # With one decode there is no tie to break: no scrape.
        scraper = asyncio.create_task(_scrape_kv_usage(router)) if len(config.decode_urls) > 1 else None
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
    return app
