"""The health watch's I/O: scrape each pod's /metrics (aiohttp, concurrent, per-pod timeout), parse the contract's
series with prometheus-client's parser, judge each pod (health.PodState), and read a hung pod's /healthz for the
stuck transfer. The verdict over a pair's scrapes and pod facts is health.py's (pure)."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any, Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pdpair import contract
from pdpair.operator.act.capped_read import AnswerTooLarge, decode, read_capped
from pdpair.operator.decide.health import PodMetrics, PodScrape, PodState, ScrapeTarget

# The most of a pod's /metrics answer the operator reads (capped_read.py says why a cap at all). A pdpair pod's
# connector exports a few series per TP rank and per peer edge; at the CRD's bounds (16 peers, TP 8) that is far
# below 1 MiB. 4 MiB leaves room for label growth, and the scrapes of a tick (one per watched pod, concurrent) still
# hold at most 4 MiB each. A pod that sends more is judged unreachable, like one that does not answer.
METRICS_ANSWER_LIMIT = 4 << 20
# The most of a hung pod's /healthz read for its stuck transfer: a small JSON object (one transfer's id, peer, rank
# and counts); 64 KiB is far above it. Past it the transfer is not named (the verdict comes from /metrics alone).
HEALTHZ_ANSWER_LIMIT = 64 << 10


def parse_pod_metrics(text: str) -> PodMetrics:
    """Read the health-relevant series from exposition text; ValueError if it is not a pdpair pod's."""
    deficit: dict[str, float] = {}
    oldest = 0.0
    hang_timeout: float | None = None
    generation: float | None = None
    timeouts = 0.0
    transfers = 0.0
    listener_failed: set[str] = set()
    seen: set[str] = set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == contract.SIGNAL_DEFICIT.name:
                peer = s.labels.get("peer", "")
                deficit[peer] = deficit.get(peer, 0.0) + s.value
            elif s.name == contract.SIGNAL_WAIT_OLDEST_SECONDS.name:
                oldest = max(oldest, s.value)
            elif s.name == contract.HANG_TIMEOUT_SECONDS.name:
                hang_timeout = s.value if hang_timeout is None else min(hang_timeout, s.value)
            elif s.name == contract.PAIR_GENERATION.name:
                generation = s.value
            elif s.name == contract.SIGNAL_WAIT_TIMEOUTS.name:
                timeouts += s.value
            elif s.name == contract.KV_TRANSFERS.name:
                if s.labels.get("outcome") == contract.OUTCOME_OK:
                    transfers += s.value
            elif s.name == contract.LISTENER_FAILED.name:
                if s.value >= 1:
                    listener_failed.add(s.labels.get("rank", ""))
            else:
                continue
            seen.add(s.name)
    required = (contract.PAIR_GENERATION.name, contract.SIGNAL_WAIT_OLDEST_SECONDS.name)
    missing = [n for n in required if n not in seen]
    if missing:
        raise ValueError(f"not a pdpair pod's metrics: missing {', '.join(missing)}")
    if generation is None or not math.isfinite(generation) or generation != int(generation):
        raise ValueError(f"{contract.PAIR_GENERATION.name} is not an integer: {generation!r}")
    return PodMetrics(deficit, oldest, hang_timeout, int(generation), timeouts, transfers,
                      tuple(sorted(listener_failed, key=lambda r: (len(r), r))))


def _judge(
    target: ScrapeTarget, metrics: PodMetrics, expected_generation: int | None, hang_timeout_seconds: float | None
) -> tuple[PodState, str]:
    if metrics.listener_failed and target.role == contract.ROLE_DECODE:
        # Before the hang: a decode whose loop stopped pairs no prefill, and prefill's transfers to it then hang
        # too; the pod says why itself, so this needs no streak (a connector older than the series never says it).
        ranks = ", ".join(metrics.listener_failed)
        return PodState.LISTENER_LOST, (
            f"{target.role} pod {target.pod}: side-channel listener lost: its loop stopped on rank"
            f"{'s' if len(metrics.listener_failed) > 1 else ''} {ranks} ({contract.LISTENER_FAILED.name}); "
            f"it pairs no prefill, its /readyz names why"
        )
    timeout = hang_timeout_seconds if hang_timeout_seconds is not None else metrics.hang_timeout_seconds
    if timeout is None:
        raise ValueError(
            f"no hang timeout for pod {target.pod}: pass the pair's, or the pod must export "
            f"{contract.HANG_TIMEOUT_SECONDS.name}"
        )
    if contract.is_hung(metrics.deficit, metrics.oldest_wait_seconds, timeout):
        return PodState.HUNG, (
            f"{target.role} pod {target.pod} hung: {metrics.deficit:g} signals missing, oldest wait "
            f"{metrics.oldest_wait_seconds:.1f}s > hang timeout {timeout:g}s"
        )
    if expected_generation is not None and metrics.generation != expected_generation:
        return PodState.STALE_GENERATION, (
            f"{target.role} pod {target.pod} reports generation {metrics.generation}, the pair is at "
            f"{expected_generation}"
        )
    return PodState.HEALTHY, f"{target.role} pod {target.pod} healthy"


