"""The port blocks of a spec with no pods around, for tests: port_blocks.required_blocks with each role's instances
range(spec.<role>.replicas) (the router's: range(spec.router.replicas)) unless `instances` names a role's (the operator itself always names both, from the spec's
counts and the pods on the port set: leases.instances_on_set)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from pdpair.contract import ROLE_ROUTER, ROLES
from pdpair.operator.decide.port_blocks import PortBlock, required_blocks
from pdpair.operator.model.spec_fields import replicas, router_replicas


def spec_blocks(spec: Mapping[str, Any], instances: Mapping[str, Iterable[int]] | None = None) -> tuple[PortBlock, ...]:
    wanted: dict[str, Iterable[int]] = {role: range(replicas(spec, role)) for role in ROLES}
    wanted[ROLE_ROUTER] = range(router_replicas(spec))
    wanted.update(instances or {})
    return required_blocks(spec, wanted)
