"""The one planner: `prepare(spec, status, pods)` and `plan(spec, status, observed, now)` decide everything a
reconcile pass does, and `deletion_step(pods, ...)` what a deleted pair's cleanup does.

It owns, in this order:
  0. each role's count (scale_plan): the role objects' counts, then the P:D band (ratio_band.py), with the write
     to the follower's scale object that the band needs; everything below plans from scale_plan(...).spec;
  1. the port leases, first, because the pod steps depend on what is held (prepare, leases.py): lease or only
     read each port set (the serving one, a Surge rollout's other one), quarantine busy ports and re-lease them,
     fence the ports of pods on lost nodes (nodes.py) and re-lease them;
  2. a Failed pair is left alone until its spec changes (status.phase Failed at this metadata.generation);
  3. whether the pair needs a restart (a current pod's node is lost, a Recreate pair's pod is on a cordoned node,
     a current pod failed or vanished, a health
     verdict for the current generation, ports found busy on the node and re-leased) and whether it may restart now (restart_policy:
     backoff, budget, the scheduling gate), or must wait, or has spent its budget (Failed);
  4. the ordered steps (next_step: surge.py's Surge plan while one applies, else recreate.py's Recreate plan):
     decode first, the listener gate, prefill, router, the replacement of older generations (rollouts and
     restarts alike, in recreate.teardown's order) and the release of a port set no generation uses.

Pure: no client, no kopf, no clock but `now` (epoch seconds). The executor (reconciler.py) observes, calls
prepare() and plan() once per pass, and carries out what they return. Everything they need is in spec, status
and what the executor observed, so a restarted operator plans exactly what the one before it would have.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from pdpair.contract import (COND_NODE_LOST, COND_PROGRESSING, COND_READY, PHASE_FAILED, PHASE_RESTARTING, ROLES)

from pdpair.operator.decide import recreate as d
from pdpair.operator.model.observed import Finding, PodView, Observed
from pdpair.operator.decide import busy_ports
from pdpair.operator.decide import health
from pdpair.operator.decide import leases
from pdpair.operator.decide import nodes
from pdpair.operator.decide import ratio_band
from pdpair.operator.decide import surge
from pdpair.operator.decide import scale_targets
from pdpair.operator.model import pair_spec, spec_fields
from pdpair.operator.decide.restart_policy import Action, RestartPolicy, decide, prune
from pdpair.operator.model.conditions import FALSE, TRUE, Condition

OUTCOME_STEP = "Step"  # apply `steps` (create/delete/probe), maybe after recording `restart`
OUTCOME_BACKOFF = "RestartBackoff"  # a restart is due but must wait (backoff, or a pod Pending for scheduling)
OUTCOME_FAILED = "RestartBudgetExhausted"  # the budget is spent: phase Failed, stop
OUTCOME_HALTED = "Halted"  # already Failed at this spec: touch nothing


@dataclass(frozen=True)
class PairPlan:
    outcome: str
    steps: d.Plan | None = None  # for OUTCOME_STEP
    restart: Finding | None = None  # the ordered restart this pass starts (the generation is bumped)
    restart_times: tuple[float, ...] | None = None  # the new restart-times record, when it changed
    phase: str = ""  # for OUTCOME_BACKOFF / OUTCOME_FAILED
    message: str = ""
    conditions: tuple[Condition, ...] = ()
    retry_at: float | None = None  # epoch seconds: when a backed-off restart may happen


def effective_spec(spec: Mapping[str, Any], scale_views: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The spec with the counts that win, before any band: spec.<role>.replicas is the role's scale object's count
    once that object exists, the inline count otherwise (scale_targets.effective_replicas: the one statement of
    which count wins, docs/xpyd.md section 2). None: scale objects not watched (the inline counts). A pass plans
    from scale_plan(...).spec, which is this with spec.scaling.ratio applied."""
    return spec if scale_views is None else scale_targets.effective_spec(spec, scale_views)


@dataclass(frozen=True)
class ScalePlan:
    """A pass's counts, settled before anything else is planned (scale_plan), and what settling them takes."""

    spec: Mapping[str, Any]  # the spec every decision of the pass is made from (banded counts)
    follower_write: tuple[str, int] | None = None  # (InferencePairRole name, spec.replicas) the executor writes first
    events: tuple[tuple[str, str, str], ...] = ()  # (type, reason, message): RatioBand, ScalingConflict
    conditions: tuple[Condition, ...] = ()  # ScalingConflict while a band is set (or being cleared)
    status_fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # status.scaling (None removes it)
    # ReplicasFromScaleTarget Events, keyed (role, inline count): the executor posts each key once
    overridden: tuple[tuple[tuple[str, int], tuple[str, str, str]], ...] = ()


