"""xPyD: the instances of a role beyond the first, and what each pod is told (pure: no client, the clock only as
`now`). docs/xpyd.md is the design; this module is the part of it the planner runs.

Instance 0 of each role goes through recreate.py's ordered steps exactly as a 1P1D pair always did (decode, prefill
beside it at once, router, the listener gate, Ready); a pair with `replicas: 1` on both roles never reaches
anything here. The other instances (`spec.<role>.replicas` > 1, as the executor's effective spec says: a role's
scale object wins over the inline count, scale_targets.py) are planned by `instance_step`, one action per pass,
after recreate.py's own action (it never overrides one):
  - decode i >= 1 is created as soon as decode 0 exists, prefill i >= 1 as soon as prefill 0 exists: every engine
    loads at once (the parallel start); a prefill learns each decode's address from the push once it has one;
  - an instance at or above its role's count (a scale-down: the highest indexes go, like a StatefulSet) is first
    marked draining (annotation pdpair.io/draining-since on the pod, the executor's write): from that pass on it is
    out of the router's set, so no new request is sent to it; it stays in the prefills' sets until its pod stops
    running, because a request the router sent to it just before the mark still needs its KV pushed there (taking
    it out at once failed such a request on the real nodes: decode answered 500). It is deleted as soon as it is
    drained, a prefill before any decode (recreate.teardown's order): the router of its generation has taken the
    mark (an answer read after the mark no longer lists it as one it may choose) and reports no request in flight
    that involves it (`involved`: for a prefill until that request's decode answer ended, since prefill pushes the
    KV to decode after answering; router/app.py) -- `router_drained`, on the executor's RouterDrainView; or, at the
    latest, once `spec.rollout.drainSeconds` passed since the mark (the deadline: requests still in flight then
    fail; without a router, before its first answer, or with an answer about another generation, the deadline is
    the only end). While one drains and its router runs, the plan asks for the next pass within
    DRAIN_POLL_SECONDS, when the executor reads the router again, so an idle instance goes within a second or two.
    Its port leases are released only once the pod is gone (leases.py counts live pods' instances).
The pushes (`prefill_peers`, `router_members`): a prefill is given every decode of its own generation that runs,
draining ones included (never another generation's: the pairing stays revision-coherent); the router every
instance of its generation that is Ready and not draining. The executor sends them (push.py) whenever they differ from what the
pod was last told.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from pdpair.contract import PHASE_READY, ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER

from pdpair.operator.model.pair_spec import PairSpec
from pdpair.operator.decide.health import REASON_CONTAINER_RESTART, REASON_NODE_LOST, REASON_POD_FAILED
from pdpair.operator.model.observed import Finding, Observed, PodView, RouterDrainView
from pdpair.operator.decide.restart_policy import Action, RestartPolicy, decide, prune, restarts_in_window

ENGINE_ROLES = (ROLE_DECODE, ROLE_PREFILL)
# While an instance drains and its generation's router runs: the next pass (and the executor's read of the router's
# counts) comes this soon, so an idle drain ends within about this much, not at spec.rollout.drainSeconds.
DRAIN_POLL_SECONDS = 1.0


def live_instances(pods: Iterable[PodView], role: str, generation: int) -> dict[int, PodView]:
    """The role's pods of `generation` that are not being deleted, by instance index."""
    return {p.instance: p for p in pods if p.role == role and p.generation == generation and not p.deleting}


@dataclass(frozen=True)
class InstanceStep:
    """One action on an instance >= 1 (or a surplus one) this pass."""

    kind: str  # CREATE | MARK_DRAINING | DELETE | WAIT_DRAIN
    role: str
    instance: int
    pod: str = ""  # the pod to mark or delete
    wait_seconds: float | None = None  # a drain still running: pass again no later
    message: str = ""


CREATE = "CreateInstance"
MARK_DRAINING = "DrainInstance"
DELETE = "DeleteInstance"
WAIT_DRAIN = "WaitInstanceDrained"


def surplus(spec: PairSpec, pods: Iterable[PodView], generation: int) -> list[PodView]:
    """Live engine pods of `generation` at or above their role's count (a scale-down), highest index first."""
    out = [p for p in pods if p.generation == generation and not p.deleting and p.role in ENGINE_ROLES
           and p.instance >= spec.replicas[p.role]]
    return sorted(out, key=lambda p: (p.role != ROLE_PREFILL, -p.instance))


