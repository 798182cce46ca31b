"""The port-lease decisions of one pass. Pure: no client, no clock.

Before planning pod steps, a pass needs the pair's ports; this module decides what happens to their Leases, and
the executor (reconciler.py) carries it out with port_leaser.PortLeaser:

  - `serving_lease`: the serving generation's port set (status.ports) is leased to match the spec's blocks, or,
    while any pod built from another spec still exists (running or terminating, so possibly still bound to them),
    only read as it is. One rule for rollouts, TP changes and operator restarts alike.
  - per instance (xPyD): a set's blocks are those of the instances range(spec.<role>.replicas) and of every
    instance a pod on that set still has (`instances_on_set`), so a scale-down releases an instance's block only
    once its pod is gone, however long it takes to terminate. The spec given is the effective one (replicas as the
    scale targets say). With a pod on the set, a pool exhausted by a scale-up keeps the held blocks
    (`LeaseStep.hoard_nothing` False, port_leaser.PortLeaser.ensure): the serving instances keep their ports.
  - `rollout_lease`: a Surge rollout's other generation (surge.py) has its own port set: leased for the new spec
    while it comes up (Progressing), only read while it drains or rolls back; none without a rollout. Its release
    is a pod-step decision (Plan.release_slot), made with the pods.
  - `fences`: a pod on a lost node (nodes.py) may still run, bound to its ports, for as long as the partition
    lasts: the ports it declares that the pair holds (either port set) become fence Leases held until that pod
    object is gone (port_leaser.PortLeaser.fence, sweep_fences), and the pair is leased replacements. Any generation's pod:
    a stale one on a lost node fences as well as a current one.
  - `busy_ports`: ports the current generation's pods found busy on their node (busy_ports.py) that the pair still
    holds from the pool are quarantined and re-leased; fixed ones (spec.router.port, outside the pool) are only
    reported. `ports_replaced` says when every busy port is out of the pair's hands: then the planner restarts the
    pair on the new ports, outside the restart budget (each such restart consumed a quarantined port).

planner.lease_plan composes the first four for a pass; planner.plan takes `ports_replaced` through Observed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from pdpair.contract import MAX_REPLICAS, ROLE_DECODE, ROLE_PREFILL

from pdpair.operator.decide import busy_ports as busy
from pdpair.operator.decide import recreate as d
from pdpair.operator.decide.nodes import LostPods
from pdpair.operator.model.observed import PodView
from pdpair.operator.decide import surge
from pdpair.operator.model import spec_fields
from pdpair.operator.model.config import PortPool
from pdpair.operator.decide.port_blocks import PortBlock, required_blocks

LEASE = "Lease"  # adopt, claim and release so that the set holds exactly `blocks`
KEEP = "Keep"  # pods of another spec may still be bound to the set: read what is held, change nothing


@dataclass(frozen=True)
class LeaseStep:
    """What to do with one port set of the pair this pass."""

    mode: str  # LEASE or KEEP
    slot: str  # the port set (ports.PORT_SLOTS)
    blocks: tuple[PortBlock, ...]  # what the spec needs (LEASE leases exactly these)
    generation: int | None = None  # the rollout generation the set belongs to (None: the serving one)
    # ensure(hoard_nothing=...): with no pod on the set, an exhausted pool releases everything (a waiting pair
    # hoards nothing); with pods on it, the held blocks stay theirs and only the new claim is given back
    hoard_nothing: bool = True

    @property
    def leasing(self) -> bool:
        return self.mode == LEASE


@dataclass(frozen=True)
class Quarantine:
    """One pod's busy-port report and what to do about it."""

    report: busy.PortsInUse
    ports: tuple[int, ...]  # pool ports the pair holds: quarantine them on report.node, lease replacements
    fixed: tuple[int, ...]  # ports the operator cannot change: report only (the pod's failure takes the budget path)


def instances_on_set(spec: Mapping[str, Any], pods: Iterable[PodView]) -> dict[str, tuple[int, ...]]:
    """Per engine role, the instances whose blocks a port set holds: range(spec.<role>.replicas), plus the instance
    of every pod on the set (`pods`: those on it), running or being deleted (it may be bound to its ports until it
    is gone). A pod label outside the CRD's range is not an instance the operator made: ignored."""
    pods = tuple(pods)
    return {role: tuple(sorted(set(range(spec_fields.replicas(spec, role))) |
                               {p.instance for p in pods if p.role == role and 0 <= p.instance < MAX_REPLICAS}))
            for role in (ROLE_DECODE, ROLE_PREFILL)}


