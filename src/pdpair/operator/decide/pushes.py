"""What each pod of the pair is told (the peer push, docs/xpyd.md sections 3, 5, 6), pure: the sets come from
instances.py (`prefill_peers`, `router_members`), the addresses and ports from the port set of the pod's generation
(given by the executor: status.ports, or a Surge rollout's other set).

  - `prefill_set`: the decodes a prefill pairs with (contract.prefill_peers.DecodePeer: host, the base of each
    decode's side-channel block, TP size), and its digest;
  - `router_set`: the instances a router sends to (contract.router_peers.RouterMember), and its digest;
  - `engine_url`: an engine pod's base URL as a router is told it (the executor reads a router's answer back by it);
  - `first_router_members`: a router is created with instance 0 of each role (a 1P1D router always was; its /readyz
    waits for them); the push adds the other instances once they are Ready;
  - `pushes`: every running prefill and router whose set is complete and differs from what its pod was last told
    (annotation pdpair.io/peers-digest): what the executor sends (act/peer_sets.py) this pass. A prefill with no
    decode running, or a router without a Ready prefill and decode, keeps what it has.
  - `draining_generations`: the generations whose router the executor reads back while an instance drains.

A digest (instances.peers_digest) is the order-free hash of a set's addresses: the pod records what it was told, so a
push is sent only when the set changes. Pure: no client, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from pdpair.contract import (PURPOSE_HTTP, PURPOSE_METRICS, PURPOSE_SIDECHANNEL, READYZ_PATH, ROLE_DECODE,
                             ROLE_PREFILL, ROLE_ROUTER)
from pdpair.contract.prefill_peers import DecodePeer
from pdpair.contract.router_peers import RouterMember
from pdpair.operator.decide import instances
from pdpair.operator.decide.port_blocks import port_of
from pdpair.operator.model.observed import PodView, url_host

Ports = list[dict[str, Any]]


@dataclass(frozen=True)
class Push:
    """One pod's set to send this pass: a prefill's decodes or a router's members, to `port` on the pod's IP (a
    prefill's metrics port, a router's HTTP port)."""

    pod: PodView
    port: int
    digest: str
    decodes: tuple[DecodePeer, ...] = ()
    members: tuple[RouterMember, ...] = ()


def side_base(ports: Ports, instance: int) -> int:
    return int(port_of(ports, ROLE_DECODE, PURPOSE_SIDECHANNEL, instance=instance) or 0)


def prefill_set(pods: Iterable[PodView], generation: int, ports: Ports, tp: int) -> tuple[tuple[DecodePeer, ...], str]:
    """(the decodes a prefill of `generation` pairs with, their digest)."""
    decodes = tuple(DecodePeer(p.instance, p.ip or "", side_base(ports, p.instance), tp)
                    for p in instances.prefill_peers(pods, generation))
    return decodes, instances.peers_digest(f"{d.host}:{d.port_base}" for d in decodes)


def engine_url(pod: PodView, ports: Ports) -> str | None:
    """`pod`'s engine base URL as a router is told it (its IP, its instance's HTTP port in `ports`); None without that
    port. The one place it is formed: a router's answer names instances by this URL, so the executor's read-back
    (act/peer_sets.engine_urls) must match what was pushed character for character."""
    http = port_of(ports, pod.role, PURPOSE_HTTP, instance=pod.instance)
    return None if http is None else f"http://{url_host(pod.ip or '')}:{http}"


def router_set(members_of: Iterable[PodView], ports: Ports) -> tuple[tuple[RouterMember, ...], str]:
    """(`members_of` as a router is told them: each engine's base URL and readiness URL, their digest); an instance
    without both ports in `ports` is left out."""
    members = []
    for p in members_of:
        url = engine_url(p, ports)
        metrics = port_of(ports, p.role, PURPOSE_METRICS, instance=p.instance)
        if url is None or metrics is None:
            continue
        members.append(RouterMember(p.role, p.instance, url, f"http://{url_host(p.ip or '')}:{metrics}{READYZ_PATH}"))
    return tuple(members), instances.peers_digest(f"{m.role}/{m.index}/{m.url}" for m in members)


def first_router_members(pods: Iterable[PodView], generation: int) -> dict[str, PodView]:
    """The instances a new router of `generation` starts with, by role: the lowest-indexed one that serves (Ready,
    not draining: a router replaced in a serving generation starts with instances that answer, not with an instance
    0 that is itself being replaced), else instance 0 when it runs (a generation's first start)."""
    pods = [p for p in pods if p.generation == generation and p.role in instances.ENGINE_ROLES]
    out = {p.role: p for p in sorted(pods, key=lambda p: -p.instance) if p.instance == 0 and p.running}
    for pod in sorted(instances.router_members(pods, generation), key=lambda p: -p.instance):
        out[pod.role] = pod
    return out


def pushes(pods: tuple[PodView, ...], ports_of: Mapping[int, Ports | None], decode_tp: int) -> list[Push]:
    """The sets to send this pass (module docstring); `ports_of`: each generation's port set (absent or None: not
    leased, nothing is pushed to its pods)."""
    out = []
    for pod in pods:
        if not pod.running or pod.role not in (ROLE_PREFILL, ROLE_ROUTER) or pod.peers_digest is None:
            continue
        ports = ports_of.get(pod.generation)
        if not ports:
            continue
        if pod.role == ROLE_PREFILL:
            metrics = port_of(ports, ROLE_PREFILL, PURPOSE_METRICS, instance=pod.instance)
            decodes, digest = prefill_set(pods, pod.generation, ports, decode_tp)
            if decodes and metrics is not None and digest != pod.peers_digest:
                out.append(Push(pod, metrics, digest, decodes=decodes))
            continue  # no decode runs: nothing to pair with (recreate.py restarts a pair left without one)
        router_port = port_of(ports, ROLE_ROUTER, PURPOSE_HTTP, instance=pod.instance)
        members, digest = router_set(instances.router_members(pods, pod.generation), ports)
        roles = {m.role for m in members}
        if router_port is not None and {ROLE_PREFILL, ROLE_DECODE} <= roles and digest != pod.peers_digest:
            out.append(Push(pod, router_port, digest, members=members))
        # else the router keeps what it has until a prefill and a decode are Ready
    return out


def draining_generations(pods: Iterable[PodView]) -> set[int]:
    """The generations with an engine instance draining (marked by a scale-down, not yet being deleted)."""
    return {p.generation for p in pods if p.role in instances.ENGINE_ROLES and p.draining_since is not None
            and not p.deleting}
