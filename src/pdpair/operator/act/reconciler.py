"""The executor: observe one pair, ask the planner (planner.plan) for the pass's plan, apply it, write status.

One `PairReconciler` lives in each pair's kopf daemon (handlers.py). Every pass is level-triggered: it starts from
what the apiserver and the pod index say now, so a pass that dies half-way (SIGKILL, 409, apiserver restart) is
simply redone. Intent is written to status before acting (pairGeneration before deleting old pods). Every pod
deletion and creation is an Event. All API calls run in threads (`asyncio.to_thread`); the event loop never waits
on the network except through awaits with deadlines.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from pdpair.contract import (
    ANNOTATION_INSTANCE_RESTART_TIMES,
    ANNOTATION_RESTART_TIMES,
    GROUP,
    KIND,
    PURPOSE_SIDECHANNEL,
    ROLE_DECODE,
    ROLE_ROUTER,
    ROLE_PREFILL,
    VERSION,
)

from pdpair.operator.act.kube_api import api_status
from pdpair.operator.act.lease_steps import LeaseSteps
from pdpair.operator.act.pair_objects import PairObjects
from pdpair.operator.act.pair_status import PairStatus
from pdpair.operator.act.pod_steps import PodSteps, Rejection, created_name
from pdpair.operator.act.peer_sets import (
    PeerSets,
    PushFailure,
)
from pdpair.operator.model.observed import NodeView, Observed, PodView, RouterDrainView
from pdpair.operator.decide import busy_ports
from pdpair.operator.decide import pass_timing, planner
from pdpair.operator.model.config import OperatorConfig
from pdpair.operator.act.listener_probe import DecodeListenerGate
from pdpair.operator.act import scale_sync
from pdpair.operator.model import pair_spec
from pdpair.operator.decide.port_blocks import ports_of
from pdpair.operator.decide.scale_targets import ScaleView
from pdpair.operator.act.port_leaser import PairRef, PortLeaser
from pdpair.operator.build.service import (
    ServiceView,
)
from pdpair.operator.model.timestamps import now_rfc3339
from pdpair.operator.decide.wake_filter import WakeFilter

log = logging.getLogger(__name__)

# Emit(type, reason, message): posts a Kubernetes Event on the pair (kopf.event in production).
Emit = Callable[[str, str, str], None]


@dataclass
class Runtime:
    """Process-wide things every pair shares."""

    config: OperatorConfig
    core: Any  # kubernetes.client.CoreV1Api
    custom: Any  # kubernetes.client.CustomObjectsApi
    leaser: PortLeaser
    wakeups: dict[str, asyncio.Event] = field(default_factory=dict)
    exited: dict[str, asyncio.Event] = field(default_factory=dict)
    metrics: Any = None  # metrics.OperatorMetrics, when served
    policy: Any = None  # kubernetes.client.PolicyV1Api: the pairs' PodDisruptionBudgets (disruption.py); None: none
    nodes_seen: dict[str, Any] = field(default_factory=dict)  # node name -> the NodeView a node event last woke for
    events: Any = None  # events.EventPoster: the pairs' Events (handlers.py); None: kopf.event
    wake_filter: WakeFilter = field(default_factory=WakeFilter)  # which watch events wake a pass (wake_filter.py)
    _http: tuple[Any, Any] | None = field(default=None, init=False, repr=False)  # (loop, aiohttp session): http()

    def http(self) -> Any:
        """The aiohttp session of every push and read of the pods' peer endpoints (push.py), shared by all pairs:
        a burst (a restarted operator beside 1000 pairs pushes each prefill at once) shares one connection pool of
        PEER_HTTP_CONNECTIONS instead of a session per request (its connector and buffers: 21 MiB against 8 for 1000
        requests at once, measured). No keep-alive: a pod's address may be another pod's by the next push. A
        session belongs to its event loop; a new loop (a test's next asyncio.run) gets a new one."""
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._http is None or self._http[0] is not loop or self._http[1].closed:
            self._http = (loop, aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=PEER_HTTP_CONNECTIONS, force_close=True)))
        return self._http[1]

    async def close(self) -> None:
        """Closes http()'s session (the operator's cleanup)."""
        if self._http is not None and not self._http[1].closed:
            await self._http[1].close()
        self._http = None

    def wake(self, uid: str) -> None:
        event = self.wakeups.get(uid)
        if event is not None:
            event.set()


