"""Pod manifests for a pair: decode, prefill (with its peer) and router. Pure dicts, no client.

Pods are named `<pair>-<role>-g<generation>` so a create after a crash meets 409 instead of a twin, and
restartPolicy is Never: a crashed engine must go through the ordered pair restart, not a lone kubelet restart.

Each role may carry a core/v1 PodTemplateSpec (`spec.<role>.template`); the pod is that template with the
operator's parts merged in (`_base_pod` for the pod, `pod_defaults._main_container` for the engine or router container,
the probes, security, FlagCX and preflight defaults from pod_defaults.py). The
owner table in docs/design.md says who owns which field; what the operator owns is refused in the template by the
CRD's CEL rules, so the merge only overwrites defensively (a body that bypassed the apiserver, e.g. a unit test).
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any, Mapping

from pdpair.contract import (
    ANNOTATION_SPEC_HASH,
    API_VERSION,
    ENV_API_KEY,
    ENV_GENERATION,
    ENV_HANG_TIMEOUT_SECONDS,
    ENV_HTTP_PORT,
    ENV_LISTEN_PORT_BASE,
    ENV_METRICS_PORT,
    ENV_NAMESPACE,
    ENV_PAIR,
    ENV_PEER_HOST,
    ENV_PEER_PORT_BASE,
    ENV_PEERS,
    ENV_PEERS_TOKEN,
    ENV_SIDE_CHANNEL_KEY,
    LABEL_INSTANCE,
    ENV_ROLE,
    ENV_TRANSPORT,
    ENV_TRANSPORT_SLOTS,
    ENV_LAYERWISE_PUTS,
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
    READYZ_PATH,
    ROLE_DECODE,
    ROLE_PREFILL,
    ROLE_ROUTER,
    SIDE_CHANNEL_SECRET_KEY,
)

from pdpair.operator.model import spec_fields
from pdpair.operator.model.observed import url_host
from pdpair.operator.build.engine_args import refused_args
from pdpair.operator.build.pod_defaults import (
    READINESS_PROBE,
    _add_preflight,
    _default_probes,
    _flagcx_defaults,
    _locked_down,
    _main_container,
    _merge_env,
    _quantities_as_strings,
    held_path,
)
from pdpair.operator.decide.port_blocks import port_of, ports_of

KV_ROLE = {ROLE_PREFILL: "kv_producer", ROLE_DECODE: "kv_consumer"}
CONNECTOR_CLASS = "PdPairConnector"
CONNECTOR_MODULE = "pdpair.connector"
POD_NAME_MAX = 63  # keeps the pod hostname equal to its name
ENGINE_CONTAINER = "engine"
ROUTER_CONTAINER = "router"
# Scheduling fields the router copies from decode when its own template does not set them.
SCHEDULING_FIELDS = ("nodeSelector", "tolerations", "affinity")


class ManifestError(ValueError):
    """The pair cannot be turned into pods (missing ports, bad spec); the message names what is missing."""


def pod_name(pair_name: str, role: str, generation: int, instance: int = 0) -> str:
    """`<pair>-<role>-g<generation>`, and `-<instance>` after it for instance >= 1 (instance 0 keeps the name a 1P1D
    pair always had)."""
    tail = f"-{role}-g{generation}" + (f"-{instance}" if instance else "")
    name = f"{pair_name}{tail}"
    if len(name) <= POD_NAME_MAX:
        return name
    digest = hashlib.sha256(pair_name.encode()).hexdigest()[:8]
    suffix = f"-{digest}{tail}"
    return pair_name[: POD_NAME_MAX - len(suffix)].rstrip("-.") + suffix


PEERS_SECRET_KEY = "token"


def peers_secret_name(pair_name: str) -> str:
    """The pair's Secret holding the bearer token of its pods' peer-set endpoints (`PUT /pdpair/v1/peers`):
    `<pair>-peers`, shortened like pod_name for a name near the limit."""
    name = f"{pair_name}-peers"
    if len(name) <= POD_NAME_MAX:
        return name
    suffix = f"-{hashlib.sha256(pair_name.encode()).hexdigest()[:8]}-peers"
    return pair_name[: POD_NAME_MAX - len(suffix)].rstrip("-.") + suffix


def _peers_token_env(pair_name: str) -> list[dict[str, Any]]:
    """PDPAIR_PEERS_TOKEN from the pair's Secret (the executor makes it before any pod): the operator pushes each
    prefill its decodes and the router its instances (xPyD, docs/xpyd.md section 3) with it."""
    return [{"name": ENV_PEERS_TOKEN, "valueFrom": {"secretKeyRef": {"name": peers_secret_name(pair_name),
                                                                     "key": PEERS_SECRET_KEY}}}]


def side_channel_secret_name(pair_name: str) -> str:
    """The pair's Secret holding its side-channel key (`PDPAIR_SIDE_CHANNEL_KEY`, key contract.SIDE_CHANNEL_SECRET_KEY):
    `<pair>-side-channel`, shortened like pod_name for a name near the limit. A Secret of its own, not a second key
    in `<pair>-peers`: pairs made by older operators have that Secret without it, and the operator may only create
    Secrets (no get or patch), so it could never add the key there."""
    name = f"{pair_name}-side-channel"
    if len(name) <= POD_NAME_MAX:
        return name
    suffix = f"-{hashlib.sha256(pair_name.encode()).hexdigest()[:8]}-side-channel"
    return pair_name[: POD_NAME_MAX - len(suffix)].rstrip("-.") + suffix


def _side_channel_key_env(pair_name: str) -> list[dict[str, Any]]:
    """PDPAIR_SIDE_CHANNEL_KEY from the pair's side-channel Secret, for prefill and decode only: the connector
    authenticates every Hello with it and refuses to start without it. Never on the router, which holds the push
    token only, so a router (or whoever reads its environment) cannot pair as a prefill."""
    return [{"name": ENV_SIDE_CHANNEL_KEY, "valueFrom": {"secretKeyRef": {"name": side_channel_secret_name(pair_name),
                                                                          "key": SIDE_CHANNEL_SECRET_KEY}}}]


def _api_key_env(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """VLLM_API_KEY from the user's Secret (`spec.apiKeySecret`) for prefill, decode and router; none without the
    field. A secretKeyRef, never the value (it would show in the pod object) nor `--api-key` (a command line shows
    in `ps` and in the pod spec). vLLM reads the variable itself; the router requires it of its clients and sends it
    to the engines; the connector's warm-up sends it to its engine. The operator never reads that Secret: a missing
    one keeps the pod from starting (CreateContainerConfigError), which the planner names in the pair's status."""
    secret = spec_fields.api_key_secret(spec)
    if secret is None:
        return []
    name, key = secret
    return [{"name": ENV_API_KEY, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}]


