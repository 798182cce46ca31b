"""The operator's defaults merged into a role's pod template (docs/design.md, owner table): the readiness and startup
probes (held while they fail), the container security defaults (`_locked_down`), FlagCX's env and IPC_LOCK, the port
preflight in front of a host-network container's command, the env merge (ours wins by name) and resource quantities
written as the client's model wants them. Each default yields to what the template sets. Pure dicts, no client.
Separate from pods.py, which builds each role's pod (identity, ports, env, command) and applies these to it."""

from __future__ import annotations

import math
from typing import Any, Mapping

from pdpair.contract import (
    FLAGCX_ENV_DEFAULTS,
    METRICS_PORT_NAME,
    PROBE_WAIT_PARAM,
    READYZ_PATH,
    STARTUPZ_PATH,
)

# The startup probe's period is the delay between an engine that serves and the kubelet seeing it (half of it on
# average), on the pair's path to Ready: 1 s, not 10 (2 s until the real-node logs showed prefill's API server up
# 2.2 s before its Ready: a startup period, then the readiness probe, then a readiness period for the warm-up). A
# probe of a starting engine is a refused connection, so probing often costs nothing; failureThreshold keeps the
# window.
STARTUP_PERIOD_SECONDS = 1
# Every 1 s: a pod's Ready lags its readiness by up to one period, on the pair's start path (a 5 s period cost the
# demo up to 10 s of its 34 s apply-to-answer). /readyz is cheap (the engine's /health; the warm-up runs once, started
# by the connector itself as soon as the engine serves). 16 failures in a row (16 s) before NotReady, about the 15 s
# the old 5 s x 3 tolerated, so a slow /health on a loaded node flaps no sooner. The router's readiness probe is the
# same: its Ready is the last step before the pair's first answer (the Service gets its endpoint then), and its
# /readyz asks the engines' own readiness directly (each ask bounded below the timeout, router/app.py).
READINESS_PROBE = {"periodSeconds": 1, "timeoutSeconds": 4, "failureThreshold": 16, "successThreshold": 1}
# Every probe of ours asks to be held while it fails (contract.PROBE_WAIT_PARAM): the kubelet's next period would
# otherwise add half a period on average to each step of the pair's path to its first answer (engine startup, engine
# readiness, the router's readiness). One period's worth: the probe returns when the pod passes or the period is over.
# The timeouts above leave this plus one check's own bound (the engine's /health 2 s, the router's ask 2.5 s).
PROBE_WAIT_SECONDS = 1
# FlagCX defaults for transport flagcx (docs/design.md): a same-vendor pair fails at init without hetero comm,
# and registering RDMA memory needs IPC_LOCK: ibv_reg_mr pins the KV cache's pages, beyond the memlock limit without
# it. The engine's default drops every capability (LOCKED_DOWN_CONTAINER), so this one is added back by name.
FLAGCX_CAPABILITY = "IPC_LOCK"
# The engine and router containers are locked down unless the role's template decides otherwise, field by field
# (docs/design.md, "Pods locked down by default"): nothing of the pair talks to the Kubernetes API, runs as root, gains
# privileges or needs a capability but FlagCX's. The images run as uid 10001 with a numeric USER, so runAsNonRoot
# needs no runAsUser; an image that runs as root fails to start with it (CreateContainerConfigError) until its template
# sets runAsNonRoot: false or a runAsUser.
SECCOMP_DEFAULT = {"type": "RuntimeDefault"}
# allowPrivilegeEscalation false is invalid beside these (the apiserver refuses the pod), so it is left unset there
ESCALATING_CAPABILITIES = frozenset({"SYS_ADMIN", "CAP_SYS_ADMIN"})
# The first step of every hostNetwork pod's own container: binds each port the pod will use on its node, and on a
# busy one fails the container with `pdpair: ports in use on this node: ...` as its termination message
# (pdpair.connector.preflight), which the operator reads to quarantine the port and lease the pair another
# (docs/design.md); on free ports it execs the container's command (after PREFLIGHT_SEPARATOR). Not an init
# container: that cost both engines of every pair start a container start plus the kubelet's relist (up to 1 s).
PREFLIGHT_COMMAND = ["python", "-m", "pdpair.connector.preflight"]
PREFLIGHT_SEPARATOR = "--"
# The init container that ran the preflight before (operator versions up to the parallel start); a template's init
# container of that name is dropped, so it cannot pose as the operator's.
LEGACY_PREFLIGHT_CONTAINER = "pdpair-preflight"


