"""The router's /metrics (names from `pdpair.contract.ROUTER_METRICS`): its split and local decisions and the current
threshold of selective disaggregation (split.py), read from the router's own state at each scrape."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdpair import contract
from pdpair.router.kv_subscriber import STATS
from pdpair.router.pools import ROUTER, Router


class _RouterCollector:
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):
        split = self.router.split
        requests = CounterMetricFamily(contract.ROUTER_REQUESTS.base_name, contract.ROUTER_REQUESTS.help,
                                       labels=list(contract.ROUTER_REQUESTS.labels))
        for mode in contract.ROUTER_MODES:
            requests.add_metric([mode], split.decisions[mode])
        yield requests
        chunks = CounterMetricFamily(contract.ROUTER_PREFIX_CHUNKS.base_name, contract.ROUTER_PREFIX_CHUNKS.help,
                                     labels=list(contract.ROUTER_PREFIX_CHUNKS.labels))
        for role, counts in self.router.prefix_chunks.items():
            for outcome, count in counts.items():
                chunks.add_metric([role, outcome], count)
        yield chunks
        blocks = CounterMetricFamily(contract.ROUTER_PREFIX_BLOCKS.base_name, contract.ROUTER_PREFIX_BLOCKS.help,
                                     labels=list(contract.ROUTER_PREFIX_BLOCKS.labels))
        for role, counts in self.router.prefix_blocks.items():
            for outcome, count in counts.items():
                blocks.add_metric([role, outcome], count)
        yield blocks
        batches = CounterMetricFamily(contract.ROUTER_KV_EVENT_BATCHES.base_name,
                                      contract.ROUTER_KV_EVENT_BATCHES.help,
                                      labels=list(contract.ROUTER_KV_EVENT_BATCHES.labels))
        for role, subscribers in self.router.kv_subscribers.items():
            if subscribers:
                for outcome in STATS:
                    batches.add_metric([role, outcome], sum(s.stats[outcome] for s in subscribers.values()))
        yield batches
        yield GaugeMetricFamily(contract.ROUTER_LOCAL_PROMPT_TOKENS.name, contract.ROUTER_LOCAL_PROMPT_TOKENS.help,
                                value=split.threshold if split.enabled else 0)


def registry_for(router: Router) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_RouterCollector(router))
    return registry


async def metrics_handler(request: web.Request) -> web.Response:
    registry = request.app[METRICS_REGISTRY]
    body = generate_latest(registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


METRICS_REGISTRY = web.AppKey("metrics_registry", CollectorRegistry)
__all__ = ["METRICS_REGISTRY", "ROUTER", "metrics_handler", "registry_for"]
