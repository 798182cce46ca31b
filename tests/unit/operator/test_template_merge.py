"""The template merge (pods.py): every user field survives, every operator-owned field wins.

The CRD refuses operator-owned fields at admission (tests/e2e/test_crd_validation.py lists those refusals); here the
merge is fed them anyway (a body that bypassed the apiserver) and must still produce the operator's value.
"""

import copy
import math

import pytest

from tests.pod_commands import without_preflight
from pdpair import contract as c
from pdpair.operator.build.pod_defaults import STARTUP_PERIOD_SECONDS
from pdpair.operator.build.pods import (
    ENGINE_CONTAINER,
    ROUTER_CONTAINER,
    engine_pod,
    router_pod,
)
from pdpair.operator.decide.port_blocks import assign, port_of, status_ports
from tests.port_blocks_support import spec_blocks
from pdpair.router.config import RouterConfig
from tests.crd_defaults import with_crd_defaults

VOLUMES = [
    {"name": "models", "persistentVolumeClaim": {"claimName": "model-cache", "readOnly": True}},
    {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
]
SIDECAR = {"name": "log-shipper", "image": "fluent-bit:3", "args": ["-c", "/etc/fb.conf"],
           "ports": [{"name": "fb-metrics", "containerPort": 2020}]}
INIT = {"name": "fetch-model", "image": "hf-cli:1", "command": ["hf", "download", "tiny"],
        "volumeMounts": [{"name": "models", "mountPath": "/models"}]}
USER_PROBE = {"httpGet": {"path": "/v1/models", "port": "http"}, "periodSeconds": 7, "failureThreshold": 2}
# The operator's container security defaults, where a template leaves them unset (pod_defaults._locked_down)
LOCKED = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}, "allowPrivilegeEscalation": False,
          "capabilities": {"drop": ["ALL"]}}


def template() -> dict:
    return {
        "metadata": {"labels": {"team": "ml", "kueue.x-k8s.io/queue-name": "gpu"},
                     "annotations": {"example.com/owner": "alice"}},
        "spec": {
            "volumes": copy.deepcopy(VOLUMES),
            "initContainers": [copy.deepcopy(INIT)],
            "containers": [
                copy.deepcopy(SIDECAR),
                {"name": ENGINE_CONTAINER,
                 "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True},
                                  {"name": "shm", "mountPath": "/dev/shm"}],
                 "resources": {"limits": {"nvidia.com/gpu": 2}},
                 "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
                 "securityContext": {"runAsUser": 1000},
                 "workingDir": "/work"},
            ],
            "securityContext": {"fsGroup": 2000},
            "imagePullSecrets": [{"name": "regcred"}],
            "priorityClassName": "inference-high",
            "schedulerName": "volcano",
            "serviceAccountName": "vllm",
            "runtimeClassName": "nvidia",
            "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                           "whenUnsatisfiable": "DoNotSchedule"}],
            "terminationGracePeriodSeconds": 120,
            "nodeSelector": {"gpu": "h200"},
        },
    }


def pair(transport: str = "tcp", **spec_extra) -> dict:
    return with_crd_defaults({
        "metadata": {"name": "demo", "namespace": "ns1", "uid": "uid-1"},
        "spec": {
            "model": "/models/tiny", "image": "img:1",
            "decode": {"tensorParallelSize": 2, "template": template()},
            "prefill": {"tensorParallelSize": 2, "template": template()},
            "connector": {"transport": transport, "hangTimeoutSeconds": 30, "slots": 64},
            "network": {"hostNetwork": True},
            **spec_extra,
        },
    })


def leased(p):
    ports, nxt = [], 20000
    for block in spec_blocks(p["spec"]):
        ports += assign(block, nxt)
        nxt += block.count
    return status_ports(ports)


def build(p, role="decode"):
    if role == "router":
        return router_pod(p, 3, leased(p), "hash", "10.0.0.1", "10.0.0.2")
    return engine_pod(p, role, 3, leased(p), "hash", peer_host="10.0.0.2" if role == "prefill" else None)


def container(pod, name):
    [found] = [x for x in pod["spec"]["containers"] if x["name"] == name]
    return found


def env(cont):
    return {e["name"]: e for e in cont["env"]}


