"""The step planner: given spec, status and what was observed, which single step comes next.

No client, no kopf, no clock, and no import of surge.py (which builds on this module). planner.next_step picks
this Recreate planner or surge.py's Surge one; planner.plan (the one owner of a pass's decisions) calls it once the
restart question is settled; the executor (reconciler.PairReconciler) applies the plan, observes again, and asks
again. The order it encodes:

  1. lease ports                          (PortsLeased)
  2. replace stale pods, in order:        prefill and router first, decode after they are gone, wait all gone
  3. create decode                        (phase DecodeStarting)
  4. create prefill in the next pass, without waiting for decode to be scheduled (phase PrefillStarting): both
     engines load at the same time. Prefill learns decode's address once decode has one: the executor pushes it
     (`PUT /pdpair/v1/peers` on prefill's metrics port, instances.prefill_peers decides the set, push.py sends it;
     retried every probe interval while prefill still loads). The pairing stays in order: prefill's connector
     hands its unique id only to a decode listener that accepted (it retries until then), and prefill's readiness
     (/readyz, pods.py) passes only once every rank is paired and its engine serves.
     4b. once both run with an IP: create the router (when enabled) beside the loading engines; its readiness
     is both engine pods' readiness, so the Service sends nothing through it before they serve.
  5. wait prefill Ready (PrefillReady), decode Ready, and decode's listener seen accepting on every rank by the
     operator's own probe (DecodeListening)
  6. wait for the router to be Ready (re-create it if it went missing)
  7. Ready

With spec.rolloutStrategy Surge, surge.py plans a spec change of a serving pair instead: the new generation goes
through steps 3-7 beside the serving one, on its own port set, then takes over (see surge.py).

"Ready" of a pod is its Ready condition: every container's readiness probe passes (decode's is vLLM's /health,
prefill's the connector's /readyz: paired and serving, see pods.py), so a pair is Ready only when both serve, paired. No step has a deadline: a pod that loads
its model slowly stays in its step (the kubelet's startupProbe is the deadline, spec.startupTimeoutSeconds).

A spec change (of anything the pods are built from) or a restart request moves the pair to a new pairGeneration;
the pods of older generations are then stale and step 2 replaces them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from pdpair.contract import (
    COND_DECODE_LISTENING,
    COND_PORTS_LEASED,
    COND_PREFILL_READY,
    COND_READY,
    PHASE_DECODE_STARTING,
    PHASE_PENDING,
    PHASE_PREFILL_STARTING,
    PHASE_READY,
    PHASE_RESTARTING,
    ROLE_DECODE,
    ROLE_PREFILL,
    ROLE_ROUTER,
)

from pdpair.operator.decide import instances
from pdpair.operator.model.pair_spec import PairSpec
from pdpair.operator.model.observed import Observed, PodView
from pdpair.operator.model.conditions import FALSE, TRUE, Condition

# --- the plan ---------------------------------------------------------------------------------------
STEP_LEASE_PORTS = "LeasePorts"
STEP_POOL_EXHAUSTED = "PoolExhausted"
STEP_DELETE_PREFILL = "DeletePrefill"  # prefill and router of an older generation
STEP_DELETE_DECODE = "DeleteDecode"
STEP_WAIT_GONE = "WaitPodsGone"
STEP_CREATE_DECODE = "CreateDecode"
STEP_WAIT_DECODE_RUNNING = "WaitDecodeRunning"
STEP_WAIT_LISTENER = "WaitDecodeListener"
STEP_CREATE_PREFILL = "CreatePrefill"
STEP_WAIT_PREFILL_READY = "WaitPrefillReady"
STEP_WAIT_DECODE_READY = "WaitDecodeReady"
STEP_CREATE_ROUTER = "CreateRouter"
STEP_WAIT_ROUTER_READY = "WaitRouterReady"
STEP_READY = "Ready"
STEP_BROKEN = "Broken"  # a current pod failed or vanished: the executor decides on a restart
# xPyD (instances.py): an instance beyond the first is created, drained or deleted while instance 0's steps wait
STEP_INSTANCES = "Instances"


@dataclass(frozen=True)
class Plan:
    step: str
    pair_generation: int
    phase: str
    conditions: tuple[Condition, ...]
    message: str
    delete: tuple[str, ...] = ()  # pod names, in this order
    # pods on a lost node whose ports are fenced to them (instances.heal): deleted with grace 0, before `delete`
    force_delete: tuple[str, ...] = ()
    create: str | None = None  # a role
    create_instance: int = 0  # which instance of that role (xPyD: instances.py); 0 for a 1P1D pair
    mark_draining: tuple[str, ...] = ()  # pods a scale-down chose: annotate pdpair.io/draining-since = now
    role_status: Mapping[str, Any] = field(default_factory=dict)  # status.prefill / status.decode (instances.py)
    probe_decode: bool = False  # the executor should probe the current decode pod's listener
    broken_reason: str | None = None
    rolled_out: bool = False  # this plan moved to a new generation for a spec change
    # Surge rollouts (surge.py); the defaults are a Recreate plan's
    create_generation: int | None = None  # the generation `create` builds (None: pair_generation)
    create_slot: str | None = None  # the port set the created pod uses (None: the serving generation's)
    status_fields: Mapping[str, Any] = field(default_factory=dict)  # more status to write (None deletes a field)
    switch_ports: bool = False  # the rollout's new generation now serves: its port set becomes status.ports
    release_slot: str | None = None  # release this port set's leases once status no longer lists them
    events: tuple[tuple[str, str, str], ...] = ()  # (type, reason, message) to post
    wait_seconds: float | None = None  # a deadline inside the plan (drain, progress): pass again no later
    # xPyD (instances.heal): the generation serves and heals failed instances alone; a health finding naming a pod
    # is then this plan's concern, never an ordered restart of the pair (planner.failure)
    heals_alone: bool = False
    instance_restart_times: Mapping[str, tuple[float, ...]] | None = None  # the new per-instance record, if changed
    replaced_instance: tuple[str, str] | None = None  # (role, restart reason code) of the instance replaced alone

    @property
    def progressing(self) -> bool:
        return self.step not in (STEP_READY, STEP_POOL_EXHAUSTED)


def current_generation(status: Mapping[str, Any], pods: Iterable[PodView]) -> int:
    """The highest generation recorded anywhere (status may lag the pods after a crash)."""
    known = [int(status.get("pairGeneration") or 0)] + [p.generation for p in pods]
    return max(known) or 1


def broken_reason(pods: Iterable[PodView], generation: int) -> str | None:
    """Why the pods of `generation` can no longer work as a pair, or None. Unscheduled Pending pods are fine."""
    current = [p for p in pods if p.generation == generation]
    rank = {ROLE_DECODE: 0, ROLE_PREFILL: 1, ROLE_ROUTER: 2}
    for pod in sorted(current, key=lambda p: (rank.get(p.role, 3), p.instance)):
        if pod.deleting and pod.instance >= 1:
            # Deleted (a scale-down, or by hand): vLLM exits 0 on SIGTERM, so it ends Succeeded while it goes; the
            # instance is re-created (or not, a scale-down) by instances.py, never a restart of the pair. (Found on
            # the real nodes: kwok pods never exit.)
            continue
        if pod.failed:
            return f"{pod.role} pod {pod.name} {pod.phase.lower()}"
        if pod.restarts > 0:
            return f"{pod.role} pod {pod.name} container restarted {pod.restarts}x"
    # Every decode gone while a prefill runs: nothing is left to pair with (one of several decodes that went is
    # re-created by instances.py instead; instance 0 is recreate.py's own).
    prefill = next((p for p in current if p.role == ROLE_PREFILL), None)
    decodes = [p for p in current if p.role == ROLE_DECODE]
    decode0 = next((p for p in decodes if p.instance == 0), None)
    if prefill is not None and (decode0 is None or decode0.deleting):
        return f"decode pod of generation {generation} vanished while prefill {prefill.name} runs"
    return None


def recreate_state(
    spec: PairSpec, status: Mapping[str, Any], observed: Observed, pin_generation: int | None = None
) -> Plan:
    """The Recreate planner (steps 1-7 above). With `pin_generation` it plans that generation as it is, whatever
    spec its pods were built from (surge.py plans the serving and the new generation of a Surge rollout so)."""
    generation, rolled_out = _generation(spec, status, observed, pin_generation)
    xpyd = instances.plan_instances(spec, status, observed, generation)
    plan = with_instances(observed, xpyd.step, _instance0_state(spec, status, observed, generation, rolled_out, xpyd))
    return replace(plan, role_status=xpyd.role_status)


# Instance 0's steps that act or must not be joined by anything else: the pass does only that.
_EXCLUSIVE_STEPS = frozenset({STEP_LEASE_PORTS, STEP_POOL_EXHAUSTED, STEP_DELETE_PREFILL, STEP_DELETE_DECODE,
                              STEP_BROKEN})


def with_instances(observed: Observed, step: instances.InstanceStep | None, plan: Plan) -> Plan:
    """Instance 0's plan, or, when it neither acts nor tears anything down, the next action on the other
    instances of its generation (instances.plan_instances' step): one action per pass, instance 0's first."""
    if step is None or plan.step in _EXCLUSIVE_STEPS or plan.create or plan.delete or plan.force_delete or (
            plan.step == STEP_WAIT_GONE and any(p.generation != plan.pair_generation for p in observed.pods)):
        return plan
    message = f"{plan.message}; {step.message}"
    if step.kind == instances.CREATE:
        return replace(plan, step=STEP_INSTANCES, message=message, create=step.role, create_instance=step.instance)
    if step.kind == instances.MARK_DRAINING:
        return replace(plan, step=STEP_INSTANCES, message=message, mark_draining=(step.pod,))
    if step.kind == instances.DELETE:
        return replace(plan, step=STEP_INSTANCES, message=message, delete=(step.pod,))
    waits = [w for w in (plan.wait_seconds, step.wait_seconds) if w is not None]
    return replace(plan, message=message, wait_seconds=min(waits) if waits else None)


def _generation(spec: PairSpec, status: Mapping[str, Any], observed: Observed,
                pin_generation: int | None) -> tuple[int, bool]:
    """(the generation this plan is for, whether it is new for a spec change): the current one (or `pin_generation`),
    the next one when a current pod was built from another spec (a rollout; never for a pinned one) or a restart
    is due."""
    if pin_generation is not None:
        generation, rolled_out = pin_generation, False
    else:
        generation = current_generation(status, observed.pods)
        rolled_out = any(p.spec_hash != spec.fingerprint for p in observed.pods
                         if p.generation == generation and not p.deleting)
    return generation + (1 if rolled_out or observed.restart_reason else 0), rolled_out


def _instance0_state(spec: PairSpec, status: Mapping[str, Any], observed: Observed, generation: int,
                     rolled_out: bool, xpyd: instances.InstancesPlan) -> Plan:
    pods = observed.pods

    def plan(step: str, phase: str, message: str, conds: list[Condition], **kw: Any) -> Plan:
        return Plan(step, generation, phase, tuple(conds), message, rolled_out=rolled_out, **kw)

    replacing_phase = PHASE_RESTARTING if (observed.restart_reason or _restarting(status)) else PHASE_PENDING

    # 1. ports
    if not observed.ports_complete:
        if observed.pool_exhausted:
            return plan(
                STEP_POOL_EXHAUSTED,
                PHASE_PENDING,
                observed.pool_message or "the operator's port pool has no room for this pair; retrying",
                [Condition(COND_PORTS_LEASED, FALSE, "PoolExhausted", observed.pool_message), _not_ready("PoolExhausted")],
            )
        return plan(
            STEP_LEASE_PORTS,
            PHASE_PENDING,
            "leasing ports",
            [Condition(COND_PORTS_LEASED, FALSE, "Leasing", "claiming port leases"), _not_ready("LeasingPorts")],
        )
    leased = Condition(COND_PORTS_LEASED, TRUE, "Leased", "every port is leased")

    # 2. stale pods go: prefill and router first, decode only after they are gone, then wait for all. A pod on a lost
    # node counts as gone once it is being deleted and its ports are fenced to it (observed.fenced, planner.plan):
    # its kubelet cannot confirm the deletion for as long as the node is lost, and no new pod can share its ports.
    stale = [p for p in pods if p.generation != generation and p.name not in observed.fenced]
    if stale:
        going = teardown(stale)
        to_delete = going.delete
        if going.front:
            return plan(
                STEP_DELETE_PREFILL if to_delete else STEP_WAIT_GONE,
                replacing_phase,
                f"replacing generation {generation - 1 if generation > 1 else generation}: stopping prefill first",
                [leased, _listening(FALSE, "Replacing", "pods of an older generation are stopping"),
                 _prefill(FALSE, "Replacing"), _not_ready("Replacing")],
                delete=to_delete,
            )
        return plan(
            STEP_DELETE_DECODE if to_delete else STEP_WAIT_GONE,
            replacing_phase,
            "prefill is gone; stopping the old decode" if to_delete else "waiting until the old pods are gone",
            [leased, _listening(FALSE, "Replacing", "pods of an older generation are stopping"),
             _prefill(FALSE, "Replacing"), _not_ready("Replacing")],
            delete=to_delete,
        )

    # Instance 0 of each role walks the ordered steps below; the others are instances.py's (with_instances).
    by_role = {p.role: p for p in pods if p.generation == generation and p.instance == 0}
    decode = by_role.get(ROLE_DECODE)
    prefill = by_role.get(ROLE_PREFILL)
    router = by_role.get(ROLE_ROUTER)

    # xPyD, serving: a failed or hung instance is replaced alone while the others serve (instances.heal); only when
    # that is impossible does the generation restart in order below.
    if xpyd.heal is not None:
        return _healing_plan(spec, generation, xpyd.heal, leased)

    reason = broken_reason(pods, generation)
    if reason:
        return plan(
            STEP_BROKEN,
            PHASE_RESTARTING,
            reason,
            [leased, _not_ready("PodFailed")],
            broken_reason=reason,
        )

    # A current pod that is being deleted (someone else deleted it) is waited out, then recreated.
    if any(p.deleting for p in by_role.values()):
        return plan(STEP_WAIT_GONE, replacing_phase, "waiting until deleted pods are gone",
                    [leased, _not_ready("Replacing")])

    # 3-4. decode
    if decode is None:
        return plan(
            STEP_CREATE_DECODE,
            PHASE_DECODE_STARTING,
            f"creating decode (generation {generation})",
            [leased, _listening(FALSE, "DecodeCreating", "the decode pod is being created"),
             _prefill(FALSE, "WaitingForDecode"), _not_ready("DecodeStarting")],
            create=ROLE_DECODE,
        )
    # 4. prefill: at once, beside the decode just created (not yet scheduled, maybe): both engines load at the same
    # time; prefill is pushed decode's address once decode has one, and pairs when decode's listener accepts.
    if prefill is None:
        return plan(
            STEP_CREATE_PREFILL,
            PHASE_PREFILL_STARTING,
            f"creating prefill beside decode (generation {generation})",
            [leased, _listening(FALSE, "DecodeStarting", "decode is starting"), _prefill(FALSE, "Creating"),
             _not_ready("PrefillStarting")],
            create=ROLE_PREFILL,
        )
    if not decode.running:
        why = "waiting for the decode pod to be scheduled" if not decode.scheduled else "waiting for the decode pod to run"
        return plan(
            STEP_WAIT_DECODE_RUNNING,
            PHASE_PREFILL_STARTING,
            why,
            [leased, _listening(FALSE, "DecodeNotRunning", why), _prefill(FALSE, "WaitingForDecode"),
             _not_ready("PrefillStarting")],
        )
    # The listener, as the operator's probe saw it; a generation that was Ready already passed it (a probe that
    # fails later, e.g. on a loaded operator after its restart, does not take a serving pair out of Ready).
    listened = observed.decode_listening or listener_proven(status, generation, prefill)
    if listened:
        # This pass's probe result, else what status says it accepted (a proven listener is not probed again): the
        # message must not flip between the two on idle passes, each flip a status write.
        listening = _listening(TRUE, "Accepting", (observed.probe_message if observed.decode_listening else "")
                               or _accepted_message(status) or f"decode {decode.ip} accepted on every rank")
    else:
        probing = observed.probe_message or f"probing decode {decode.ip} side-channel ports"
        listening = _listening(FALSE, "NotAccepting", probing)

    # 4b. the router, as soon as prefill has an address too: its start (image, imports, bind) runs while the engines
    # load, off the path to the first answer. Its readiness (/readyz: prefill's and decode's own readiness, pods.py)
    # keeps the Service off it until both serve; the pair's Ready still waits for every step below.
    if spec.router_enabled and router is None and prefill.running:
        return plan(
            STEP_CREATE_ROUTER,
            PHASE_PREFILL_STARTING,
            "prefill runs; creating the router beside the loading engines",
            [leased, listening, _prefill(TRUE, "PodReady") if prefill.ready else _prefill(FALSE, "Starting"),
             _not_ready("RouterStarting")],
            create=ROLE_ROUTER,
            probe_decode=not listened,
        )
    if not (prefill.running and prefill.ready):
        return plan(
            STEP_WAIT_PREFILL_READY,
            PHASE_PREFILL_STARTING,
            "waiting for prefill to pair with decode and serve (its readiness: /readyz)",
            [leased, listening, _prefill(FALSE, "Starting"), _not_ready("PrefillStarting")],
            probe_decode=not listened,
        )
    prefill_ready = _prefill(TRUE, "PodReady")
    # Ready means serving: decode's readiness probe (vLLM /health) must pass too, not only its listener.
    if not decode.ready:
        return plan(
            STEP_WAIT_DECODE_READY,
            PHASE_PREFILL_STARTING,
            "waiting for the decode pod to be Ready",
            [leased, listening, prefill_ready, _not_ready("DecodeNotReady")],
            probe_decode=not listened,
        )
    if not listened:
        return plan(
            STEP_WAIT_LISTENER,
            PHASE_PREFILL_STARTING,
            probing,
            [leased, listening, prefill_ready, _not_ready("DecodeNotListening")],
            probe_decode=True,
        )

    # 6. router: made at 5b; here only when it went missing later (someone deleted it)
    if spec.router_enabled:
        if router is None:
            return plan(
                STEP_CREATE_ROUTER,
                PHASE_PREFILL_STARTING,
                "creating the router",
                [leased, listening, prefill_ready, _not_ready("RouterStarting")],
                create=ROLE_ROUTER,
            )
        if not (router.running and router.ready):
            return plan(
                STEP_WAIT_ROUTER_READY,
                PHASE_PREFILL_STARTING,
                "waiting for the router pod to be Ready",
                [leased, listening, prefill_ready, _not_ready("RouterStarting")],
            )

    # 7.
    return plan(
        STEP_READY,
        PHASE_READY,
        f"generation {generation} is ready",
        [leased, listening, prefill_ready,
         Condition(COND_READY, TRUE, "PairReady", "decode and prefill are Ready (serving), and the router when enabled")],
    )


def _healing_plan(spec: PairSpec, generation: int, healed: instances.Heal, leased: Condition) -> Plan:
    """A serving xPyD generation (instances.heal): phase Ready while at least one instance of each role serves;
    a failed instance (or router replica) is deleted now, or its backoff waited out, and what is gone is re-created
    (instances.instance_step). The Ready condition is False while no router serves: the engines do, but nothing
    answers the Service until a router is Ready."""
    counts = ", ".join(f"{role} {healed.serving.get(role, 0)}/{spec.replicas[role]}"
                       for role in (ROLE_PREFILL, ROLE_DECODE))
    ready = (Condition(COND_READY, TRUE, "PairReady", f"serving with {counts} instances Ready")
             if healed.router_serving else
             Condition(COND_READY, FALSE, "RouterReplacing", f"no router serves (one is being replaced); {counts} "
                                                             "instances Ready behind it"))
    conditions = (leased, _listening(TRUE, "Accepting", "the generation served: decode's listener accepted"),
                  _prefill(TRUE, "PodReady"), ready)
    common = dict(heals_alone=True, instance_restart_times=healed.restart_times, wait_seconds=healed.wait_seconds)
    if healed.force_delete:
        return Plan(STEP_INSTANCES, generation, PHASE_READY, conditions, healed.message,
                    force_delete=tuple(p.name for p in healed.force_delete),
                    replaced_instance=(healed.replaced_role, healed.reason),
                    events=(("Warning", "InstanceReplacing", healed.message),), **common)
    if healed.replace is not None:
        return Plan(STEP_INSTANCES, generation, PHASE_READY, conditions, healed.message, delete=(healed.replace.name,),
                    replaced_instance=(healed.replace.role, healed.reason),
                    events=(("Warning", "InstanceReplacing", healed.message),), **common)
    message = f"generation {generation} is ready ({counts} serving)" + (f"; {healed.message}" if healed.message else "")
    return Plan(STEP_READY, generation, PHASE_READY, conditions, message, **common)


def _accepted_message(status: Mapping[str, Any]) -> str:
    """The message of status's DecodeListening condition while it is True ("" when it is not)."""
    for cond in status.get("conditions") or []:
        if cond.get("type") == COND_DECODE_LISTENING and cond.get("status") == TRUE:
            return str(cond.get("message") or "")
    return ""


def _restarting(status: Mapping[str, Any]) -> bool:
    return status.get("phase") == PHASE_RESTARTING


def listener_proven(status: Mapping[str, Any], generation: int, prefill: PodView | None) -> bool:
    """The generation was Ready (status says so; the serving one keeps phase Ready during a Surge rollout) and its
    prefill is Ready: a Ready prefill is a paired one (its /readyz), so decode's listener accepted, whatever a later
    probe says. The one statement of that rule: recreate_state reads it, listener_probes skips the probe."""
    return (status.get("phase") == PHASE_READY and int(status.get("pairGeneration") or 0) == generation
            and prefill is not None and prefill.ready)


@dataclass(frozen=True)
class ListenerProbes:
    """The decode pods whose side-channel listener the executor probes this pass (a condition of Ready)."""

    serving: PodView | None  # the serving generation's decode, on status.ports
    rollout: PodView | None  # a Progressing Surge rollout's new decode, on the rollout's port set


def listener_probes(status: Mapping[str, Any], pods: "tuple[PodView, ...]", serving_generation: int,
                    progressing_generation: int | None) -> ListenerProbes:
    """Which decode listeners to probe this pass (planner.prepare): the serving generation's, and a Progressing
    Surge rollout's new generation's (`progressing_generation`; None without one)."""
    new_decode = _to_probe(pods, progressing_generation) if progressing_generation is not None else None
    return ListenerProbes(_to_probe(pods, serving_generation, status), new_decode)


def _to_probe(pods: "tuple[PodView, ...]", generation: int, status: Mapping[str, Any] | None = None) -> PodView | None:
    """The generation's decode while its listener is still to be seen accepting: it runs, and the generation was not
    Ready yet with its prefill Ready (prefill starts beside decode and pairs when the listener accepts, so its
    readiness proves the listener; recreate_state reads the result). The executor caches a decode seen accepting,
    so each is probed until then, not after."""
    decode = next((p for p in pods if p.role == ROLE_DECODE and p.generation == generation and p.instance == 0), None)
    if decode is None or not decode.running:
        return None
    prefill = next((p for p in pods if p.role == ROLE_PREFILL and p.generation == generation and p.instance == 0),
                   None)
    if status is not None and listener_proven(status, generation, prefill):
        return None
    return decode


@dataclass(frozen=True)
class Teardown:
    delete: tuple[str, ...]  # pod names to delete now, in this order (none: wait)
    front: bool  # prefill or router is still there: decode waits


def teardown(pods: Iterable[PodView], decode_after_front_gone: bool = True) -> Teardown:
    """The teardown order, the one definition (a restart's or rollout's old generation, a rolled-back generation, a
    deleted pair): router and prefill first, decode after them, so no prefill pushes KV to a decode that is gone
    and no new decode is made while an old prefill may still reach its port. A pod already being deleted is not
    deleted again. `decode_after_front_gone`: decode goes only once prefill and router are gone (a replacement);
    False: once they are being deleted (a deleted pair: nothing replaces it, and waiting out the front's grace
    period first would only hold the port leases longer)."""
    pods = list(pods)
    front = [p for p in pods if p.role != ROLE_DECODE and (decode_after_front_gone or not p.deleting)]
    if front:
        return Teardown(tuple(p.name for p in _ordered(front) if not p.deleting), front=True)
    return Teardown(tuple(p.name for p in pods if not p.deleting), front=False)


def _ordered(pods: Iterable[PodView]) -> list[PodView]:
    rank = {ROLE_ROUTER: 0, ROLE_PREFILL: 1, ROLE_DECODE: 2}
    return sorted(pods, key=lambda p: (rank.get(p.role, 1), p.name))


def _not_ready(reason: str) -> Condition:
    return Condition(COND_READY, FALSE, reason, "")


def _listening(status: str, reason: str, message: str = "") -> Condition:
    return Condition(COND_DECODE_LISTENING, status, reason, message)


def _prefill(status: str, reason: str) -> Condition:
    return Condition(COND_PREFILL_READY, status, reason, "")