def router_drained(pod: PodView, router: RouterDrainView | None) -> bool:
    """Whether the router of `pod`'s generation says the draining `pod` is done: an answer about that generation
    (from its router pod, and the set it was pushed), read at or after the mark, that no longer lists the pod as one
    it may choose (draining, leaving, or gone from its set: the push that carried the mark was taken) and reports no
    request in flight involving it. From then on no request can reach it: only the operator's pushes change the
    router's set, and none lists a draining instance again. No view, another generation's, or one read before the
    mark: False (the deadline decides)."""
    return (router is not None and pod.draining_since is not None and router.generation == pod.generation
            and router.answered_generation == pod.generation and router.read_at >= pod.draining_since
            and pod.name not in router.choosable and router.involved.get(pod.name, 0) == 0)


def instance_step(spec: PairSpec, pods: Iterable[PodView], generation: int, now: float,
                  leased: Mapping[str, frozenset[int]] | None = None, serving: bool = False,
                  router: RouterDrainView | None = None) -> InstanceStep | None:
    """The next action on the instances beyond the first of `generation`, or None. Scale-down first (a draining
    instance's drain clock runs while the others start), then creation: decodes before prefills. `serving`: the
    generation heals alone (heals_alone), so a missing instance 0 is re-created here too, beside the serving
    ones, instead of recreate.py's ordered start. `router`: what the router of `generation` last answered (the
    executor's read; None: no router, or none read yet): a draining instance goes as soon as `router_drained`,
    else at its deadline."""
    pods = list(pods)
    going = surplus(spec, pods, generation)
    # Read only when something drains: the CRD defaults it, and a 1P1D spec never needs it.
    drain_seconds = spec.drain_seconds if going else 0.0
    waits: list[float] = []
    router_runs = any(p.role == ROLE_ROUTER and p.generation == generation and p.running and not p.deleting
                      for p in pods)
    for pod in going:
        if pod.draining_since is None:
            return InstanceStep(MARK_DRAINING, pod.role, pod.instance, pod.name,
                                message=f"scaling {pod.role} down: draining {pod.name}")
        left = pod.draining_since + drain_seconds - now
        drained = router_drained(pod, router)
        if left <= 0 or drained:
            if pod.role == ROLE_DECODE and any(p.role == ROLE_PREFILL and p.draining_since is not None and
                                               p.name != pod.name for p in going):
                continue  # prefills leave before decodes (no transfer to a decode that is gone); theirs is the wait
            if drained:
                why = (f"drained: its router reports no request in flight involving it, {now - pod.draining_since:.1f}"
                       f" s after the mark")
            else:
                count = router.involved.get(pod.name, 0) if router is not None else 0
                why = (f"drain deadline (spec.rollout.drainSeconds {drain_seconds:g} s) passed"
                       + (f" with {count} request(s) still involving it" if count else ""))
            return InstanceStep(DELETE, pod.role, pod.instance, pod.name,
                                message=f"scaling {pod.role} down: {pod.name} {why}; deleting it")
        waits.append(min(left, DRAIN_POLL_SECONDS) if router_runs else left)
    unleased: list[str] = []

    def missing(role: str) -> list[int]:
        present = {p.instance for p in pods if p.role == role and p.generation == generation}
        count = spec.router_replicas if role == ROLE_ROUTER else spec.replicas[role]
        out = [i for i in range(0 if serving else 1, count) if i not in present]
        # a deleted one is waited out (its name comes back)
        if leased is not None:
            unleased.extend(f"{role} {i}" for i in out if i not in leased.get(role, frozenset()))
            out = [i for i in out if i in leased.get(role, frozenset())]
        return out

    routers = [p for p in pods if p.role == ROLE_ROUTER and p.generation == generation]
    # Router replicas: more than spec.router.replicas go at once, the highest first (a router keeps no request past
    # its pod's end that the Service still sends it: the endpoint goes with the deletion); the missing ones are
    # created once router 0 exists (recreate.py makes it in the ordered start) or, in a serving generation, at
    # once, and before any engine instance when no router of the generation runs (the Service answers nothing).
    extra = sorted((p for p in routers if not p.deleting and p.instance >= spec.router_replicas),
                   key=lambda p: -p.instance)
    if extra:
        return InstanceStep(DELETE, ROLE_ROUTER, extra[0].instance, extra[0].name,
                            message=f"router replicas {spec.router_replicas}: deleting router {extra[0].name}")

    def router_step() -> InstanceStep | None:
        if not spec.router_enabled or not (serving or any(p.instance == 0 for p in routers)):
            return None
        for i in missing(ROLE_ROUTER)[:1]:
            return InstanceStep(CREATE, ROLE_ROUTER, i, message=f"creating router {i} (generation {generation})")
        return None

    if serving and not any(p.running for p in routers) and (step := router_step()) is not None:
        return step
    decodes = live_instances(pods, ROLE_DECODE, generation)
    prefills = live_instances(pods, ROLE_PREFILL, generation)
    if 0 in decodes or (serving and decodes):
        for i in missing(ROLE_DECODE)[:1]:
            return InstanceStep(CREATE, ROLE_DECODE, i, message=f"creating decode instance {i} (generation "
                                f"{generation})")
    if 0 in prefills or (serving and prefills):
        for i in missing(ROLE_PREFILL)[:1]:
            return InstanceStep(CREATE, ROLE_PREFILL, i, message=f"creating prefill instance {i} (generation "
                                f"{generation})")
    if (step := router_step()) is not None:
        return step
    if unleased:
        return InstanceStep(WAIT_DRAIN, "", -1, wait_seconds=min(waits) if waits else None,
                            message=f"no ports for {', '.join(unleased)}: the port pool is exhausted; the serving "
                            "instances keep theirs, the rest start when ports are free")
    if waits:
        return InstanceStep(WAIT_DRAIN, "", -1, wait_seconds=min(waits),
                            message=f"draining {len(waits)} instance(s) before deleting them (until the router "
                                    "reports no request involving each, at most spec.rollout.drainSeconds)")
    return None


