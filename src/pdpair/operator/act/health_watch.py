"""The health watch of one pair, on its own tick (handlers.watch_health runs it as the pair's `health` daemon): every
health interval it scrapes the Ready pair's engine pods (every instance of both roles: `scrape_pair`), probes its
decodes' side-channel listeners (`probe_listeners`) and writes what it saw to `status.health` (only that key; the
reconciler owns the conditions and reads the verdict back from status). What it sees is judged by
decide/health_status.py (`observe`, `health_patch`, `restart_finding`, `announce`); this module only observes,
writes and tells. A generation that served keeps being judged after it lost Ready (health_status.watch_generation).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Mapping

from pdpair.contract import GROUP, PLURAL, PURPOSE_METRICS, PURPOSE_SIDECHANNEL, ROLE_DECODE, VERSION

from pdpair.operator.act import scrape
from pdpair.operator.act.listener_probe import refused_ports
from pdpair.operator.decide import health, health_status
from pdpair.operator.decide.port_blocks import port_of, ports_of
from pdpair.operator.model import spec_fields
from pdpair.operator.model.observed import PodView

Emit = Callable[[str, str, str], None]


async def watch(runtime: Any, body: Mapping[str, Any], uid: str, stopped: Any,
                sleep: Callable[[float], Awaitable[None]], pods_of: Callable[[], list[PodView]], emit: Emit,
                logger: logging.Logger) -> None:
    """Until `stopped` is truthy: one tick per health interval (`sleep(seconds)` returns early when stopped), the
    live `body` read at each tick, the pair's pods from `pods_of()` (the pod index)."""
    interval = runtime.config.health_interval
    refresh = health_status.HEALTH_REFRESH_INTERVALS * interval
    # The last status.health this watch wrote, as the apiserver returned it: the live body may not show our own
    # write by the next scrape. A cache of status, rebuilt from the body when the daemon starts.
    written: Any = None
    loop = asyncio.get_running_loop()
    next_scrape = loop.time()
    while not stopped:
        # Fixed rate, not "sleep after each scrape": scrape time must not stretch the period, so a hang is seen
        # within hangTimeout + one interval (plus the restart's own latency). After a stall, no burst of catch-ups.
        next_scrape = max(next_scrape + interval, loop.time())
        await sleep(next_scrape - loop.time())
        if stopped:
            break
        status = body.get("status") or {}
        generation = health_status.watch_generation(status)
        if generation is None:
            continue  # a pair still starting (or restarting) has nothing to judge yet
        previous = health_status.newest(written, status.get("health"))
        try:
            pods = pods_of()
            (scrapes, facts), refused = await asyncio.gather(
                scrape_pair(body, generation, pods, interval),
                probe_listeners(body, generation, pods, runtime.config.probe_timeout))
            observed, verdict = health_status.observe(previous, generation, scrapes, facts, refused=refused)
            patch = health_status.health_patch(previous, observed, refresh)
            if patch is None:
                continue
            result = await asyncio.to_thread(
                runtime.custom.patch_namespaced_custom_object_status, GROUP, VERSION, body["metadata"]["namespace"],
                PLURAL, body["metadata"]["name"], {"status": {"health": patch}},
            )
            written = ((result or {}).get("status") or {}).get("health") or observed
        except Exception as exc:  # a bug or an API error here must not stop the watch
            logger.warning("health check failed: %s: %s", type(exc).__name__, exc)
            continue
        runtime.wake(uid)  # the reconciler derives SignalsHealthy and the restart from what was just written
        if health_status.announce(verdict, health_status.restart_finding(previous, generation)):
            if verdict.hung and runtime.metrics is not None:
                runtime.metrics.hang_detected()
            emit("Warning", "Unhealthy", f"{verdict.reason}: {verdict.message}")
            logger.warning("pair unhealthy (%s): %s", verdict.reason, verdict.message)


async def scrape_pair(
    body: Mapping[str, Any], generation: int, pods: list[PodView], interval: float
) -> tuple[list[health.PodScrape], dict[str, Any]]:
    """Scrape every engine instance of `generation` the watch judges (health.watched_pods, health.scrape_due), all at
    once with one per-pod timeout; returns the scrapes and the pod objects by instance key (observe's `pods`)."""
    spec = body.get("spec") or {}
    ports = (body.get("status") or {}).get("ports") or []
    watched = health.watched_pods(pods, generation)
    targets = []
    for pod in watched.values():
        if pod is None or not health.scrape_due(pod):
            continue
        port = port_of(ports, pod.role, PURPOSE_METRICS, instance=pod.instance)
        if port:
            targets.append(health.ScrapeTarget(pod.role, pod.name, pod.ip or "", port, pod.instance))
    scrapes = await scrape.scrape_pods(
        targets,
        expected_generation=generation,
        hang_timeout_seconds=spec_fields.hang_timeout_seconds(spec),
        timeout=max(0.2, min(2.0, interval / 2)),
    )
    return scrapes, {key: (pod.raw if pod is not None else None) for key, pod in watched.items()}


async def probe_listeners(
    body: Mapping[str, Any], generation: int, pods: list[PodView], timeout: float
) -> dict[str, tuple[int, ...] | None]:
    """TCP-probe the side-channel ports of every decode instance of `generation` the watch scrapes, all at once:
    pod name -> the ports that refused (() = all accepted, None = no definite answer; health_status.observe's
    `refused`). The reconciler's own probe stops once a generation served (a Ready prefill proves the pairing, and a
    serving pair's pass runs only on events and resyncs: probing it every second would wake every serving pair every
    second); this one runs on the watch's tick, so a listener that closes later is seen."""
    ports = (body.get("status") or {}).get("ports") or []
    probes: dict[str, Any] = {}
    for pod in health.watched_pods(pods, generation).values():
        if pod is None or pod.role != ROLE_DECODE or not health.scrape_due(pod):
            continue
        ranks = ports_of(ports, ROLE_DECODE, PURPOSE_SIDECHANNEL, instance=pod.instance)
        if ranks:
            probes[pod.name] = refused_ports(pod.ip or "", ranks, timeout)
    results = await asyncio.gather(*probes.values())
    return dict(zip(probes, results))
