"""Per-request timeline: wall-clock stamps of each stage of a P/D request, logged as one line per process.

Stages, in order (process that stamps it):
  router:   received, prefill_answered, decode_first_chunk, done
  prefill:  finished (scheduler: request_finished), pull_received, first_put, last_put, flushed (worker); a Pull
            served layer by layer while its prompt was computed (layer-wise puts) also step_started,
            first_layer_written, last_layer_written: puts that began before the last layer was written overlapped
            the computation
  decode:   allocated (scheduler), pull_sent, first_signal, last_signal, handed_to_engine (worker), scheduled
            (scheduler: the request's first step after its load)

Lines go to the `pdpair.timeline` logger, at INFO, only when PDPAIR_TIMELINE_LOG=1 (off by default: one line per
request per process is too much for production logs). Stamps are `time.time()` seconds, so lines of different
processes join by request id: vLLM's internal ids embed the router's X-Request-Id, and
tests/bench/bench_pd_latency.py (`timeline_report`) joins them. The worker also records its stage durations in the vLLM connector stats
(`vllm:pdpair_stage_seconds{stage}`), without the knob.
"""

from __future__ import annotations

import logging
import os
import time

ENV_TIMELINE_LOG = "PDPAIR_TIMELINE_LOG"
logger = logging.getLogger("pdpair.timeline")


def enabled() -> bool:
    return os.environ.get(ENV_TIMELINE_LOG, "") == "1"


_ENABLED = enabled()


def now() -> float:
    return time.time()


def log(side: str, request_id: str, **stamps: float | None) -> None:
    """One line: `timeline <side> <request id> stage=<seconds> ...` (stages without a stamp are left out)."""
    if not _ENABLED:
        return
    fields = " ".join(f"{stage}={stamp:.6f}" for stage, stamp in stamps.items() if stamp is not None)
    logger.info("timeline %s %s %s", side, request_id, fields)
