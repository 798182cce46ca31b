"""The router's configuration: `RouterConfig` (what `__main__` builds from the flags and the environment) and the
checks that refuse a bad value at start, naming the flag."""

from __future__ import annotations

import dataclasses
import math
import urllib.parse
from dataclasses import dataclass

from pdpair.contract import ENV_PEERS_TOKEN

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
    # Selective disaggregation (split.py): a prompt estimated shorter than this many tokens goes to a decode instance
    # alone, and the threshold then follows the router's measurements. 0: every request is split (prefill, then
    # decode), nothing is learned.
    local_prompt_tokens: int = 0
    # Whether that threshold follows the measurements (and one streamed request in split.EXPLORE_EVERY of a length
    # bucket goes the other way to keep both means current). Off: the threshold stays at --local-prompt-tokens, as a
    # fixed number of tokens (llm-d's and Dynamo's rule): predictable, and with a threshold above every prompt, a
    # router that never splits.
    learn_split_threshold: bool = True
    # Both legs at once (app._both_legs): decode gets its request together with prefill's, naming the transfer by a
    # key the router makes, so decode allocates and pulls while prefill computes. Off: decode's request goes once
    # prefill answered (sequential). On by default: faster in docs/benchmarks.md ("Both legs at once"), TTFT and
    # requests/s alike.
    concurrent_legs: bool = True
    # Prefix affinity (prefix_index.py): a prompt goes to the prefill this router sent its longest prefix to, among
    # those within PREFIX_LOAD_SLACK requests of the least loaded. Off: by load alone.
    prefix_affinity: bool = False
    # Each instance's own readiness URL, in the order of its role's URLs (empty: its base URL + /health). The
    # router's /readyz passes while at least one prefill and one decode pass theirs (`readiness`).
    prefill_ready_urls: tuple[str, ...] = ()
    decode_ready_urls: tuple[str, ...] = ()
    # Precise prefix affinity (kv_blocks.py, kv_subscriber.py): each instance's KV events endpoint (the engine's
    # --kv-events-config endpoint as the router reaches it, tcp://HOST:PORT, its replay endpoint at PORT + 1), in the
    # order of its role's URLs; empty: that role is matched by the approximate index (prefix_index.py). Needs
    # --prefix-affinity and --tokenizer.
    prefill_kv_events: tuple[str, ...] = ()
    decode_kv_events: tuple[str, ...] = ()
    # The model's tokenizer (a directory or a name loadable offline), for the prompt's token ids (prompt_tokenizer.py).
    tokenizer: str | None = None
    # The engines' --kv-events-config topic (vLLM's default: "").
    kv_events_topic: str = ""
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


def check_count(flag: str, value: int) -> int:
    """`value` if it is an int >= 0, else a ValueError naming `flag`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{flag} must be an integer >= 0, got {value!r}")
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


def check_kv_events(flag: str, endpoints: tuple[str, ...], urls: tuple[str, ...]) -> tuple[str, ...]:
    """() or one KV events endpoint per instance of the role, in the same order, each tcp://HOST:PORT: a ValueError
    naming `flag` otherwise."""
    from pdpair.router.kv_subscriber import replay_endpoint

    if isinstance(endpoints, str) or not isinstance(endpoints, (tuple, list)):
        raise ValueError(f"{flag} takes a tuple of endpoints, got {endpoints!r}")
    if endpoints and len(endpoints) != len(urls):
        raise ValueError(f"{flag} is given {len(endpoints)} time(s) for {len(urls)} instance(s): give it once per "
                         f"instance, in the same order, or not at all")
    for endpoint in endpoints:
        try:
            replay_endpoint(endpoint)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    return tuple(endpoints)
