"""A prefill's set of decodes as the operator pushes it (`PUT /pdpair/v1/peers` on the prefill's metrics port): the
one definition of a decode peer and of the body, which the operator plans (operator/decide/pushes.py) and writes
(operator/act/peer_sets.py), and the prefill's connector reads (connector/pod_server.py `PeerPush`, which needs only
`host` and `portBase` of each decode and ignores the other keys).

The body: `{"epoch": int, "generation": int, "decodes": [{"index": int, "host": str, "portBase": int, "tp": int}]}`,
decodes in index order; one index and one host:portBase per body."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdpair.contract.router_peers import count


@dataclass(frozen=True)
class DecodePeer:
    """A decode instance as a prefill is pushed it: its index, its pod's host (IP), the base of its side-channel port
    block (TP rank r listens on port_base + r), its TP size."""
    index: int
    host: str
    port_base: int
    tp: int


def prefill_body(epoch: int, generation: int, decodes: Iterable[DecodePeer]) -> dict:
    """The body of a prefill's push, decodes in index order. A ValueError for what the connector would refuse anyway
    or a planner bug: a negative or non-integer number, an empty host, one index or one host:portBase twice."""
    count(epoch, "epoch")
    count(generation, "generation")
    indexes, addresses, out = set(), set(), []
    for peer in sorted(decodes, key=lambda p: p.index):
        count(peer.index, "decode index")
        count(peer.port_base, f"decode {peer.index} port_base")
        if isinstance(peer.tp, bool) or not isinstance(peer.tp, int) or peer.tp < 1:
            raise ValueError(f"decode {peer.index} tp must be an integer >= 1, got {peer.tp!r}")
        host = peer.host.strip("[]") if isinstance(peer.host, str) else ""
        if not host:
            raise ValueError(f"decode {peer.index} has no host: {peer.host!r}")
        if peer.index in indexes or (host, peer.port_base) in addresses:
            raise ValueError(f"decode {peer.index} ({host}:{peer.port_base}) is named twice")
        indexes.add(peer.index)
        addresses.add((host, peer.port_base))
        out.append({"index": peer.index, "host": host, "portBase": peer.port_base, "tp": peer.tp})
    return {"epoch": epoch, "generation": generation, "decodes": out}
