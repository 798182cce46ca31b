"""The operator's pods on a real control plane (kwok nodes) carry the user's pod templates, the ordered startup still
holds, and a prefill that never becomes ready leaves the pair PrefillStarting (no Ready, no restart). The live pods, read
back from the API, carry the security defaults where no template decided (and the template's values where one did), and
the engines the side-channel key's secretKeyRef.

The operator runs as `python -m pdpair.operator` under the chart's ServiceAccount (tests/e2e/operator_helpers.py).
kwok plays no probes: a pod labelled NEVER_READY_LABEL runs but stays not Ready (devcluster/kwok.py).
"""

from __future__ import annotations

import socket
import time

import pytest

from pdpair.contract import (
    COND_PREFILL_READY,
    COND_READY,
    ENV_SIDE_CHANNEL_KEY,
    SIDE_CHANNEL_SECRET_KEY,
    LABEL_INSTANCE,
    LABEL_ROLE,
    PURPOSE_SIDECHANNEL,
    ROLE_DECODE,
    STARTUPZ_PATH,
)
from pdpair.operator.model.config import ENV_HEALTH_INTERVAL
from pdpair.operator.build.pod_defaults import held_path
from pdpair.operator.build.pods import side_channel_secret_name
from tests.pod_commands import without_preflight
from devcluster.kwok import NEVER_READY_LABEL
from tests.e2e.operator_helpers import (
    Api,
    PodRecorder,
    cleanup_pairs,
    condition,
    operator,
    pool_of_free_ports,
)
from devcluster.waiting import wait_for

pytestmark = pytest.mark.cluster

GANG_SCHEDULER = "test-gang-scheduler"  # no such scheduler runs: the test binds these pods itself
PRIORITY_CLASS = "pdpair-test-high"
PROBE = {"httpGet": {"path": "/v1/models", "port": "http"}, "periodSeconds": 7, "failureThreshold": 4}
SIDECAR = {"name": "log-shipper", "image": "busybox:1", "args": ["sleep", "infinity"]}
# The operator's container security defaults where a template leaves a field unset (pod_defaults._locked_down)
LOCKED = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}, "allowPrivilegeEscalation": False,
          "capabilities": {"drop": ["ALL"]}}


def template(role: str) -> dict:
    return {
        "metadata": {"labels": {"team": "ml"}, "annotations": {"example.com/owner": role}},
        "spec": {
            "volumes": [{"name": "models", "emptyDir": {}}, {"name": "shm", "emptyDir": {"medium": "Memory"}}],
            "containers": [
                {"name": "engine",
                 "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True},
                                  {"name": "shm", "mountPath": "/dev/shm"}],
                 "readinessProbe": PROBE,
                 "resources": {"limits": {"cpu": 1, "memory": "1Gi"}},  # a number, as users write it
                 "securityContext": {"runAsUser": 1000, "allowPrivilegeEscalation": False}},
                SIDECAR,
            ],
            "securityContext": {"runAsNonRoot": True, "fsGroup": 2000},
            "imagePullSecrets": [{"name": "regcred"}],
            "priorityClassName": PRIORITY_CLASS,
            "schedulerName": GANG_SCHEDULER,
        },
    }


def ensure_priority_class(cluster) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    try:
        client.SchedulingV1Api(cluster.api_client()).create_priority_class(
            {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": PRIORITY_CLASS},
             "value": 1000})
    except ApiException as exc:
        if exc.status != 409:
            raise


def bind_gang_pods(api: Api, ns: str, node: str) -> None:
    """Play the gang scheduler: bind every unbound pod that names it (the default scheduler leaves them alone)."""
    from kubernetes.client.exceptions import ApiException

    for pod in api.pods(ns):
        if pod["spec"].get("scheduler_name") == GANG_SCHEDULER and not pod["spec"].get("node_name"):
            body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod["metadata"]["name"]},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
            try:
                api.core.create_namespaced_binding(ns, body, _preload_content=False)
            except ApiException as exc:
                if exc.status not in (404, 409):
                    raise


def pod_of(api: Api, ns: str, role: str) -> dict | None:
    """The role's instance 0 (router 0 of the router replicas)."""
    return next((p for p in api.pods(ns) if p["metadata"]["labels"].get(LABEL_ROLE) == role
                 and p["metadata"]["labels"].get(LABEL_INSTANCE, "0") == "0"), None)


def raw_pod(api: Api, ns: str, name: str) -> dict:
    """The pod as the apiserver serves it (camelCase), for comparing with what the template said."""
    return api.core.api_client.sanitize_for_serialization(api.core.read_namespaced_pod(name, ns))


def container(pod: dict, name: str) -> dict:
    return next(c for c in pod["spec"]["containers"] if c["name"] == name)


