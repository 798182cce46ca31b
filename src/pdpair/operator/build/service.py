"""The router's Service: ClusterIP, named after the pair, selecting the pair's router pod. Pure dicts, no client.

Clients reach a pair at `<pair>.<namespace>.svc:<router port>` whatever the router pod's generation or IP. The
Service exists only while `spec.router.enabled`; it is owned by the pair (ownerReference), so the garbage
collector removes it with the pair. `plan_service` compares what should exist with what the watch shows and names
one action; reconciler.py applies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from pdpair.contract import (
    HTTP_PORT_NAME,
    LABEL_GENERATION,
    LABEL_PAIR,
    LABEL_ROLE,
    PURPOSE_HTTP,
    ROLE_ROUTER,
)

from pdpair.operator.build.pods import owned_metadata
from pdpair.operator.decide.port_blocks import port_of

ACTION_CREATE = "create"
ACTION_PATCH = "patch"  # ours, but its port or selector is not what the pair needs now
ACTION_DELETE = "delete"


def service_name(pair_name: str) -> str:
    # The CRD keeps pair names DNS-1035 labels of <= 45 characters, which is what a Service name must be.
    return pair_name


def router_selector(pair_name: str, generation: int | None = None) -> dict[str, str]:
    """The router pods (spec.router.replicas of them) of any generation: one generation's exist at a time (Recreate:
    old routers go before new ones start). During a Surge rollout two generations' do, and `generation` picks the
    serving one."""
    selector = {LABEL_PAIR: pair_name, LABEL_ROLE: ROLE_ROUTER}
    if generation is not None:
        selector[LABEL_GENERATION] = str(generation)
    return selector


def router_service(pair: Mapping[str, Any], ports: list[Mapping[str, Any]] | None, generation: int | None = None,
                   service_port: int | None = None) -> dict[str, Any] | None:
    """The Service the pair should have now, or None (router disabled, or its port not leased yet). The Service's
    port is the router's leased port, or `service_port` once a Surge rollout moved the router to another port
    (status.servicePort: clients keep the port they know; targetPort is the router container's named port)."""
    spec = pair.get("spec") or {}
    if not bool((spec.get("router") or {}).get("enabled", True)):
        return None
    port = port_of(ports or [], ROLE_ROUTER, PURPOSE_HTTP)
    if port is None:
        return None
    meta = pair["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owned_metadata(pair, service_name(meta["name"]), ROLE_ROUTER, **{LABEL_ROLE: ROLE_ROUTER}),
        "spec": {
            "type": "ClusterIP",
            "selector": router_selector(meta["name"], generation),
            "ports": [{"name": HTTP_PORT_NAME, "protocol": "TCP", "port": int(service_port or port),
                       "targetPort": HTTP_PORT_NAME}],
        },
    }


@dataclass(frozen=True)
class ServiceView:
    """The parts of an observed Service the operator compares."""

    name: str
    uid: str
    owner_uids: tuple[str, ...]
    selector: tuple[tuple[str, str], ...]
    ports: tuple[tuple[str, int, str], ...]  # (name, port, targetPort)
    deleting: bool = False

    @classmethod
    def from_service(cls, svc: Mapping[str, Any]) -> "ServiceView":
        meta = svc.get("metadata") or {}
        spec = svc.get("spec") or {}
        return cls(
            name=meta.get("name", ""),
            uid=meta.get("uid", ""),
            owner_uids=tuple(o.get("uid", "") for o in meta.get("ownerReferences") or ()),
            selector=tuple(sorted((spec.get("selector") or {}).items())),
            ports=_ports(spec.get("ports")),
            deleting=bool(meta.get("deletionTimestamp")),
        )


def _ports(ports: Any) -> tuple[tuple[str, int, str], ...]:
    return tuple(
        sorted((p.get("name") or "", int(p.get("port") or 0), str(p.get("targetPort") or "")) for p in ports or ())
    )


def kept_service_port(spec: Mapping[str, Any], status: Mapping[str, Any], observed: "ServiceView | None",
                      pair_uid: str) -> int | None:
    """The port the pair's Service keeps, or None (then it takes the router's leased port): clients know a Service
    by its port, so once the Service exists it keeps its port when the router's changes (a Surge switch to the other
    port set, records it in status.servicePort; a restart whose router port was fenced on a lost node or found busy
    on its node gets a new one), and only the router container's named targetPort follows. A fixed
    spec.router.port is the user's choice: it is the Service's port, always."""
    if (spec.get("router") or {}).get("port"):
        return None
    if status.get("servicePort"):
        return int(status["servicePort"])
    if observed is not None and not observed.deleting and pair_uid in observed.owner_uids and observed.ports:
        return int(observed.ports[0][1])
    return None


def plan_service(
    desired: Mapping[str, Any] | None, observed: ServiceView | None, pair_uid: str
) -> str | None:
    """One action that moves `observed` (the pair's Service as the watch shows it, or None) towards `desired`."""
    ours = observed is not None and pair_uid in observed.owner_uids
    if desired is None:
        return ACTION_DELETE if ours and not observed.deleting else None
    if observed is None or observed.deleting:
        return ACTION_CREATE  # a Service still being deleted meets 409; the next pass retries
    if not ours:
        return None  # someone else's Service of that name: never touched (the executor reports it)
    spec = desired["spec"]
    if observed.selector != tuple(sorted(spec["selector"].items())) or observed.ports != _ports(spec["ports"]):
        return ACTION_PATCH
    return None