async def scrape_pod(
    session: aiohttp.ClientSession,
    target: ScrapeTarget,
    *,
    expected_generation: int | None,
    hang_timeout_seconds: float | None = None,
    timeout: float = 2.0,
) -> PodScrape:
    """Scrape one pod within `timeout` seconds in total (never raises for the pod's faults)."""
    loop = asyncio.get_running_loop()
    started = loop.time()

    def done(state: PodState, message: str, metrics: PodMetrics | None = None, details=None) -> PodScrape:
        return PodScrape(target, state, message, metrics, details or {}, loop.time() - started)

    try:
        async with asyncio.timeout(timeout):
            async with session.get(target.url()) as resp:
                if resp.status != 200:
                    return done(PodState.UNREACHABLE, f"{target.url()} answered HTTP {resp.status}")
                try:
                    body = decode(await read_capped(resp, METRICS_ANSWER_LIMIT), resp)
                except AnswerTooLarge as exc:
                    return done(PodState.UNREACHABLE, f"{target.url()}: {exc}")
            try:
                metrics = parse_pod_metrics(body)
                state, message = _judge(target, metrics, expected_generation, hang_timeout_seconds)
            except ValueError as exc:
                return done(PodState.UNREACHABLE, f"{target.url()}: {exc}")
            details: dict[str, Any] = {}
            if state is PodState.HUNG:
                details = {"deficit_by_peer": metrics.deficit_by_peer, "oldest_wait_seconds": metrics.oldest_wait_seconds}
                stuck = await _stuck_transfer(session, target)
                if stuck:
                    details["transfer"] = stuck
                    message += (
                        f"; stuck transfer {stuck.get('id')} from {stuck.get('peer')}"
                        + (f" rank {stuck['rank']}" if "rank" in stuck else "") + ": "
                        f"{stuck.get('received')}/{stuck.get('expected')} signals"
                    )
            return done(state, message, metrics, details)
    except TimeoutError:
        return done(PodState.UNREACHABLE, f"{target.url()} did not answer within {timeout:g}s")
    except (aiohttp.ClientError, OSError) as exc:
        return done(PodState.UNREACHABLE, f"{target.url()}: {type(exc).__name__}: {exc}")


async def _stuck_transfer(session: aiohttp.ClientSession, target: ScrapeTarget) -> dict[str, Any] | None:
    """The transfer /healthz names (best effort: the verdict comes from /metrics alone)."""
    try:
        async with session.get(target.url(contract.HEALTHZ_PATH)) as resp:
            body = json.loads(await read_capped(resp, HEALTHZ_ANSWER_LIMIT))
    except (aiohttp.ClientError, OSError, ValueError):  # AnswerTooLarge is a ValueError
        return None
    transfer = body.get("transfer") if isinstance(body, dict) else None
    return transfer if isinstance(transfer, dict) else None


async def scrape_pods(
    targets: Sequence[ScrapeTarget],
    *,
    expected_generation: int | None,
    hang_timeout_seconds: float | None = None,
    timeout: float = 2.0,
    session: aiohttp.ClientSession | None = None,
) -> list[PodScrape]:
    """Scrape all targets concurrently; each has its own `timeout`, so one slow pod delays no other."""
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout!r}")
    own = session is None
    if own:
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout))
    try:
        return list(
            await asyncio.gather(
                *(
                    scrape_pod(
                        session,
                        t,
                        expected_generation=expected_generation,
                        hang_timeout_seconds=hang_timeout_seconds,
                        timeout=timeout,
                    )
                    for t in targets
                )
            )
        )
    finally:
        if own:
            await session.close()
