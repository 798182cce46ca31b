"""Surge rollouts (spec.rolloutStrategy: Surge): a spec change of a serving pair never takes it down.

Pure like recreate.py (spec, status, observed, now -> Plan); `now` is epoch seconds passed in by the executor.
The rollout lives in status.rollout, so a restarted operator carries on where the last one stopped:

  (no rollout)  the serving generation F is Ready and the spec changed, or a pod of F sits on a cordoned node
                (nodes.cordoned: kubectl cordon/drain; same spec, a re-home)  -> Progressing (RollingOut Event)
  Progressing   generation T = F+1 goes through recreate.py's steps 3-7 (decode, listener probe, prefill, router)
                beside F, on the pair's other port set (port_leaser.py slots "a"/"b"); the router Service keeps
                selecting F's router. When T is Ready: status.pairGeneration = T, status.ports = T's ports, the
                Service selects T's router                                 -> Draining (RolloutSwitched)
                T failed (a pod Failed or restarted, or the API server refused one), was not Ready within
                spec.rollout.progressDeadlineSeconds, or its ports found no room: status.failedRollout records the spec hash (never retried until the spec
                changes again), Progressing=False RolloutFailed             -> RollingBack (RolloutFailed)
                the spec changed again                                     -> RollingBack (no failure recorded)
  Draining      F's in-flight requests get spec.rollout.drainSeconds after the switch; then F's prefill and
                router are deleted, then its decode; once gone its port set is released -> done (RolloutDrained)
  RollingBack   T's pods are deleted (prefill and router first), then its port set is released -> done

"Done" is one status write (no status.rollout) and then the release of the set. A pass that dies between the two
leaves that set leased with no rollout naming it; release_left_slot plans its release in a later pass.

The serving generation's own failures keep the Recreate restart path (the executor's restart policy): a restart
abandons the rollout, and the new generation is built from the current spec on the serving port set.
A spec change of a pair that is not Ready (nothing serves) is a Recreate rollout whatever the strategy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from pdpair.contract import (
    COND_PROGRESSING,
    PURPOSE_HTTP,
    ROLE_ROUTER,
)

from pdpair.operator.decide import recreate as d
from pdpair.operator.decide import nodes
from pdpair.operator.model.observed import Observed
from pdpair.operator.decide.port_blocks import DEFAULT_SLOT, other_slot, port_of
from pdpair.operator.model.pair_spec import PairSpec
from pdpair.operator.model.conditions import FALSE, TRUE, Condition
from pdpair.operator.model.timestamps import epoch, rfc3339

PHASE_PROGRESSING = "Progressing"
PHASE_DRAINING = "Draining"
PHASE_ROLLING_BACK = "RollingBack"
ACTIVE_PHASES = (PHASE_PROGRESSING, PHASE_DRAINING, PHASE_ROLLING_BACK)

STEP_ROLLOUT_START = "RolloutStart"
STEP_ROLLOUT_LEASE_PORTS = "RolloutLeasePorts"
STEP_ROLLOUT_SWITCH = "RolloutSwitch"
STEP_ROLLOUT_DRAIN = "RolloutDrain"  # the old generation serves its in-flight requests
STEP_ROLLOUT_DELETE = "RolloutDeletePods"  # the old (or failed) generation's pods go, prefill and router first
STEP_ROLLOUT_WAIT_GONE = "RolloutWaitGone"
STEP_ROLLOUT_DONE = "RolloutDone"

EVENT_ROLLING_OUT = "RollingOut"
EVENT_SWITCHED = "RolloutSwitched"
EVENT_DRAINED = "RolloutDrained"
EVENT_FAILED = "RolloutFailed"
EVENT_ROLLED_BACK = "RolloutRolledBack"


def active_rollout(status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    rollout = status.get("rollout")
    return rollout if isinstance(rollout, Mapping) and rollout.get("phase") in ACTIVE_PHASES else None


def serving_slot(status: Mapping[str, Any]) -> str:
    """The port set of status.pairGeneration (status.ports)."""
    return str(status.get("portSlot") or DEFAULT_SLOT)


def other_generation(status: Mapping[str, Any]) -> tuple[int, str] | None:
    """(generation, port set) of a rollout's generation that does not serve: the new one while Progressing or
    RollingBack, the old one while Draining. None without a rollout."""
    rollout = active_rollout(status)
    if rollout is None:
        return None
    if rollout["phase"] == PHASE_DRAINING:
        return int(rollout["fromGeneration"]), other_slot(str(rollout["portSlot"]))
    return int(rollout["toGeneration"]), str(rollout["portSlot"])


def serving_generation(status: Mapping[str, Any], pods) -> int:
    """The generation the pair serves with: status.pairGeneration during a rollout (pods of the new generation
    exist beside it), else the highest generation seen (recreate.current_generation)."""
    if active_rollout(status) is not None and status.get("pairGeneration"):
        return int(status["pairGeneration"])
    return d.current_generation(status, pods)


@dataclass(frozen=True)
class Generations:
    """Which generation serves and which one a rollout has beside it, on which port set: read from status (and the
    pods) once per pass (`generations`), for the lease steps and the listener probes."""

    serving: int  # serving_generation
    serving_slot: str  # its port set (status.ports)
    other: tuple[int, str] | None  # other_generation: (generation, port set) of the one that does not serve
    rollout: Mapping[str, Any] | None  # active_rollout: status.rollout while a rollout runs


def generations(status: Mapping[str, Any], pods) -> Generations:
    slot, other, rollout = serving_slot(status), other_generation(status), active_rollout(status)
    return Generations(serving_generation(status, pods), slot, other, rollout)


def _progressing(status: str, reason: str, message: str) -> Condition:
    return Condition(COND_PROGRESSING, status, reason, message[:32768])


def _without(observed: Observed, generation: int) -> Observed:
    return dataclasses.replace(observed, pods=tuple(p for p in observed.pods if p.generation != generation),
                               restart_reason=None)


def surge_plan(spec: PairSpec, status: Mapping[str, Any], observed: Observed,
               now: float | None) -> d.Plan | None:
    """The plan while a Surge rollout runs or starts; None: recreate.recreate_state plans."""
    rollout = active_rollout(status)
    if rollout is None:
        return _maybe_start(spec, status, observed, now)
    if observed.restart_reason:
        # The serving generation restarts (the executor's restart policy decided): Recreate takes over from every
        # generation; the rollout only finishes off its other generation's port set once those pods are gone.
        plan = d.recreate_state(spec, status, observed)
        if rollout["phase"] == PHASE_PROGRESSING:
            rollout = {**rollout, "phase": PHASE_ROLLING_BACK,
                       "message": f"abandoned: the serving generation restarts ({observed.restart_reason})"[:1024]}
        return dataclasses.replace(plan, status_fields={"rollout": dict(rollout)})
    # the rollout's clocks (status.rollout.startedAt, switchedAt; None: absent or spoiled)
    started, switched = epoch(rollout.get("startedAt")), epoch(rollout.get("switchedAt"))
    if rollout["phase"] == PHASE_PROGRESSING:
        return _progress(spec, status, observed, now, rollout, started)
    return _finish(spec, status, observed, now, rollout, switched)


def _maybe_start(spec: PairSpec, status: Mapping[str, Any], observed: Observed,
                 now: float | None) -> d.Plan | None:
    if not spec.surge or observed.restart_reason or not observed.ports_complete:
        return None
    want = spec.fingerprint
    generation = d.current_generation(status, observed.pods)
    if any(p.generation != generation for p in observed.pods):
        return None  # older pods are still being replaced (a Recreate in progress)
    serving = [p for p in observed.pods if not p.deleting]
    # A pod on a cordoned node (kubectl cordon / drain) moves with a rollout of the same spec: the new generation's
    # pods are scheduled elsewhere (the node is unschedulable), then this one is drained and deleted by us. The
    # pair's PodDisruptionBudget refuses the drain's evictions meanwhile, so the drain ends once we are done.
    moving = nodes.cordoned_pods(serving, observed.nodes)
    if not serving or (all(p.spec_hash == want for p in serving) and not moving):
        return None
    plan = d.recreate_state(spec, status, observed, pin_generation=generation)
    failed = status.get("failedRollout") or {}
    if failed.get("specHash") == want:
        # This spec failed as a new generation: keep serving the old one until the spec changes again.
        message = f"rollout of this spec failed: {failed.get('reason', '')}; change the spec to try again"
        return dataclasses.replace(plan, conditions=plan.conditions + (_progressing(FALSE, "RolloutFailed", message),))
    if plan.phase != d.PHASE_READY:
        return None  # nothing serves yet: nothing to protect, Recreate (an xPyD scale step beside Ready serves)
    to = generation + 1
    slot = other_slot(serving_slot(status))
    message = f"rolling out generation {to} beside generation {generation} (Surge), decode first"
    why = "spec changed"
    if all(p.spec_hash == want for p in serving):
        why = nodes.describe_cordoned(moving)
        message = f"re-homing: {message}, on schedulable nodes"
    started = rfc3339(now if now is not None else 0.0)
    return dataclasses.replace(
        plan,
        step=STEP_ROLLOUT_START,
        create=None, create_instance=0, mark_draining=(), delete=(),  # a pending scale step waits for the rollout
        message=message,
        conditions=plan.conditions + (_progressing(TRUE, "RollingOut", message),),
        status_fields={
            "rollout": {"fromGeneration": generation, "toGeneration": to, "phase": PHASE_PROGRESSING, "specHash": want,
                        "portSlot": slot, "startedAt": started, "message": message},
            "failedRollout": None,
        },
        events=(("Normal", EVENT_ROLLING_OUT, f"{why}: {message}"[:1024]),),
    )


def _progress(spec: PairSpec, status: Mapping[str, Any], observed: Observed, now: float | None,
              rollout: Mapping[str, Any], started: float | None) -> d.Plan:
    old, new = int(rollout["fromGeneration"]), int(rollout["toGeneration"])
    # What the steps below read, first: the serving generation's plan and the new one's (pure: planned even when a
    # step below does not use it)
    serving = d.recreate_state(spec, status, _without(observed, new), pin_generation=old)
    new_only = Observed(
        pods=tuple(p for p in observed.pods if p.generation == new), ports_complete=True,
        decode_listening=observed.rollout_decode_listening, probe_message=observed.rollout_probe_message)
    bring = d.recreate_state(spec, {"pairGeneration": new}, new_only, pin_generation=new)
    service_port = status.get("servicePort") or port_of(status.get("ports") or [], ROLE_ROUTER, PURPOSE_HTTP)
    if serving.step == d.STEP_BROKEN:
        return dataclasses.replace(serving, status_fields={"rollout": dict(rollout)})
    if rollout.get("specHash") != spec.fingerprint:
        return _roll_back(serving, rollout, f"the spec changed again during the rollout to generation {new}",
                          failed=False, now=now)
    reason = d.broken_reason(observed.pods, new)
    if reason:
        return _roll_back(serving, rollout, f"generation {new} failed: {reason}", failed=True, now=now)
    deadline = spec.progress_deadline_seconds
    left = None if (now is None or started is None) else started + deadline - now
    if left is not None and left <= 0:
        return _roll_back(serving, rollout, f"generation {new} was not Ready within {deadline:.0f}s "
                                            "(spec.rollout.progressDeadlineSeconds)", failed=True, now=now)
    if observed.rollout_rejection:
        return _roll_back(serving, rollout, f"generation {new}: {observed.rollout_rejection}", failed=True, now=now)
    if observed.rollout_pool_exhausted:
        return _roll_back(serving, rollout, "no room in the port pool for a second generation: "
                                            f"{observed.rollout_pool_message}", failed=True, now=now)

    def going(step: str, message: str, **kw: Any) -> d.Plan:
        message = f"rolling out generation {new}: {message}"
        return dataclasses.replace(
            serving, **{"delete": (), "create": None, "create_instance": 0, "mark_draining": (), "probe_decode": False,
                        **kw}, step=step, message=message,
            conditions=serving.conditions + (_progressing(TRUE, "RollingOut", message),),
            status_fields={"rollout": {**rollout, "message": message[:1024]}}, wait_seconds=left)

    if not observed.rollout_ports_complete:
        return going(STEP_ROLLOUT_LEASE_PORTS, "leasing its ports (the pair's second port set)")
    if bring.step != d.STEP_READY:
        # xPyD: the new generation's other instances too (instances.py), on its port set; its scale-down waits
        return going(bring.step, bring.message, create=bring.create, create_instance=bring.create_instance,
                     create_generation=new, create_slot=str(rollout["portSlot"]), probe_decode=bring.probe_decode)

    drain = spec.drain_seconds
    message = f"generation {new} is Ready and serves; generation {old} drains for {drain:.0f}s"
    return dataclasses.replace(
        bring,
        step=STEP_ROLLOUT_SWITCH,
        message=message,
        conditions=bring.conditions + (_progressing(TRUE, "Draining", message),),
        status_fields={
            "rollout": {**rollout, "phase": PHASE_DRAINING, "switchedAt": rfc3339(now or 0.0), "message": message},
            "portSlot": str(rollout["portSlot"]),
            **({"servicePort": int(service_port)} if service_port else {}),
        },
        switch_ports=True,
        events=(("Normal", EVENT_SWITCHED, f"the router Service now selects generation {new}; {message}"),),
        wait_seconds=drain,
    )


def _roll_back(serving: d.Plan, rollout: Mapping[str, Any], reason: str, failed: bool, now: float | None) -> d.Plan:
    new = int(rollout["toGeneration"])
    message = f"rolling back generation {new}: {reason}; generation {rollout['fromGeneration']} keeps serving"
    fields: dict[str, Any] = {"rollout": {**rollout, "phase": PHASE_ROLLING_BACK, "message": message[:1024]}}
    if failed:
        fields["failedRollout"] = {"specHash": rollout.get("specHash", ""), "generation": new,
                                   "reason": reason[:1024], "time": rfc3339(now or 0.0)}
    condition = _progressing(FALSE, "RolloutFailed", message) if failed else _progressing(TRUE, "Superseded", message)
    return dataclasses.replace(
        serving, message=message, delete=(), create=None, create_instance=0, mark_draining=(), probe_decode=False,
        conditions=serving.conditions + (condition,), status_fields=fields,
        events=((("Warning", EVENT_FAILED, message),) if failed else ()))


def _finish(spec: PairSpec, status: Mapping[str, Any], observed: Observed, now: float | None,
            rollout: Mapping[str, Any], switched: float | None) -> d.Plan:
    """Draining or RollingBack: the generation that does not serve goes, then its port set."""
    gone_generation, gone_slot = other_generation(status)  # type: ignore[misc]
    draining = rollout["phase"] == PHASE_DRAINING
    serving_generation = int(rollout["toGeneration"] if draining else rollout["fromGeneration"])
    # What the steps below read, first: the serving generation's plan, the gone one's teardown
    superseded = int(status.get("pairGeneration") or 0) != serving_generation
    # Superseded: a restart superseded the rollout, and Recreate replaces every older generation, this one included
    serving = (d.recreate_state(spec, status, observed) if superseded else
               d.recreate_state(spec, status, _without(observed, gone_generation), pin_generation=serving_generation))
    left_pods = [p for p in observed.pods if p.generation == gone_generation and p.name not in observed.fenced]
    going = d.teardown(left_pods)
    if (serving.delete or serving.create) if superseded else serving.step == d.STEP_BROKEN:
        return dataclasses.replace(serving, status_fields={"rollout": dict(rollout)})
    failed = status.get("failedRollout") or {}
    if draining:
        condition = _progressing(TRUE, "Draining", str(rollout.get("message", "")))
    elif int(failed.get("generation") or -1) == gone_generation:
        condition = _progressing(FALSE, "RolloutFailed", str(rollout.get("message", "")))
    else:
        condition = _progressing(TRUE, "Superseded", str(rollout.get("message", "")))

    def step(name: str, message: str, **kw: Any) -> d.Plan:
        return dataclasses.replace(
            serving, step=name, message=message, delete=kw.pop("delete", ()), create=None, create_instance=0,
            mark_draining=(), probe_decode=False,
            conditions=serving.conditions + (kw.pop("condition", condition),), **kw)

    if draining:
        left = None if (now is None or switched is None) else switched + spec.drain_seconds - now
        if left is not None and left > 0:
            return step(STEP_ROLLOUT_DRAIN, f"generation {gone_generation} drains in-flight requests ({left:.0f}s left)",
                        status_fields={"rollout": dict(rollout)}, wait_seconds=left)
    if left_pods:
        to_delete = going.delete
        what = "prefill and router" if going.front else "decode"
        message = f"generation {gone_generation}: deleting its {what}" if to_delete else \
            f"waiting until generation {gone_generation}'s pods are gone"
        return step(STEP_ROLLOUT_DELETE if to_delete else STEP_ROLLOUT_WAIT_GONE, message, delete=to_delete,
                    status_fields={"rollout": {**rollout, "message": message}})
    if draining:
        message = f"rollout to generation {serving_generation} done; generation {gone_generation} drained and deleted"
        events = (("Normal", EVENT_DRAINED, message),)
        done = _progressing(TRUE, "RolloutComplete", message)
    else:
        message = f"generation {gone_generation} rolled back; {rollout.get('message', '')}"
        events = (("Normal", EVENT_ROLLED_BACK, message),)
        done = condition
    return step(STEP_ROLLOUT_DONE, serving.message, condition=done, status_fields={"rollout": None},
                release_slot=gone_slot, events=events)


def release_left_slot(plan: d.Plan, status: Mapping[str, Any], observed: Observed) -> d.Plan:
    """`plan`, releasing a port set that a finished rollout left leased, when it is safe to.

    A rollout ends with a status write (status.rollout removed), then the executor releases the other generation's
    set (Plan.release_slot). A pass that dies between the two (an API error on a lease delete, a SIGKILL, lost
    leadership) leaves that set leased, and from then on nothing in status names it (other_generation() is None):
    without this, its ports stay taken until the pair is deleted. The leases are the truth, so the set is found
    among them (observed.leased_slots). It is released only when no pod can still be bound to it: no rollout before
    or after this pass (a pass that starts one leaves the set to it; PortLeaser.ensure adopts what fits), and every
    pod is of the plan's generation, which uses the serving set. The serving set itself is never released.
    """
    after = {**status, **plan.status_fields}
    if plan.release_slot or active_rollout(status) is not None or active_rollout(after) is not None:
        return plan
    if any(p.generation != plan.pair_generation and p.name not in observed.fenced for p in observed.pods):
        return plan  # an older generation's pod (a Recreate replacement, a pod the index still shows) may use it
    left = sorted(s for s in observed.leased_slots if s != serving_slot(after))
    return dataclasses.replace(plan, release_slot=left[0]) if left else plan
