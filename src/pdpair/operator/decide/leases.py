"""The port-lease decisions of one pass. Pure: no client, no clock.

Before planning pod steps, a pass needs the pair's ports; this module decides what happens to their Leases, and
the executor (reconciler.py) carries it out with port_leaser.PortLeaser:

  - `lease_steps` (serving): the serving generation's port set (status.ports) is leased to match the spec's blocks, or,
    while any pod built from another spec still exists (running or terminating, so possibly still bound to them),
    only read as it is. One rule for rollouts, TP changes and operator restarts alike.
  - per instance (xPyD): a set's blocks are those of the instances range(spec.<role>.replicas) and of every
    instance a pod on that set still has (`instances_on_set`), so a scale-down releases an instance's block only
    once its pod is gone, however long it takes to terminate. The spec given is the effective one (replicas as the
    scale targets say). With a pod on the set, a pool exhausted by a scale-up keeps the held blocks
    (`LeaseStep.hoard_nothing` False, port_leaser.PortLeaser.ensure): the serving instances keep their ports.
  - `lease_steps` (rollout): a Surge rollout's other generation (surge.py) has its own port set: leased for the new spec
    while it comes up (Progressing), only read while it drains or rolls back; none without a rollout. Its release
    is a pod-step decision (Plan.release_slot), made with the pods.
  - `fences`: a pod on a lost node (nodes.py) may still run, bound to its ports, for as long as the partition
    lasts: the ports it declares that the pair holds (either port set) become fence Leases held until that pod
    object is gone and its node is back (or deleted) (port_leaser.PortLeaser.fence, sweep_fences), and the pair is
    leased replacements. Any generation's pod:
    a stale one on a lost node fences as well as a current one.
  - busy ports (busy_ports.py: `quarantines`, `ports_replaced`): ports the current generation's pods found busy on
    their node that the pair still holds from the pool are quarantined and re-leased.

planner.prepare composes these for a pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from pdpair.contract import MAX_REPLICAS, MAX_ROUTER_REPLICAS, ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER

from pdpair.operator.decide.nodes import LostPods
from pdpair.operator.model.observed import PodView
from pdpair.operator.decide.surge import PHASE_PROGRESSING, Generations
from pdpair.operator.model.pair_spec import PairSpec
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


def instances_on_set(spec: PairSpec, pods: Iterable[PodView]) -> dict[str, tuple[int, ...]]:
    """Per role (the router's replicas too), the instances whose blocks a port set holds: range(spec.<role>.replicas)
    (spec.router.replicas; none while the router is disabled), plus the instance
    of every pod on the set (`pods`: those on it), running or being deleted (it may be bound to its ports until it
    is gone). A pod label outside the CRD's range is not an instance the operator made: ignored."""
    pods = tuple(pods)
    counts = {ROLE_DECODE: (spec.replicas[ROLE_DECODE], MAX_REPLICAS),
              ROLE_PREFILL: (spec.replicas[ROLE_PREFILL], MAX_REPLICAS),
              ROLE_ROUTER: (spec.router_replicas, MAX_ROUTER_REPLICAS)}
    return {role: tuple(sorted(set(range(count)) |
                               {p.instance for p in pods if p.role == role and 0 <= p.instance < bound}))
            for role, (count, bound) in counts.items()}


def lease_steps(spec: PairSpec, generations: Generations,
                pods: Iterable[PodView]) -> tuple[LeaseStep, LeaseStep | None]:
    """The two port sets' steps: (serving, rollout).

    The serving set (status.ports) is leased to match the spec's blocks, or, while any pod built from another spec
    still exists, only read. Every generation is on it (Recreate keeps its ports across generations) but a Surge
    rollout's other one, which has the other set: leased for the new spec while it comes up (Progressing), only read
    while it drains or rolls back; None without a rollout."""
    pods = tuple(pods)
    other = generations.other
    on_serving = tuple(p for p in pods if other is None or p.generation != other[0])
    on_other = tuple(p for p in pods if other is not None and p.generation == other[0])
    serving_instances = instances_on_set(spec, on_serving)
    other_instances = instances_on_set(spec, on_other) if other is not None else None
    serving_blocks = required_blocks(spec, serving_instances)
    other_blocks = required_blocks(spec, other_instances) if other_instances is not None else ()
    serving = LeaseStep(KEEP if any(p.spec_hash != spec.fingerprint for p in pods) else LEASE,
                        generations.serving_slot, serving_blocks, hoard_nothing=not on_serving)
    if other is None:
        return serving, None
    generation, slot = other
    active = generations.rollout or {}
    leasing = (active.get("phase") == PHASE_PROGRESSING and active.get("specHash") == spec.fingerprint
               and all(p.spec_hash == spec.fingerprint for p in on_other))
    return serving, LeaseStep(LEASE if leasing else KEEP, slot, other_blocks, generation, hoard_nothing=not on_other)


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


def unheld_pods(lost: LostPods, held_pool_ports: Iterable[int]) -> frozenset[str]:
    """The pods on lost nodes none of whose ports is one the pair holds (all fenced to them, or never the pair's):
    whatever runs there can no longer collide with a port the pair leases again."""
    held = set(held_pool_ports)
    return frozenset(p.name for p in lost.pods if not set(p.ports) & held)


def fenced_pods(lost: LostPods, held_pool_ports: Iterable[int]) -> frozenset[str]:
    """The pods on lost nodes that count as gone for the order of a teardown: being deleted, and none of the pool
    ports the pair holds is one of theirs (all fenced to them). Until both hold they are waited for like any pod."""
    unheld = unheld_pods(lost, held_pool_ports)
    return frozenset(p.name for p in lost.pods if p.deleting and p.name in unheld)
