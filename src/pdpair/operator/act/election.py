"""Leader election on one coordination.k8s.io Lease, so two or more operator replicas never act at once.

The same protocol as client-go's leaderelection (and the official Python client's `kubernetes.leaderelection`),
written here because that module's calls carry no request deadline and the fencing below depends on one:

- A candidate reads the Lease every `retry_period`. It may take it when the Lease is free (no holder) or when the
  Lease's record has not changed for `lease_duration` seconds *as measured on the candidate's own monotonic clock*
  from the moment it first saw that record (never from the holder's timestamps: no clock-skew assumption). Every
  write is a replace with the resourceVersion it read, so two candidates racing for one expired Lease cannot both
  win: the apiserver answers the loser 409.
- The leader renews every `retry_period`. Fencing: if no renewal *sent* within the last `renew_deadline` seconds
  succeeded, the leader exits the process at once (`on_lost`), before any standby can see the Lease expire: a
  standby waits `lease_duration` > `renew_deadline` after it *read* the last renewal, which the apiserver committed
  after the leader sent it. A hung apiserver call cannot stretch this: a watchdog thread checks the deadline, not
  the renew loop.
- On a graceful stop the leader releases the Lease (empty holder), so a standby takes over within one
  `retry_period` instead of `lease_duration`.

What this does not fence: a write the old leader sent before it exited and that reaches the apiserver later than
`lease_duration - renew_deadline` after. The operator's writes are idempotent by construction (deterministic pod
and lease names, create-if-absent, level-triggered status), so such a late write conflicts rather than duplicates.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from pdpair.operator.act.kube_api import request_timeout

log = logging.getLogger(__name__)

LOST_LEADERSHIP_EXIT_CODE = 70  # the process exits with this when it can no longer prove it leads


@dataclass(frozen=True)
class ElectionSettings:
    lease_name: str
    namespace: str
    identity: str
    lease_duration: float  # seconds a standby waits after the last change it saw before taking the Lease
    renew_deadline: float  # seconds the leader keeps acting without a successful renewal; < lease_duration
    retry_period: float  # seconds between a candidate's tries and between the leader's renewals

    def __post_init__(self) -> None:
        if not (0 < self.retry_period < self.renew_deadline < self.lease_duration):
            raise ValueError(
                f"leader election needs 0 < retry period ({self.retry_period}) < renew deadline "
                f"({self.renew_deadline}) < lease duration ({self.lease_duration})"
            )


def may_take(holder: str | None, identity: str, observed_at: float, lease_duration: float, now: float) -> bool:
    """Whether `identity` may write the Lease now: it holds it, nobody does, or the record it last saw change at
    `observed_at` (monotonic) has gone unrenewed for `lease_duration` seconds."""
    if not holder or holder == identity:
        return True
    return now >= observed_at + lease_duration


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class LeaderElector:
    """One candidate. `coordination` is a kubernetes.client.CoordinationV1Api (calls get their own deadline)."""

    def __init__(self, coordination: Any, settings: ElectionSettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api = coordination
        self.settings = settings
        self.clock = clock
        self._observed_version: str | None = None
        self._observed_at = 0.0
        self.last_renewed_at: float | None = None  # monotonic time a successful write was *sent*
        self.acquired_at: float | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # --- one attempt -----------------------------------------------------------------------------------------
    def try_acquire_or_renew(self) -> bool:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        s = self.settings
        # Half the renew deadline per call: under a busy apiserver a renewal that takes longer than the retry
        # period still counts, and two tries fit before the watchdog fences (it fences whatever a call does).
        timeout = request_timeout(max(0.5, s.renew_deadline / 2))
        sent = self.clock()
        now = _utc_now()
        try:
            lease = self.api.read_namespaced_lease(s.lease_name, s.namespace, _request_timeout=timeout)
        except ApiException as exc:
            if exc.status != 404:
                log.info("leader election: reading lease %s failed: %s", s.lease_name, exc.reason)
                return False
            body = client.V1Lease(
                metadata=client.V1ObjectMeta(name=s.lease_name, namespace=s.namespace),
                spec=client.V1LeaseSpec(holder_identity=s.identity, lease_duration_seconds=int(s.lease_duration),
                                        acquire_time=now, renew_time=now, lease_transitions=0),
            )
            try:  # 409 when another candidate created it first
                self.api.create_namespaced_lease(s.namespace, body, _request_timeout=timeout)
            except Exception as create_exc:
                log.info("leader election: creating lease %s failed: %s", s.lease_name,
                         getattr(create_exc, "reason", None) or create_exc)
                return False
            return self._won(sent)
        except Exception as exc:  # connection refused or timed out (apiserver restarting)
            log.info("leader election: reading lease %s failed: %s", s.lease_name, exc)
            return False

        spec = lease.spec or client.V1LeaseSpec()
        version = lease.metadata.resource_version
        if version != self._observed_version:
            self._observed_version, self._observed_at = version, self.clock()
        duration = float(spec.lease_duration_seconds or s.lease_duration)
        if not may_take(spec.holder_identity, s.identity, self._observed_at, duration, self.clock()):
            return False
        previous_holder = spec.holder_identity
        ours = previous_holder == s.identity
        spec.acquire_time = spec.acquire_time if ours and spec.acquire_time else now
        if not ours:
            spec.lease_transitions = int(spec.lease_transitions or 0) + 1
        spec.holder_identity = s.identity
        spec.lease_duration_seconds = int(s.lease_duration)
        spec.renew_time = now
        lease.spec = spec
        try:
            # replace carries metadata.resourceVersion: a concurrent writer makes this a 409, never a double win
            self.api.replace_namespaced_lease(s.lease_name, s.namespace, lease, _request_timeout=timeout)
        except Exception as exc:
            # A write whose answer was lost (read timeout) may have landed; urllib3 then retries the same PUT,
            # which the apiserver refuses with 409 because the first one changed the resourceVersion. Either way
            # a read shows whether the Lease now holds exactly the record this call sent.
            if not self._landed(now, timeout):
                log.info("leader election: writing lease %s failed: %s", s.lease_name,
                         getattr(exc, "reason", None) or exc)
                return False
            log.info("leader election: writing lease %s answered %s, but the write landed", s.lease_name,
                     getattr(exc, "reason", None) or type(exc).__name__)
        if not ours:
            log.info("leader election: took lease %s from %r", s.lease_name, previous_holder)
        return self._won(sent)

    def _landed(self, renew_time: datetime.datetime, timeout: tuple[float, float]) -> bool:
        """Whether the Lease holds this candidate with the renew time it just sent (microsecond precision, so no
        other write can match it)."""
        try:
            lease = self.api.read_namespaced_lease(self.settings.lease_name, self.settings.namespace,
                                                   _request_timeout=timeout)
        except Exception:
            return False
        spec = lease.spec
        return bool(spec and spec.holder_identity == self.settings.identity and spec.renew_time == renew_time)

    def _won(self, sent: float) -> bool:
        self.last_renewed_at = sent
        self._observed_version = None  # our own write: the next read starts a fresh observation
        return True

    # --- the candidate's and the leader's loops ------------------------------------------------------------------
    def wait_for_leadership(self) -> bool:
        """Blocks until this candidate leads (True) or stop() is called (False)."""
        s = self.settings
        log.info("leader election: %s is a candidate for lease %s/%s", s.identity, s.namespace, s.lease_name)
        while not self._stop.is_set():
            if self.try_acquire_or_renew():
                self.acquired_at = self.clock()
                log.info("leader election: %s leads (lease %s/%s)", s.identity, s.namespace, s.lease_name)
                return True
            self._stop.wait(s.retry_period)
        return False

    def keep_leading(self, on_lost: Callable[[str], None]) -> None:
        """Starts the renew loop and the fencing watchdog (daemon threads). `on_lost(reason)` runs once, from the
        watchdog, when renew_deadline passes without a successful renewal; it must stop all work (exit)."""

        def renew() -> None:
            while not self._stop.wait(self.settings.retry_period):
                self.try_acquire_or_renew()

        def watchdog() -> None:
            while not self._stop.wait(min(0.25, self.settings.retry_period / 4)):
                since = self.clock() - (self.last_renewed_at or 0.0)
                if since > self.settings.renew_deadline:
                    on_lost(f"no successful lease renewal for {since:.1f}s (renew deadline "
                            f"{self.settings.renew_deadline:g}s)")
                    return

        for target, name in ((renew, "pdpair-lease-renew"), (watchdog, "pdpair-lease-watchdog")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.settings.retry_period + 5)

    def release(self) -> bool:
        """Stops renewing and empties the Lease's holder if it is still ours, so a standby need not wait for
        expiry. Call only after all work has stopped."""
        self.stop()
        s = self.settings
        timeout = request_timeout(5.0)
        try:
            lease = self.api.read_namespaced_lease(s.lease_name, s.namespace, _request_timeout=timeout)
            if lease.spec is None or lease.spec.holder_identity != s.identity:
                return False
            lease.spec.holder_identity = None
            lease.spec.lease_duration_seconds = 1
            lease.spec.renew_time = _utc_now()
            self.api.replace_namespaced_lease(s.lease_name, s.namespace, lease, _request_timeout=timeout)
        except Exception as exc:  # any failure: the Lease then expires on its own
            log.warning("leader election: releasing lease %s failed (%s); it expires in %gs", s.lease_name,
                        getattr(exc, "reason", exc), s.lease_duration)
            return False
        log.info("leader election: released lease %s", s.lease_name)
        return True


def exit_now(reason: str) -> None:
    """on_lost for the real process: log, flush, and end at once. No cleanup handler may run: any of them could
    still write to the cluster after another replica has started leading."""
    log.critical("leader election: lost leadership: %s; exiting (code %d)", reason, LOST_LEADERSHIP_EXIT_CODE)
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:
            pass
    os._exit(LOST_LEADERSHIP_EXIT_CODE)
