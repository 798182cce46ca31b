"""kopf handlers: glue. Each reads its inputs (the indexes, the live body) and hands them to the executor: the
reconciler (act/reconciler.py), the health watch (act/health_watch.py), the deleted pair's cleanup
(act/pair_teardown.py) and the lease sweep (act/lease_sweep.py). What they do is decided in decide/.

- startup: settings (finalizer and progress storage in pdpair.io, posting level, watch timeouts), API clients,
  the port leaser, the orphan-lease sweep.
- index `pair_pods`: the pods of each pair (by the pair-uid label), kept live by the watch; `pair_services` the same
  for the router Service.
- index `node_views`: every Node as observed.NodeView (Ready condition, unreachable taint, cordon); a change of any
  wakes the pairs with a pod on that node (lost and cordoned nodes: nodes.py, planner.py, surge.py).
- index `pair_budgets`: the PodDisruptionBudget of each pair, its name and spec (disruption.py); the reconciler makes
  a missing one and patches an outdated one.
- index `pair_scale_targets`: each pair's InferencePairRole objects (scale_targets.ScaleView), by the uid of the pair
  that owns them (their controller ownerReference); `kubectl scale` or an autoscaler moving one wakes its pair.
- events on pairs, their pods, their Service and their PodDisruptionBudget wake that pair's daemon, so reaction is
  immediate, not per poll.
- daemon `reconcile`: one per pair, loops PairReconciler.reconcile_once (it also drives the probe gate).
- daemon `health`: one per pair, the health watch (act/health_watch.py).
- delete: waits for the daemon to stop, then the cleanup (act/pair_teardown.py): deletes the pair's pods (prefill and
  router first) and waits until they are gone (deleted AND terminated: a pod object disappears only once the kubelet
  has stopped it), then stops listing the ports in status and releases the leases. A port is never leased again
  while a process may still hold it: the ports of a pod still there at the deadline (on a lost node, say) are
  fenced to it, not released.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import random
import secrets
from typing import Any, Callable

import kopf

from pdpair.contract import (
    FINALIZER,
    GROUP,
    LABEL_PAIR_UID,
    PLURAL,
    ROLE_OBJECT_PLURAL,
    VERSION,
)

from pdpair.operator.build import disruption
from pdpair.operator.glue import memory
from pdpair.operator.decide import pass_timing, scale_targets
from pdpair.operator.decide import wake_filter
from pdpair.operator.act import health_watch, lease_sweep, pair_teardown
from pdpair.operator.act.kube_api import TimedApi
from pdpair.operator.model.config import ENV_PEERS_KEY, OperatorConfig
from pdpair.operator.glue.kopf_internals import NoDiffBaseStorage, diff_dependent_handlers, quiet_wake_ups
from pdpair.operator.act.events import EventPoster, kubernetes_post
from pdpair.operator.model.observed import NodeView, PodView
from pdpair.operator.act.port_leaser import PortLeaser
from pdpair.operator.act.kube_api import api_status
from pdpair.operator.act.reconciler import PairReconciler, Runtime, throttled_retry
from pdpair.operator.build.service import ServiceView

log = logging.getLogger(__name__)

DAEMON_STOP_WAIT = 15.0
# The watch-event handlers below only wake a pair's daemon. kopf logs "Handler '<name>' succeeded." at INFO after each
# call: at 1000 pairs 17.7k of the log's 24k lines while starting them, and formatting and writing those lines took
# 5-7% of the event loop (py-spy). kopf_internals.QuietWakeUps drops exactly those lines; failures are still logged.
WAKE_UP_HANDLERS = ("pod_changed", "node_changed", "service_changed", "budget_changed", "pair_changed",
                    "scale_target_changed")


EVENT_DRAIN_TIMEOUT = 5.0
CONSISTENCY_TIMEOUT = 60.0


def _load_kube_config(api_threads: int) -> Any:
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    configuration = kubernetes.client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = api_threads
    return kubernetes.client.ApiClient(configuration)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    import kubernetes

    config: OperatorConfig = memo.get("config") or OperatorConfig.from_env()
    if not config.peers_key:
        config = dataclasses.replace(config, peers_key=secrets.token_urlsafe(32))
        logger.warning("%s is not set: this process derives the pairs' push tokens from a key of its own; pods "
                       "made before a restart of the operator will refuse its pushes until they are re-created "
                       "(the chart sets it from a Secret)", ENV_PEERS_KEY)
    quiet_wake_ups(WAKE_UP_HANDLERS)
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    needs_diff = diff_dependent_handlers(kopf.get_default_registry())
    if needs_diff:  # they would never fire without a diff-base (kopf_internals.py): refuse rather than ignore them
        raise kopf.PermanentError(f"handlers {needs_diff} need kopf's diff-base, which this operator does not keep")
    settings.persistence.diffbase_storage = NoDiffBaseStorage()  # no handler needs one (kopf_internals.py)
    # The pairs' Events go through events.EventPoster (handlers._emitter), not kopf's queue; kopf posts none of its
    # log lines (posting.loggers is off by default) and, at this level, nothing below a warning.
    settings.posting.level = logging.WARNING
    # After its own patch (the finalizer) kopf waits this long for the watch to show it; past
    # that it acts on the stale body and patches the same again. Under load (1000 pairs) the watch lags more than
    # kopf's 5 s default: every such lag cost a duplicate PATCH per pair. Only the delete handler waits on this.
    settings.persistence.consistency_timeout = CONSISTENCY_TIMEOUT
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 90
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 60
    settings.watching.label_selectors["pods"] = LABEL_PAIR_UID  # only pods we made reach the operator
    settings.watching.label_selectors["services"] = LABEL_PAIR_UID  # and only Services we made
    settings.watching.label_selectors["poddisruptionbudgets"] = LABEL_PAIR_UID  # and PodDisruptionBudgets

    asyncio.get_running_loop().set_default_executor(
        concurrent.futures.ThreadPoolExecutor(max_workers=config.api_threads, thread_name_prefix="pdpair-api")
    )
    api = _load_kube_config(config.api_threads)
    timeout = config.api_timeout  # every blocking API call below gets this deadline (kube_api.py)
    coordination = TimedApi(kubernetes.client.CoordinationV1Api(api), timeout)
    leaser = PortLeaser(coordination, config.namespace, config.port_pool)
    held = await leaser.refresh_taken()
    core = TimedApi(kubernetes.client.CoreV1Api(api), timeout)
    custom = TimedApi(kubernetes.client.CustomObjectsApi(api), timeout)
    policy = TimedApi(kubernetes.client.PolicyV1Api(api), timeout)
    runtime = Runtime(config, core, custom, leaser, policy=policy, events=EventPoster(kubernetes_post(core)))
    memo["runtime"] = runtime
    memo["event_poster"] = asyncio.create_task(runtime.events.run(), name="pdpair-event-poster")
    memo["sweeper"] = asyncio.create_task(lease_sweep.sweep_forever(runtime), name="pdpair-lease-sweep")
    memo["trimmer"] = asyncio.create_task(memory.trim_forever(), name="pdpair-malloc-trim")
    memo["metrics_server"] = _start_metrics(runtime)
    frozen = memory.freeze_startup()  # what the startup made is never walked by the collector again (memory.py)
    logger.info(
        "pdpair operator: pool %d-%d (%d held), leases in %s, probe every %.1fs; %d startup objects frozen",
        config.port_pool.first, config.port_pool.last, held, config.namespace, config.probe_interval, frozen,
    )


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    runtime: Runtime | None = memo.get("runtime")
    if runtime is not None and runtime.events is not None:
        await runtime.events.drain(EVENT_DRAIN_TIMEOUT)  # what is still queued goes out, a few seconds at most
    if runtime is not None:
        await runtime.close()
    poster = memo.get("event_poster")
    if poster is not None:
        poster.cancel()
    for name in ("sweeper", "trimmer"):
        task = memo.get(name)
        if task is not None:
            task.cancel()
    server = memo.get("metrics_server")
    if server is not None:
        server.stop()


@kopf.on.probe(id="pairs")
async def probe_pairs(memo: kopf.Memo, **_: Any) -> int:
    runtime: Runtime | None = memo.get("runtime")
    return len(runtime.wakeups) if runtime else 0


@kopf.index("v1", "pods", labels={LABEL_PAIR_UID: kopf.PRESENT})
async def pair_pods(body: kopf.Body, labels: kopf.Labels, **_: Any) -> dict[str, PodView]:
    return {labels[LABEL_PAIR_UID]: PodView.from_pod(body)}


@kopf.on.event("v1", "pods", labels={LABEL_PAIR_UID: kopf.PRESENT})
async def pod_changed(labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    runtime: Runtime | None = memo.get("runtime")
    if runtime:
        runtime.wake(labels[LABEL_PAIR_UID])


@kopf.index("v1", "nodes")
async def node_views(name: str, body: kopf.Body, **_: Any) -> dict[str, NodeView]:
    return {name: NodeView.from_node(body)}


@kopf.on.event("v1", "nodes")
async def node_changed(name: str, body: kopf.Body, memo: kopf.Memo, pair_pods: kopf.Index, **_: Any) -> None:
    """Wake the pairs with a pod on the node when what decides a lost node changed (not on every heartbeat)."""
    runtime: Runtime | None = memo.get("runtime")
    if runtime is None:
        return
    view = NodeView.from_node(body)
    seen = runtime.nodes_seen.get(name)
    runtime.nodes_seen[name] = view
    if seen is not None and (seen.ready, seen.since, seen.unreachable, seen.unschedulable) == \
            (view.ready, view.since, view.unreachable, view.unschedulable):
        return
    for uid, pods in pair_pods.items():
        if any(p.node == name for p in pods):
            runtime.wake(uid)


def _nodes_of(pods: list[PodView], node_views: kopf.Index) -> dict[str, NodeView]:
    """The NodeViews of the nodes the pods are bound to (a node not in the index is left out: not judged)."""
    out: dict[str, NodeView] = {}
    for pod in pods:
        if pod.node and pod.node not in out:
            for view in node_views.get(pod.node, ()):
                out[pod.node] = view
    return out


@kopf.index("v1", "services", labels={LABEL_PAIR_UID: kopf.PRESENT})
async def pair_services(body: kopf.Body, labels: kopf.Labels, **_: Any) -> dict[str, ServiceView]:
    return {labels[LABEL_PAIR_UID]: ServiceView.from_service(body)}


@kopf.on.event("v1", "services", labels={LABEL_PAIR_UID: kopf.PRESENT})
async def service_changed(labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    runtime: Runtime | None = memo.get("runtime")
    if runtime:
        runtime.wake(labels[LABEL_PAIR_UID])  # e.g. someone deleted the router Service: recreate it now


@kopf.index("policy", "v1", "poddisruptionbudgets", labels={LABEL_PAIR_UID: kopf.PRESENT})
async def pair_budgets(name: str, labels: kopf.Labels, spec: kopf.Spec, **_: Any) -> dict[str, tuple[str, tuple]]:
    return {labels[LABEL_PAIR_UID]: (name, disruption.budget_shape(spec))}


@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels={LABEL_PAIR_UID: kopf.PRESENT})
async def budget_changed(body: kopf.Body, uid: str, labels: kopf.Labels, memo: kopf.Memo, type: str | None,
                         **_: Any) -> None:
    runtime: Runtime | None = memo.get("runtime")
    # e.g. someone deleted the pair's PodDisruptionBudget or changed it: make it again; not its status updates
    if runtime and runtime.wake_filter.changed("pdb", uid, wake_filter.dependent_key(body), type):
        runtime.wake(labels[LABEL_PAIR_UID])


def _owned_by_a_pair(body: kopf.Body, **_: Any) -> bool:
    return scale_targets.owner_uid(body) is not None


@kopf.index(GROUP, VERSION, ROLE_OBJECT_PLURAL, when=_owned_by_a_pair)
async def pair_scale_targets(body: kopf.Body, **_: Any) -> dict[str, scale_targets.ScaleView]:
    """The pairs' InferencePairRole objects by the uid of the owning pair (one losing its owner leaves the index)."""
    uid = scale_targets.owner_uid(body)
    return {uid: scale_targets.ScaleView.from_body(body)} if uid else {}


