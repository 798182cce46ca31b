"""The operator's push of peer sets (docs/xpyd.md sections 3, 5, 6): the HTTP client, the digest of a body and the
per-pair token Secret; each body has its one definition in the contract (contract/prefill_peers.py,
contract/router_peers.py). No decision is made here: the planner decides each set (who, which epoch, who is
draining); the executor builds the bodies, sends them with `push`, and records `body_digest` of what it pushed.

- Each prefill's connector: `PUT /pdpair/v1/peers` on its metrics port, `contract.prefill_peers.prefill_body` (the
  whole set of decodes it pairs with). Its answer: `{"epoch", "generation", "ranks": {rank: {"host:portBase":
  paired}}, "paired": {"host:portBase": every rank paired}}` (502 with `unreachable_ranks` when a TP rank could not
  be reached).
- The router: `PUT /pdpair/v1/peers` on its HTTP port, `contract.router_peers.router_body` (both roles'
  instances, `draining` marked; the body's one definition, which the router parses). Its
  answer, also to `GET` (`read_peers`, while an instance drains): `{"epoch", "generation", "prefills": [{"index",
  "url", "outstanding", "involved", "draining"}], "decodes": [...], "leaving": [{"role", "url", "outstanding",
  "involved"}], "warnings": [...]}`: the executor records it as an observed.RouterDrainView, and the planner
  (instances.router_drained) deletes a draining instance once the router no longer lists it as one it may choose
  and its `involved` is 0.
- Both: bearer token PDPAIR_PEERS_TOKEN (401 without), 400 for a malformed body (the error names the field), 409 for
  an epoch older than the last one accepted (and, for a prefill, another generation than its own).

The pure part (the result, digest, Secret) imports no HTTP client, so a decision module may import it too;
`push` imports aiohttp when it runs.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdpair.operator.act.capped_read import AnswerTooLarge, decode, read_capped
from pdpair.operator.build.pods import PEERS_SECRET_KEY, owned_metadata

if TYPE_CHECKING:
    import aiohttp

TOKEN_KEY = PEERS_SECRET_KEY  # the key of the token in the pair's Secret (pods.py gives pods the env entry)
TOKEN_COMPONENT = "peers-token"  # app.kubernetes.io/component of the Secret
# The most of an answer to a push or a read_peers the operator reads (capped_read.py says why a cap at all). The
# largest real one, the router's at the CRD's bounds (16 instances a role, each with its URL and counts, plus its
# warnings), is a few KiB; 64 KiB is far above it. An endpoint that sends more has refused the push (an answered
# failure: retried on events and resyncs, not at the probe interval).
ANSWER_LIMIT = 64 << 10


@dataclass(frozen=True)
class PushResult:
    """ok: the endpoint answered 2xx. status: its HTTP status (None: no answer: refused, reset, timed out). answer:
    its JSON object (None: none, or not a JSON object). error: the cause when not ok ("" when ok)."""
    ok: bool
    status: int | None
    answer: dict | None
    error: str


def body_digest(body: Mapping[str, Any]) -> str:
    """16 hex characters of the sha256 of `body`'s canonical JSON (sorted keys, no spaces): the same for the same
    body however its keys were ordered; for a pod annotation recording what was pushed."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


async def push(session: "aiohttp.ClientSession", url: str, token: str, body: dict,
               timeout_seconds: float) -> PushResult:
    """PUT `body` to `url` (the endpoint's full URL) with `Authorization: Bearer <token>`, the whole request (connect,
    send, answer) bounded by `timeout_seconds`. Never raises for the network (refused, reset, DNS, timeout, a bad
    URL): those are a PushResult with ok False, status None and the cause. A ValueError only for a timeout that is
    not a finite number > 0 (a bug, not the network)."""
    return await _request(session, "PUT", url, token, body, timeout_seconds)


async def read_peers(session: "aiohttp.ClientSession", url: str, token: str, timeout_seconds: float) -> PushResult:
    """GET `url` (the router's peers endpoint) with the same bearer token and bound as `push`: the router's current
    answer without a change (its requests in flight per instance, while one drains). Never raises for the network."""
    return await _request(session, "GET", url, token, None, timeout_seconds)


async def _request(session: "aiohttp.ClientSession", method: str, url: str, token: str, body: dict | None,
                   timeout_seconds: float) -> PushResult:
    import aiohttp

    if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)) or \
            not (timeout_seconds > 0 and math.isfinite(timeout_seconds)):
        raise ValueError(f"timeout_seconds must be a finite number > 0, got {timeout_seconds!r}")

    async def send() -> tuple[int, str | AnswerTooLarge]:
        async with session.request(method, url, headers={"Authorization": f"Bearer {token}"},
                                   timeout=aiohttp.ClientTimeout(total=timeout_seconds),
                                   **({"json": body} if body is not None else {})) as resp:
            try:
                return resp.status, decode(await read_capped(resp, ANSWER_LIMIT), resp)
            except AnswerTooLarge as exc:
                return resp.status, exc

    try:
        # aiohttp's total bounds the request; wait_for bounds everything else too (a slow DNS answer included).
        status, text = await asyncio.wait_for(send(), timeout_seconds)
    except asyncio.TimeoutError:
        return PushResult(False, None, None, f"{method} {url}: no answer within {timeout_seconds:g} s")
    except (aiohttp.ClientError, OSError, ValueError) as exc:  # aiohttp.InvalidURL is a ValueError too
        return PushResult(False, None, None, f"{method} {url}: {type(exc).__name__}: {exc}")
    if isinstance(text, AnswerTooLarge):  # it answered, with more than any endpoint of ours sends: a refusal
        return PushResult(False, status, None, f"{method} {url}: HTTP {status}: {text}")
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    answer = answer if isinstance(answer, dict) else None
    if 200 <= status < 300:
        return PushResult(True, status, answer, "")
    cause = answer.get("error") if answer is not None else None
    return PushResult(False, status, answer, f"{method} {url}: HTTP {status}: {cause or text[:300]!s}")


def pair_token(key: str, pair_uid: str) -> str:
    """A pair's push token: HMAC-SHA256 of its uid under the operator's key (PDPAIR_PEERS_KEY), URL-safe base64
    without padding (43 characters, the endpoints' token rule). Derived, not stored: the operator writes it into the
    pair's Secret once and never needs to read a Secret back (its RBAC has create, not get, on Secrets)."""
    digest = hmac.new(key.encode(), pair_uid.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def token_secret(pair: Mapping[str, Any], name: str, token: str) -> dict:
    """The pair's token Secret (core/v1, Opaque, `stringData: {token}`), in the pair's namespace, labelled like
    everything the pair owns and owned by it (the garbage collector deletes it with the pair)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": owned_metadata(pair, name, TOKEN_COMPONENT),
        "type": "Opaque",
        "stringData": {TOKEN_KEY: token},
    }
