"""xPyD: the instances of a role beyond the first, and what each pod is told (pure: no client, the clock only as
`now`). docs/xpyd.md is the design; this module is the part of it the planner runs.

Instance 0 of each role goes through desired.py's ordered steps exactly as a 1P1D pair always did (decode, prefill
beside it once decode runs, router, the listener gate, Ready); a pair with `replicas: 1` on both roles never reaches
anything here. The other instances (`spec.<role>.replicas` > 1, as the executor's effective spec says: a role's
scale object wins over the inline count, scale_targets.py) are planned by `instance_step`, one action per pass,
after desired.py's own action (it never overrides one):
  - decode i >= 1 is created as soon as decode 0 exists: every decode loads at once (the parallel start);
  - prefill i >= 1 once a decode of its generation runs (has an address), like prefill 0;
  - an instance at or above its role's count (a scale-down: the highest indexes go, like a StatefulSet) is first
    marked draining (annotation pdpair.io/draining-since on the pod, the executor's write): from that pass on it is
    in no push, so the router sends it nothing new and no prefill starts a new transfer to it (a decode left out of a
    prefill's set keeps its edge until the pushes in flight end: the connector's rule); after
    `spec.rollout.drainSeconds` it is deleted, a prefill or router before any decode (desired.teardown's order);
    its port leases are released only once the pod is gone (leases.py counts live pods' instances).
The pushes (`prefill_peers`, `router_members`): a prefill is given every decode of its own generation that runs and
is not draining (never another generation's: the pairing stays revision-coherent); the router every instance of
its generation that is Ready and not draining. The executor sends them (push.py) whenever they differ from what the
pod was last told.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from pdpair.contract import ROLE_DECODE, ROLE_PREFILL

from . import spec_fields
from .observed import PodView

ENGINE_ROLES = (ROLE_DECODE, ROLE_PREFILL)


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


def surplus(spec: Mapping[str, Any], pods: Iterable[PodView], generation: int) -> list[PodView]:
    """Live engine pods of `generation` at or above their role's count (a scale-down), highest index first."""
    out = [p for p in pods if p.generation == generation and not p.deleting and p.role in ENGINE_ROLES
           and p.instance >= spec_fields.replicas(spec, p.role)]
    return sorted(out, key=lambda p: (p.role != ROLE_PREFILL, -p.instance))


def instance_step(spec: Mapping[str, Any], pods: Iterable[PodView], generation: int, now: float,
                  leased: Mapping[str, frozenset[int]] | None = None) -> InstanceStep | None:
    """The next action on the instances beyond the first of `generation`, or None. Scale-down first (a draining
    instance's drain clock runs while the others start), then creation: decodes before prefills."""
    pods = list(pods)
    going = surplus(spec, pods, generation)
    # Read only when something drains: the CRD defaults it (spec_fields), and a 1P1D spec never needs it.
    drain_seconds = float(spec_fields.defaulted(spec, "rollout", "drainSeconds")) if going else 0.0
    waits: list[float] = []
    for pod in going:
        if pod.draining_since is None:
            return InstanceStep(MARK_DRAINING, pod.role, pod.instance, pod.name,
                                message=f"scaling {pod.role} down: draining {pod.name}")
        left = pod.draining_since + drain_seconds - now
        if left <= 0:
            if pod.role == ROLE_DECODE and any(p.role == ROLE_PREFILL and p.draining_since is not None and
                                               p.name != pod.name for p in going):
                continue  # prefills leave before decodes (no transfer to a decode that is gone)
            return InstanceStep(DELETE, pod.role, pod.instance, pod.name,
                                message=f"scaling {pod.role} down: {pod.name} drained, deleting it")
        waits.append(left)
    unleased: list[str] = []

    def missing(role: str) -> list[int]:
        present = {p.instance for p in pods if p.role == role and p.generation == generation}
        out = [i for i in range(1, spec_fields.replicas(spec, role)) if i not in present]  # a deleted one is
        # waited out (its name comes back)
        if leased is not None:
            unleased.extend(f"{role} {i}" for i in out if i not in leased.get(role, frozenset()))
            out = [i for i in out if i in leased.get(role, frozenset())]
        return out

    decodes = live_instances(pods, ROLE_DECODE, generation)
    if 0 in decodes:
        for i in missing(ROLE_DECODE)[:1]:
            return InstanceStep(CREATE, ROLE_DECODE, i, message=f"creating decode instance {i} (generation "
                                f"{generation})")
    if any(p.running for p in decodes.values()) and 0 in live_instances(pods, ROLE_PREFILL, generation):
        for i in missing(ROLE_PREFILL)[:1]:
            return InstanceStep(CREATE, ROLE_PREFILL, i, message=f"creating prefill instance {i} (generation "
                                f"{generation})")
    if unleased:
        return InstanceStep(WAIT_DRAIN, "", -1, wait_seconds=min(waits) if waits else None,
                            message=f"no ports for {', '.join(unleased)}: the port pool is exhausted; the serving "
                            "instances keep theirs, the rest start when ports are free")
    if waits:
        return InstanceStep(WAIT_DRAIN, "", -1, wait_seconds=min(waits),
                            message=f"draining {len(waits)} instance(s) before deleting them")
    return None