def check_template_applied(pod: dict, role: str) -> None:
    spec = pod["spec"]
    assert pod["metadata"]["labels"]["team"] == "ml" and pod["metadata"]["labels"][LABEL_ROLE] == role
    assert pod["metadata"]["annotations"]["example.com/owner"] == role
    assert [v["name"] for v in spec["volumes"] if v["name"] in ("models", "shm")] == ["models", "shm"]
    assert next(v for v in spec["volumes"] if v["name"] == "shm")["emptyDir"] == {"medium": "Memory"}
    assert spec["securityContext"] == {"runAsNonRoot": True, "fsGroup": 2000}
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["priorityClassName"] == PRIORITY_CLASS and spec["priority"] == 1000
    assert spec["schedulerName"] == GANG_SCHEDULER
    assert spec["restartPolicy"] == "Never" and spec["hostNetwork"] is True
    sidecar = container(pod, SIDECAR["name"])
    assert (sidecar["image"], sidecar["args"]) == (SIDECAR["image"], SIDECAR["args"])


def check_locked_down(api: Api, ns: str, pods: dict, pair_name: str) -> None:
    """The live pods of a pair without security settings in its templates, read back from the API: every operator
    container locked down, no ServiceAccount token mounted; the engines take the side-channel key from the pair's
    Secret (which exists), the router never."""
    api.core.read_namespaced_secret(side_channel_secret_name(pair_name), ns)  # made before the first engine pod
    for role, listed in pods.items():
        pod = raw_pod(api, ns, listed["metadata"]["name"])
        main = container(pod, "router" if role == "router" else "engine")
        assert main["securityContext"] == LOCKED, role
        assert pod["spec"]["automountServiceAccountToken"] is False, role
        assert not [v for v in pod["spec"].get("volumes") or [] if v["name"].startswith("kube-api-access")], role
        refs = {e["name"]: (e.get("valueFrom") or {}).get("secretKeyRef") for e in main["env"]}
        if role == "router":
            assert ENV_SIDE_CHANNEL_KEY not in refs
        else:
            assert refs[ENV_SIDE_CHANNEL_KEY] == {"name": side_channel_secret_name(pair_name),
                                                  "key": SIDE_CHANNEL_SECRET_KEY}, role