def _main_container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    """The template's container called `name` (the operator's), created first in the list if absent."""
    containers = pod["spec"]["containers"]
    for container in containers:
        if container.get("name") == name:
            return container
    container = {"name": name}
    containers.insert(0, container)
    return container


def _merge_env(user: list[Mapping[str, Any]], ours: list[dict[str, str]]) -> list[dict[str, Any]]:
    """User entries first (their order kept), then ours; a user entry with a name we set is dropped (ours wins)."""
    owned = {e["name"] for e in ours}
    return [dict(e) for e in user if e.get("name") not in owned] + ours


def held_path(path: str) -> str:
    """A probe path that asks the connector or router to hold a failing answer for PROBE_WAIT_SECONDS."""
    return f"{path}?{PROBE_WAIT_PARAM}={PROBE_WAIT_SECONDS}"


def _default_probes(container: dict[str, Any], startup_timeout: int) -> None:
    """readinessProbe and startupProbe, unless the template brought its own. The startup probe is the connector's
    /startupz on the metrics port: the engine's /health (vLLM's own, which cannot hold an answer). Readiness is the connector's /readyz on the metrics port: the engine's /health, then
    one warm-up completion through its API (connector/warmup.py: a first-call compile at TP > 1 is paid before
    Ready, not by the first user request); for prefill also every rank paired with decode, because prefill starts
    beside decode and pairs only once decode's listener accepts: a prefill that serves but is not paired yet must
    not make the pair Ready."""
    action = {"httpGet": {"path": held_path(STARTUPZ_PATH), "port": METRICS_PORT_NAME, "scheme": "HTTP"}}
    ready = {"httpGet": {"path": held_path(READYZ_PATH), "port": METRICS_PORT_NAME, "scheme": "HTTP"}}
    container.setdefault("readinessProbe", {**ready, **READINESS_PROBE})
    container.setdefault("startupProbe", {
        **action,
        "periodSeconds": STARTUP_PERIOD_SECONDS,
        "timeoutSeconds": 5,
        "successThreshold": 1,
        # the kubelet gives up (and the pod fails: restartPolicy Never) after failureThreshold * periodSeconds
        "failureThreshold": max(1, math.ceil(startup_timeout / STARTUP_PERIOD_SECONDS)),
    })