# The pair's Secrets each role's pod references (secretKeyRef): the executor makes them before it creates the pod, as
# a pod whose Secret is missing never starts (CreateContainerConfigError). The API key's Secret (spec.apiKeySecret) is
# not one of them: the user makes it.
SECRET_PEERS = "peers"
SECRET_SIDE_CHANNEL = "side-channel"
POD_SECRETS = {
    ROLE_DECODE: (SECRET_SIDE_CHANNEL,),
    ROLE_PREFILL: (SECRET_PEERS, SECRET_SIDE_CHANNEL),
    ROLE_ROUTER: (SECRET_PEERS,),
}


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


def owned_labels(pair: Mapping[str, Any], component: str) -> dict[str, str]:
    """The labels of everything the pair owns (pods, the router Service, the PodDisruptionBudget): the pair's name
    and uid (the operator's watches select on the uid) and the recommended app.kubernetes.io set."""
    meta = pair["metadata"]
    return {
        LABEL_PAIR: meta["name"],
        LABEL_PAIR_UID: meta["uid"],
        "app.kubernetes.io/name": "pdpair",
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "pdpair-operator",
    }


def owned_metadata(pair: Mapping[str, Any], name: str, component: str, **labels: str) -> dict[str, Any]:
    """metadata of an object the pair owns beside its pods: in its namespace, `owned_labels` (+ `labels`), and the
    pair as controller owner, so the garbage collector removes it with the pair."""
    return {"name": name, "namespace": pair["metadata"]["namespace"],
            "labels": {**owned_labels(pair, component), **labels}, "ownerReferences": [owner_reference(pair)]}


