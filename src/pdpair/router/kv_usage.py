"""Decodes' KV-cache usage, the router's tie-break between decodes with equal load (pools.Pool.choose): scraped from
each decode's /metrics in the background while there is more than one to choose from."""

from __future__ import annotations

import asyncio
import logging
import math

import aiohttp

from pdpair.router.pools import Instance, Router

logger = logging.getLogger("pdpair.router")
KV_USAGE_METRIC = "vllm:kv_cache_usage_perc"


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


async def scrape_kv_usage(router: Router) -> None:
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
