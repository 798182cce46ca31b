"""Pod templates on a real kube-apiserver: every operator-owned field in spec.<role>.template is refused at create
with a message that names the field, a shorthand and its template twin together are refused, and a full template
is accepted and stored as written.

No operator runs here (tests/e2e/test_pod_templates.py runs one).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest

from pdpair import contract
from tests.e2e.test_crd_validation import (
    at,
    both,
    create,
    create_error,
    minimal,
)

pytestmark = pytest.mark.cluster


def engine(**fields: Any) -> dict:
    return {"name": "engine", **fields}


def containers(role: str, *items: dict) -> Callable[[dict], None]:
    return at(f"{role}.template", {"spec": {"containers": list(items)}})


def pod_spec(role: str, **fields: Any) -> Callable[[dict], None]:
    return at(f"{role}.template", {"spec": fields})


def tmeta(role: str, **fields: Any) -> Callable[[dict], None]:
    return at(f"{role}.template", {"metadata": fields})


SIDECAR = {"name": "sidecar", "image": "busybox:1"}
TPL = "spec.decode.template"
ONE_PLACE = "set it in one place"

# id, mutation, substrings of the apiserver's message (the first names the field)
BAD_TEMPLATES: list[tuple[str, Callable[[dict], None], tuple[str, ...]]] = [
    ("restart-policy-always", pod_spec("decode", restartPolicy="Always"),
     (f"{TPL}.spec.restartPolicy", "must be Never")),
    ("restart-policy-on-failure", pod_spec("prefill", restartPolicy="OnFailure"),
     ("spec.prefill.template.spec.restartPolicy", "must be Never")),
    ("host-network-true", pod_spec("decode", hostNetwork=True),
     (f"{TPL}.spec.hostNetwork", "spec.network.hostNetwork")),
    ("host-network-contradicts-spec-network", both(at("network.hostNetwork", True), pod_spec("prefill", hostNetwork=False)),
     ("spec.prefill.template.spec.hostNetwork", "spec.network.hostNetwork")),
    ("engine-command", containers("decode", engine(command=["sleep", "infinity"])),
     (f"{TPL}.spec.containers[0].command", "command must not be set")),
    ("engine-args", containers("prefill", engine(args=["--dtype", "float32"])),
     ("spec.prefill.template.spec.containers[0].args", "spec.<role>.args")),
    ("engine-image", containers("decode", SIDECAR, engine(image="other:1")),
     (f"{TPL}.spec.containers[1].image", "spec.image")),
    ("engine-ports", containers("decode", engine(ports=[{"containerPort": 9000}])),
     (f"{TPL}.spec.containers[0].ports", "leased by the operator")),
    ("engine-env-pdpair", containers("decode", engine(env=[{"name": "PDPAIR_ROLE", "value": "prefill"}])),
     (f"{TPL}.spec.containers[0].env", "PDPAIR_*")),
    ("sidecar-port-named-http", containers("decode", {**SIDECAR, "ports": [{"name": "http", "containerPort": 8080}]}),
     (f"{TPL}.spec.containers[0].ports", "http, metrics or side-<n>")),
    ("sidecar-port-named-metrics", containers("prefill", {**SIDECAR, "ports": [{"name": "metrics", "containerPort": 9090}]}),
     ("spec.prefill.template.spec.containers[0].ports", "http, metrics or side-<n>")),
    ("sidecar-port-named-side-0", containers("decode", {**SIDECAR, "ports": [{"name": "side-0", "containerPort": 7000}]}),
     (f"{TPL}.spec.containers[0].ports", "http, metrics or side-<n>")),
    ("label-pdpair-prefix", tmeta("decode", labels={contract.LABEL_ROLE: "router"}),
     (f"{TPL}.metadata.labels", "pdpair.io/ prefix")),
    ("annotation-pdpair-prefix", tmeta("decode", annotations={contract.ANNOTATION_SPEC_HASH: "x"}),
     (f"{TPL}.metadata.annotations", "pdpair.io/ prefix")),
    ("metadata-name", tmeta("decode", name="mine"), (f"{TPL}.metadata.name", "must not be set")),
    ("metadata-generate-name", tmeta("prefill", generateName="mine-"),
     ("spec.prefill.template.metadata.generateName", "must not be set")),
    ("metadata-namespace", tmeta("decode", namespace="other"), (f"{TPL}.metadata.namespace", "must not be set")),
    ("init-container-named-engine", pod_spec("decode", initContainers=[{"name": "engine", "image": "busybox:1"}]),
     (f"{TPL}.spec.initContainers", "must not use the name engine")),
    ("resources-shorthand-and-template", both(at("decode.resources", {"limits": {"cpu": "1"}}),
                                              containers("decode", engine(resources={"limits": {"cpu": "2"}}))),
     ("spec.decode.resources", ONE_PLACE)),
    ("env-shorthand-and-template", both(at("prefill.env", [{"name": "A", "value": "1"}]),
                                        containers("prefill", engine(env=[{"name": "B", "value": "2"}]))),
     ("spec.prefill.env", ONE_PLACE)),
    ("node-selector-shorthand-and-template", both(at("decode.nodeSelector", {"a": "b"}),
                                                  pod_spec("decode", nodeSelector={"c": "d"})),
     ("spec.decode.nodeSelector", ONE_PLACE)),
    ("tolerations-shorthand-and-template", both(at("decode.tolerations", [{"key": "a", "operator": "Exists"}]),
                                                pod_spec("decode", tolerations=[{"key": "b", "operator": "Exists"}])),
     ("spec.decode.tolerations", ONE_PLACE)),
    ("affinity-shorthand-and-template", both(
        at("prefill.affinity", {"nodeAffinity": {}}),
        pod_spec("prefill", affinity={"podAntiAffinity": {}})),
     ("spec.prefill.affinity", ONE_PLACE)),
    ("router-command", containers("router", {"name": "router", "command": ["nginx"]}),
     ("spec.router.template.spec.containers[0].command", "must not be set")),
    ("router-ports", containers("router", {"name": "router", "ports": [{"containerPort": 80}]}),
     ("spec.router.template.spec.containers[0].ports", "leased by the operator")),
    ("router-image", containers("router", {"name": "router", "image": "nginx:1"}),
     ("spec.router.template.spec.containers[0].image", "spec.image")),
    ("router-env-pdpair", containers("router", {"name": "router", "env": [{"name": "PDPAIR_HTTP_PORT", "value": "1"}]}),
     ("spec.router.template.spec.containers[0].env", "PDPAIR_*")),
    ("router-restart-policy", pod_spec("router", restartPolicy="Always"),
     ("spec.router.template.spec.restartPolicy", "must be Never")),
    ("router-init-container-named-router", pod_spec("router", initContainers=[{"name": "router", "image": "x:1"}]),
     ("spec.router.template.spec.initContainers", "must not use the name router")),
    ("ephemeral-containers", pod_spec("decode", ephemeralContainers=[{"name": "dbg", "image": "busybox:1"}]),
     (f'unknown field "{TPL}.spec.ephemeralContainers"',)),
    ("container-without-name", containers("decode", {"image": "busybox:1"}),
     (f"{TPL}.spec.containers[0].name", "Required value")),
    ("too-many-containers", containers("decode", *[{"name": f"c{i}", "image": "x:1"} for i in range(33)]),
     (f"{TPL}.spec.containers", "Too many")),
    ("startup-timeout-too-short", at("startupTimeoutSeconds", 10),
     ("spec.startupTimeoutSeconds", "greater than or equal to 60")),
    ("startup-timeout-too-long", at("startupTimeoutSeconds", 86401),
     ("spec.startupTimeoutSeconds", "less than or equal to 86400")),
]


def test_at_least_twenty_bad_templates_are_listed():
    assert len({case[0] for case in BAD_TEMPLATES}) == len(BAD_TEMPLATES) >= 20


@pytest.mark.parametrize("mutate, expected", [c[1:] for c in BAD_TEMPLATES], ids=[c[0] for c in BAD_TEMPLATES])
def test_bad_template_is_refused_naming_the_field(custom_api, crd_namespace, mutate, expected):
    obj = minimal("bad-template")
    mutate(obj)
    message = create_error(custom_api, crd_namespace, obj)
    for part in expected:
        assert part in message, f"{part!r} not in the apiserver's message:\n{message}"


FULL_TEMPLATE = {
    "metadata": {"labels": {"team": "ml", "kueue.x-k8s.io/queue-name": "q"}, "annotations": {"example.com/a": "b"}},
    "spec": {
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "cache", "readOnly": True}},
                    {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}],
        "initContainers": [{"name": "fetch", "image": "busybox:1", "command": ["true"]}],
        "containers": [
            {"name": "engine", "resources": {"limits": {"nvidia.com/gpu": 2, "memory": "8Gi"}},
             "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                     {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
             "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True},
                              {"name": "shm", "mountPath": "/dev/shm"}],
             "readinessProbe": {"httpGet": {"path": "/v1/models", "port": "http"}, "periodSeconds": 7},
             "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}, "runAsUser": 1000}},
            {"name": "sidecar", "image": "busybox:1", "args": ["sleep", "inf"],
             "ports": [{"name": "sc", "containerPort": 9999}]},
        ],
        "securityContext": {"fsGroup": 2000},
        "imagePullSecrets": [{"name": "regcred"}],
        "serviceAccountName": "vllm",
        "priorityClassName": "high",
        "schedulerName": "volcano",
        "runtimeClassName": "nvidia",
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway"}],
        "nodeSelector": {"gpu": "h200"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "restartPolicy": "Never",
    },
}


def test_a_full_template_is_accepted_and_stored_as_written(local_cluster, custom_api, crd_namespace):
    obj = minimal("full-template")
    obj["spec"]["decode"] = {"template": copy.deepcopy(FULL_TEMPLATE)}
    obj["spec"]["prefill"] = {"template": copy.deepcopy(FULL_TEMPLATE)}
    obj["spec"]["router"] = {"template": {"spec": {"containers": [{"name": "router",
                                                                   "resources": {"requests": {"cpu": "100m"}}}],
                                                   "priorityClassName": "high"}}}
    created = create(custom_api, crd_namespace, obj)
    try:
        stored = created["spec"]["decode"]["template"]
        # the apiserver only adds the map-list key defaults (protocol of a containerPort)
        expected = copy.deepcopy(FULL_TEMPLATE)
        expected["spec"]["containers"][1]["ports"][0]["protocol"] = "TCP"
        assert stored == expected
        assert created["spec"]["startupTimeoutSeconds"] == 1800
        assert created["spec"]["router"]["template"]["spec"]["priorityClassName"] == "high"
        # what admission looks up must exist: the ServiceAccount, the PriorityClass, the RuntimeClass
        ensure_objects(local_cluster, crd_namespace)
        dry_run_operator_pods(local_cluster, crd_namespace, created)
    finally:
        custom_api.delete_namespaced_custom_object(contract.GROUP, contract.VERSION, crd_namespace, contract.PLURAL,
                                                   "full-template")


TEMPLATE_EXAMPLES = ("cpu-pvc-model.yaml", "hub-download.yaml", "gpu-pair.yaml", "flagcx-rdma.yaml",
                     "gang-scheduled.yaml")


def test_template_examples_exist():
    """test_crd_validation.test_examples_apply_server_side applies every examples/*.yaml; these must be among them."""
    from tests.e2e.test_crd_validation import EXAMPLES

    assert set(TEMPLATE_EXAMPLES) <= {p.name for p in EXAMPLES}


def _example_pairs() -> list[tuple[str, dict]]:
    import yaml

    from tests.e2e.test_crd_validation import EXAMPLES

    return [(f"{path.name}:{doc['metadata']['name']}", doc) for path in EXAMPLES
            for doc in yaml.safe_load_all(path.read_text()) if doc and doc["kind"] == contract.KIND]


@pytest.mark.parametrize("example", [doc for _, doc in _example_pairs()], ids=[i for i, _ in _example_pairs()])
def test_operator_pods_of_every_example_pass_pod_validation(local_cluster, custom_api, crd_namespace, example):
    """What the operator would create from each example (the apiserver-defaulted pair, merged by pods.py) is a pod
    the apiserver accepts: a server-side dry-run create runs the full pod validation and admission."""
    body = copy.deepcopy(example)
    body["metadata"] = {"name": example["metadata"]["name"]}
    pair = create(custom_api, crd_namespace, body)
    try:
        dry_run_operator_pods(local_cluster, crd_namespace, pair)
    finally:
        custom_api.delete_namespaced_custom_object(contract.GROUP, contract.VERSION, crd_namespace, contract.PLURAL,
                                                   example["metadata"]["name"])


def dry_run_operator_pods(cluster, namespace: str, pair: dict) -> None:
    """Build the pair's pods as the operator does (pods.py, made-up leases) and have the apiserver validate them."""
    from kubernetes import client

    from pdpair.operator.build.pods import engine_pod, router_pod
    from pdpair.operator.decide.port_blocks import assign, status_ports
    from tests.port_blocks_support import spec_blocks

    leased, port = [], 30000
    for block in spec_blocks(pair["spec"]):
        leased += assign(block, port)
        port += block.count
    ports = status_ports(leased)
    pods = [engine_pod(pair, "decode", 1, ports, "h"), engine_pod(pair, "prefill", 1, ports, "h", peer_host="10.0.0.2")]
    if pair["spec"]["router"]["enabled"]:
        pods.append(router_pod(pair, 1, ports, "h", "10.0.0.1", "10.0.0.2"))
    core = client.CoreV1Api(cluster.api_client())
    for pod in pods:
        pod["metadata"].pop("ownerReferences")  # the dry run has no pair uid to point at
        # through V1Pod.from_dict, as the operator's reconciler creates pods
        created = core.create_namespaced_pod(namespace, client.V1Pod.from_dict(pod), dry_run="All")
        main = next(c for c in created.spec.containers if c.name in ("engine", "router"))
        assert main.readiness_probe is not None and main.image == pair["spec"]["image"]


def ensure_objects(cluster, namespace: str) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    api = cluster.api_client()
    for create_it in (
        lambda: client.CoreV1Api(api).create_namespaced_service_account(namespace, {"metadata": {"name": "vllm"}}),
        lambda: client.SchedulingV1Api(api).create_priority_class({"metadata": {"name": "high"}, "value": 100}),
        lambda: client.NodeV1Api(api).create_runtime_class({"metadata": {"name": "nvidia"}, "handler": "nvidia"}),
    ):
        try:
            create_it()
        except ApiException as exc:
            if exc.status != 409:
                raise
