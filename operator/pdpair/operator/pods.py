"""Pod manifests for a pair: decode, prefill (with its peer) and router. Pure dicts, no client.

Pods are named `<pair>-<role>-g<generation>` so a create after a crash meets 409 instead of a twin, and
restartPolicy is Never: a crashed engine must go through the ordered pair restart, not a lone kubelet restart.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from pdpair.contract import (
    ANNOTATION_SPEC_HASH,
    API_VERSION,
    ENV_GENERATION,
    ENV_HANG_TIMEOUT_SECONDS,
    ENV_HTTP_PORT,
    ENV_LISTEN_PORT_BASE,
    ENV_METRICS_PORT,
    ENV_NAMESPACE,
    ENV_PAIR,
    ENV_PEER_HOST,
    ENV_PEER_PORT_BASE,
    ENV_ROLE,
    ENV_TRANSPORT,
    ENV_TRANSPORT_SLOTS,
    KIND,
    LABEL_GENERATION,
    LABEL_PAIR,
    LABEL_PAIR_UID,
    HTTP_PORT_NAME,
    LABEL_ROLE,
    METRICS_PORT_NAME,
    PURPOSE_HTTP,
    PURPOSE_METRICS,
    PURPOSE_SIDECHANNEL,
    ROLE_DECODE,
    ROLE_PREFILL,
    ROLE_ROUTER,
)

from .engine_args import refused_args
from .ports import port_of, ports_of

KV_ROLE = {ROLE_PREFILL: "kv_producer", ROLE_DECODE: "kv_consumer"}
CONNECTOR_CLASS = "PdPairConnector"
CONNECTOR_MODULE = "pdpair.connector"
POD_NAME_MAX = 63  # keeps the pod hostname equal to its name
ENGINE_CONTAINER = "engine"
ROUTER_CONTAINER = "router"
# The CRD's defaults (the apiserver applies them; these only cover a body that bypassed it, e.g. a unit test).
# tests/unit/operator/test_pods.py checks them against the CRD file.
CONNECTOR_DEFAULTS = {"transport": "flagcx", "hangTimeoutSeconds": 60, "slots": 256}


class ManifestError(ValueError):
    """The pair cannot be turned into pods (missing ports, bad spec); the message names what is missing."""


def pod_name(pair_name: str, role: str, generation: int) -> str:
    name = f"{pair_name}-{role}-g{generation}"
    if len(name) <= POD_NAME_MAX:
        return name
    digest = hashlib.sha256(pair_name.encode()).hexdigest()[:8]
    suffix = f"-{digest}-{role}-g{generation}"
    return pair_name[: POD_NAME_MAX - len(suffix)].rstrip("-.") + suffix


def owner_reference(pair: Mapping[str, Any]) -> dict[str, Any]:
    meta = pair["metadata"]
    # blockOwnerDeletion stays off: it would need update on inferencepairs/finalizers, and background GC
    # (what we rely on) does not use it.
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": False,
    }


def pod_labels(pair: Mapping[str, Any], role: str, generation: int) -> dict[str, str]:
    meta = pair["metadata"]
    return {
        LABEL_PAIR: meta["name"],
        LABEL_PAIR_UID: meta["uid"],
        LABEL_ROLE: role,
        LABEL_GENERATION: str(generation),
        "app.kubernetes.io/name": "pdpair",
        "app.kubernetes.io/component": role,
        "app.kubernetes.io/managed-by": "pdpair-operator",
    }


ENGINE_ENTRYPOINT = ["python", "-m", "vllm.entrypoints.openai.api_server"]


def engine_command(spec: Mapping[str, Any], role: str) -> list[str]:
    """vLLM's command line: the user's args, then the operator's own flags, so argparse keeps ours on a repeat.

    Order cannot beat every spelling (vLLM appends --flag.key dotted keys last, --config reads a file); the CRD refuses
    those, see pdpair.operator.engine_args, and so does this function for a spec an older CRD admitted.
    """
    user = [str(a) for a in (spec.get(role) or {}).get("args") or []]
    if refused := refused_args(user):
        problems = "; ".join(f"spec.{role}.{problem}" for problem in refused)
        raise ManifestError(f"{problems}: the cluster's CRD is older than the operator, upgrade it "
                            "(charts/pdpair/README.md)")
    return [*ENGINE_ENTRYPOINT, *user, *owned_engine_flags(spec, role)]


def owned_engine_flags(spec: Mapping[str, Any], role: str) -> list[str]:
    """Every pinned flag of engine_args.OWNED_FLAGS, in that order; "" is vLLM's None (its default) for host and uds."""
    role_spec = spec.get(role) or {}
    kv_config = {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": KV_ROLE[role],
    }
    return [
        "--model", spec["model"],
        "--served-model-name", spec.get("servedModelName") or spec["model"],
        "--host", "",
        "--uds", "",
        "--port", f"$({ENV_HTTP_PORT})",
        "--tensor-parallel-size", str(int(role_spec.get("tensorParallelSize", 1))),
        "--pipeline-parallel-size", "1",
        "--prefill-context-parallel-size", "1",
        "--data-parallel-size", "1",
        "--kv-transfer-config", json.dumps(kv_config, separators=(",", ":")),
    ]


def _require(value: int | None, what: str) -> int:
    if value is None:
        raise ManifestError(f"no leased port for {what}")
    return value