# --- user fields survive ------------------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_every_user_pod_field_survives(role):
    pod = build(pair(), role)
    spec = pod["spec"]
    assert spec["volumes"] == VOLUMES
    assert spec["initContainers"] == [INIT]  # the operator adds none: its port preflight runs in the engine's command
    # The apiserver fills the port's protocol (a map-list key, so the generated CRD keeps its default).
    assert container(pod, "log-shipper") == {**SIDECAR, "ports": [{**SIDECAR["ports"][0], "protocol": "TCP"}]}
    assert spec["securityContext"] == {"fsGroup": 2000}
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    for key, value in (("priorityClassName", "inference-high"), ("schedulerName", "volcano"),
                       ("serviceAccountName", "vllm"), ("runtimeClassName", "nvidia"),
                       ("terminationGracePeriodSeconds", 120), ("nodeSelector", {"gpu": "h200"})):
        assert spec[key] == value, key
    assert spec["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
    assert labels["team"] == "ml" and labels["kueue.x-k8s.io/queue-name"] == "gpu"
    assert annotations["example.com/owner"] == "alice"


def test_every_user_engine_container_field_survives():
    engine = container(build(pair()), ENGINE_CONTAINER)
    assert engine["volumeMounts"] == [{"name": "models", "mountPath": "/models", "readOnly": True},
                                      {"name": "shm", "mountPath": "/dev/shm"}]
    assert engine["resources"] == {"limits": {"nvidia.com/gpu": "2"}}  # as a string: see the quantities test
    assert engine["securityContext"] == {"runAsUser": 1000, **LOCKED}  # tcp: no FlagCX capability added
    assert engine["workingDir"] == "/work"
    assert env(engine)["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}


def test_user_probes_win_over_the_defaults():
    p = pair()
    engine_tmpl = p["spec"]["decode"]["template"]["spec"]["containers"][1]
    engine_tmpl["readinessProbe"] = copy.deepcopy(USER_PROBE)
    engine_tmpl["startupProbe"] = {"tcpSocket": {"port": "http"}, "failureThreshold": 5}
    engine = container(build(p), ENGINE_CONTAINER)
    assert engine["readinessProbe"] == USER_PROBE
    assert engine["startupProbe"] == {"tcpSocket": {"port": "http"}, "failureThreshold": 5}


def test_user_may_override_the_operator_defaults_of_dns_and_service_links():
    p = pair()
    p["spec"]["decode"]["template"]["spec"].update(dnsPolicy="Default", enableServiceLinks=True)
    spec = build(p)["spec"]
    assert (spec["dnsPolicy"], spec["enableServiceLinks"]) == ("Default", True)
    plain = build(pair())["spec"]
    assert (plain["dnsPolicy"], plain["enableServiceLinks"]) == ("ClusterFirstWithHostNet", False)


def test_the_pair_spec_is_not_modified():
    p = pair("flagcx")
    before = copy.deepcopy(p)
    for role in ("decode", "prefill", "router"):
        build(p, role)
    assert p == before


# --- operator-owned fields win ------------------------------------------------------------------------------
OWNED = {
    # what the user (wrongly) sets in the template -> how the pod must look anyway
    "restartPolicy": (lambda t: t["spec"].update(restartPolicy="Always"),
                      lambda pod: pod["spec"]["restartPolicy"] == "Never"),
    "hostNetwork": (lambda t: t["spec"].update(hostNetwork=False),
                    lambda pod: pod["spec"]["hostNetwork"] is True),
    "ephemeralContainers": (lambda t: t["spec"].update(ephemeralContainers=[{"name": "dbg", "image": "busybox"}]),
                            lambda pod: "ephemeralContainers" not in pod["spec"]),
    "engine command": (lambda t: _engine(t).update(command=["sleep", "inf"]),
                       lambda pod: without_preflight(container(pod, ENGINE_CONTAINER)["command"])[:3] == [
                           "python", "-m", "vllm.entrypoints.openai.api_server"]),
    "engine args": (lambda t: _engine(t).update(args=["--port", "1"]),
                    lambda pod: "args" not in container(pod, ENGINE_CONTAINER)),
    "engine image": (lambda t: _engine(t).update(image="evil:1"),
                     lambda pod: container(pod, ENGINE_CONTAINER)["image"] == "img:1"),
    "engine ports": (lambda t: _engine(t).update(ports=[{"name": "http", "containerPort": 8000}]),
                     lambda pod: {p["name"] for p in container(pod, ENGINE_CONTAINER)["ports"]}
                     == {"http", "metrics", "side-0", "side-1"}
                     and 8000 not in [p["containerPort"] for p in container(pod, ENGINE_CONTAINER)["ports"]]),
    "PDPAIR_ env": (lambda t: _engine(t)["env"].append({"name": c.ENV_ROLE, "value": "prefill"}),
                    lambda pod: [e["value"] for e in container(pod, ENGINE_CONTAINER)["env"]
                                 if e["name"] == c.ENV_ROLE] == ["decode"]),
    "pdpair.io/ label": (lambda t: t["metadata"]["labels"].update({c.LABEL_ROLE: "router", c.LABEL_GENERATION: "9"}),
                         lambda pod: pod["metadata"]["labels"][c.LABEL_ROLE] == "decode"
                         and pod["metadata"]["labels"][c.LABEL_GENERATION] == "3"),
    "spec-hash annotation": (lambda t: t["metadata"]["annotations"].update({c.ANNOTATION_SPEC_HASH: "x"}),
                             lambda pod: pod["metadata"]["annotations"][c.ANNOTATION_SPEC_HASH] == "hash"),
    "metadata name": (lambda t: t["metadata"].update(name="mine", namespace="other", generateName="x-"),
                      lambda pod: (pod["metadata"]["name"], pod["metadata"]["namespace"]) == ("demo-decode-g3", "ns1")
                      and "generateName" not in pod["metadata"]),
}


def _engine(t):
    return t["spec"]["containers"][1]


@pytest.mark.parametrize("field", sorted(OWNED))
def test_operator_owned_field_wins(field):
    set_it, holds = OWNED[field]
    p = pair()
    set_it(p["spec"]["decode"]["template"])
    assert holds(build(p)), field


def test_engine_container_is_created_first_when_absent():
    p = pair()
    p["spec"]["decode"]["template"] = {"spec": {"containers": [copy.deepcopy(SIDECAR)]}}
    pod = build(p)
    assert [x["name"] for x in pod["spec"]["containers"]] == [ENGINE_CONTAINER, "log-shipper"]
    no_template = pair()
    del no_template["spec"]["decode"]["template"]
    assert [x["name"] for x in build(no_template)["spec"]["containers"]] == [ENGINE_CONTAINER]


def test_engine_container_keeps_its_place_when_present():
    assert [x["name"] for x in build(pair())["spec"]["containers"]] == ["log-shipper", ENGINE_CONTAINER]


def test_shorthand_fields_still_apply():
    p = pair()
    p["spec"]["decode"] = {"tensorParallelSize": 2, "resources": {"limits": {"cpu": "4"}},
                           "env": [{"name": "FOO", "value": "1"}], "nodeSelector": {"a": "b"},
                           "tolerations": [{"key": "k", "operator": "Exists"}]}
    pod = build(p)
    engine = container(pod, ENGINE_CONTAINER)
    assert engine["resources"] == {"limits": {"cpu": "4"}} and env(engine)["FOO"]["value"] == "1"
    assert pod["spec"]["nodeSelector"] == {"a": "b"} and pod["spec"]["tolerations"][0]["key"] == "k"


# --- probes ---------------------------------------------------------------------------------------------------
def contract_wait(probe: dict) -> float:
    """The hold a probe asks for (its path's ?wait=), parsed as the connector and the router parse it."""
    from urllib.parse import parse_qs, urlsplit

    return c.parse_probe_wait(parse_qs(urlsplit(probe["httpGet"]["path"]).query)[c.PROBE_WAIT_PARAM][0])


def test_default_probes_start_on_health_and_ready_through_the_connectors_readyz():
    """Decode: started = the connector's /startupz (vLLM's /health); Ready = the connector's /readyz (the engine serves
    and its warm-up completion is done); both held while they fail (`?wait=`), with a timeout above the hold plus one
    check's own bound."""
    from pdpair.connector.pod_server import ENGINE_HEALTH_TIMEOUT_SECONDS
    from pdpair.operator.build.pod_defaults import PROBE_WAIT_SECONDS

    engine = container(build(pair()), ENGINE_CONTAINER)
    assert engine["startupProbe"]["httpGet"] == {"path": f"{c.STARTUPZ_PATH}?wait={PROBE_WAIT_SECONDS}",
                                                 "port": c.METRICS_PORT_NAME, "scheme": "HTTP"}
    assert engine["readinessProbe"]["httpGet"] == {"path": f"{c.READYZ_PATH}?wait={PROBE_WAIT_SECONDS}",
                                                   "port": c.METRICS_PORT_NAME, "scheme": "HTTP"}
    assert {c.HTTP_PORT_NAME, c.METRICS_PORT_NAME} <= {p["name"] for p in engine["ports"]}
    startup = engine["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 1800  # the 30-minute default window
    for probe in (startup, engine["readinessProbe"]):
        assert PROBE_WAIT_SECONDS + ENGINE_HEALTH_TIMEOUT_SECONDS < probe["timeoutSeconds"]
    assert contract_wait(startup) == PROBE_WAIT_SECONDS <= c.PROBE_WAIT_MAX_SECONDS


def test_prefill_is_ready_once_paired_through_the_connectors_readyz():
    """Prefill starts beside decode and pairs when decode's listener accepts: its readiness is the connector's
    /readyz on the metrics port (paired on every rank, engine serving); its startup probe the engine's /health through
    the connector's /startupz."""
    engine = container(build(pair(), "prefill"), ENGINE_CONTAINER)
    assert engine["readinessProbe"]["httpGet"]["path"].startswith(c.READYZ_PATH + "?")
    assert engine["startupProbe"]["httpGet"]["path"].startswith(c.STARTUPZ_PATH + "?")
    assert engine["readinessProbe"]["httpGet"]["port"] == engine["startupProbe"]["httpGet"]["port"] == c.METRICS_PORT_NAME
    assert c.METRICS_PORT_NAME in {p["name"] for p in engine["ports"]}


@pytest.mark.parametrize("seconds", [60, 95, 7200])
def test_startup_window_follows_the_spec(seconds):
    startup = container(build(pair(startupTimeoutSeconds=seconds)), ENGINE_CONTAINER)["startupProbe"]
    assert startup["failureThreshold"] == math.ceil(seconds / STARTUP_PERIOD_SECONDS)
    assert startup["periodSeconds"] * startup["failureThreshold"] >= seconds


def test_router_gets_a_readiness_probe_and_keeps_its_template():
    p = pair()
    p["spec"]["router"] = {"enabled": True, "template": {
        "metadata": {"labels": {"team": "edge"}},
        "spec": {"containers": [{"name": ROUTER_CONTAINER, "resources": {"requests": {"cpu": "100m"}}},
                                copy.deepcopy(SIDECAR)],
                 "priorityClassName": "edge", "tolerations": [{"key": "edge", "operator": "Exists"}]}}}
    pod = build(p, "router")
    router = container(pod, ROUTER_CONTAINER)
    # /readyz: the router is created while the engines load, and is Ready only once a prefill and a decode are; it
    # asks each engine pod's own readiness (its /readyz on the metrics port)
    assert router["readinessProbe"]["httpGet"] == {"path": "/readyz?wait=1", "port": c.HTTP_PORT_NAME, "scheme": "HTTP"}
    assert (router["readinessProbe"]["periodSeconds"], router["readinessProbe"]["failureThreshold"]) == (1, 16)
    assert contract_wait(router["readinessProbe"]) + RouterConfig.ready_check_timeout_seconds < \
        router["readinessProbe"]["timeoutSeconds"]
    command, ports = router["command"], leased(p)
    for flag, host, role in (("--prefill-ready", "10.0.0.1", "prefill"), ("--decode-ready", "10.0.0.2", "decode")):
        metrics = port_of(ports, role, c.PURPOSE_METRICS)
        assert command[command.index(flag) + 1] == f"http://{host}:{metrics}/readyz", command
    assert router["resources"] == {"requests": {"cpu": "100m"}}
    assert without_preflight(router["command"])[:3] == ["python", "-m", "pdpair.router"] and router["image"] == "img:1"
    assert container(pod, "log-shipper") == SIDECAR
    assert pod["metadata"]["labels"]["team"] == "edge" and pod["metadata"]["labels"][c.LABEL_ROLE] == "router"
    assert pod["spec"]["priorityClassName"] == "edge"
    # its own tolerations win; decode's nodeSelector (from decode's template) is copied since it sets none
    assert pod["spec"]["tolerations"] == [{"key": "edge", "operator": "Exists"}]
    assert pod["spec"]["nodeSelector"] == {"gpu": "h200"}
    assert pod["spec"]["restartPolicy"] == "Never"


# --- FlagCX defaults ------------------------------------------------------------------------------------------
def test_flagcx_sets_hetero_comm_and_ipc_lock():
    engine = container(build(pair("flagcx")), ENGINE_CONTAINER)
    assert env(engine)["FLAGCX_USE_HETERO_COMM"]["value"] == "1"
    assert engine["securityContext"] == {"runAsUser": 1000, **LOCKED,
                                         "capabilities": {"add": ["IPC_LOCK"], "drop": ["ALL"]}}


def test_tcp_sets_neither():
    engine = container(build(pair("tcp")), ENGINE_CONTAINER)
    assert "FLAGCX_USE_HETERO_COMM" not in env(engine)
    assert engine["securityContext"]["capabilities"] == {"drop": ["ALL"]}


@pytest.mark.parametrize("security, expected", [
    ({"capabilities": {"drop": ["IPC_LOCK"]}}, {**LOCKED, "capabilities": {"drop": ["IPC_LOCK"]}}),
    ({"capabilities": {"add": ["IPC_LOCK", "NET_RAW"]}},
     {**LOCKED, "capabilities": {"add": ["IPC_LOCK", "NET_RAW"], "drop": ["ALL"]}}),
    # privileged has every capability: no drop, and allowPrivilegeEscalation false would be refused beside it
    ({"privileged": True}, {"privileged": True, "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}),
    ({"capabilities": {"drop": ["ALL"]}}, {**LOCKED, "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}),
])
def test_flagcx_capability_respects_the_template(security, expected):
    p = pair("flagcx")
    _engine(p["spec"]["decode"]["template"])["securityContext"] = security
    assert container(build(p), ENGINE_CONTAINER)["securityContext"] == expected


def test_flagcx_env_respects_the_template():
    p = pair("flagcx")
    _engine(p["spec"]["decode"]["template"])["env"].append({"name": "FLAGCX_USE_HETERO_COMM", "value": "0"})
    values = [e["value"] for e in container(build(p), ENGINE_CONTAINER)["env"] if e["name"] == "FLAGCX_USE_HETERO_COMM"]
    assert values == ["0"]


# --- each operator-owned template field has its admission rule in the CRD -----------------------------------
def _rules(node):
    return {(r.get("fieldPath"), r["message"].split(" must")[0]) for r in node.get("x-kubernetes-validations", [])}


@pytest.fixture(scope="module")
def crd():
    import yaml
    from pathlib import Path

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    path = Path(__file__).resolve().parents[3] / "charts/pdpair/crds/inferencepairs.pdpair.io.yaml"
    return yaml.load(path.read_text(), Loader=loader)


@pytest.mark.parametrize("role, main", [("prefill", ENGINE_CONTAINER), ("decode", ENGINE_CONTAINER),
                                        ("router", ROUTER_CONTAINER)])
def test_every_owned_template_field_has_a_cel_rule(crd, role, main):
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    template = spec[role]["properties"]["template"]
    paths = {p for p, _ in _rules(template["properties"]["metadata"])}
    assert paths == {".name", ".generateName", ".namespace", ".labels", ".annotations"}
    paths = {p for p, _ in _rules(template["properties"]["spec"])}
    assert paths == {".restartPolicy", ".hostNetwork", ".initContainers"}
    assert "ephemeralContainers" not in template["properties"]["spec"]["properties"]
    item_rules = _rules(template["properties"]["spec"]["properties"]["containers"]["items"])
    assert {p for p, _ in item_rules} == {".command", ".args", ".image", ".ports", ".env"}
    assert {m for _, m in item_rules} >= {f"containers[{main}].{f}" for f in ("command", "args", "image", "ports")}
    if role != "router":  # the shorthand conflicts live on the role object
        assert {p for p, _ in _rules(spec[role])} == {".resources", ".env", ".nodeSelector", ".tolerations",
                                                     ".affinity"}


def test_quantities_become_strings_for_the_client_model():
    """The CRD keeps `nvidia.com/gpu: 2` as a number; the client's V1Pod model takes only strings there."""
    from kubernetes.client import V1Pod

    p = pair()
    tmpl = p["spec"]["decode"]["template"]["spec"]
    tmpl["volumes"].append({"name": "scratch", "emptyDir": {"sizeLimit": 1073741824}})
    tmpl["initContainers"][0]["resources"] = {"requests": {"cpu": 0.5}}
    _engine(p["spec"]["decode"]["template"])["env"].append(
        {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": 1}}})
    pod = build(p)
    engine = container(pod, ENGINE_CONTAINER)
    assert engine["resources"] == {"limits": {"nvidia.com/gpu": "2"}}
    assert pod["spec"]["initContainers"][0]["resources"] == {"requests": {"cpu": "0.5"}}
    assert pod["spec"]["volumes"][-1]["emptyDir"]["sizeLimit"] == "1073741824"
    assert env(engine)["MEM"]["valueFrom"]["resourceFieldRef"]["divisor"] == "1"
    V1Pod.from_dict(pod)  # raises on a number where the model wants a string
    assert p["spec"]["decode"]["template"]["spec"]["containers"][1]["resources"] == {"limits": {"nvidia.com/gpu": 2}}


# --- locked down by default -----------------------------------------------------------------------------------
def bare_pair(transport: str = "tcp") -> dict:
    return with_crd_defaults({"metadata": {"name": "demo", "namespace": "ns1", "uid": "uid-1"},
                              "spec": {"model": "m", "image": "img:1", "connector": {"transport": transport}}})


@pytest.mark.parametrize("role", ["decode", "prefill", "router"])
@pytest.mark.parametrize("transport", ["tcp", "flagcx"])
def test_pods_are_locked_down_without_a_template(role, transport):
    pod = build(bare_pair(transport), role)
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert "securityContext" not in pod["spec"]  # the container's, so a template's pod-level context stays its own
    main = container(pod, ROUTER_CONTAINER if role == "router" else ENGINE_CONTAINER)
    add = ["IPC_LOCK"] if transport == "flagcx" and role != "router" else []  # only FlagCX engines get one back
    assert main["securityContext"] == {**LOCKED, "capabilities": {"drop": ["ALL"], **({"add": add} if add else {})}}


def _template_with(role: str, pod_security: dict | None = None, security: dict | None = None,
                   **pod_fields) -> dict:
    name = ROUTER_CONTAINER if role == "router" else ENGINE_CONTAINER
    spec: dict = {"containers": [{"name": name, **({"securityContext": security} if security is not None else {})}],
                  **pod_fields}
    if pod_security is not None:
        spec["securityContext"] = pod_security
    return {"spec": spec}


@pytest.mark.parametrize("role", ["decode", "router"])
@pytest.mark.parametrize("pod_security, security, expected", [
    # each field the template writes wins, the others keep their default
    (None, {"runAsNonRoot": False}, {**LOCKED, "runAsNonRoot": False}),
    ({"runAsNonRoot": False}, None, {k: v for k, v in LOCKED.items() if k != "runAsNonRoot"}),
    (None, {"runAsUser": 0}, {"runAsUser": 0, **{k: v for k, v in LOCKED.items() if k != "runAsNonRoot"}}),
    ({"runAsUser": 0}, None, {k: v for k, v in LOCKED.items() if k != "runAsNonRoot"}),
    (None, {"runAsUser": 1000}, {"runAsUser": 1000, **LOCKED}),
    ({"seccompProfile": {"type": "Unconfined"}}, None, {k: v for k, v in LOCKED.items() if k != "seccompProfile"}),
    (None, {"seccompProfile": {"type": "Localhost", "localhostProfile": "vllm.json"}},
     {**LOCKED, "seccompProfile": {"type": "Localhost", "localhostProfile": "vllm.json"}}),
    (None, {"allowPrivilegeEscalation": True}, {**LOCKED, "allowPrivilegeEscalation": True}),
    (None, {"capabilities": {"drop": []}}, {**LOCKED, "capabilities": {"drop": []}}),
    (None, {"capabilities": {"add": ["NET_RAW"]}}, {**LOCKED, "capabilities": {"add": ["NET_RAW"], "drop": ["ALL"]}}),
    # the apiserver refuses allowPrivilegeEscalation false beside SYS_ADMIN or privileged: left unset there
    (None, {"capabilities": {"add": ["SYS_ADMIN"]}},
     {**{k: v for k, v in LOCKED.items() if k != "allowPrivilegeEscalation"},
      "capabilities": {"add": ["SYS_ADMIN"], "drop": ["ALL"]}}),
    (None, {"privileged": True}, {"privileged": True, "runAsNonRoot": True,
                                  "seccompProfile": {"type": "RuntimeDefault"}}),
])
def test_a_templates_security_field_wins_over_the_default(role, pod_security, security, expected):
    p = bare_pair()
    p["spec"][role]["template"] = _template_with(role, pod_security, security)
    pod = build(p, role)
    main = container(pod, ROUTER_CONTAINER if role == "router" else ENGINE_CONTAINER)
    assert main["securityContext"] == expected
    if pod_security is not None:
        assert pod["spec"]["securityContext"] == pod_security  # the pod's level is never written


@pytest.mark.parametrize("role", ["prefill", "router"])
def test_a_template_may_mount_the_service_account_token(role):
    p = bare_pair()
    p["spec"][role]["template"] = _template_with(role, automountServiceAccountToken=True, serviceAccountName="vllm")
    spec = build(p, role)["spec"]
    assert spec["automountServiceAccountToken"] is True and spec["serviceAccountName"] == "vllm"


def test_sidecars_and_init_containers_keep_their_own_security():
    """Only the operator's container is locked down: the template's other containers are the user's."""
    pod = build(pair())
    assert "securityContext" not in container(pod, "log-shipper")
    assert pod["spec"]["initContainers"] == [INIT]


def test_a_roles_instances_prefer_distinct_nodes_unless_the_role_says_how_to_spread():
    """By default each engine pod carries a preferred pod anti-affinity term against its own role and generation
    (one lost node takes one instance of a role); a node affinity the user set is kept beside it; a role that sets
    its own podAntiAffinity or topologySpreadConstraints keeps only that; router replicas spread the same way."""
    from pdpair.contract import LABEL_GENERATION, LABEL_PAIR_UID, LABEL_ROLE
    from pdpair.operator.build.pods import SPREAD_TOPOLOGY_KEY

    p = pair()
    constraints = p["spec"]["decode"]["template"]["spec"].pop("topologySpreadConstraints")
    pod = build(p)
    terms = pod["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert len(terms) == 1 and terms[0]["podAffinityTerm"]["topologyKey"] == SPREAD_TOPOLOGY_KEY
    selector = terms[0]["podAffinityTerm"]["labelSelector"]["matchLabels"]
    assert selector == {k: pod["metadata"]["labels"][k] for k in (LABEL_PAIR_UID, LABEL_ROLE, LABEL_GENERATION)}
    assert selector[LABEL_ROLE] == "decode"
    node_affinity = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}}
    p["spec"]["decode"]["template"]["spec"]["affinity"] = {"nodeAffinity": node_affinity}
    pod = build(p)
    assert pod["spec"]["affinity"]["nodeAffinity"] == node_affinity and "podAntiAffinity" in pod["spec"]["affinity"]
    own = {"requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": {"matchLabels": {"a": "b"}},
                                                                "topologyKey": "rack"}]}
    p["spec"]["decode"]["template"]["spec"]["affinity"] = {"podAntiAffinity": own}
    assert build(p)["spec"]["affinity"] == {"podAntiAffinity": own}
    del p["spec"]["decode"]["template"]["spec"]["affinity"]
    p["spec"]["decode"]["template"]["spec"]["topologySpreadConstraints"] = constraints
    assert "affinity" not in build(p)["spec"]
    router = build(p, "router")  # its replicas spread too (decode's own constraints are not the router's)
    term = router["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"][LABEL_ROLE] == "router"