def scale_plan(spec: Mapping[str, Any], status: Mapping[str, Any] | None,
               scale_views: Mapping[str, Any] | None) -> ScalePlan:
    """Which count each role runs this pass: effective_spec's (a role object's count wins over the inline one), then
    the P:D band of spec.scaling.ratio (ratio_band.decide: the follower is kept inside the band of the leader's
    count). The executor writes `follower_write` to the follower's scale object, so the next pass sees the count
    it plans with now; `status_fields` records what was decided (ratio_band.Record), which is how a later pass
    tells a count another writer set on the follower from the operator's own."""
    counts = (scale_targets.effective_replicas(spec, scale_views) if scale_views is not None
              else {role: spec_fields.replicas(spec, role) for role in ROLES})
    live = {role: view.name for role in ROLES
            if (view := scale_targets.live_view(scale_views or {}, role)) is not None}
    band = ratio_band.ratio_band(spec)
    decision = ratio_band.decide(spec, counts, live.get(band.follower) if band else None, status,
                                 live.get(band.leader, "") if band else "")
    had_record = isinstance((status or {}).get("scaling"), Mapping)
    record = decision.record.status() if decision.record is not None else None
    return ScalePlan(
        # without a band, exactly effective_spec's (a spec without the roles' counts stays without them)
        spec=scale_targets.with_counts(spec, decision.counts) if band else effective_spec(spec, scale_views),
        follower_write=decision.write,
        events=decision.events,
        conditions=decision.conditions,
        status_fields={"scaling": record} if record is not None or had_record else {},
        overridden=tuple(scale_targets.overridden_events(scale_targets.inline_overridden(spec, scale_views)))
        if scale_views is not None else (),
    )


@dataclass(frozen=True)
class Prelude:
    """What a pass does before its pod steps are planned, because they depend on it: the port-lease steps
    (leases.py: the pod steps need to know which ports are held) and the listener probes (recreate.py's gate)."""

    serving: leases.LeaseStep
    rollout: leases.LeaseStep | None  # a Surge rollout's other generation; None without a rollout
    busy: tuple[busy_ports.PortsInUse, ...]  # busy-port reports of the serving generation (busy_ports.quarantines)
    lost: nodes.LostPods = nodes.LostPods()  # the pair's pods on lost nodes (leases.fences)
    probes: d.ListenerProbes = d.ListenerProbes(None, None)
    serving_generation: int = 1  # the generation the pair serves with (surge.serving_generation)


def prepare(spec: Mapping[str, Any], status: Mapping[str, Any] | None, pods: "tuple[PodView, ...]",
            node_views: Mapping[str, nodes.NodeView] | None = None, now: float = 0.0,
            node_lost_seconds: float = float("inf")) -> Prelude:
    """The pass's first half (Prelude): from the spec (the pass's counts settled), status and the pods."""
    spec, status = pair_spec.read(spec), status or {}
    generations = surge.generations(status, pods)
    active = generations.rollout
    progressing = int(active["toGeneration"]) if active and active.get("phase") == surge.PHASE_PROGRESSING else None
    probes = d.listener_probes(status, pods, generations.serving, progressing)
    serving, rollout = leases.lease_steps(spec, generations, pods)
    return Prelude(serving, rollout, tuple(busy_ports.reports(pods, generations.serving)),
                   nodes.lost_pods(pods, node_views or {}, now, node_lost_seconds), probes, generations.serving)


def service_generation(status: Mapping[str, Any] | None) -> int | None:
    """The generation whose router the pair's Service selects: during a Surge rollout two routers exist and the
    Service selects the serving generation's; otherwise any router of the pair (None)."""
    status = status or {}
    return int(status.get("pairGeneration") or 0) if surge.active_rollout(status) else None


def next_step(
    spec: Mapping[str, Any], status: Mapping[str, Any] | None, observed: Observed, now: float | None = None
) -> d.Plan:
    """The next step of the pair's ordered steps. `now` (epoch seconds) is only read by a Surge rollout's deadlines
    (drain, progress). recreate.py (Recreate) and surge.py (Surge, built on recreate.py) are siblings that never
    import this module: the choice between them is made here, once."""
    spec, status = pair_spec.read(spec), status or {}
    surge_steps = surge.surge_plan(spec, status, observed, now)
    steps = surge_steps if surge_steps is not None else d.recreate_state(spec, status, observed)
    return surge.release_left_slot(steps, status, observed)


def deleted_pair_teardown(pods: "list[PodView]") -> tuple[str, ...]:
    """Which pods of a deleted pair to delete now: the Recreate order, with decode going once prefill and router are
    being deleted (recreate.teardown)."""
    return d.teardown(pods, decode_after_front_gone=False).delete


