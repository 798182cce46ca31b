"""A leased port that a process outside Kubernetes holds on a node: what the pods report, and what to do. Pure.

A pair pod on the host network binds its leased ports on its node. A foreign process (a debugger, a stray server)
may already hold one; the lease cannot know, since the pool is cluster-wide and leased before scheduling. The pod's
port preflight (pdpair.connector.preflight, the last init container) or the connector's own bind then fails the pod
with `pdpair: ports in use on this node: <ports>` as a termination message. The executor (reconciler.py):

  1. reads those ports from the current generation's pods (`reports`);
  2. turns each busy port the pair holds from the pool into a quarantine Lease (holder node-busy/<node>, a TTL), so
     no pair is leased it until the TTL passes (port_leaser.PortLeaser.quarantine);
  3. leases the pair replacements (the ordinary ensure), emits PortInUse, and, once every busy port is out of the
     pair's hands (`ports_replaced`), the planner restarts the pair decode-first on the new ports, outside the
     restart budget: every such restart consumed a quarantined port, so it cannot loop.
`quarantines` says which ports to quarantine (held pool ports) and which only to report (fixed ones).

A busy port that cannot be replaced (a fixed spec.router.port, or one outside the pool) is only reported; the pod's
failure then takes the ordinary budgeted restart path.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Mapping

from pdpair.contract import parse_ports_in_use

from pdpair.operator.decide.port_blocks import PortBlock
from pdpair.operator.model.config import PortPool


@dataclass(frozen=True)
class PortsInUse:
    """One pod's report: `ports` were busy on `node` when `container` bound them."""

    role: str
    pod: str
    node: str
    container: str
    ports: tuple[int, ...]

    def describe(self) -> str:
        return (f"port{'s' if len(self.ports) > 1 else ''} {' '.join(map(str, self.ports))} in use on node "
                f"{self.node or '?'} ({self.role} pod {self.pod}, container {self.container})")


def pod_ports_in_use(pod: Mapping[str, Any]) -> tuple[str, tuple[int, ...]]:
    """(container, busy ports) from a pod's termination messages (init containers first); ("", ()) when none."""
    status = pod.get("status") or {}
    for key in ("initContainerStatuses", "containerStatuses"):
        for cs in status.get(key) or []:
            for state in (cs.get("state") or {}, cs.get("lastState") or {}):
                ports = parse_ports_in_use((state.get("terminated") or {}).get("message"))
                if ports:
                    return str(cs.get("name") or "?"), ports
    return "", ()


def reports(pods: Iterable[Any], generation: int) -> list[PortsInUse]:
    """The reports of the pods of `generation` (pods: observed.PodView, whose `raw` is the API object)."""
    found: list[PortsInUse] = []
    for pod in pods:
        if pod.generation != generation or pod.raw is None:
            continue
        container, ports = pod_ports_in_use(pod.raw)
        if ports:
            node = str(((pod.raw.get("spec") or {}).get("nodeName")) or "")
            found.append(PortsInUse(pod.role, pod.name, node, container, ports))
    return found


@dataclass(frozen=True)
class BusyPlan:
    quarantine: tuple[int, ...] = ()  # busy pool ports the pair still holds: quarantine them, lease others
    fixed: tuple[int, ...] = ()  # busy ports the pair cannot change (fixed router port, or outside the pool)

    @property
    def replaced(self) -> bool:
        """Nothing left to do but restart on the new ports (every busy port is already out of the pair's hands)."""
        return not self.quarantine and not self.fixed


def plan(busy: Iterable[int], held: Iterable[int], pool: PortPool, fixed: Iterable[int] = ()) -> BusyPlan:
    """What to do about `busy` ports, given the ports the pair holds now and its fixed (user-chosen) ports."""
    held_set, fixed_set = set(held), set(fixed)
    cannot = sorted(p for p in set(busy) if p in fixed_set or p not in pool)
    quarantine = sorted(p for p in set(busy) if p in held_set and p not in cannot)
    return BusyPlan(tuple(quarantine), tuple(cannot))


@dataclass(frozen=True)
class Quarantine:
    """One pod's busy-port report and what to do about it."""

    report: PortsInUse
    ports: tuple[int, ...]  # pool ports the pair holds: quarantine them on report.node, lease replacements
    fixed: tuple[int, ...]  # ports the operator cannot change: report only (the pod's failure takes the budget path)


def _fixed_ports(blocks: Iterable[PortBlock]) -> list[int]:
    return [b.fixed for b in blocks if b.fixed is not None]


def quarantines(reports: Iterable[PortsInUse], held: Iterable[Mapping[str, Any]], blocks: Iterable[PortBlock],
                pool: PortPool) -> list[Quarantine]:
    """For each report, the ports to quarantine (held pool ports) and the ones only to report (fixed)."""
    held_ports = [int(p["port"]) for p in held]
    fixed = _fixed_ports(blocks)
    out = []
    for report in reports:
        todo = plan(report.ports, held_ports, pool, fixed)
        out.append(Quarantine(report, todo.quarantine, todo.fixed))
    return out


def ports_replaced(reports: list[PortsInUse], held: list[Mapping[str, Any]] | None,
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


def quarantine_expired(renewed: datetime | None, duration_seconds: int | None, now: datetime) -> bool:
    """A quarantine Lease is over once renewTime (or acquireTime) + leaseDurationSeconds has passed; a Lease that
    lacks either is over at once (it cannot say how long it should hold)."""
    if renewed is None or not duration_seconds:
        return True
    if renewed.tzinfo is None:
        renewed = renewed.replace(tzinfo=timezone.utc)
    return now >= renewed + timedelta(seconds=int(duration_seconds))