@kopf.on.event(GROUP, VERSION, ROLE_OBJECT_PLURAL, when=_owned_by_a_pair)
async def scale_target_changed(body: kopf.Body, uid: str, memo: kopf.Memo, type: str | None, **_: Any) -> None:
    runtime: Runtime | None = memo.get("runtime")
    pair_uid = scale_targets.owner_uid(body)
    # kubectl scale / an autoscaler moved spec.replicas, or someone deleted it: act now; not our own status writes
    if runtime and pair_uid and runtime.wake_filter.changed("role", uid, wake_filter.dependent_key(body), type):
        runtime.wake(pair_uid)


def _scale_views(pair_scale_targets: kopf.Index, uid: str, pair_name: str) -> dict[str, scale_targets.ScaleView]:
    """The pair's role objects by role, what scale_targets.effective_spec and scale_sync.sync_scale_targets take."""
    return scale_targets.views_by_role(pair_name, pair_scale_targets.get(uid, ()))


@kopf.on.event(GROUP, VERSION, PLURAL)
async def pair_changed(body: kopf.Body, uid: str, memo: kopf.Memo, type: str | None, **_: Any) -> None:
    runtime: Runtime | None = memo.get("runtime")
    if runtime and runtime.wake_filter.changed("pair", uid, wake_filter.pair_key(body), type):
        runtime.wake(uid)  # not for the reconciler's own status writes: wake_filter.py