# A deleted pair's wait for its pods this long (or half its bound, if less) gets an Event saying what it waits for
POD_GONE_SLOW_SECONDS = 30.0


@dataclass(frozen=True)
class DeletionStep:
    """One round of a deleted pair's cleanup (pair_teardown.pods_gone executes rounds until `done`)."""

    delete: tuple[str, ...]  # pods to delete now, in this order (deleted_pair_teardown)
    done: bool  # none is left, or the deadline passed: stop waiting (`left`: the pods still there, fenced to)
    left: tuple[PodView, ...] = ()
    tell_slow: bool = False  # say once that the pods are waited for (a WaitingForPods Event)
    seconds_left: float = 0.0  # until the deadline


def deletion_step(pods: "list[PodView]", began: float, now: float, timeout: float, told_slow: bool) -> DeletionStep:
    """A deleted pair's next round, `now` (epoch seconds) after its deletion `began`: delete in the teardown order,
    wait until no pod is left, at most `timeout` (PDPAIR_POD_GONE_TIMEOUT); a pod still there then is `left`."""
    if not pods:
        return DeletionStep((), done=True)
    deadline = began + timeout
    if now >= deadline:
        return DeletionStep(deleted_pair_teardown(pods), done=True, left=tuple(pods))
    slow = not told_slow and now - began >= min(POD_GONE_SLOW_SECONDS, timeout / 2)
    return DeletionStep(deleted_pair_teardown(pods), done=False, tell_slow=slow, seconds_left=max(0.0, deadline - now))


def halted(status: Mapping[str, Any], meta_generation: int) -> bool:
    """Failed at the spec it failed with: only a spec change (a new metadata.generation) moves the pair again."""
    return status.get("phase") == PHASE_FAILED and status.get("observedGeneration") == meta_generation


def failure(steps: d.Plan, observed: Observed, lost: nodes.LostPods | None = None,
            spec: pair_spec.PairSpec | None = None) -> Finding | None:
    """Why the pair's current generation needs an ordered restart (a current pod on a lost node, a current pod
    failed or vanished, busy ports re-leased, the health watch's finding about this generation), else None. A lost
    node comes first: its pods look failed or vanished too (the node lifecycle controller marks them), and only
    this cause says why."""
    generation = steps.pair_generation
    stranded = nodes.LostPods(tuple(p for p in lost.pods if p.generation == generation), lost.reasons) if lost else None
    if stranded and stranded.pods and steps.heals_alone:
        return None  # a serving xPyD generation keeps serving: instances.heal replaces only what ran there
    if stranded and stranded.pods:
        # Outside the restart budget and its backoff (as busy ports): re-homing must not wait, and it cannot loop,
        # since the new pods are scheduled onto Ready nodes (the lost node's taints keep them off it).
        return Finding(health.REASON_NODE_LOST, f"{stranded.describe()}; re-homing generation {generation} "
                       f"on Ready nodes, its ports there fenced", generation, counted=False)
    if steps.step == d.STEP_BROKEN:
        if observed.ports_replaced:
            return Finding(health.REASON_PORT_IN_USE, observed.ports_replaced, generation, counted=False)
        for pod in observed.pods:
            if pod.generation == generation and pod.raw is not None:
                fact = health.pod_fact(pod.role, pod.raw)
                if fact.reason:
                    return Finding(fact.reason, fact.message, generation)
        return Finding(health.REASON_POD_VANISHED, steps.broken_reason or "a pair pod vanished", generation)
    if steps.step == d.STEP_READY and spec is not None and not spec.surge:
        # A Recreate pair with a pod on a cordoned node: an ordered restart moves it (the new pods are scheduled
        # elsewhere; a Surge pair is re-homed by surge.py instead, without a gap). Outside the budget: cordoning
        # is the cluster's decision, not a failure of the pair.
        moving = nodes.cordoned_pods([p for p in observed.pods if p.generation == generation], observed.nodes)
        if moving:
            return Finding(health.REASON_NODE_DRAIN, f"{nodes.describe_cordoned(moving)}; moving generation "
                           f"{generation} to schedulable nodes (Recreate: an ordered restart)", generation,
                           counted=False)
    found = observed.health
    if found is not None and found.pod and steps.heals_alone:
        return None  # about one instance of a serving xPyD generation: instances.heal replaces it alone (or it is
        # about a pod since replaced), never a restart of the pair
    if found is not None and found.reason == health.REASON_POD_VANISHED and steps.heals_alone:
        # A role's instance 0 missing from a serving xPyD generation: the watch names no pod (there is none), but it is
        # an instance like the others, and instances.heal re-creates it; a role left with no instance at all is
        # recreate.broken_reason's (STEP_BROKEN above). The real nodes showed the race: decode 0 deleted by its own
        # replacement, the watch's next tick found no decode 0, and the pair restarted as a whole.
        return None
    return found if found is not None and found.generation == generation else None