def pod_labels(pair: Mapping[str, Any], role: str, generation: int, instance: int = 0) -> dict[str, str]:
    return {**owned_labels(pair, role), LABEL_ROLE: role, LABEL_GENERATION: str(generation),
            LABEL_INSTANCE: str(instance)}


ENGINE_ENTRYPOINT = ["python", "-m", "vllm.entrypoints.openai.api_server"]


def engine_command(spec: Mapping[str, Any], role: str) -> list[str]:
    """vLLM's command line: the user's args, then the operator's own flags, so argparse keeps ours on a repeat.

    Order cannot beat every spelling (vLLM appends --flag.key dotted keys last, --config reads a file); the CRD refuses
    those, see pdpair.operator.build.engine_args, and so does this function for a spec an older CRD admitted.
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


def _base_pod(pair: Mapping[str, Any], role: str, generation: int, spec_hash: str, instance: int = 0) -> dict[str, Any]:
    """The role's template with the operator's pod-level fields merged in (containers come later)."""
    meta = pair["metadata"]
    spec = pair["spec"]
    template = copy.deepcopy((spec.get(role) or {}).get("template") or {})
    user_meta = template.get("metadata") or {}
    pod_spec: dict[str, Any] = template.get("spec") or {}
    host_network = bool((spec.get("network") or {}).get("hostNetwork", True))
    # Operator-owned: the CRD refuses a template that sets these differently.
    pod_spec["restartPolicy"] = "Never"
    pod_spec["hostNetwork"] = host_network
    pod_spec.pop("ephemeralContainers", None)
    # Operator defaults the template may override.
    pod_spec.setdefault("enableServiceLinks", False)
    if host_network:
        pod_spec.setdefault("dnsPolicy", "ClusterFirstWithHostNet")
    pod_spec["containers"] = list(pod_spec.get("containers") or [])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(meta["name"], role, generation, instance),
            "namespace": meta["namespace"],
            # user labels and annotations are kept; ours win on a clash
            "labels": {**(user_meta.get("labels") or {}), **pod_labels(pair, role, generation, instance)},
            "annotations": {**(user_meta.get("annotations") or {}), ANNOTATION_SPEC_HASH: spec_hash},
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
    instance: int = 0,
    peers: list[tuple[str, int]] | None = None,
) -> dict[str, Any]:
    """The decode or prefill pod (instance `instance` of its role). Prefill is given the decodes that run when it is
    created: `peers`, each (address, side-channel base port), or `peer_host` alone for decode instance 0; none when
    it is created beside a decode that has no address yet (recreate.py, step 4). Every decode that gets an address
    later reaches it through the operator's push (PDPAIR_PEERS_TOKEN; instances.py, push.py). Its listener may not
    accept yet: prefill's connector retries until it does, and prefill's readiness waits for the pairing."""
    if role not in KV_ROLE:
        raise ManifestError(f"engine role must be prefill or decode, got {role!r}")
    spec = pair["spec"]
    role_spec = spec.get(role) or {}
    side = ports_of(ports, role, PURPOSE_SIDECHANNEL, instance=instance)
    what = role if not instance else f"{role} instance {instance}"
    if not side:
        raise ManifestError(f"no leased side-channel ports for {what}")
    http = _require(port_of(ports, role, PURPOSE_HTTP, instance=instance), f"{what} http")
    metrics = _require(port_of(ports, role, PURPOSE_METRICS, instance=instance), f"{what} metrics")
    env = _identity_env(pair, role, generation)
    env += [
        {"name": ENV_LISTEN_PORT_BASE, "value": str(side[0])},
        {"name": ENV_METRICS_PORT, "value": str(metrics)},
        {"name": ENV_HTTP_PORT, "value": str(http)},
        {"name": ENV_HANG_TIMEOUT_SECONDS, "value": str(spec_fields.defaulted(spec, "connector",
                                                                             "hangTimeoutSeconds"))},
        {"name": ENV_TRANSPORT, "value": spec_fields.transport(spec)},
        {"name": ENV_TRANSPORT_SLOTS, "value": str(spec_fields.transport_slots(spec))},
    ]
    if role == ROLE_PREFILL:
        if peers is None and peer_host:
            decode_side = ports_of(ports, ROLE_DECODE, PURPOSE_SIDECHANNEL)
            if not decode_side:
                raise ManifestError("no leased side-channel ports for decode")
            peers = [(peer_host, decode_side[0])]
        # No peers: created beside a decode with no address yet; the push brings it (PDPAIR_PEERS_TOKEN below).
        if peers and len(peers) == 1:  # the variables a 1P1D prefill always had
            env += [
                {"name": ENV_PEER_HOST, "value": peers[0][0]},
                {"name": ENV_PEER_PORT_BASE, "value": str(peers[0][1])},
            ]
        elif peers:
            env.append({"name": ENV_PEERS, "value": ",".join(f"{url_host(h)}:{base}" for h, base in peers)})
        env += _peers_token_env(pair["metadata"]["name"])
        layerwise = spec_fields.layerwise_puts(spec)
        if layerwise is not None:
            env.append({"name": ENV_LAYERWISE_PUTS, "value": "true" if layerwise else "false"})
    env += _side_channel_key_env(pair["metadata"]["name"])
    env += _api_key_env(spec)
    container_ports = [
        {"name": HTTP_PORT_NAME, "containerPort": http, "protocol": "TCP"},
        {"name": METRICS_PORT_NAME, "containerPort": metrics, "protocol": "TCP"},
    ] + [{"name": f"side-{rank}", "containerPort": port, "protocol": "TCP"} for rank, port in enumerate(side)]
    pod = _base_pod(pair, role, generation, spec_hash, instance)
    container = _main_container(pod, ENGINE_CONTAINER)
    # The CRD refuses env both in the shorthand and in the template's engine container; either one is the user's.
    user_env = list(container.get("env") or []) + list(role_spec.get("env") or [])
    merged_env = _merge_env(user_env, env)
    if spec_fields.transport(spec) == "flagcx":
        merged_env = _flagcx_defaults(container, merged_env)  # before _locked_down: it reads the template's own
    container.pop("args", None)
    container.update({
        "image": spec["image"],
        "command": engine_command(spec, role),
        "env": merged_env,
        "ports": container_ports,
    })
    if role_spec.get("resources"):
        container["resources"] = copy.deepcopy(role_spec["resources"])
    _default_probes(container, spec_fields.startup_timeout_seconds(spec))
    _locked_down(pod, container)
    for key in SCHEDULING_FIELDS:
        if role_spec.get(key):
            pod["spec"][key] = copy.deepcopy(role_spec[key])
    _spread_by_default(pod["spec"], pod["metadata"]["labels"])
    _add_preflight(pod, container)
    return _quantities_as_strings(pod)


SPREAD_WEIGHT = 50  # of the scheduler's 1..100 for preferred terms: a user's preferred node affinity may outweigh it
SPREAD_TOPOLOGY_KEY = "kubernetes.io/hostname"


def _spread_by_default(pod_spec: dict[str, Any], labels: Mapping[str, str]) -> None:
    """A role's instances of one generation prefer distinct nodes (a preferred pod anti-affinity term), so one lost
    node takes one instance of a role, not all of them (an unpinned 2P2D pair once had both decodes on one node).
    Preferred, never required: a pair with more instances than nodes still schedules. A role whose affinity or
    template already says how its pods spread (podAntiAffinity, topologySpreadConstraints) keeps only that. The
    router's replicas spread the same way (spec.router.replicas)."""
    if pod_spec.get("topologySpreadConstraints") or "podAntiAffinity" in (pod_spec.get("affinity") or {}):
        return
    selector = {key: labels[key] for key in (LABEL_PAIR_UID, LABEL_ROLE, LABEL_GENERATION)}
    affinity = dict(pod_spec.get("affinity") or {})
    affinity["podAntiAffinity"] = {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": SPREAD_WEIGHT,
        "podAffinityTerm": {"labelSelector": {"matchLabels": selector}, "topologyKey": SPREAD_TOPOLOGY_KEY},
    }]}
    pod_spec["affinity"] = affinity


