"""The pair's API key at the router (spec.apiKeySecret, VLLM_API_KEY): every path but the router's probes and the
peer push needs `Authorization: Bearer <key>`; a request without it is answered 401 before its body is read."""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

from pdpair.contract import ENV_API_KEY, METRICS_PATH, PEERS_PATH, READYZ_PATH
from pdpair.router.config import HEALTH_PATH

# The router's paths that need no API key: its liveness and readiness (the kubelet's probes) and the peer push, which
# has its own token. Every other path, the OpenAI API under /v1 and any path the router does not serve, needs the key.
OPEN_PATHS = frozenset({HEALTH_PATH, READYZ_PATH, PEERS_PATH, METRICS_PATH})  # /metrics: as vLLM's, open
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
