"""The pure half of port leasing: which port blocks a pair needs (`required_blocks`), where a run of free ports
starts (`choose_run`), which held leases still fit (`match_existing`), and how `status.ports` names and reads them
(`status_ports`, `port_of`, `ports_of`). No API call: the executor's `act/port_leaser.py` claims the Leases."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from pdpair.contract import (
    LABEL_INSTANCE,
    LABEL_PORT_SLOT,
    LEASE_NAME_PREFIX,
    MAX_REPLICAS,
    MAX_ROUTER_REPLICAS,
    PORT_SLOTS,
    PURPOSE_HTTP,
    PURPOSE_METRICS,
    PURPOSE_SIDECHANNEL,
    ROLE_DECODE,
    ROLE_PREFILL,
    ROLE_ROUTER,
    status_port_name,
)

from pdpair.operator.model import spec_fields
from pdpair.operator.model.config import PortPool

LABEL_VALUE_MAX = 63



def lease_name(port: int) -> str:
    return f"{LEASE_NAME_PREFIX}{port}"


DEFAULT_SLOT = PORT_SLOTS[0]  # leases without the slot label (made before slots existed) are in set "a"


def other_slot(slot: str) -> str:
    """The pair's other port set: where a Surge rollout leases the new generation's ports."""
    return PORT_SLOTS[1] if slot == PORT_SLOTS[0] else PORT_SLOTS[0]


def lease_slot(labels: Mapping[str, str] | None) -> str:
    return (labels or {}).get(LABEL_PORT_SLOT) or DEFAULT_SLOT


def lease_instance(labels: Mapping[str, str] | None) -> int:
    """The instance a Lease belongs to: absent is 0 (made before instances existed); a value we did not write
    reads as -1, which fits no block, so ensure releases it."""
    value = (labels or {}).get(LABEL_INSTANCE)
    if value is None:
        return 0
    try:
        return int(value)
    except ValueError:
        return -1


# --- pure planning --------------------------------------------------------------------------------
@dataclass(frozen=True)
class PortBlock:
    """A run of ports one (role, instance, purpose) needs; side channels are contiguous (base + rank)."""

    role: str
    purpose: str
    count: int
    contiguous: bool = False
    fixed: int | None = None  # a user-chosen port (spec.router.port), leased the same way, even outside the pool
    instance: int = 0  # the role's instance (xPyD), or the router replica

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.role, self.instance, self.purpose)


@dataclass(frozen=True, order=True)
class PortAssignment:
    role: str
    # Second in the sort order, so status.ports lists each instance's ports together (instance 0's first, as before
    # instances existed); keyword-only, so the positional (role, purpose, rank, port) stays what it was.
    instance: int = field(default=0, kw_only=True)
    purpose: str
    rank: int  # offset inside the block: for side channels, tp_rank * portsPerRank + k
    port: int

    @property
    def name(self) -> str:
        """The status.ports list-map key the CRD defines: <role>-<purpose>-<index>[-i<instance>]."""
        return status_port_name(self.role, self.purpose, self.rank, self.instance)

    def as_status(self) -> dict[str, Any]:
        entry = {"name": self.name, "role": self.role, "purpose": self.purpose, "rank": self.rank, "port": self.port}
        if self.instance:  # absent means 0: a 1P1D pair's status stays byte-identical to before instances
            entry["instance"] = self.instance
        return entry


def required_blocks(spec: Mapping[str, Any], instances: Mapping[str, Iterable[int]]) -> tuple[PortBlock, ...]:
    """Every port block a pair needs, given its spec (defaults as in the CRD): per prefill and decode instance a
    side channel, metrics and http block, and an http block per router replica. `instances` names, per role, the
    instance indexes that need ports (leases.instances_on_set: the spec's range(spec.<role>.replicas) and those of
    pods still on the port set, so a scale-down keeps a block until its pod is gone); an engine role it does not name
    has none, the router then has range(spec.router.replicas). Decode's blocks
    come first, instance by instance, then prefill's, then the router's: the order ports are claimed in."""
    network = spec.get("network") or {}
    per_rank = int(network.get("portsPerRank", 1))
    if per_rank < 1:
        raise ValueError(f"spec.network.portsPerRank must be >= 1, got {per_rank}")
    blocks: list[PortBlock] = []
    for role in (ROLE_DECODE, ROLE_PREFILL):
        tp = int((spec.get(role) or {}).get("tensorParallelSize", 1))
        if tp < 1:
            raise ValueError(f"spec.{role}.tensorParallelSize must be >= 1, got {tp}")
        indexes = sorted(set(instances.get(role, ())))
        bad = [i for i in indexes if not 0 <= i < MAX_REPLICAS]
        if bad:
            raise ValueError(f"{role} instance indexes must be 0..{MAX_REPLICAS - 1}, got {bad}")
        for i in indexes:
            blocks.append(PortBlock(role, PURPOSE_SIDECHANNEL, tp * per_rank, contiguous=True, instance=i))
            blocks.append(PortBlock(role, PURPOSE_METRICS, 1, instance=i))
            blocks.append(PortBlock(role, PURPOSE_HTTP, 1, instance=i))
    router = spec.get("router") or {}
    if router.get("enabled", True):
        fixed = router.get("port")
        indexes = sorted(set(instances[ROLE_ROUTER] if ROLE_ROUTER in instances else
                             range(spec_fields.router_replicas(spec))))
        bad = [i for i in indexes if not 0 <= i < MAX_ROUTER_REPLICAS]
        if bad:
            raise ValueError(f"router instance indexes must be 0..{MAX_ROUTER_REPLICAS - 1}, got {bad}")
        for i in indexes:  # a fixed port is router 0's; the others lease theirs from the pool
            blocks.append(PortBlock(ROLE_ROUTER, PURPOSE_HTTP, 1, fixed=int(fixed) if fixed and i == 0 else None,
                                    instance=i))
    return tuple(blocks)


def choose_run(pool: PortPool, taken: set[int] | frozenset[int], count: int, start_at: int | None = None) -> int | None:
    """Lowest first port of `count` free contiguous ports in the pool (from `start_at`), or None."""
    port = pool.first if start_at is None else max(pool.first, start_at)
    while port + count - 1 <= pool.last:
        # Skip a taken stretch with a bare loop: with 6000 held ports, a generator per port (as before) made this
        # 76% of the event loop's time while 1000 pairs leased, and starved the watches.
        while port in taken:
            port += 1
        if port + count - 1 > pool.last:
            break
        clash = next((p for p in range(port + count - 1, port, -1) if p in taken), None)
        if clash is None:
            return port
        port = clash + 1
    return None


def assign(block: PortBlock, first_port: int) -> list[PortAssignment]:
    return [PortAssignment(block.role, block.purpose, r, first_port + r, instance=block.instance)
            for r in range(block.count)]


def match_existing(
    blocks: Iterable[PortBlock], held: Mapping[tuple[str, int, str], list[int]]
) -> tuple[list[PortAssignment], list[int]]:
    """Split ports a pair already holds, by (role, instance, purpose), into ones that still fit a block (kept) and
    ones to release.

    A block is kept whole or not at all: its ports must be exactly `count` and contiguous when required. An
    instance no block names any more (scaled down, its pod gone) is released.
    """
    keep: list[PortAssignment] = []
    release: list[int] = []
    wanted = {b.key: b for b in blocks}
    for key, ports in held.items():
        ports = sorted(ports)
        block = wanted.get(key)
        if block is not None and _fits(block, ports):
            keep.extend(assign(block, ports[0]))
        else:
            release.extend(ports)
    return keep, release


def _fits(block: PortBlock, ports: list[int]) -> bool:
    if len(ports) != block.count:
        return False
    if block.fixed is not None and ports != [block.fixed]:
        return False
    return not block.contiguous or ports == list(range(ports[0], ports[0] + block.count))


def missing_blocks(blocks: Iterable[PortBlock], have: Iterable[PortAssignment]) -> list[PortBlock]:
    held = {(a.role, a.instance, a.purpose) for a in have}
    return [b for b in blocks if b.key not in held]


def describe(block: PortBlock) -> str:
    return f"{block.role}{f' instance {block.instance}' if block.instance else ''} {block.purpose}"


def status_ports(assignments: Iterable[PortAssignment]) -> list[dict[str, Any]]:
    return [a.as_status() for a in sorted(assignments)]


def _of(p: Mapping[str, Any], role: str, purpose: str, instance: int) -> bool:
    # an entry without "instance" is instance 0 (as_status writes it only when > 0)
    return p.get("role") == role and p.get("purpose") == purpose and int(p.get("instance", 0)) == instance


def port_of(ports: Iterable[Mapping[str, Any]], role: str, purpose: str, rank: int = 0,
            instance: int = 0) -> int | None:
    """Look a port up in a status.ports-shaped list."""
    for p in ports:
        if _of(p, role, purpose, instance) and int(p.get("rank", 0)) == rank:
            return int(p["port"])
    return None


def ports_of(ports: Iterable[Mapping[str, Any]], role: str, purpose: str, instance: int = 0) -> list[int]:
    return sorted(int(p["port"]) for p in ports if _of(p, role, purpose, instance))


