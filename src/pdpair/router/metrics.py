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


def _counter(metric: contract.Metric, samples: dict[tuple[str, ...], float]) -> CounterMetricFamily:
    """One of the contract's counters with these samples (label values in the metric's label order)."""
    family = CounterMetricFamily(metric.base_name, metric.help, labels=list(metric.labels))
    for labels, value in samples.items():
        family.add_metric(list(labels), value)
    return family


class _RouterCollector:
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):
        split = self.router.split
        yield _counter(contract.ROUTER_REQUESTS, {(mode,): split.decisions[mode] for mode in contract.ROUTER_MODES})
        for metric, per_role in ((contract.ROUTER_PREFIX_CHUNKS, self.router.prefix_chunks),
                                 (contract.ROUTER_PREFIX_BLOCKS, self.router.prefix_blocks)):
            yield _counter(metric, {(role, outcome): count for role, counts in per_role.items()
                                    for outcome, count in counts.items()})
        yield _counter(contract.ROUTER_KV_EVENT_BATCHES, {
            (role, outcome): sum(s.stats[outcome] for s in subscribers.values())
            for role, subscribers in self.router.kv_subscribers.items() if subscribers for outcome in STATS})
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