# --- healing one instance: xPyD pairs that serve ------------------------------------------------------
@dataclass(frozen=True)
class Heal:
    """What `heal` decided for a serving xPyD generation: it keeps serving (phase Ready) while a failed or hung
    instance, or a router replica, is replaced alone, and while the pods a lost node took are replaced."""

    replace: PodView | None = None  # delete it now (its instance is re-created by instance_step once it is gone)
    # Pods on a lost node whose ports are fenced to them: force-deleted now (grace 0: their kubelet cannot confirm a
    # graceful end while the node is cut off), so their instances come back under the same names on Ready nodes
    force_delete: tuple[PodView, ...] = ()
    router_serving: bool = True  # False while no router serves (the Ready condition says so)
    restart_times: Mapping[str, tuple[float, ...]] | None = None  # the new per-instance record, when it changed
    wait_seconds: float | None = None  # a replacement in backoff: pass again no later
    message: str = ""
    serving: Mapping[str, int] = field(default_factory=dict)  # role -> instances serving (Ready, not draining)
    reason: str = ""  # the restart reason code of the replacement (health.RESTART_REASONS: the metric's label)
    replaced_role: str = ""  # the role of what is replaced (the metric's label)


def instance_key(pod: PodView) -> str:
    return f"{pod.role}-{pod.instance}"


def heals_alone(spec: PairSpec, status: Mapping[str, Any], generation: int) -> bool:
    """Whether failures of `generation` are healed one instance at a time: the pair runs more than one instance in
    some role (xPyD) and this generation has served (status says Ready at it; a Surge rollout's serving generation
    keeps that phase). A 1P1D pair, and any generation still starting, restarts in order as a whole (recreate.py)."""
    many = spec.engine_instances > 2
    return many and status.get("phase") == PHASE_READY and int(status.get("pairGeneration") or 0) == generation


def _failing(pod: PodView) -> bool:
    return pod.failed or pod.restarts > 0


def _names(pod: PodView, finding: Finding | None, generation: int) -> bool:
    return (finding is not None and finding.generation == generation and finding.pod == pod.name
            and (not finding.pod_uid or finding.pod_uid == pod.uid))


