"""The router's probes: `/health` (liveness) and `/readyz` (readiness: a prefill and a decode that may be chosen are
ready on their own readiness URLs), held for the probe's `?wait=SECONDS`."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from pdpair.contract import PROBE_WAIT_PARAM, parse_probe_wait, probe_hold_pause
from pdpair.router.pools import ROUTER, Instance, Router, no_instance


async def health(request: web.Request) -> web.Response:
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
    warnings = [no_instance(role) for role in ("prefill", "decode") if not body[role]]
    return ready, {**body, "warnings": warnings} if warnings else body


async def readyz(request: web.Request) -> web.Response:
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
