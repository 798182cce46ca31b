"""The operator's push of the instance sets to the router: `PUT /pdpair/v1/peers` (and `GET`, the same answer),
bearer PDPAIR_PEERS_TOKEN; the body is contract/router_peers.py's."""

from __future__ import annotations

import hmac
import json
import logging

from aiohttp import web

from pdpair.contract import ENV_PEERS_TOKEN, MAX_PEERS_BODY_BYTES
from pdpair.contract.router_peers import BODY_ROLES, RouterMember, count
from pdpair.router.config import check_url
from pdpair.router.pools import ROUTER, Pool, Router

logger = logging.getLogger("pdpair.router")

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


async def peers_handler(request: web.Request) -> web.Response:
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


async def no_peers_handler(request: web.Request) -> web.Response:
    return web.json_response({"error": f"no peer push on this router ({ENV_PEERS_TOKEN} is not set): its instances "
                                       "are its flags'"}, status=404)