def prefill_peers(pods: Iterable[PodView], generation: int) -> list[PodView]:
    """The decodes a prefill of `generation` is given: that generation's, running (an address), not draining; by
    index."""
    return sorted((p for p in pods if p.role == ROLE_DECODE and p.generation == generation and p.running
                   and p.draining_since is None), key=lambda p: p.instance)


def peers_digest(entries: Iterable[str]) -> str:
    """A short, order-free digest of a pushed set (its members' addresses): the pod annotation
    pdpair.io/peers-digest records what the pod was last told, so a push is sent only when the set changes."""
    return hashlib.sha256("\n".join(sorted(entries)).encode()).hexdigest()[:16]


def router_members(pods: Iterable[PodView], generation: int) -> list[PodView]:
    """The engine instances the router of `generation` sends to: its generation's, Ready, not draining. A decode
    that is Ready has been probed listening or is paired with a Ready prefill (desired.py's gates)."""
    return sorted((p for p in pods if p.role in ENGINE_ROLES and p.generation == generation and p.running
                   and p.ready and p.draining_since is None), key=lambda p: (p.role, p.instance))


def role_status(spec: Mapping[str, Any], pods: Iterable[PodView], generation: int,
                scale_targets: Mapping[str, str] | None = None) -> dict[str, Any]:
    """status.prefill and status.decode, from the plan's generation: desired (the effective count), ready (Ready
    and not draining), readyOfDesired (the P and D printer columns) and each instance's pod."""
    pods = list(pods)
    out: dict[str, Any] = {}
    for role in ENGINE_ROLES:
        desired = spec_fields.replicas(spec, role)
        mine = sorted((p for p in pods if p.role == role and p.generation == generation),
                      key=lambda p: (p.instance, p.deleting))
        ready = sum(1 for p in mine if p.ready and p.running and p.draining_since is None)
        entry: dict[str, Any] = {
            "desired": desired,
            "ready": ready,
            "readyOfDesired": f"{ready}/{desired}",
            "instances": [{"index": p.instance, "pod": p.name, "generation": p.generation, "ready": p.ready,
                           **({"draining": True} if p.draining_since is not None or p.deleting else {})}
                          for p in mine][:64],
        }
        if scale_targets and scale_targets.get(role):
            entry["scaleTarget"] = scale_targets[role]
        out[role] = entry
    return out


__all__ = ["InstanceStep", "instance_step", "live_instances", "prefill_peers", "role_status", "router_members",
           "surplus", "CREATE", "DELETE", "MARK_DRAINING", "WAIT_DRAIN"]
