"""The router's instance sets as the operator pushes them (`PUT /pdpair/v1/peers` on the router's HTTP port): the one
definition of a member and of the body, which the operator writes (operator/act/push.py) and the router reads
(router/peer_push.py `parse_peers_body`).

The body: `{"epoch": int, "generation": int, "prefills": [{"index": int, "url": str, "readyUrl": str, "draining":
bool}], "decodes": [...]}`, each role in index order; one index per role, one URL per body."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdpair.contract import ROLE_DECODE, ROLE_PREFILL

# The body's list of each role, by role.
BODY_ROLES = {ROLE_PREFILL: "prefills", ROLE_DECODE: "decodes"}


@dataclass(frozen=True)
class RouterMember:
    """An instance as the router is pushed it: role (prefill or decode), index, its engine's base URL, its own
    readiness URL (the router's /readyz asks it), and whether it is draining (never chosen again; its requests in
    flight finish)."""
    role: str
    index: int
    url: str
    ready_url: str
    draining: bool = False

    def wire(self) -> dict:
        return {"index": self.index, "url": self.url, "readyUrl": self.ready_url, "draining": bool(self.draining)}


def count(value: object, what: str) -> int:
    """`value` if it is an integer >= 0 (not a bool), else a ValueError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {value!r}")
    return value


def router_body(epoch: int, generation: int, members: Iterable[RouterMember]) -> dict:
    """The body of the router's push. A ValueError for a role that is neither prefill nor decode, or one index or
    one URL twice (the router would refuse them: 400)."""
    count(epoch, "epoch")
    count(generation, "generation")
    roles: dict[str, list[RouterMember]] = {role: [] for role in BODY_ROLES}
    urls: set[str] = set()
    for member in members:
        if member.role not in roles:
            raise ValueError(f"role must be {ROLE_PREFILL!r} or {ROLE_DECODE!r}, got {member.role!r}")
        count(member.index, f"{member.role} index")
        if any(m.index == member.index for m in roles[member.role]) or member.url in urls:
            raise ValueError(f"{member.role} {member.index} ({member.url}) is named twice")
        urls.add(member.url)
        roles[member.role].append(member)
    return {"epoch": epoch, "generation": generation,
            **{BODY_ROLES[role]: [m.wire() for m in sorted(items, key=lambda m: m.index)]
               for role, items in roles.items()}}