def plan(spec: Mapping[str, Any], status: Mapping[str, Any] | None, observed: Observed, now: float) -> PairPlan:
    spec, status = pair_spec.read(spec), status or {}
    if halted(status, observed.meta_generation):
        return PairPlan(OUTCOME_HALTED)

    lost = nodes.lost_pods(observed.pods, observed.nodes, now, observed.node_lost_seconds)
    observed = dataclasses.replace(observed, fenced=leases.fenced_pods(lost, observed.held_pool_ports), now=now,
                                   stranded=lost.names,
                                   stranded_fenced=leases.unheld_pods(lost, observed.held_pool_ports))
    node_condition = node_lost_condition(lost)
    steps = next_step(spec, status, dataclasses.replace(observed, restart_reason=None), now)
    restart = failure(steps, observed, lost, spec)
    new_times: tuple[float, ...] | None = None
    if restart is not None and restart.counted:
        policy = RestartPolicy.from_spec(spec.get("restartPolicy"))
        decision = decide(policy, observed.restart_times, now,
                          pods_pending_scheduling=any(p.pending_scheduling for p in observed.pods))
        if decision.action == Action.BUDGET_EXHAUSTED:
            text = f"restart budget spent ({decision.message}); last failure: {restart.message}"
            return PairPlan(OUTCOME_FAILED, phase=PHASE_FAILED, message=text,
                            conditions=(Condition(COND_READY, FALSE, "RestartBudgetExhausted", text[:32768]),))
        if decision.action in (Action.WAIT, Action.PENDING_SCHEDULING):
            return PairPlan(OUTCOME_BACKOFF, phase=PHASE_RESTARTING, message=f"{restart.message}; {decision.message}",
                            conditions=(Condition(COND_READY, FALSE, "RestartBackoff", decision.message),
                                        node_condition),
                            retry_at=decision.not_before)
        new_times = tuple(prune(policy, list(observed.restart_times) + [now], now))
    if restart is not None:
        steps = next_step(spec, status, dataclasses.replace(observed, restart_reason=restart.message), now)
    wait = steps.wait_seconds
    if lost.recheck_seconds is not None:  # a not-Ready node turns lost then, and nothing else wakes the pair
        wait = lost.recheck_seconds if wait is None else min(wait, lost.recheck_seconds)
    steps = dataclasses.replace(steps, conditions=steps.conditions + (node_condition,), wait_seconds=wait)
    return PairPlan(OUTCOME_STEP, steps=naming_config_errors(steps, observed.pods), restart=restart,
                    restart_times=new_times)


def config_errors(pods: "tuple[PodView, ...] | list[PodView]") -> str:
    """The pair's pods (not being deleted) whose container the kubelet cannot create from its configuration
    (health.container_config_error: a missing Secret, such as spec.apiKeySecret's, or a missing key in one), each
    with the kubelet's message; "" when none."""
    return "; ".join(f"{p.role} pod {p.name}: {error}" for p in pods
                     if not p.deleting and (error := health.container_config_error(p.raw)))


def naming_config_errors(steps: d.Plan, pods: "tuple[PodView, ...] | list[PodView]") -> d.Plan:
    """`steps` with every pod stuck on its configuration named (`config_errors`): in the message, and in the Ready
    condition while it is False (reason CreateContainerConfigError), else in a Surge rollout's Progressing condition
    (the serving generation stays Ready). Such a pod waits, and so does the pair's step, until the object is made;
    without this the pair would only say it waits for the pod to run."""
    stuck = config_errors(pods)
    if not stuck:
        return steps
    conditions = list(steps.conditions)
    ready = next((i for i, c in enumerate(conditions) if c.type == COND_READY and c.status == FALSE), None)
    if ready is not None:
        conditions[ready] = Condition(COND_READY, FALSE, health.CONFIG_ERROR_REASONS[0], stuck[:32768])
    else:
        for i, c in enumerate(conditions):
            if c.type == COND_PROGRESSING:
                conditions[i] = dataclasses.replace(c, message=f"{c.message}; {stuck}"[:32768])
    return dataclasses.replace(steps, message=f"{steps.message}; {stuck}", conditions=tuple(conditions))


def node_lost_condition(lost: nodes.LostPods) -> Condition:
    """NodeLost: True while a pod of the pair (any generation) sits on a lost node, naming nodes and pods."""
    if lost.pods:
        return Condition(COND_NODE_LOST, TRUE, "NodeLost", lost.describe()[:32768])
    return Condition(COND_NODE_LOST, FALSE, "NodesReady", "no pod of the pair is on a lost node")