def test_operator_pods_carry_the_templates_and_start_in_order(platform, cluster_namespace, tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    ensure_priority_class(cluster)
    router_template = template("router")
    router_template["spec"]["containers"] = [
        {"name": "router", "readinessProbe": PROBE, "securityContext": {"runAsUser": 1000}}, SIDECAR]
    recorder = PodRecorder(api, ns)
    try:
        with operator(platform, ns, pool_of_free_ports(20), tmp_path):
            api.create_pair(ns, "tpl", connector={"transport": "flagcx"}, router={"enabled": True, "template": router_template},
                            decode={"template": template("decode")}, prefill={"template": template("prefill")})

            def decode_running():
                bind_gang_pods(api, ns, "kwok-op-0")
                pod = pod_of(api, ns, "decode")
                return pod if pod and pod["status"].get("pod_ip") else None

            decode = raw_pod(api, ns, wait_for(decode_running, 60, "the decode pod bound and running")["metadata"]["name"])
            check_template_applied(decode, "decode")
            engine = container(decode, "engine")
            assert engine["readinessProbe"]["httpGet"]["path"] == "/v1/models"  # the user's probe wins
            assert engine["readinessProbe"]["periodSeconds"] == 7
            # the default fills what the user left: the connector's held /startupz
            assert engine["startupProbe"]["httpGet"]["path"] == held_path(STARTUPZ_PATH)
            assert engine["startupProbe"]["periodSeconds"] * engine["startupProbe"]["failureThreshold"] == 1800
            assert engine["resources"]["limits"] == {"cpu": "1", "memory": "1Gi"}
            assert engine["volumeMounts"][:2] == [{"name": "models", "mountPath": "/models", "readOnly": True},
                                                  {"name": "shm", "mountPath": "/dev/shm"}]
            # flagcx: the user's securityContext keeps its fields and gains IPC_LOCK on top of the drop of every
            # other capability; runAsNonRoot stays the template's pod-level one; hetero comm is on
            assert engine["securityContext"] == {
                "runAsUser": 1000, "allowPrivilegeEscalation": False, "seccompProfile": {"type": "RuntimeDefault"},
                "capabilities": {"add": ["IPC_LOCK"], "drop": ["ALL"]}}
            assert decode["spec"]["automountServiceAccountToken"] is False
            assert {e["name"]: e.get("value") for e in engine["env"]}["FLAGCX_USE_HETERO_COMM"] == "1"
            assert engine["image"] == "img:1" and without_preflight(engine["command"])[:3] == [
                "python", "-m", "vllm.entrypoints.openai.api_server"]

            # parallel start, ordered pairing: prefill beside the running decode, the router beside them once prefill
            # runs, but no Ready until decode's listener accepts
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                bind_gang_pods(api, ns, "kwok-op-0")
                assert api.pair(ns, "tpl")["status"].get("phase") != "Ready"
                time.sleep(0.2)
            pair = api.pair(ns, "tpl")
            side = [p["port"] for p in pair["status"]["ports"]
                    if p["role"] == ROLE_DECODE and p["purpose"] == PURPOSE_SIDECHANNEL]
            with socket.socket() as listener:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(("127.0.0.1", side[0]))
                listener.listen(16)

                def ready():
                    bind_gang_pods(api, ns, "kwok-op-0")
                    p = api.pair(ns, "tpl")
                    return p if p["status"].get("phase") == "Ready" else None

                wait_for(ready, 60, "phase Ready")
            for role in ("prefill", "router"):
                pod = raw_pod(api, ns, pod_of(api, ns, role)["metadata"]["name"])
                check_template_applied(pod, role)
            router = container(raw_pod(api, ns, pod_of(api, ns, "router")["metadata"]["name"]), "router")
            assert router["readinessProbe"]["httpGet"]["path"] == "/v1/models"
            assert router["securityContext"] == {"runAsUser": 1000, **{k: v for k, v in LOCKED.items()
                                                                       if k != "runAsNonRoot"}}
            assert without_preflight(router["command"])[:3] == ["python", "-m", "pdpair.router"]
            created = [name.rsplit("-g", 1)[0].rsplit("-", 1)[1] for name in recorder.created()]
            assert created == ["decode", "prefill", "router", "router"], recorder.order()  # router 1 after router 0
            cleanup_pairs(api, ns)
    finally:
        recorder.stop()


def test_a_prefill_that_never_becomes_ready_stays_starting(platform, cluster_namespace, tmp_path):
    """Inside the startup window: no Ready, no restart, the same prefill pod, while the health watch runs (1 s). The
    pair's live pods carry the security defaults and the engines the side-channel key's secretKeyRef (three pod reads,
    well under 1 s added)."""
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    with operator(platform, ns, pool_of_free_ports(20), tmp_path, env={ENV_HEALTH_INTERVAL: "1"}):
        api.create_pair(ns, "slow", router={"enabled": True}, connector={"transport": "tcp"},
                        prefill={"template": {"metadata": {"labels": {NEVER_READY_LABEL[0]: NEVER_READY_LABEL[1]}}}})
        decode = wait_for(lambda: (lambda p: p if p and p["status"].get("pod_ip") else None)(pod_of(api, ns, "decode")),
                          60, "a running decode pod")
        pair = api.pair(ns, "slow")
        side = [p["port"] for p in pair["status"]["ports"]
                if p["role"] == ROLE_DECODE and p["purpose"] == PURPOSE_SIDECHANNEL]
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", side[0]))
            listener.listen(16)
            prefill = wait_for(lambda: (lambda p: p if p and p["status"].get("phase") == "Running" else None)(
                pod_of(api, ns, "prefill")), 60, "a running (not ready) prefill pod")
            ready = {c["type"]: c["status"] for c in prefill["status"]["conditions"]}["Ready"]
            assert ready == "False"
            generation = api.pair(ns, "slow")["status"]["pairGeneration"]
            # The router starts beside the engines once prefill runs; its readiness is theirs, the pair's Ready too.
            router = wait_for(lambda: pod_of(api, ns, "router"), 30, "the router pod beside the loading engines")
            check_locked_down(api, ns, {"decode": decode, "prefill": prefill, "router": router}, "slow")
            # and router replica 1 once router 0 exists (spec.router.replicas' default, 2)
            replica = wait_for(lambda: next((p for p in api.pods(ns) if p["metadata"]["name"] ==
                                             router["metadata"]["name"] + "-1"), None), 30, "router replica 1")
            # Watch well past several health intervals and reconcile passes: the pair must not move.
            observed_for = 20.0
            deadline = time.monotonic() + observed_for
            polls = 0
            while time.monotonic() < deadline:
                pair = api.pair(ns, "slow")
                status = pair["status"]
                assert status["phase"] == "PrefillStarting", status
                assert condition(pair, COND_READY)["status"] == "False"
                assert condition(pair, COND_PREFILL_READY)["status"] == "False"
                assert not status.get("restarts"), status
                assert status["pairGeneration"] == generation
                pods = {p["metadata"]["name"]: p["metadata"]["uid"] for p in api.pods(ns)}
                assert pods == {decode["metadata"]["name"]: decode["metadata"]["uid"],
                                prefill["metadata"]["name"]: prefill["metadata"]["uid"],
                                router["metadata"]["name"]: router["metadata"]["uid"],
                                replica["metadata"]["name"]: replica["metadata"]["uid"]}, pods  # none replaced
                polls += 1
                time.sleep(0.5)
            assert polls >= 10
            reasons = {e.reason for e in api.events(ns)}
            assert not reasons & {"Restarting", "Unhealthy"}, reasons
        cleanup_pairs(api, ns)