def _emitter(runtime: Runtime, body: kopf.Body) -> Callable[[str, str, str], None]:
    """emit(type, reason, message) on the pair: through the operator's bounded poster (events.py), not kopf.event, whose
    per-object workers each opened a connection of their own (~100 MiB at 1000 pairs). Only the pair's reference is
    kept, not its body."""
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    poster = runtime.events
    if poster is None:  # a Runtime built without one (tests): kopf's queue
        def via_kopf(type_: str, reason: str, message: str) -> None:
            kopf.event(body, type=type_, reason=reason, message=message[:1024])
        return via_kopf

    def emit(type_: str, reason: str, message: str) -> None:
        poster.emit(namespace, name, uid, type_, reason, message)
    return emit


@kopf.daemon(GROUP, VERSION, PLURAL, id="reconcile", cancellation_backoff=5.0, cancellation_timeout=5.0)
async def reconcile(
    body: kopf.Body, uid: str, stopped: kopf.DaemonStopped, memo: kopf.Memo, logger: logging.Logger,
    pair_pods: kopf.Index, pair_services: kopf.Index, node_views: kopf.Index, pair_budgets: kopf.Index,
    pair_scale_targets: kopf.Index, **_: Any,
) -> None:
    runtime: Runtime = memo["runtime"]
    wake = runtime.wakeups.setdefault(uid, asyncio.Event())
    exited = runtime.exited.setdefault(uid, asyncio.Event())
    exited.clear()

    emit = _emitter(runtime, body)
    reconciler = PairReconciler(runtime, body, emit, logger)
    failures = 0
    last_error = ""
    try:
        while not stopped:
            wake.clear()
            try:
                pods = list(pair_pods.get(uid, ()))
                delay = await reconciler.reconcile_once(pods, list(pair_services.get(uid, ())),
                                                        _nodes_of(pods, node_views), list(pair_budgets.get(uid, ())),
                                                        _scale_views(pair_scale_targets, uid, body["metadata"]["name"]))
                failures, last_error = 0, ""
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # 409s, apiserver restarts, bad specs: report, back off, redo the pass
                throttled = throttled_retry(exc, random.uniform(0.0, 0.5))
                if throttled is not None:  # the apiserver asked for less: no failure, no Event
                    logger.info("reconcile pass throttled by the API server (429); retrying in %.1fs", throttled)
                    await _sleep(wake, stopped, throttled)
                    continue
                failures += 1
                delay = pass_timing.failed_pass(failures)
                text = f"{type(exc).__name__}: {str(exc)[:500]}"
                if api_status(exc) == 409 or "Connection" in type(exc).__name__:
                    logger.info("reconcile pass failed (%s); retrying in %.1fs", text, delay)
                else:
                    logger.warning("reconcile pass failed (%s); retrying in %.1fs", text, delay)
                    if text != last_error:
                        emit("Warning", "ReconcileError", text)
                last_error = text
            await _sleep(wake, stopped, delay)
    finally:
        exited.set()
        runtime.wakeups.pop(uid, None)