def heal(spec: PairSpec, pods: Iterable[PodView], generation: int, now: float,
         finding: Finding | None, restart_times: Mapping[str, tuple[float, ...]],
         router_wanted: bool, stranded: frozenset[str] = frozenset(),
         stranded_fenced: frozenset[str] = frozenset()) -> Heal | None:
    """For a generation that `heals_alone`, what to replace now, while every role keeps a serving instance:
      - the pods on a lost node (`stranded`; `stranded_fenced`: those whose ports are fenced to them), all at once,
        outside any budget: force-deleted once fenced, then re-created like any missing instance (the router too);
      - a failed engine pod, a container that restarted, or the pod a health finding names (hung, unreachable, a
        stale generation), one at a time, each under its own restart budget and backoff (spec.restartPolicy,
        restart_policy.py, per "<role>-<index>");
      - a router replica that failed, restarted or is named (budget "router-<index>"); a missing one is
        instance_step's to create (before the engines when no router runs).
    None when the generation cannot go on serving alone and must restart in order as a whole: a role would have no
    serving instance left, or an instance (or the router) spent its budget (the pair's own budget then counts the
    restart)."""
    pods = [p for p in pods if p.generation == generation]
    lost = [p for p in pods if p.name in stranded]
    engines = [p for p in pods if p.role in ENGINE_ROLES and not p.deleting and p.name not in stranded]
    named = next((p for p in engines if _names(p, finding, generation)), None)
    # A draining instance (a scale-down chose it) is going anyway: instance_step deletes it after its drain, and it
    # is not re-created, so its failure is neither a replacement nor a charge on its budget.
    failing = [p for p in engines if p.draining_since is None and (_failing(p) or p is named)]
    serving = {role: sum(1 for p in engines if p.role == role and p.running and p.ready and
                         p.draining_since is None and p not in failing) for role in ENGINE_ROLES}
    if any(count == 0 for count in serving.values()):
        return None
    routers = [p for p in pods if p.role == ROLE_ROUTER and not p.deleting and p.name not in stranded]
    router_serving = not router_wanted or any(p.running and p.ready and not _failing(p) for p in routers)
    if lost:
        fenced = tuple(p for p in lost if p.name in stranded_fenced)
        where = ", ".join(sorted({p.node for p in lost}))
        what = ", ".join(f"{p.role} {p.instance}" for p in sorted(lost, key=lambda p: (p.role, p.instance)))
        if fenced:
            return Heal(force_delete=fenced, serving=serving, router_serving=router_serving, reason=REASON_NODE_LOST,
                        replaced_role=fenced[0].role,
                        message=f"node {where} lost: replacing {what} alone on Ready nodes (force-deleted: their "
                                f"ports stay fenced to them); the other instances serve")
        return Heal(serving=serving, router_serving=router_serving, wait_seconds=1.0,
                    message=f"node {where} lost: {what} wait for their ports to be fenced before they are replaced")
    policy = RestartPolicy.from_spec(spec.get("restartPolicy"))
    # Routers first: a failed one is out of the Service already, but the replicas left carry all the load.
    candidates = sorted((p for p in routers if router_wanted and (_failing(p) or _names(p, finding, generation))),
                        key=lambda p: p.instance)
    candidates += sorted(failing, key=lambda p: (p.role != ROLE_DECODE, p.instance))
    waits: list[float] = []
    for pod in candidates:
        key = instance_key(pod)
        earlier = restart_times.get(key, ())
        is_named = _names(pod, finding, generation)
        code = (finding.reason if is_named and finding is not None else
                REASON_POD_FAILED if pod.failed else REASON_CONTAINER_RESTART)
        why = (finding.message if is_named and finding is not None else
               f"{pod.role} pod {pod.name} {pod.phase.lower()}" if pod.failed else
               f"{pod.role} pod {pod.name} container restarted {pod.restarts}x")
        decision = decide(policy, earlier, now)
        if decision.action == Action.BUDGET_EXHAUSTED:
            return None
        if decision.action == Action.WAIT and decision.not_before is not None:
            waits.append(decision.not_before - now)
            continue
        record = {k: v for k, v in restart_times.items() if restarts_in_window(policy, v, now)}
        record[key] = tuple(prune(policy, list(earlier) + [now], now))
        what = f"router {pod.instance}" if pod.role == ROLE_ROUTER else f"{pod.role} instance {pod.instance}"
        return Heal(replace=pod, restart_times=record, serving=serving, reason=code, replaced_role=pod.role,
                    router_serving=not router_wanted or any(p.running and p.ready and not _failing(p)
                                                            for p in routers if p is not pod),
                    message=f"replacing {what} alone ({why}); {decision.message} for this instance")
    if waits:
        return Heal(wait_seconds=min(waits), serving=serving, router_serving=router_serving,
                    message=f"{len(waits)} failed instance(s) wait for their restart backoff")
    if not router_serving:
        return Heal(serving=serving, router_serving=False,
                    message="no router serves: waiting for a router pod to be Ready" if routers else
                    "no router runs: re-creating the router with the serving instances")
    return Heal(serving=serving)