def serving_lease(spec: Mapping[str, Any], status: Mapping[str, Any], pods: Iterable[PodView]) -> LeaseStep:
    pods = tuple(pods)
    want = d.spec_fingerprint(spec)
    mode = KEEP if any(p.spec_hash != want for p in pods) else LEASE
    # Every generation is on the serving set (Recreate keeps its ports across generations) but a Surge rollout's
    # other one, which has the other set (rollout_lease).
    other = surge.other_generation(status)
    on_set = tuple(p for p in pods if other is None or p.generation != other[0])
    return LeaseStep(mode, surge.serving_slot(status), required_blocks(spec, instances_on_set(spec, on_set)),
                     hoard_nothing=not on_set)


def rollout_lease(spec: Mapping[str, Any], status: Mapping[str, Any], pods: Iterable[PodView]) -> LeaseStep | None:
    other = surge.other_generation(status)
    if other is None:
        return None
    generation, slot = other
    active = surge.active_rollout(status) or {}
    want = d.spec_fingerprint(spec)
    on_set = tuple(p for p in pods if p.generation == generation)
    leasing = active.get("phase") == surge.PHASE_PROGRESSING and active.get("specHash") == want and all(
        p.spec_hash == want for p in on_set)
    return LeaseStep(LEASE if leasing else KEEP, slot, required_blocks(spec, instances_on_set(spec, on_set)),
                     generation, hoard_nothing=not on_set)


def busy_reports(status: Mapping[str, Any], pods: Iterable[PodView]) -> list[busy.PortsInUse]:
    """The busy-port reports of the serving generation's pods."""
    pods = tuple(pods)
    return busy.reports(pods, surge.serving_generation(status, pods))


def _fixed_ports(blocks: Iterable[PortBlock]) -> list[int]:
    return [b.fixed for b in blocks if b.fixed is not None]


def quarantines(reports: Iterable[busy.PortsInUse], held: Iterable[Mapping[str, Any]], blocks: Iterable[PortBlock],
                pool: PortPool) -> list[Quarantine]:
    """For each report, the ports to quarantine (held pool ports) and the ones only to report (fixed)."""
    held_ports = [int(p["port"]) for p in held]
    fixed = _fixed_ports(blocks)
    out = []
    for report in reports:
        todo = busy.plan(report.ports, held_ports, pool, fixed)
        out.append(Quarantine(report, todo.quarantine, todo.fixed))
    return out


def ports_replaced(reports: list[busy.PortsInUse], held: list[Mapping[str, Any]] | None,
                   blocks: Iterable[PortBlock], pool: PortPool) -> str | None:
    """What to say when the pods found busy ports that the pair no longer holds (all replaced), else None: the
    planner's cue for a restart on the new ports."""
    if not reports or held is None:
        return None
    if not all(q.ports == () and q.fixed == () for q in quarantines(reports, held, blocks, pool)):
        return None
    roles = sorted({r.role for r in reports})
    now_held = "; ".join(f"{role} ports {sorted(int(p['port']) for p in held if p['role'] == role)}"
                         for role in roles)
    return f"{'; '.join(r.describe() for r in reports)}; re-leased: {now_held}"


@dataclass(frozen=True)
class Fence:
    """One pod on a lost node and the ports the pair still holds of those it declares: fence them to it."""

    pod: PodView
    why: str  # why its node is lost (nodes.lost_reason)
    ports: tuple[int, ...]

    @property
    def pod_ref(self) -> str:
        """<namespace>/<name>/<uid> for the fence Lease (ANNOTATION_FENCED_POD)."""
        namespace = str(((self.pod.raw or {}).get("metadata") or {}).get("namespace") or "")
        return f"{namespace}/{self.pod.name}/{self.pod.uid}"


def fences(lost: LostPods, held: Iterable[Mapping[str, Any]], pool: PortPool) -> list[Fence]:
    """For each pod on a lost node, the held pool ports (status.ports entries of either port set) it declares; a
    pod none of whose ports the pair holds any more is left out (fenced already, or never bound to the pair's). A
    fixed port (spec.router.port, outside the pool) is not the operator's to fence: it is left as it is."""
    held_ports = {int(p["port"]) for p in held if int(p["port"]) in pool}
    out = []
    for pod in lost.pods:
        ports = tuple(sorted(set(pod.ports) & held_ports))
        if ports:
            out.append(Fence(pod, (lost.reasons or {}).get(pod.node, f"node {pod.node} is lost"), ports))
    return out


def fenced_pods(lost: LostPods, held_pool_ports: Iterable[int]) -> frozenset[str]:
    """The pods on lost nodes that count as gone for the order of a teardown: being deleted, and none of the pool
    ports the pair holds is one of theirs (all fenced to them). Until both hold they are waited for like any pod."""
    held = set(held_pool_ports)
    return frozenset(p.name for p in lost.pods if p.deleting and not set(p.ports) & held)