def _flagcx_defaults(container: dict[str, Any], env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """FLAGCX_USE_HETERO_COMM=1 and the IPC_LOCK capability (RDMA memory registration pins the KV cache; added back
    after the default drop of every capability), unless the template already decides them."""
    names = {e.get("name") for e in env}
    env = env + [{"name": k, "value": v} for k, v in FLAGCX_ENV_DEFAULTS.items() if k not in names]
    security = container.setdefault("securityContext", {})
    if security.get("privileged"):
        return env  # a privileged container has every capability
    capabilities = security.setdefault("capabilities", {})
    if FLAGCX_CAPABILITY not in (capabilities.get("drop") or []) and FLAGCX_CAPABILITY not in (
            capabilities.get("add") or []):
        capabilities["add"] = list(capabilities.get("add") or []) + [FLAGCX_CAPABILITY]
    return env


def _locked_down(pod: dict[str, Any], container: dict[str, Any]) -> None:
    """The security defaults of the operator's container and its pod, each only where the template left that field
    unset (a value the template wrote wins, at the container's or, for the fields a pod-level securityContext also
    has, the pod's level):
    - pod `automountServiceAccountToken: false`: no process of the pair calls the Kubernetes API;
    - `runAsNonRoot: true`, unless the template runs the container as uid 0 (runAsUser 0, an explicit choice);
    - `seccompProfile: RuntimeDefault`;
    - `allowPrivilegeEscalation: false`, unless privileged or adding SYS_ADMIN (the apiserver refuses either beside it);
    - `capabilities.drop: [ALL]`, unless privileged or the template's capabilities name a drop list; what the template
      adds stays added (FlagCX's IPC_LOCK included, _flagcx_defaults).
    """
    spec = pod["spec"]
    spec.setdefault("automountServiceAccountToken", False)
    pod_security = spec.get("securityContext") or {}
    if container.get("securityContext") is None:
        container["securityContext"] = {}
    security = container["securityContext"]

    def decided(field: str) -> bool:  # set at the container's level, or at the pod's where a pod has the field
        return security.get(field) is not None or pod_security.get(field) is not None

    run_as = security.get("runAsUser") if security.get("runAsUser") is not None else pod_security.get("runAsUser")
    if not decided("runAsNonRoot") and run_as != 0:
        security["runAsNonRoot"] = True
    if not decided("seccompProfile"):
        security["seccompProfile"] = dict(SECCOMP_DEFAULT)
    privileged = bool(security.get("privileged"))
    capabilities = security.get("capabilities") or {}
    if security.get("allowPrivilegeEscalation") is None and not privileged and not (
            ESCALATING_CAPABILITIES & set(capabilities.get("add") or [])):
        security["allowPrivilegeEscalation"] = False
    if not privileged and capabilities.get("drop") is None:
        security["capabilities"] = {**capabilities, "drop": ["ALL"]}


def _quantities_as_strings(pod: dict[str, Any]) -> dict[str, Any]:
    """Writes every resource quantity of the pod as a string, in place.

    The CRD takes quantities as int-or-string (`nvidia.com/gpu: 2`, like a pod does), but the kubernetes client's
    V1Pod model, which the operator creates pods through, accepts only strings there.
    """
    def fix_map(node: Any, *keys: str) -> None:
        for key in keys:
            values = node.get(key) if isinstance(node, dict) else None
            if isinstance(values, dict):
                for name, value in values.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        values[name] = str(value)

    def fix_value(node: Any, key: str) -> None:
        if isinstance(node, dict) and isinstance(node.get(key), (int, float)) and not isinstance(node[key], bool):
            node[key] = str(node[key])

    def fix_downward(items: Any) -> None:
        for item in items or []:
            fix_value(item.get("resourceFieldRef"), "divisor")

    spec = pod["spec"]
    fix_map(spec.get("resources"), "limits", "requests")
    fix_map(spec, "overhead")
    for container in list(spec.get("containers") or []) + list(spec.get("initContainers") or []):
        fix_map(container.get("resources"), "limits", "requests")
        for env in container.get("env") or []:
            fix_value((env.get("valueFrom") or {}).get("resourceFieldRef"), "divisor")
    for volume in spec.get("volumes") or []:
        fix_value(volume.get("emptyDir"), "sizeLimit")
        claim = ((volume.get("ephemeral") or {}).get("volumeClaimTemplate") or {}).get("spec") or {}
        fix_map(claim.get("resources"), "limits", "requests")
        fix_downward((volume.get("downwardAPI") or {}).get("items"))
        for source in (volume.get("projected") or {}).get("sources") or []:
            fix_downward((source.get("downwardAPI") or {}).get("items"))
    return pod


def _add_preflight(pod: dict[str, Any], container: dict[str, Any]) -> None:
    """The port preflight in front of `container`'s command (it runs right before the engine, after every init
    container of the template), checking every containerPort of `container`. Only on the host network: a pod
    network is private."""
    spec = pod["spec"]
    if spec.get("initContainers"):
        spec["initContainers"] = [c for c in spec["initContainers"] if c.get("name") != LEGACY_PREFLIGHT_CONTAINER]
        if not spec["initContainers"]:
            del spec["initContainers"]
    if not spec.get("hostNetwork"):
        return
    ports = [str(p["containerPort"]) for p in container.get("ports") or []]
    container["command"] = [*PREFLIGHT_COMMAND, *ports, PREFLIGHT_SEPARATOR, *container["command"]]