def _base_pod(pair: Mapping[str, Any], role: str, generation: int, spec_hash: str) -> dict[str, Any]:
    meta = pair["metadata"]
    spec = pair["spec"]
    host_network = bool((spec.get("network") or {}).get("hostNetwork", True))
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "hostNetwork": host_network,
        "enableServiceLinks": False,
    }
    if host_network:
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(meta["name"], role, generation),
            "namespace": meta["namespace"],
            "labels": pod_labels(pair, role, generation),
            "annotations": {ANNOTATION_SPEC_HASH: spec_hash},
            "ownerReferences": [owner_reference(pair)],
        },
        "spec": pod_spec,
    }


def _identity_env(pair: Mapping[str, Any], role: str, generation: int) -> list[dict[str, str]]:
    meta = pair["metadata"]
    return [
        {"name": ENV_ROLE, "value": role},
        {"name": ENV_PAIR, "value": meta["name"]},
        {"name": ENV_NAMESPACE, "value": meta["namespace"]},
        {"name": ENV_GENERATION, "value": str(generation)},
    ]


def engine_pod(
    pair: Mapping[str, Any],
    role: str,
    generation: int,
    ports: list[Mapping[str, Any]],
    spec_hash: str,
    peer_host: str | None = None,
) -> dict[str, Any]:
    """The decode or prefill pod. Prefill needs `peer_host`: decode's IP, whose listener was probed."""
    if role not in KV_ROLE:
        raise ManifestError(f"engine role must be prefill or decode, got {role!r}")
    spec = pair["spec"]
    role_spec = spec.get(role) or {}
    connector = spec.get("connector") or {}
    side = ports_of(ports, role, PURPOSE_SIDECHANNEL)
    if not side:
        raise ManifestError(f"no leased side-channel ports for {role}")
    http = _require(port_of(ports, role, PURPOSE_HTTP), f"{role} http")
    metrics = _require(port_of(ports, role, PURPOSE_METRICS), f"{role} metrics")
    env = [dict(e) for e in role_spec.get("env") or []]  # user env first; ours below wins
    env += _identity_env(pair, role, generation)
    env += [
        {"name": ENV_LISTEN_PORT_BASE, "value": str(side[0])},
        {"name": ENV_METRICS_PORT, "value": str(metrics)},
        {"name": ENV_HTTP_PORT, "value": str(http)},
        {"name": ENV_HANG_TIMEOUT_SECONDS, "value": str(connector.get("hangTimeoutSeconds",
                                                                      CONNECTOR_DEFAULTS["hangTimeoutSeconds"]))},
        {"name": ENV_TRANSPORT, "value": str(connector.get("transport", CONNECTOR_DEFAULTS["transport"]))},
        {"name": ENV_TRANSPORT_SLOTS, "value": str(connector.get("slots", CONNECTOR_DEFAULTS["slots"]))},
    ]
    if role == ROLE_PREFILL:
        if not peer_host:
            raise ManifestError("prefill needs the decode pod's address (decode has no IP yet)")
        decode_side = ports_of(ports, ROLE_DECODE, PURPOSE_SIDECHANNEL)
        if not decode_side:
            raise ManifestError("no leased side-channel ports for decode")
        env += [
            {"name": ENV_PEER_HOST, "value": peer_host},
            {"name": ENV_PEER_PORT_BASE, "value": str(decode_side[0])},
        ]
    container_ports = [
        {"name": HTTP_PORT_NAME, "containerPort": http, "protocol": "TCP"},
        {"name": METRICS_PORT_NAME, "containerPort": metrics, "protocol": "TCP"},
    ] + [{"name": f"side-{rank}", "containerPort": port, "protocol": "TCP"} for rank, port in enumerate(side)]
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": spec["image"],
        "command": engine_command(spec, role),
        "env": env,
        "ports": container_ports,
    }
    if role_spec.get("resources"):
        container["resources"] = role_spec["resources"]
    pod = _base_pod(pair, role, generation, spec_hash)
    pod["spec"]["containers"] = [container]
    for key in ("nodeSelector", "tolerations", "affinity"):
        if role_spec.get(key):
            pod["spec"][key] = role_spec[key]
    return pod


def router_pod(
    pair: Mapping[str, Any],
    generation: int,
    ports: list[Mapping[str, Any]],
    spec_hash: str,
    prefill_host: str,
    decode_host: str,
) -> dict[str, Any]:
    spec = pair["spec"]
    router_port = _require(port_of(ports, ROLE_ROUTER, PURPOSE_HTTP), "router http")
    prefill_http = _require(port_of(ports, ROLE_PREFILL, PURPOSE_HTTP), "prefill http")
    decode_http = _require(port_of(ports, ROLE_DECODE, PURPOSE_HTTP), "decode http")
    if not (prefill_host and decode_host):
        raise ManifestError("the router needs both prefill and decode addresses")
    container = {
        "name": ROUTER_CONTAINER,
        "image": spec["image"],
        "command": [
            "python", "-m", "pdpair.router",
            "--port", str(router_port),
            "--prefill", f"http://{_host(prefill_host)}:{prefill_http}",
            "--decode", f"http://{_host(decode_host)}:{decode_http}",
        ],
        "env": _identity_env(pair, ROLE_ROUTER, generation) + [{"name": ENV_HTTP_PORT, "value": str(router_port)}],
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": router_port, "protocol": "TCP"}],
    }
    pod = _base_pod(pair, ROLE_ROUTER, generation, spec_hash)
    pod["spec"]["containers"] = [container]
    # The router runs where decode may run: same scheduling constraints.
    decode_spec = spec.get(ROLE_DECODE) or {}
    for key in ("nodeSelector", "tolerations", "affinity"):
        if decode_spec.get(key):
            pod["spec"][key] = decode_spec[key]
    return pod


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address
