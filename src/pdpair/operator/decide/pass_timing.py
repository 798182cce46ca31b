"""When a pair's next pass comes (pure): every pass ends by sleeping until then, and any wakeup (a watch event of
the pair, its pods, nodes, Service, budget or role objects) cuts the sleep short. So the delay only matters for what
no event announces: a listener that starts to accept, a failed push that could now succeed, a deadline inside the
plan, a backoff. The executor (reconciler.py) returns `next_pass`'s answer, or `backoff_pass`'s for a restart that
must wait; nothing else decides a delay.
"""

from __future__ import annotations

from typing import Iterable

from pdpair.operator.decide import recreate as d
from pdpair.operator.decide import surge
from pdpair.operator.model.config import OperatorConfig

MIN_DELAY_SECONDS = 0.2  # never a busy loop, whatever a deadline says

# Steps that wait for a pod to change: the pod's watch event wakes the pair (handlers.pod_changed), so these wait a
# resync interval, not the probe interval. Polling them every second was most of the operator's passes while 1000
# pairs started: the event loop saturated and the decode probes timed out on it, a livelock.
WAITS_FOR_POD_EVENTS = frozenset({d.STEP_WAIT_DECODE_RUNNING, d.STEP_WAIT_PREFILL_READY, d.STEP_WAIT_DECODE_READY,
                                  d.STEP_WAIT_ROUTER_READY, d.STEP_WAIT_GONE, surge.STEP_ROLLOUT_WAIT_GONE,
                                  surge.STEP_ROLLOUT_DRAIN})  # the drain's end is the plan's wait_seconds


def pass_delay(step: str, cfg: OperatorConfig, wait_seconds: float | None = None) -> float:
    """How long a pair sleeps after a pass that ended at `step`; no longer than a deadline inside the plan
    (`wait_seconds`: a rollout's drain or progress deadline, a drain poll, a lost node's recheck)."""
    if wait_seconds is not None:
        return max(MIN_DELAY_SECONDS, min(wait_seconds, pass_delay(step, cfg)))
    if step == d.STEP_READY or step in WAITS_FOR_POD_EVENTS:
        return cfg.resync_interval
    if step == d.STEP_POOL_EXHAUSTED:
        return cfg.pool_retry
    return cfg.probe_interval  # the decode listener probe (nothing wakes us when it starts to accept), creates


def push_retry_delay(failing: Iterable[tuple[bool, bool, int]], cfg: OperatorConfig) -> float | None:
    """When to pass again for the pods whose last push failed, given (ready, answered, consecutive failures) of each;
    None when none failed or none needs it sooner than events and resyncs. Nothing wakes a pair when a failed push
    could succeed, so the pass itself must come back. A pod that is not Ready still loads (a prefill created beside
    its decode learns decode's address this way: its endpoint opens any moment): every probe interval. A Ready pod
    serves already: a push that got no answer (a timeout on a busy node, a dropped connection) is retried at the
    probe interval doubled per failure, up to the resync interval; one it answered with a refusal (401: another
    operator key; 404: no such endpoint) is not retried sooner than the next event or resync, which is soon enough
    for what does not change by itself."""
    delays = [cfg.probe_interval if not ready else
              min(cfg.probe_interval * 2 ** min(max(failures, 1) - 1, 16), cfg.resync_interval)
              for ready, answered, failures in failing if not (ready and answered)]
    return min(delays) if delays else None


def next_pass(step: str, wait_seconds: float | None, cfg: OperatorConfig, *, refused_for: float | None = None,
              created_unseen: bool = False, failing_pushes: Iterable[tuple[bool, bool, int]] = ()) -> float:
    """The sleep after a pass that applied a plan ending at `step`:
    - `refused_for`: the API server refused the pod this plan creates, which may be tried again in that many seconds
      (pod_steps.Rejection): then, within a resync;
    - `created_unseen`: the plan creates a pod this operator already created and the pod index does not show yet:
      its watch event will wake the pair, so a resync (or the plan's own deadline);
    - else the step's delay (pass_delay), sooner when a failed push needs another try (push_retry_delay)."""
    if refused_for is not None:
        return max(MIN_DELAY_SECONDS, min(refused_for, cfg.resync_interval))
    if created_unseen:
        return pass_delay(step, cfg, wait_seconds) if wait_seconds is not None else cfg.resync_interval
    delay = pass_delay(step, cfg, wait_seconds)
    retry = push_retry_delay(failing_pushes, cfg)
    return delay if retry is None else min(delay, retry)


def backoff_pass(retry_in: float | None, cfg: OperatorConfig) -> float:
    """The sleep while a due restart backs off: until it may happen (`retry_in` seconds; None: unknown, a pod waits
    to be scheduled), within a resync."""
    wait = retry_in if retry_in is not None else cfg.probe_interval
    return max(MIN_DELAY_SECONDS, min(wait, cfg.resync_interval))


THROTTLED_RETRY_DEFAULT = 1.0  # no (readable) Retry-After
THROTTLED_RETRY_MIN = 0.2
THROTTLED_RETRY_MAX = 30.0


def throttled_pass(retry_after: object, jitter: float) -> float:
    """The sleep before a pass the API server throttled (429) is redone: its Retry-After (`retry_after`, the
    header's value; THROTTLED_RETRY_DEFAULT when absent or unreadable) within [THROTTLED_RETRY_MIN,
    THROTTLED_RETRY_MAX], times 1 + `jitter` (a fraction in [0, 0.5], drawn by the caller)."""
    try:
        seconds = float(retry_after)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = THROTTLED_RETRY_DEFAULT
    if not seconds == seconds:  # NaN
        seconds = THROTTLED_RETRY_DEFAULT
    return min(max(seconds, THROTTLED_RETRY_MIN), THROTTLED_RETRY_MAX) * (1 + min(max(jitter, 0.0), 0.5))


FAILED_PASS_BASE = 0.5  # seconds after the first failed pass
FAILED_PASS_MAX = 30.0


def failed_pass(failures: int) -> float:
    """The sleep after the `failures`-th failed pass in a row (an API error, a 409, a bad spec): doubling from
    FAILED_PASS_BASE, at most FAILED_PASS_MAX."""
    return min(FAILED_PASS_MAX, FAILED_PASS_BASE * 2 ** min(failures, 6))