@dataclass(frozen=True)
class InstancesPlan:
    """What a pass decides about the instances of one generation, at once (`plan_instances`); recreate.py joins it
    to instance 0's ordered steps."""

    heal: Heal | None  # the generation heals alone (heal's answer); None: it does not, or must restart in order
    step: InstanceStep | None  # the next action on the instances beyond the first (instance_step)
    role_status: Mapping[str, Any]  # status.prefill and status.decode


def plan_instances(spec: PairSpec, status: Mapping[str, Any], observed: Observed, generation: int) -> InstancesPlan:
    """Every decision about the instances of `generation`: whether a failed one is replaced alone (`heal`, when the
    generation `heals_alone`, with its per-instance restart record), the next scale or drain action
    (`instance_step`: a generation that heals alone re-creates a missing instance 0 too) and its role status."""
    pods = observed.pods
    healed = None
    if heals_alone(spec, status, generation):
        earlier = observed.instance_restart_times if observed.instance_restarts_generation == generation else {}
        healed = heal(spec, pods, generation, observed.now, observed.health, earlier, spec.router_enabled,
                      observed.stranded, observed.stranded_fenced)
    step = instance_step(spec, pods, generation, observed.now, observed.leased_instances, serving=healed is not None,
                         router=observed.router_views.get(generation))
    return InstancesPlan(healed, step, role_status(spec, pods, generation))


def prefill_peers(pods: Iterable[PodView], generation: int) -> list[PodView]:
    """The decodes a prefill of `generation` is given: that generation's, running (an address), by index. A draining
    decode stays until its pod stops: the router no longer sends it requests, but one it sent just before the mark
    still has its KV pushed there by a prefill."""
    return sorted((p for p in pods if p.role == ROLE_DECODE and p.generation == generation and p.running),
                  key=lambda p: p.instance)


def peers_digest(entries: Iterable[str]) -> str:
    """A short, order-free digest of a pushed set (its members' addresses): the pod annotation
    pdpair.io/peers-digest records what the pod was last told, so a push is sent only when the set changes."""
    return hashlib.sha256("\n".join(sorted(entries)).encode()).hexdigest()[:16]


def router_members(pods: Iterable[PodView], generation: int) -> list[PodView]:
    """The engine instances the router of `generation` sends to: its generation's, Ready, not draining. A decode
    that is Ready has been probed listening or is paired with a Ready prefill (recreate.py's gates)."""
    return sorted((p for p in pods if p.role in ENGINE_ROLES and p.generation == generation and p.running
                   and p.ready and p.draining_since is None), key=lambda p: (p.role, p.instance))


def role_status(spec: PairSpec, pods: Iterable[PodView], generation: int,
                scale_targets: Mapping[str, str] | None = None) -> dict[str, Any]:
    """status.prefill and status.decode, from the plan's generation: desired (the effective count), ready (Ready
    and not draining), readyOfDesired (the P and D printer columns) and each instance's pod."""
    pods = list(pods)
    out: dict[str, Any] = {}
    for role in ENGINE_ROLES:
        desired = spec.replicas[role]
        role_pods = sorted((p for p in pods if p.role == role and p.generation == generation),
                           key=lambda p: (p.instance, p.deleting))
        ready = sum(1 for p in role_pods if p.ready and p.running and p.draining_since is None)
        entry: dict[str, Any] = {
            "desired": desired,
            "ready": ready,
            "readyOfDesired": f"{ready}/{desired}",
            "instances": [{"index": p.instance, "pod": p.name, "generation": p.generation, "ready": p.ready,
                           **({"draining": True} if p.draining_since is not None or p.deleting else {})}
                          for p in role_pods][:64],
        }
        if scale_targets and scale_targets.get(role):
            entry["scaleTarget"] = scale_targets[role]
        out[role] = entry
    return out


__all__ = ["DRAIN_POLL_SECONDS", "Heal", "InstanceStep", "InstancesPlan", "heal", "plan_instances", "router_drained", "heals_alone", "instance_key", "instance_step", "live_instances", "prefill_peers", "role_status", "router_members",
           "surplus", "CREATE", "DELETE", "MARK_DRAINING", "WAIT_DRAIN"]