# Requests to the pods' peer endpoints in flight at once, all pairs together (Runtime.http); each is bounded by the
# probe timeout, waiting for a connection included, so a burst beyond it fails fast and is retried (pass_timing.push_retry_delay).
PEER_HTTP_CONNECTIONS = 128


# The API server's "slow down" (429: API Priority and Fairness queues full, or max-inflight): not an error of the pair.
# A pass it refused is redone after the Retry-After it names, bounded, with jitter so that pairs refused together do
# not come back together; no failure backoff and no ReconcileError Event (a write to an apiserver that asked for less).
TOO_MANY_REQUESTS = 429
def throttled_retry(exc: BaseException, jitter: float) -> float | None:
    """Seconds until a pass the API server throttled is redone (pass_timing.throttled_pass of its Retry-After);
    None when `exc` is not a 429."""
    if api_status(exc) != TOO_MANY_REQUESTS:
        return None
    headers = getattr(exc, "headers", None) or {}
    return pass_timing.throttled_pass(headers.get("Retry-After"), jitter)


EVENT_SOURCE = "pdpair-operator"


class PairReconciler(PairStatus, PodSteps, PairObjects, PeerSets, LeaseSteps):
    def __init__(self, rt: Runtime, body: Mapping[str, Any], emit: Emit, logger: logging.Logger | None = None):
        self.rt = rt
        self.body = body  # kopf's live body: spec and metadata follow the watch
        self.emit = emit
        self.log = logger or log
        meta = body["metadata"]
        self.ref = PairRef(meta["namespace"], meta["name"], meta["uid"])
        # A write-through copy of the pair's status: our own patches land here at once, while the watch may still
        # deliver older versions; _refresh_status adopts the live one whenever the watch has a newer object.
        self.status: dict[str, Any] = {}
        self.status_version: str | None = None
        self._refresh_status()
        self.ports: list[dict[str, Any]] | None = None  # leased, as status.ports
        self.blocks: tuple | None = None
        self.pool_message = ""
        self.next_lease_try = 0.0
        self.leases_checked_at = 0.0
        # A Surge rollout's other generation (surge.py): its port set ("slot"), leased beside self.ports
        self.rollout_ports: list[dict[str, Any]] | None = None
        self.rollout_blocks: tuple | None = None
        self.rollout_checked_at = 0.0
        self.rollout_pool_message = ""
        # Every port set the pair holds leases in, as last read (with the reads above, no call of its own): a set
        # that a rollout left leased when the pass that ended it died before releasing it (surge.release_left_slot)
        self.leased_slots: frozenset[str] = frozenset()
        self.listener_gate = DecodeListenerGate(rt.config.probe_timeout, emit)
        self.last_step = ""
        self.service: str | None = (self.status.get("service") or None)  # the router Service we own, by name
        self.service_problem = ""  # the last Service error reported as an Event (reported once, not per pass)
        self.budget_problem = ""  # the same for the PodDisruptionBudget
        self.network_policy_problem = ""  # the same for the NetworkPolicy
        # (spec digest, time.monotonic()) of the pair's NetworkPolicy as last made or read: not watched, it is read
        # again when the wanted spec changes or NETWORK_POLICY_RECHECK_RESYNCS resyncs later (a deleted one comes back)
        self.network_policy_seen: tuple[str, float] | None = None
        # The restart-times annotation as this reconciler last wrote it, until the watch shows it: a cache for the
        # watch's lag, not state (the annotation on the pair is the record; see _restart_times)
        self.restart_times_written: tuple[tuple[float, ...], float] | None = None
        # the same for the per-instance record (instances.heal): ((generation, times), when written)
        self.instance_restarts_written: tuple[tuple[int, dict[str, tuple[float, ...]]], float] | None = None
        self.rejections: dict[str, Rejection] = {}  # role -> the API server's last refusal (a backoff, not a decision)
        # pod name -> when this reconciler created it, until the pod index shows it: our own status patch wakes the
        # next pass before the pod's watch event arrives, and re-creating it then would only earn a 409
        self.created_unseen: dict[str, float] = {}
        # pod uid -> when this reconciler deleted it, until the index shows it terminating or gone (same lag: a
        # second delete would be accepted and post a second PodDeleted Event)
        self.deleted_unseen: dict[str, float] = {}
        self.unreplaceable_reported: set[tuple[str, int]] = set()  # (pod, port) told once as PortInUse
        self.peers_token: str | None = None  # the pair's Secret's token (pods.peers_secret_name), once read or made
        self.side_channel_made = False  # the pair's side-channel Secret (pods.side_channel_secret_name) made or found
        self.push_failures: dict[str, PushFailure] = {}  # pod uid -> its failing push, until one succeeds
        # pod uid -> the digest this reconciler pushed, until the pod index shows the annotation (the watch's lag)
        self.pushed: dict[str, str] = {}
        # generation -> what its router last answered (PUT or GET peers) while an instance of it drains: recorded
        # here, decided on by the planner (instances.router_drained). Memory only: a restarted operator reads the
        # router again on its first pass while something drains, and its first plan falls back to the deadline.
        self.router_views: dict[int, RouterDrainView] = {}  # per generation: its routers' answers, merged
        self.router_answers: dict[str, RouterDrainView] = {}  # per router pod uid: its last answer
        self.router_read_failures: dict[str, str] = {}  # router pod uid -> the last read error logged (once per cause)
        self.scale_cache = scale_sync.ScaleSyncCache()  # its own writes to the role objects until the index shows them
        self.overridden_told: set[tuple[str, int]] = set()  # (role, inline count) told in a ReplicasFromScaleTarget Event
        self.scale_views: Mapping[str, ScaleView] | None = None  # this pass's, for the status write

    # --- one pass -----------------------------------------------------------------------------------
    async def reconcile_once(self, pods: Iterable[PodView], services: Iterable[ServiceView] = (),
                             node_views: Mapping[str, NodeView] | None = None,
                             budgets: Iterable[tuple[str, tuple]] | None = None,
                             scale_views: Mapping[str, ScaleView] | None = None) -> float:
        """One level-triggered pass. Returns how long to sleep before the next one (a wakeup cuts it short).
        `node_views`: the nodes of the pair's pods, as the node index has them (lost nodes: nodes.py); `budgets`:
        the (name, disruption.budget_shape) of the pair's PodDisruptionBudgets the watch shows (None: not watched,
        none is made); `scale_views`: the pair's InferencePairRole objects by role, as the index has them (None: not
        watched, none is made, the inline counts hold)."""
        started = time.monotonic()
        self.scale_views = scale_views
        meta_generation = int(self.body["metadata"].get("generation") or 0)
        pods = tuple(pods)
        cfg = self.rt.config

        self._refresh_status()
        if planner.halted(self.status, meta_generation):
            return cfg.resync_interval  # the restart budget is spent; only a spec change moves the pair again
        scaling = await self.settle_counts(scale_views)
        spec = pair_spec.read(scaling.spec)  # read once: every decision of the pass reads this one

        node_views = dict(node_views or {})
        prelude = planner.prepare(spec, self.status, pods, node_views, time.time(), cfg.node_lost_seconds)
        await self.lease_serving(prelude.serving)
        await self.lease_rollout(prelude.rollout)
        await self.quarantine_busy(prelude)
        await self.fence_lost(prelude)
        await self.ensure_service(services)
        if budgets is not None:
            await self.ensure_budget(budgets)
        await self.ensure_network_policy()

        generation = prelude.serving_generation
        probes = prelude.probes
        serving_ranks = ports_of(self.ports or [], ROLE_DECODE, PURPOSE_SIDECHANNEL)  # decode 0's side channels
        rollout_ranks = ports_of(self.rollout_ports or [], ROLE_DECODE, PURPOSE_SIDECHANNEL)
        listening, probe_message = False, self.listener_gate.message
        if probes.serving is not None:
            listening, probe_message = await self.listener_gate.probe(probes.serving, serving_ranks)
        rollout_listening, rollout_probe_message = False, ""
        if probes.rollout is not None and self.rollout_ports:
            rollout_listening, rollout_probe_message = await self.listener_gate.probe(probes.rollout, rollout_ranks)

        partial = self.ports is not None and bool(self.pool_message)  # a scale-up past the pool: see lease_serving
        observed = Observed(
            pods=pods,
            ports_complete=self.ports is not None,
            pool_exhausted=bool(self.pool_message) and not partial,
            leased_instances=({role: frozenset(int(p.get("instance") or 0) for p in self.ports or []
                                                if p.get("role") == role)
                               for role in (ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER)}
                              if partial else None),
            pool_message=self.pool_message,
            decode_listening=listening,
            probe_message=probe_message,
            rollout_ports_complete=self.rollout_ports is not None,
            rollout_pool_exhausted=bool(self.rollout_pool_message),
            rollout_pool_message=self.rollout_pool_message,
            rollout_decode_listening=rollout_listening,
            rollout_probe_message=rollout_probe_message,
            rollout_rejection=self._rollout_rejection(spec),
            leased_slots=self.leased_slots,
            meta_generation=meta_generation,
            restart_times=tuple(self._restart_times()),
            instance_restarts_generation=self._instance_restart_times()[0],
            instance_restart_times=self._instance_restart_times()[1],
            health=self._health_finding(),
            ports_replaced=busy_ports.ports_replaced(prelude.busy, self.ports, prelude.serving.blocks,
                                                 self.rt.leaser.pool),
            nodes=node_views,
            node_lost_seconds=cfg.node_lost_seconds,
            held_pool_ports=frozenset(int(p["port"]) for p in (self.ports or []) + (self.rollout_ports or [])
                                      if int(p["port"]) in self.rt.leaser.pool),
            router_views=dict(self.router_views),
        )
        decided = planner.plan(spec, self.status, observed, time.time())
        if decided.outcome == planner.OUTCOME_HALTED:
            return cfg.resync_interval
        if decided.outcome == planner.OUTCOME_FAILED:
            await self._fail(decided.message, decided.conditions, meta_generation)
            return cfg.resync_interval
        if decided.outcome == planner.OUTCOME_BACKOFF:
            await self._write_status({"phase": decided.phase, "message": decided.message[:32768],
                                      **scaling.status_fields},
                                     list(decided.conditions) + self._signals_condition(generation)  # it stands
                                     + list(scaling.conditions),
                                     meta_generation)
            return pass_timing.backoff_pass(decided.retry_at - time.time() if decided.retry_at else None, cfg)
        plan = decided.steps
        assert plan is not None
        extra: dict[str, Any] = {}
        if decided.restart is not None:
            restart = decided.restart
            if decided.restart_times is not None:
                await self._patch_meta({ANNOTATION_RESTART_TIMES: json.dumps(list(decided.restart_times))})
                self.restart_times_written = (decided.restart_times, time.monotonic())
            # Posted and acknowledged before the status write that records the restart (see _post_event_now).
            await self._post_event_now("Warning", "Restarting",
                                       f"ordered restart to generation {plan.pair_generation}: {restart.message}")
            extra["restarts"] = int(self.status.get("restarts") or 0) + 1
            extra["lastRestart"] = {"time": now_rfc3339(), "reason": restart.message[:1024]}
            self._count_restart(restart.reason)

        if plan.instance_restart_times is not None:  # recorded before the pod is deleted, as the pair's restarts
            record = (plan.pair_generation, {k: tuple(v) for k, v in plan.instance_restart_times.items()})
            await self._patch_meta({ANNOTATION_INSTANCE_RESTART_TIMES: json.dumps(
                {"generation": record[0], "times": {k: list(v) for k, v in record[1].items()}})})
            self.instance_restarts_written = (record, time.monotonic())
        if plan.replaced_instance is not None and self.rt.metrics is not None:
            self.rt.metrics.instance_replaced(self.ref.namespace, self.ref.name, *plan.replaced_instance)

        if plan.rolled_out:
            self.emit("Normal", "RollingOut", f"spec changed: rolling out generation {plan.pair_generation}, decode first")

        if plan.switch_ports:  # the rollout's new generation serves: its port set is status.ports now
            self.ports, self.rollout_ports = self.rollout_ports, self.ports
            self.blocks, self.rollout_blocks = self.rollout_blocks, None
            self.leases_checked_at = self.rollout_checked_at = time.monotonic()

        # Intent first: status carries the generation before any pod is touched.
        rejection = self._rejection(plan)
        await self._write_status(
            {**self._status_fields(plan, pods), **self._rollout_fields(plan, pods), **extra,
             **scaling.status_fields, **({"message": rejection.message} if rejection else {})},
            list(plan.conditions) + self._signals_condition(plan.pair_generation) + self._scale_condition()
            + list(scaling.conditions) + ([self._rejected_condition(rejection, plan)] if rejection else []),
            meta_generation,
        )
        if plan.step != self.last_step:
            self.log.info("pair %s/%s: %s (%s)", self.ref.namespace, self.ref.name, plan.step, plan.message)
            self.last_step = plan.step

        for event in plan.events:
            self.emit(*event)
        await self._act(plan, pods, meta_generation)
        answered = await self.push_sets(pods)
        await self.read_routers(pods, answered)
        if scale_views is not None and plan.role_status:  # a role object's status follows the plan's counts
            desired, ready = scale_sync.counts_of(plan.role_status)
            for event in await scale_sync.sync_scale_targets(self.rt.custom, self.body, scale_views, desired, ready,
                                                             cache=self.scale_cache, seed_counts=dict(spec.replicas)):
                self.emit(*event)
        if plan.release_slot:  # status no longer lists them (written above): the leases can go
            released = await self.rt.leaser.release_slot(self.ref, plan.release_slot)
            self.rollout_ports, self.rollout_blocks = None, None
            self.leased_slots -= {plan.release_slot}  # only once done: a pass that dies before plans it again
            self.log.info("pair %s/%s: released %d port leases of port set %s", self.ref.namespace, self.ref.name,
                          released, plan.release_slot)
        if plan.switch_ports or plan.release_slot or "rollout" in plan.status_fields:
            await self.ensure_service(services)  # the selector follows the serving generation in this very pass
        self._observe_duration(time.monotonic() - started)

        rejection = self._rejection(plan)
        return pass_timing.next_pass(
            plan.step, plan.wait_seconds, cfg,
            refused_for=rejection.not_before - time.monotonic() if rejection is not None else None,
            created_unseen=bool(plan.create) and created_name(self.ref.name, plan) in self.created_unseen,
            failing_pushes=[(p.ready, failure.answered, failure.count)
                            for p in pods if (failure := self.push_failures.get(p.uid)) is not None])

    # --- the per-role scale objects (scale_targets.py and ratio_band.py decide, scale_sync.py writes) -------------
    async def settle_counts(self, views: Mapping[str, ScaleView] | None) -> planner.ScalePlan:
        """This pass's counts (planner.scale_plan: the role objects' counts, then spec.scaling.ratio), from the
        views with this executor's own unseen writes overlaid; carries out the plan's write to the follower's scale
        object before anything is planned from it, then posts the plan's Events (after the write: an Event never
        tells of a count that was not written)."""
        seen = scale_sync.with_own_writes(views, self.scale_cache) if views is not None else None
        scaling = planner.scale_plan(self.body["spec"], self.status, seen)
        if scaling.follower_write is not None and views is not None:
            name, replicas = scaling.follower_write
            indexed = next(v for v in views.values() if v.name == name)  # the index's count: what the write replaces
            await scale_sync.write_replicas(self.rt.custom, self.ref.namespace, indexed, replicas, self.scale_cache)
        for event in scaling.events:
            self.emit(*event)
        for key, event in scaling.overridden:  # once per distinct inline count (docs/xpyd.md section 2)
            if key not in self.overridden_told:
                self.overridden_told.add(key)
                self.emit(*event)
        return scaling

    async def _post_event_now(self, type_: str, reason: str, message: str) -> None:
        """Posts an Event and waits until the apiserver has it, for an Event that must outlive this process.

        kopf queues its Events and posts them a moment later. A leader SIGKILLed between writing a restart into
        status and that post lost the Restarting Event for good: its successor sees the restart already recorded
        and never announces it. Posted first, the Event is at least once (a successor may repeat it, naming the
        same generation). If the post fails, kopf's queue gets it, as for every other Event."""
        now = now_rfc3339()
        event = {
            "metadata": {"generateName": f"{self.ref.name}.", "namespace": self.ref.namespace},
            "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": self.ref.name,
                               "namespace": self.ref.namespace, "uid": self.ref.uid},
            "type": type_, "reason": reason, "message": message[:1024],
            "source": {"component": EVENT_SOURCE}, "reportingComponent": EVENT_SOURCE,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            await asyncio.to_thread(self.rt.core.create_namespaced_event, self.ref.namespace, event)
        except Exception as exc:
            self.log.info("posting the %s Event directly failed (%s); queued instead", reason, exc)
            self.emit(type_, reason, message)

    # --- metrics -----------------------------------------------------------------------------------
    def _count_restart(self, reason_code: str) -> None:
        if self.rt.metrics is not None:
            self.rt.metrics.pair_restarted(self.ref.namespace, self.ref.name, reason_code)

    def _observe_duration(self, seconds: float) -> None:
        if self.rt.metrics is not None:
            self.rt.metrics.observe_reconcile(seconds)
            self.rt.metrics.set_pair_phase(self.ref.namespace, self.ref.name, self.status.get("phase") or "Pending")
            # the pool gauge is read when scraped (metrics.read_port_pool), not recounted after every pass