@kopf.daemon(GROUP, VERSION, PLURAL, id="health", cancellation_backoff=2.0, cancellation_timeout=5.0)
async def watch_health(
    body: kopf.Body, uid: str, stopped: kopf.DaemonStopped, memo: kopf.Memo, logger: logging.Logger,
    pair_pods: kopf.Index, **_: Any,
) -> None:
    """The pair's health watch (health_watch.py), on the pod index and the live body."""
    runtime: Runtime = memo["runtime"]
    await health_watch.watch(runtime, body, uid, stopped, lambda delay: _sleep(asyncio.Event(), stopped, delay),
                             lambda: list(pair_pods.get(uid, ())), _emitter(runtime, body), logger)


@kopf.on.delete(GROUP, VERSION, PLURAL, id="release-ports")
async def release_ports(body: kopf.Body, uid: str, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """The deleted pair's cleanup (pair_teardown.py), once its reconcile daemon stopped."""
    runtime: Runtime = memo["runtime"]
    exited = runtime.exited.get(uid)
    if exited is not None and not exited.is_set():
        try:  # a daemon still claiming would re-create leases after we release them
            await asyncio.wait_for(exited.wait(), DAEMON_STOP_WAIT)
        except asyncio.TimeoutError:
            logger.warning("the pair's daemon did not stop within %.0fs; releasing anyway", DAEMON_STOP_WAIT)
    await pair_teardown.release(runtime, body, uid, _emitter(runtime, body), logger)
    runtime.exited.pop(uid, None)


async def _sleep(wake: asyncio.Event, stopped: kopf.DaemonStopped, delay: float) -> None:
    async def stop_wait() -> None:
        await stopped.wait()

    waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stop_wait())]
    try:
        await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


def _start_metrics(runtime: Runtime) -> Any:
    """Serve the operator metrics (metrics.py) on the configured port."""
    from pdpair.operator.act.metrics import OperatorMetrics, serve

    runtime.metrics = OperatorMetrics()
    runtime.metrics.read_port_pool(runtime.leaser.free_count, runtime.config.port_pool.size)
    server = serve(runtime.config.metrics_port, runtime.metrics)
    log.info("operator metrics on port %d", server.port)
    return server