def router_pod(
    pair: Mapping[str, Any],
    generation: int,
    ports: list[Mapping[str, Any]],
    spec_hash: str,
    prefill_host: str | list[tuple[int, str]],
    decode_host: str | list[tuple[int, str]],
    instance: int = 0,
) -> dict[str, Any]:
    """Router pod `instance` (spec.router.replicas). `prefill_host`/`decode_host`: instance 0's address, or every
    (instance, address) the router starts with (the operator's push keeps the set current afterwards:
    instances.router_members)."""
    spec = pair["spec"]
    what_port = "router http" if not instance else f"router {instance} http"
    router_port = _require(port_of(ports, ROLE_ROUTER, PURPOSE_HTTP, instance=instance), what_port)
    members = {ROLE_PREFILL: [(0, prefill_host)] if isinstance(prefill_host, str) else list(prefill_host),
               ROLE_DECODE: [(0, decode_host)] if isinstance(decode_host, str) else list(decode_host)}
    if not all(host for role in members for _, host in members[role]) or not all(members.values()):
        raise ManifestError("the router needs both prefill and decode addresses")
    command = ["python", "-m", "pdpair.router", "--port", str(router_port)]
    for role in (ROLE_PREFILL, ROLE_DECODE):
        for index, host in members[role]:
            what = role if not index else f"{role} instance {index}"
            http = _require(port_of(ports, role, PURPOSE_HTTP, instance=index), f"{what} http")
            command += [f"--{role}", f"http://{url_host(host)}:{http}"]
    # The engine pods' own readiness (paired, serving, warmed up): the router is created while they load, and its
    # /readyz passes only once a prefill and a decode do (recreate.py, step 5).
    for role in (ROLE_PREFILL, ROLE_DECODE):
        for index, host in members[role]:
            what = role if not index else f"{role} instance {index}"
            metrics = _require(port_of(ports, role, PURPOSE_METRICS, instance=index), f"{what} metrics")
            command += [f"--{role}-ready", f"http://{url_host(host)}:{metrics}{READYZ_PATH}"]
    router_spec = spec.get("router") or {}
    if router_spec.get("debugRouting"):
        command += ["--debug-routing", "--log-choices"]  # tests force each (prefill, decode) combination
    if router_spec.get("localPromptTokens") is not None:  # unset: the router's own default (RouterConfig)
        command += ["--local-prompt-tokens", str(int(router_spec["localPromptTokens"]))]
    for field, flag in (("concurrentLegs", "concurrent-legs"), ("prefixAffinity", "prefix-affinity"),
                        ("learnSplitThreshold", "learn-split-threshold")):
        if router_spec.get(field) is not None:  # unset: the router's own default (RouterConfig)
            command += [f"--{flag}" if router_spec[field] else f"--no-{flag}"]
    pod = _base_pod(pair, ROLE_ROUTER, generation, spec_hash, instance)
    container = _main_container(pod, ROUTER_CONTAINER)
    ours = (_identity_env(pair, ROLE_ROUTER, generation) + [{"name": ENV_HTTP_PORT, "value": str(router_port)}]
            + _peers_token_env(pair["metadata"]["name"]) + _api_key_env(spec))
    container.pop("args", None)
    container.update({
        "image": spec["image"],
        "command": command,
        "env": _merge_env(container.get("env") or [], ours),
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": router_port, "protocol": "TCP"}],
    })
    container.setdefault("readinessProbe", {
        "httpGet": {"path": held_path(READYZ_PATH), "port": HTTP_PORT_NAME, "scheme": "HTTP"}, **READINESS_PROBE})
    _locked_down(pod, container)
    # The router runs where decode may run: decode's scheduling constraints (shorthand or template), unless the
    # router's own template sets them.
    decode_spec = spec.get(ROLE_DECODE) or {}
    decode_template_spec = (decode_spec.get("template") or {}).get("spec") or {}
    for key in SCHEDULING_FIELDS:
        value = decode_spec.get(key) or decode_template_spec.get(key)
        if value and key not in pod["spec"]:
            pod["spec"][key] = copy.deepcopy(value)
    _spread_by_default(pod["spec"], pod["metadata"]["labels"])  # the replicas on distinct nodes, as the engines
    _add_preflight(pod, container)
    return _quantities_as_strings(pod)
