"""The InferencePair CRD on a real kube-apiserver: bad specs are refused at create time with a message that names
the field, good specs are accepted and come back defaulted, status is validated, and the printer columns work.

Everything here runs against devcluster's local control plane (etcd + kube-apiserver); no operator runs.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from pdpair import contract
from tests.engine_args_corpus import (
    BENIGN_SPELLINGS,
    ENV_REFERENCE_SPELLINGS,
    ISSUE_SPELLINGS,
    LITERAL_DOLLAR_SPELLINGS,
    OWNED_SPELLINGS,
    TRAILING_DOTTED_SPELLINGS,
    generated_owned_spellings,
    lookalike_spellings,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))

pytestmark = pytest.mark.cluster


def minimal(name: str) -> dict:
    return {
        "apiVersion": contract.API_VERSION,
        "kind": contract.KIND,
        "metadata": {"name": name},
        "spec": {"model": "/models/tiny", "image": "ghcr.io/pdpair/pdpair:0.1.0"},
    }


def create(custom_api, namespace: str, body: dict) -> dict:
    # Strict: unknown fields are errors, as `kubectl apply` does by default.
    return custom_api.create_namespaced_custom_object(contract.GROUP, contract.VERSION, namespace, contract.PLURAL,
                                                      body, field_validation="Strict")


def create_error(custom_api, namespace: str, body: dict) -> str:
    from kubernetes.client.rest import ApiException

    try:
        created = create(custom_api, namespace, body)
    except ApiException as exc:
        assert exc.status in (400, 422), f"unexpected HTTP {exc.status}: {exc.body}"
        return json.loads(exc.body)["message"]
    custom_api.delete_namespaced_custom_object(contract.GROUP, contract.VERSION, namespace, contract.PLURAL,
                                               created["metadata"]["name"])
    raise AssertionError(f"the apiserver accepted a bad spec: {json.dumps(body['spec'])[:600]}")


# --- the table of bad specs --------------------------------------------------------------------------------------
# Each case: an id, a function that breaks a fresh minimal object, and substrings the apiserver's message must
# contain. The first substring is always the field path, so the message names the field.

def at(path: str, value: Any) -> Callable[[dict], None]:
    """Sets spec.<path> (dotted; created as needed)."""
    def mutate(obj: dict) -> None:
        node = obj["spec"]
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return mutate


def drop(path: str) -> Callable[[dict], None]:
    def mutate(obj: dict) -> None:
        if path == "spec":
            del obj["spec"]
        else:
            del obj["spec"][path]
    return mutate


def both(*mutations: Callable[[dict], None]) -> Callable[[dict], None]:
    def mutate(obj: dict) -> None:
        for m in mutations:
            m(obj)
    return mutate


def rename(name: str) -> Callable[[dict], None]:
    def mutate(obj: dict) -> None:
        obj["metadata"]["name"] = name
    return mutate


OWNED = "operator-owned flag"
NEGATIVE = "requests and limits must not be negative"
NO_EXECUTE = "tolerationSeconds needs tolerations[].effect NoExecute"
RESERVED = "PDPAIR_* variables are set by the operator"
KEY_REF = {"name": "hf", "key": "token"}


def above(resource: str) -> str:
    """The message of a request above its limit names the resource."""
    return f"requests[{resource}] must not be above"


BAD_SPECS: list[tuple[str, Callable[[dict], None], tuple[str, ...]]] = [
    ("spec-missing", drop("spec"), ("spec: Required value",)),
    ("model-missing", drop("model"), ("spec.model: Required value",)),
    ("image-missing", drop("image"), ("spec.image: Required value",)),
    ("model-empty", at("model", ""), ("spec.model", "at least 1 chars")),
    ("model-whitespace", at("model", "my model"), ("spec.model", "should match")),
    ("model-too-long", at("model", "m" * 513), ("spec.model", "Too long")),
    ("image-whitespace", at("image", "ghcr.io/x y"), ("spec.image", "should match")),
    ("served-model-name-too-long", at("servedModelName", "n" * 257), ("spec.servedModelName", "Too long")),
    ("tp-zero", at("prefill.tensorParallelSize", 0), ("spec.prefill.tensorParallelSize", "greater than or equal to 1")),
    ("tp-too-big", both(at("prefill.tensorParallelSize", 16), at("decode.tensorParallelSize", 16)),
     ("spec.decode.tensorParallelSize", "less than or equal to 8")),
    ("tp-string", at("decode.tensorParallelSize", "2"), ("spec.decode.tensorParallelSize", "must be of type integer")),
    ("tp-heterogeneous", both(at("prefill.tensorParallelSize", 2), at("decode.tensorParallelSize", 1)),
     ("spec.prefill.tensorParallelSize", "must equal spec.decode.tensorParallelSize", "heterogeneous")),
    ("args-port", at("decode.args", ["--port", "8000"]), ("spec.decode.args[0]", "--port", OWNED)),
    ("args-port-equals", at("prefill.args", ["--dtype", "float32", "--port=8000"]), ("spec.prefill.args[2]", OWNED)),
    ("args-host", at("decode.args", ["--host=0.0.0.0"]), ("spec.decode.args[0]", OWNED)),
    ("args-model", at("decode.args", ["--model", "other"]), ("spec.decode.args[0]", OWNED)),
    ("args-kv-transfer-config", at("prefill.args", ["--kv-transfer-config", "{}"]), ("spec.prefill.args[0]", OWNED)),
    ("args-kv-transfer-config-underscores", at("prefill.args", ['--kv_transfer_config={"kv_role":"kv_both"}']),
     ("spec.prefill.args[0]", OWNED)),
    ("args-served-model-name", at("decode.args", ["--served-model-name", "x"]), ("spec.decode.args[0]", OWNED)),
    ("args-tp-long", at("decode.args", ["--tensor-parallel-size=2"]), ("spec.decode.args[0]", OWNED)),
    ("args-tp-short", at("prefill.args", ["-tp", "2"]), ("spec.prefill.args[0]", OWNED)),
    ("args-pipeline-parallel", at("decode.args", ["--pipeline-parallel-size", "2"]),
     ("spec.decode.args[0]", "--pipeline-parallel-size")),
    ("args-data-parallel-short", at("decode.args", ["-dp=2"]), ("spec.decode.args[0]", "--data-parallel-size")),
    ("args-empty-entry", at("decode.args", [""]), ("spec.decode.args[0]", "at least 1 chars")),
    ("args-too-many", at("decode.args", ["--enforce-eager"] * 65), ("spec.decode.args", "Too many")),
    ("env-reserved-role", at("decode.env", [{"name": "PDPAIR_ROLE", "value": "prefill"}]),
     ("spec.decode.env[0].name", "PDPAIR_ROLE", RESERVED)),
    ("env-reserved-peer", at("prefill.env", [{"name": "A", "value": "1"}, {"name": "PDPAIR_PEER_HOST", "value": "h"}]),
     ("spec.prefill.env[1].name", RESERVED)),
    ("env-duplicate-name", at("decode.env", [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]),
     ("spec.decode.env[1]", "Duplicate value")),
    ("env-bad-name", at("decode.env", [{"name": "1BAD", "value": "x"}]), ("spec.decode.env[0].name", "should match")),
    ("env-name-missing", at("decode.env", [{"value": "x"}]), ("spec.decode.env[0].name", "Required value")),
    ("env-value-and-valueFrom", at("decode.env", [{"name": "T", "value": "x", "valueFrom": {"secretKeyRef": KEY_REF}}]),
     ("spec.decode.env[0].valueFrom", "mutually exclusive")),
    ("env-valueFrom-empty", at("decode.env", [{"name": "T", "valueFrom": {}}]),
     ("spec.decode.env[0].valueFrom", "exactly one of secretKeyRef and configMapKeyRef")),
    ("env-valueFrom-both-refs", at("decode.env", [{"name": "T", "valueFrom": {"secretKeyRef": KEY_REF,
                                                                             "configMapKeyRef": KEY_REF}}]),
     ("spec.decode.env[0].valueFrom", "exactly one of secretKeyRef and configMapKeyRef")),
    ("env-secret-key-missing", at("decode.env", [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "hf"}}}]),
     ("spec.decode.env[0].valueFrom.secretKeyRef.key", "Required value")),
    ("transport-unknown", at("connector.transport", "rdma"),
     ("spec.connector.transport", 'Unsupported value: "rdma"', '"flagcx", "tcp"')),
    ("hang-timeout-zero", at("connector.hangTimeoutSeconds", 0),
     ("spec.connector.hangTimeoutSeconds", "greater than or equal to 5")),
    ("hang-timeout-too-long", at("connector.hangTimeoutSeconds", 7200),
     ("spec.connector.hangTimeoutSeconds", "less than or equal to 3600")),
    ("slots-over-flagcx-pool", both(at("connector.transport", "flagcx"), at("connector.slots", 512)),
     ("spec.connector.slots", "<= 256 when spec.connector.transport is flagcx")),
    ("slots-zero", at("connector.slots", 0), ("spec.connector.slots", "greater than or equal to 1")),
    ("ports-per-rank-too-many", at("network.portsPerRank", 2), ("spec.network.portsPerRank", "less than or equal to 1")),
    ("host-network-string", at("network.hostNetwork", "yes"), ("spec.network.hostNetwork", "must be of type boolean")),
    ("max-backoff-below-backoff", both(at("restartPolicy.backoffSeconds", 60), at("restartPolicy.maxBackoffSeconds", 30)),
     ("spec.restartPolicy.maxBackoffSeconds", "must be >= spec.restartPolicy.backoffSeconds")),
    ("max-restarts-negative", at("restartPolicy.maxRestarts", -1),
     ("spec.restartPolicy.maxRestarts", "greater than or equal to 0")),
    ("backoff-zero", at("restartPolicy.backoffSeconds", 0),
     ("spec.restartPolicy.backoffSeconds", "greater than or equal to 1")),
    ("window-shorter-than-hang-timeout", both(at("connector.hangTimeoutSeconds", 600), at("restartPolicy.windowSeconds", 300)),
     ("spec.restartPolicy.windowSeconds", "must be >= spec.connector.hangTimeoutSeconds")),
    ("router-port-without-router", both(at("router.enabled", False), at("router.port", 18000)),
     ("spec.router.port", "spec.router.enabled is false")),
    ("router-port-privileged", at("router.port", 80), ("spec.router.port", "greater than or equal to 1024")),
    ("surge-with-fixed-router-port", both(at("rolloutStrategy", "Surge"), at("router.port", 18000)),
     ("spec.rolloutStrategy", "one fixed spec.router.port cannot serve both")),
    ("rollout-strategy-unknown", at("rolloutStrategy", "RollingUpdate"), ("spec.rolloutStrategy", "Unsupported value")),
    ("drain-seconds-too-long", at("rollout.drainSeconds", 3601),
     ("spec.rollout.drainSeconds", "less than or equal to 3600")),
    ("progress-deadline-too-short", at("rollout.progressDeadlineSeconds", 10),
     ("spec.rollout.progressDeadlineSeconds", "greater than or equal to 60")),
    ("toleration-exists-with-value", at("decode.tolerations", [{"key": "gpu", "operator": "Exists", "value": "x"}]),
     ("spec.decode.tolerations[0].value", "must be empty when tolerations[].operator is Exists")),
    ("toleration-bad-effect", at("prefill.tolerations", [{"key": "gpu", "effect": "Evict"}]),
     ("spec.prefill.tolerations[0].effect", "Unsupported value")),
    ("resources-bad-quantity", at("decode.resources", {"requests": {"cpu": "lots"}}),
     ("spec.decode.resources.requests.cpu", "should match")),
    # What a pod refuses is refused at admission, not only when the operator creates the pod.
    ("resources-negative-cpu-request", at("decode.resources", {"requests": {"cpu": "-100m"}}),
     ("spec.decode.resources.requests[cpu]", NEGATIVE)),
    ("resources-negative-cpu-request-integer", at("prefill.resources", {"requests": {"cpu": -1}}),
     ("spec.prefill.resources.requests[cpu]", NEGATIVE)),
    ("resources-negative-memory-limit", at("prefill.resources", {"limits": {"memory": "-1Gi"}}),
     ("spec.prefill.resources.limits[memory]", NEGATIVE)),
    ("resources-negative-gpu-limit-integer", at("decode.resources", {"limits": {"nvidia.com/gpu": -2}}),
     ("spec.decode.resources.limits[nvidia.com/gpu]", NEGATIVE)),
    ("resources-cpu-request-above-limit", at("decode.resources", {"requests": {"cpu": "2", "memory": "1Gi"},
                                                                 "limits": {"cpu": "1500m", "memory": "1Gi"}}),
     ("spec.decode.resources.requests", above("cpu"))),
    ("resources-memory-request-above-limit", at("prefill.resources", {"requests": {"memory": "1025Mi"},
                                                                     "limits": {"memory": "1Gi"}}),
     ("spec.prefill.resources.requests", above("memory"))),
    ("resources-integer-request-above-string-limit", at("decode.resources", {"requests": {"nvidia.com/gpu": 2},
                                                                            "limits": {"nvidia.com/gpu": "1"}}),
     ("spec.decode.resources.requests", above("nvidia.com/gpu"))),
    ("resources-string-request-above-integer-limit", at("decode.resources", {"requests": {"cpu": "1001m"},
                                                                            "limits": {"cpu": 1}}),
     ("spec.decode.resources.requests", above("cpu"))),
    ("toleration-seconds-with-no-schedule", at("decode.tolerations", [{"key": "gpu", "operator": "Exists",
                                                                       "effect": "NoSchedule", "tolerationSeconds": 30}]),
     ("spec.decode.tolerations[0].tolerationSeconds", NO_EXECUTE)),
    ("toleration-seconds-without-effect", at("prefill.tolerations", [
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30},
        {"key": "gpu", "operator": "Exists", "tolerationSeconds": 30}]),
     ("spec.prefill.tolerations[1].tolerationSeconds", NO_EXECUTE)),
    ("toleration-seconds-with-empty-effect", at("decode.tolerations", [{"key": "gpu", "operator": "Equal", "value": "a",
                                                                        "effect": "", "tolerationSeconds": 0}]),
     ("spec.decode.tolerations[0].tolerationSeconds", NO_EXECUTE)),
    ("node-selector-value-too-long", at("prefill.nodeSelector", {"pool": "v" * 64}),
     ("spec.prefill.nodeSelector.pool", "Too long")),
    ("ratio-max-below-min", at("scaling.ratio", {"min": 2, "max": 0.5}),
     ("spec.scaling.ratio.max", "must be >= spec.scaling.ratio.min")),
    ("ratio-zero", at("scaling.ratio", {"min": 0, "max": 1}), ("spec.scaling.ratio.min", "greater than 0")),
    ("ratio-over-16", at("scaling.ratio", {"min": 1, "max": 17}),
     ("spec.scaling.ratio.max", "less than or equal to 16")),
    ("ratio-without-max", at("scaling.ratio", {"min": 1}), ("spec.scaling.ratio.max", "Required value")),
    ("scaling-follower-unknown", both(at("scaling.ratio", {"min": 1, "max": 2}), at("scaling.follower", "router")),
     ("spec.scaling.follower", "Unsupported value")),
    ("api-key-secret-without-name", at("apiKeySecret", {"key": "token"}), ("spec.apiKeySecret.name", "Required value")),
    ("api-key-secret-name-not-dns-1123", at("apiKeySecret", {"name": "Pair_Key"}),
     ("spec.apiKeySecret.name", "should match")),
    ("api-key-secret-name-empty-label", at("apiKeySecret", {"name": "pair..key"}),
     ("spec.apiKeySecret.name", "should match")),
    ("api-key-secret-name-too-long", at("apiKeySecret", {"name": "k" * 254}), ("spec.apiKeySecret.name", "Too long")),
    ("api-key-secret-key-bad-character", at("apiKeySecret", {"name": "pair-key", "key": "api/key"}),
     ("spec.apiKeySecret.key", "should match")),
    ("api-key-secret-key-dot-dot", at("apiKeySecret", {"name": "pair-key", "key": "..data"}),
     ("spec.apiKeySecret.key", "must not be '.' nor start with '..'")),
    ("api-key-secret-key-dot", at("apiKeySecret", {"name": "pair-key", "key": "."}),
     ("spec.apiKeySecret.key", "must not be '.' nor start with '..'")),
    ("api-key-secret-with-a-value", at("apiKeySecret", {"name": "pair-key", "value": "sk-inline"}),
     ('unknown field "spec.apiKeySecret.value"',)),
    ("api-key-flag-beside-the-secret", both(at("apiKeySecret", {"name": "pair-key"}),
                                            at("decode.args", ["--api-key", "sk-other"])),
     ("spec.apiKeySecret", "must not pass --api-key")),
    ("api-key-flag-spelled-with-underscores-beside-the-secret", both(at("apiKeySecret", {"name": "pair-key"}),
                                                                    at("prefill.args", ["--api_key=sk-other"])),
     ("spec.apiKeySecret", "must not pass --api-key")),
    ("unknown-field", at("replicas", 2), ('unknown field "spec.replicas"',)),
    ("unknown-nested-field", at("connector.transports", "tcp"), ('unknown field "spec.connector.transports"',)),
    ("name-too-long", rename("p" * 46), ("metadata.name", "Too long", "45")),
    ("name-not-dns-1035", rename("9-pair"), ("metadata.name", "should match")),
]


def test_table_has_enough_distinct_cases():
    ids = [case_id for case_id, _, _ in BAD_SPECS]
    assert len(ids) == len(set(ids)) and len(ids) >= 35


@pytest.mark.parametrize("mutate,expected", [(m, e) for _, m, e in BAD_SPECS], ids=[i for i, _, _ in BAD_SPECS])
def test_bad_spec_is_refused_with_a_message_naming_the_field(custom_api, crd_namespace, mutate, expected, request):
    obj = minimal(f"bad-{abs(hash(request.node.name)) % 10**8}")
    mutate(obj)
    message = create_error(custom_api, crd_namespace, obj)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in the apiserver's message:\n{message}"


# --- operator-owned vLLM flags in args (corpus shared with tests/unit/operator/test_engine_args.py) --------------

OWNED_ENTRY = "is an operator-owned flag as vLLM reads it"
MAX_ARGS = 64


def with_decode_args(name: str, args: list[str]) -> dict:
    obj = minimal(name)
    obj["spec"]["decode"] = {"args": args}
    return obj


@pytest.mark.parametrize("spelling", OWNED_SPELLINGS, ids=[s.id for s in OWNED_SPELLINGS])
def test_owned_flag_spelling_is_refused_naming_the_field_and_the_entry(custom_api, crd_namespace, spelling, request):
    # After a benign entry, so the message must name the right index.
    obj = with_decode_args(f"own-{abs(hash(request.node.name)) % 10**8}", ["--enforce-eager", *spelling.args])
    message = create_error(custom_api, crd_namespace, obj)
    assert "spec.decode.args[1]: Invalid value" in message, message
    assert f"args entry {spelling.args[0]} {OWNED_ENTRY}" in message, message


def test_issue_spellings_are_all_in_the_table():
    assert {s.args for s in ISSUE_SPELLINGS} == {
        ("--por=9999",), ("--tensor-parallel=4",), ("--kv-transfer-conf", ISSUE_SPELLINGS[2].args[1]),
        ("--kv-transfer-config.kv_role=kv_both",), ("--served-model=evil",), ("--pipeline-parallel=2",)}


def batches(entries: list[str], size: int) -> list[list[str]]:
    return [entries[i:i + size] for i in range(0, len(entries), size)]


def test_every_generated_owned_spelling_is_refused(custom_api, crd_namespace):
    """Every prefix of every owned option and alias, with =, a value, dotted keys and underscores: each entry named."""
    entries = sorted({s.args[0] for s in generated_owned_spellings()})
    assert len(entries) > 400
    for n, batch in enumerate(batches(entries, MAX_ARGS - 1)):
        args = [*batch, "--enforce-eager"]  # a last entry with a value, so only the item rule speaks
        message = create_error(custom_api, crd_namespace, with_decode_args(f"gen-{n}", args))
        missing = [(i, e) for i, e in enumerate(batch) if f"spec.decode.args[{i}]: Invalid value" not in message
                   or f"args entry {e} {OWNED_ENTRY}" not in message]
        assert missing == [], f"not refused (or not named) in batch {n}: {missing[:5]}"
        assert f"spec.decode.args[{len(batch)}]" not in message  # --enforce-eager is fine


@pytest.mark.parametrize("spelling", TRAILING_DOTTED_SPELLINGS, ids=[s.id for s in TRAILING_DOTTED_SPELLINGS])
def test_trailing_dotted_key_is_refused(custom_api, crd_namespace, spelling, request):
    name = f"tail-{abs(hash(request.node.name)) % 10**8}"
    message = create_error(custom_api, crd_namespace, with_decode_args(name, list(spelling.args)))
    assert "spec.decode.args: Invalid value" in message and "must not end with a dotted key without '='" in message
    # with its value the same entry is fine
    created = create(custom_api, crd_namespace, with_decode_args(name, [*spelling.args[:-1], spelling.args[-1] + "=1"]))
    assert created["spec"]["decode"]["args"][-1] == spelling.args[-1] + "=1"


@pytest.mark.parametrize("spelling", ENV_REFERENCE_SPELLINGS, ids=[s.id for s in ENV_REFERENCE_SPELLINGS])
def test_env_reference_in_args_is_refused(custom_api, crd_namespace, spelling, request):
    # e.g. env EXTRA_FLAG="--kv-transfer-config.kv_role=kv_both" with args ["$(EXTRA_FLAG)"] would pass the flag rule
    obj = with_decode_args(f"env-{abs(hash(request.node.name)) % 10**8}", list(spelling.args))
    obj["spec"]["decode"]["env"] = [{"name": "EXTRA_FLAG", "value": "--kv-transfer-config.kv_role=kv_both"}]
    message = create_error(custom_api, crd_namespace, obj)
    index = len(spelling.args) - 1
    assert f"spec.decode.args[{index}]: Invalid value" in message, message
    assert f"args entry {spelling.args[-1]} references an environment variable as $(NAME)" in message, message


def test_benign_args_and_lookalikes_are_accepted(custom_api, crd_namespace):
    spellings = [*BENIGN_SPELLINGS, *LITERAL_DOLLAR_SPELLINGS, *lookalike_spellings()]
    batch: list[str] = []
    sent = 0
    for spelling in [*spellings, None]:  # whole spellings per object: a flag stays with its value
        if spelling is None or len(batch) + len(spelling.args) > MAX_ARGS:
            created = create(custom_api, crd_namespace, with_decode_args(f"benign-{sent}", batch))
            assert created["spec"]["decode"]["args"] == batch
            sent, batch = sent + 1, []
        if spelling is not None:
            batch += spelling.args
    assert sent >= 2  # more than one object's worth


# --- good specs --------------------------------------------------------------------------------------------------

def test_minimal_spec_comes_back_fully_defaulted(custom_api, crd_namespace):
    created = create(custom_api, crd_namespace, minimal("defaults"))
    spec = created["spec"]
    for role in contract.ROLES:
        assert spec[role] == {"replicas": 1, "tensorParallelSize": 1}  # one instance per role unless said
    assert spec["connector"] == {"transport": contract.TRANSPORT_FLAGCX, "hangTimeoutSeconds": 60, "slots": 256}
    assert spec["network"] == {"hostNetwork": True, "portsPerRank": 1}
    assert spec["restartPolicy"] == {"maxRestarts": 5, "windowSeconds": 1800, "backoffSeconds": 10,
                                     "maxBackoffSeconds": 300}
    assert spec["router"] == {"enabled": True, "replicas": 2}
    assert spec["rolloutStrategy"] == contract.ROLLOUT_RECREATE
    assert spec["rollout"] == {"drainSeconds": 30, "progressDeadlineSeconds": 1800}
    # and the same on a fresh read (defaults are also applied when reading from etcd)
    read = custom_api.get_namespaced_custom_object(contract.GROUP, contract.VERSION, crd_namespace, contract.PLURAL,
                                                   "defaults")
    assert read["spec"] == spec


def test_partial_sections_are_defaulted_field_by_field(custom_api, crd_namespace):
    obj = minimal("partial")
    obj["spec"]["connector"] = {"transport": "tcp"}
    obj["spec"]["restartPolicy"] = {"maxRestarts": 0}
    obj["spec"]["decode"] = {"args": ["--enforce-eager"]}
    spec = create(custom_api, crd_namespace, obj)["spec"]
    assert spec["connector"] == {"transport": "tcp", "hangTimeoutSeconds": 60, "slots": 256}
    assert spec["restartPolicy"]["maxRestarts"] == 0 and spec["restartPolicy"]["backoffSeconds"] == 10
    assert spec["decode"] == {"args": ["--enforce-eager"], "replicas": 1, "tensorParallelSize": 1}


def test_api_key_secret_gets_its_default_key_and_stays_absent_when_unset(custom_api, crd_namespace):
    """spec.apiKeySecret: the key defaults to api-key; a spec without the field comes back without it (no key)."""
    obj = minimal("api-key")
    obj["spec"]["apiKeySecret"] = {"name": "pair-api-key"}
    assert create(custom_api, crd_namespace, obj)["spec"]["apiKeySecret"] == {"name": "pair-api-key", "key": "api-key"}
    assert "apiKeySecret" not in create(custom_api, crd_namespace, minimal("no-api-key"))["spec"]


GOOD_SPECS: list[tuple[str, Callable[[dict], None]]] = [
    ("lookalike-flags-are-not-owned", at("decode.args", ["--model-impl", "vllm", "--hostname-ignored", "--portable",
                                                         "--max-model-len", "512", "--enable-prefix-caching"])),
    ("user-env-and-secret-ref", at("decode.env", [{"name": "FLAGCX_IB_HCA", "value": "mlx5_0"},
                                                  {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": KEY_REF}},
                                                  {"name": "MY_PDPAIR_NOTE", "value": "prefix elsewhere is fine"}])),
    ("tp-8-both", both(at("prefill.tensorParallelSize", 8), at("decode.tensorParallelSize", 8))),
    ("tcp-allows-many-slots", both(at("connector.transport", "tcp"), at("connector.slots", 4096))),
    ("flagcx-at-pool-size", both(at("connector.transport", "flagcx"), at("connector.slots", 256))),
    ("router-disabled", at("router.enabled", False)),
    ("router-fixed-port", at("router.port", 18000)),
    ("surge-with-knobs", both(at("rolloutStrategy", "Surge"), at("rollout.drainSeconds", 0),
                              at("rollout.progressDeadlineSeconds", 86400))),
    ("toleration-exists", at("decode.tolerations", [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                     "effect": "NoSchedule"}])),
    ("toleration-seconds-with-no-execute", at("decode.tolerations", [
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])),
    ("resources-request-equals-limit", at("decode.resources", {
        "requests": {"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": 1, "ephemeral-storage": "0"},
        "limits": {"cpu": "1000m", "memory": "1024Mi", "nvidia.com/gpu": "1"}})),
    ("resources-request-below-limit-and-zero", at("prefill.resources", {"requests": {"cpu": "500m", "memory": 0},
                                                                        "limits": {"cpu": 2, "memory": "2Gi"}})),
    ("resources-and-placement", both(
        at("decode.resources", {"requests": {"cpu": "500m", "memory": "2Gi", "nvidia.com/gpu": 1},
                                "limits": {"memory": "4Gi"}}),
        at("decode.nodeSelector", {"kubernetes.io/os": "linux"}),
        at("decode.affinity", {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}}}))),
    ("name-at-45", rename("p" * 45)),
    ("window-equals-hang-timeout", both(at("connector.hangTimeoutSeconds", 600), at("restartPolicy.windowSeconds", 600))),
    ("ratio-band", at("scaling.ratio", {"min": 0.5, "max": 2})),
    ("api-key-secret", at("apiKeySecret", {"name": "pair-api-key.v2", "key": ".token_1"})),
    ("api-key-secret-beside-a-lookalike-flag", both(at("apiKeySecret", {"name": "pair-key", "key": "api-key"}),
                                                    at("decode.args", ["--api-server-count", "1"]))),
    ("api-key-flag-without-the-secret", at("decode.args", ["--api-key", "sk-user-managed"])),
    ("ratio-single-point-decode-follows", both(at("scaling.ratio", {"min": 1, "max": 1}),
                                               at("scaling.follower", "decode"))),
]


@pytest.mark.parametrize("mutate", [m for _, m in GOOD_SPECS], ids=[i for i, _ in GOOD_SPECS])
def test_good_spec_is_accepted_as_written(custom_api, crd_namespace, mutate, request):
    obj = minimal(f"good-{abs(hash(request.node.name)) % 10**8}")
    mutate(obj)
    created = create(custom_api, crd_namespace, obj)
    # nothing the user wrote was pruned or changed; the apiserver only added defaults
    for key, value in obj["spec"].items():
        if isinstance(value, dict):
            assert value.items() <= created["spec"][key].items(), key
        else:
            assert created["spec"][key] == value, key


# --- what a pod refuses, in the pod templates too (rules from hack/gen_crd.py) -----------------------------------

def template(role: str, **pod_spec: Any) -> Callable[[dict], None]:
    return at(f"{role}.template", {"spec": pod_spec})


BAD_TEMPLATE_PODS: list[tuple[str, Callable[[dict], None], tuple[str, ...]]] = [
    ("router-container-negative-cpu-request",
     template("router", containers=[{"name": "router", "resources": {"requests": {"cpu": "-1"}}}]),
     ("spec.router.template.spec.containers[0].resources.requests[cpu]", NEGATIVE)),
    ("sidecar-negative-memory-limit",
     template("decode", containers=[{"name": "sidecar", "image": "busybox:1",
                                     "resources": {"limits": {"memory": -1}}}]),
     ("spec.decode.template.spec.containers[0].resources.limits[memory]", NEGATIVE)),
    ("engine-cpu-request-above-limit",
     template("prefill", containers=[{"name": "engine", "resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}}]),
     ("spec.prefill.template.spec.containers[0].resources.requests", above("cpu"))),
    ("init-container-memory-request-above-limit",
     template("decode", initContainers=[{"name": "fetch", "image": "busybox:1", "resources": {
         "requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}}]),
     ("spec.decode.template.spec.initContainers[0].resources.requests", above("memory"))),
    ("pod-level-memory-request-above-limit",
     template("router", resources={"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}),
     ("spec.router.template.spec.resources.requests", above("memory"))),
    ("template-toleration-seconds-with-no-schedule",
     template("router", tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule",
                                      "tolerationSeconds": 30}]),
     ("spec.router.template.spec.tolerations[0].tolerationSeconds", NO_EXECUTE)),
    ("template-toleration-seconds-without-effect",
     template("decode", tolerations=[{"key": "gpu", "operator": "Exists", "tolerationSeconds": 30}]),
     ("spec.decode.template.spec.tolerations[0].tolerationSeconds", NO_EXECUTE)),
]


@pytest.mark.parametrize("mutate,expected", [(m, e) for _, m, e in BAD_TEMPLATE_PODS],
                         ids=[i for i, _, _ in BAD_TEMPLATE_PODS])
def test_template_a_pod_would_refuse_is_refused_naming_the_field(custom_api, crd_namespace, mutate, expected, request):
    obj = minimal(f"badpod-{abs(hash(request.node.name)) % 10**8}")
    mutate(obj)
    message = create_error(custom_api, crd_namespace, obj)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in the apiserver's message:\n{message}"


def test_template_a_pod_accepts_is_admitted(custom_api, crd_namespace):
    equal = {"requests": {"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": 1},
             "limits": {"cpu": "1000m", "memory": "1024Mi", "nvidia.com/gpu": "1"}}
    obj = minimal("goodpod")
    template("decode", containers=[{"name": "engine", "resources": equal}],
             initContainers=[{"name": "fetch", "image": "busybox:1", "resources": {"requests": {"cpu": 0}}}],
             tolerations=[{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
                           "tolerationSeconds": 300}])(obj)
    template("router", resources={"requests": {"memory": "512Mi"}, "limits": {"memory": "512Mi"}})(obj)
    created = create(custom_api, crd_namespace, obj)
    assert created["spec"]["decode"]["template"] == obj["spec"]["decode"]["template"]
    assert created["spec"]["router"]["template"] == obj["spec"]["router"]["template"]


# The same verdicts as the pod's own validation (a server-side dry run of a Pod), on the edges of the rules: equal
# quantities in other spellings, integer against string, negative zero, a limit one unit below the request.
# (resources or a toleration, whether a pod admits it)
PARITY_RESOURCES: list[tuple[dict, bool]] = [
    ({"requests": {"cpu": "-0"}}, True),
    ({"requests": {"cpu": "1"}, "limits": {"cpu": "1000m"}}, True),
    ({"requests": {"cpu": 1}, "limits": {"cpu": "999m"}}, False),
    ({"requests": {"memory": "1Gi"}, "limits": {"memory": 1073741824}}, True),
    ({"requests": {"memory": "1Gi"}, "limits": {"memory": 1073741823}}, False),
    ({"requests": {"cpu": "1e3"}, "limits": {"cpu": "1k"}}, True),
    ({"requests": {"cpu": "-1e-3"}}, False),
    ({"limits": {"cpu": "-1m"}}, False),
    ({"requests": {"example.com/foo": 3, "cpu": "2"}, "limits": {"example.com/foo": 3}}, True),
]
PARITY_TOLERATIONS: list[tuple[dict, bool]] = [
    ({"key": "a", "operator": "Exists", "tolerationSeconds": 1}, False),
    ({"key": "a", "operator": "Exists", "effect": "PreferNoSchedule", "tolerationSeconds": 0}, False),
    ({"key": "a", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 0}, True),
    ({"key": "a", "operator": "Equal", "value": "b", "effect": "NoSchedule"}, True),
]


def admitted(call: Callable[[], Any]) -> bool:
    from kubernetes.client.rest import ApiException

    try:
        call()
    except ApiException as exc:
        assert exc.status in (400, 422), f"unexpected HTTP {exc.status}: {exc.body}"
        return False
    return True


@pytest.mark.parametrize("resources,tolerations,pod_admits",
                         [(r, None, ok) for r, ok in PARITY_RESOURCES] + [(None, [t], ok) for t, ok in PARITY_TOLERATIONS],
                         ids=[f"resources-{i}" for i in range(len(PARITY_RESOURCES))]
                         + [f"toleration-{i}" for i in range(len(PARITY_TOLERATIONS))])
def test_admission_agrees_with_the_pods_own_validation(local_cluster, custom_api, crd_namespace, resources, tolerations,
                                                        pod_admits, request):
    container = {"name": "c", "image": "busybox:1", **({"resources": resources} if resources else {})}
    # "default": its ServiceAccount exists from the start (a fresh namespace's may not yet); a dry run stores nothing.
    # kubectl, not the client's model, which takes quantities only as strings.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "parity", "namespace": "default"},
           "spec": {"containers": [container], **({"tolerations": tolerations} if tolerations else {})}}
    proc = local_cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)
    expected = proc.returncode == 0
    assert expected == pod_admits and (expected or "is invalid" in proc.stderr), proc.stderr
    name = f"par-{abs(hash(request.node.name)) % 10**8}"
    shorthand = minimal(f"{name}-s")
    if resources:
        shorthand["spec"]["decode"] = {"resources": resources}
    else:
        shorthand["spec"]["prefill"] = {"tolerations": tolerations}
    in_template = minimal(f"{name}-t")
    at("router.template", {"spec": pod["spec"]})(in_template)
    for obj in (shorthand, in_template):
        got = admitted(lambda: custom_api.create_namespaced_custom_object(
            contract.GROUP, contract.VERSION, crd_namespace, contract.PLURAL, obj, dry_run="All"))
        assert got == expected, f"pod admitted: {expected}, pair admitted: {got}: {json.dumps(obj['spec'])}"


def test_examples_exist():
    # an empty parameter set would make the next test vanish without failing
    assert EXAMPLES, f"no examples/*.yaml under {REPO}: the server-side apply test would check nothing"
    assert any(p.name == "inferencepair.yaml" for p in EXAMPLES), [p.name for p in EXAMPLES]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_apply_server_side(local_cluster, crd_namespace, example):
    docs = [d for d in yaml.safe_load_all(example.read_text()) if d]
    assert docs, f"{example} holds no objects"
    for doc in docs:
        doc["metadata"]["namespace"] = crd_namespace
    proc = local_cluster.kubectl("apply", "--server-side", "--field-manager=pdpair-tests", "-f", "-",
                                 input=yaml.safe_dump_all(docs))
    assert "serverside-applied" in proc.stdout, proc.stdout


def test_kubectl_apply_shows_the_field_in_its_error(local_cluster, crd_namespace):
    obj = minimal("kubectl-bad")
    obj["metadata"]["namespace"] = crd_namespace
    obj["spec"]["decode"] = {"env": [{"name": "PDPAIR_TRANSPORT", "value": "tcp"}]}
    proc = local_cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(obj), check=False)
    assert proc.returncode != 0
    assert "spec.decode.env[0].name" in proc.stderr and RESERVED in proc.stderr, proc.stderr


# --- status subresource and printer columns ----------------------------------------------------------------------

def good_status() -> dict:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "phase": contract.PHASE_READY,
        "observedGeneration": 1,
        "pairGeneration": 2,
        "restarts": 1,
        "lastRestart": {"time": now, "reason": "decode hung"},
        "pods": {"decode": "p-decode-2", "prefill": "p-prefill-2", "router": "p-router-2"},
        "prefill": {"desired": 2, "ready": 1, "readyOfDesired": "1/2",
                    "instances": [{"index": 0, "pod": "p-prefill-2", "generation": 2, "ready": True}]},
        "decode": {"desired": 1, "ready": 1, "readyOfDesired": "1/1"},
        "ports": [
            {"name": "decode-sidechannel-0", "role": "decode", "purpose": "sidechannel", "rank": 0, "port": 20001},
            {"name": "decode-sidechannel-1", "role": "decode", "purpose": "sidechannel", "rank": 1, "port": 20002},
            {"name": "prefill-sidechannel-0", "role": "prefill", "purpose": "sidechannel", "rank": 0, "port": 20010},
            {"name": "decode-metrics-0", "role": "decode", "purpose": "metrics", "rank": 0, "port": 20003},
        ],
        "conditions": [
            {"type": c, "status": "True", "reason": "Done", "message": "", "lastTransitionTime": now,
             "observedGeneration": 1}
            for c in contract.CONDITIONS
        ],
        "message": "serving",
    }


@pytest.fixture
def pair_with_status(custom_api, crd_namespace, request):
    name = f"st-{abs(hash(request.node.name)) % 10**8}"
    create(custom_api, crd_namespace, minimal(name))
    return name


def patch_status(custom_api, namespace: str, name: str, status: dict) -> dict:
    return custom_api.patch_namespaced_custom_object_status(contract.GROUP, contract.VERSION, namespace,
                                                            contract.PLURAL, name, {"status": status})


def test_status_is_written_only_through_the_subresource(custom_api, crd_namespace, pair_with_status):
    # status sent with the main resource is dropped ...
    custom_api.patch_namespaced_custom_object(contract.GROUP, contract.VERSION, crd_namespace, contract.PLURAL,
                                              pair_with_status, {"status": {"phase": "Ready"}})
    read = custom_api.get_namespaced_custom_object(contract.GROUP, contract.VERSION, crd_namespace, contract.PLURAL,
                                                   pair_with_status)
    assert "status" not in read or "phase" not in read["status"]
    # ... and kept through /status
    written = patch_status(custom_api, crd_namespace, pair_with_status, good_status())
    assert written["status"]["ports"][0]["port"] == 20001
    assert written["metadata"]["generation"] == 1  # a status write does not bump the spec generation


def test_printer_columns_show_phase_ready_instances_restarts_and_decode_port(local_cluster, custom_api, crd_namespace,
                                                                  pair_with_status):
    patch_status(custom_api, crd_namespace, pair_with_status, good_status())
    proc = local_cluster.kubectl("get", contract.SHORT_NAME, pair_with_status, "-n", crd_namespace)
    header, row = proc.stdout.strip().splitlines()
    assert header.split() == ["NAME", "PHASE", "READY", "P", "D", "RESTARTS", "DECODE", "PORT", "AGE"]
    assert row.split()[:7] == [pair_with_status, "Ready", "True", "1/2", "1/1", "1", "20001"]
    wide = local_cluster.kubectl("get", f"{contract.PLURAL}.{contract.GROUP}", pair_with_status, "-n", crd_namespace,
                                 "-o", "wide").stdout
    assert "TRANSPORT" in wide and "flagcx" in wide


BAD_STATUS: list[tuple[str, Callable[[dict], None], tuple[str, ...]]] = [
    ("phase-unknown", lambda s: s.update(phase="Running"), ("status.phase", 'Unsupported value: "Running"')),
    ("condition-type-unknown", lambda s: s["conditions"][0].update(type="Healthy"),
     ("status.conditions[0].type", "Unsupported value")),
    ("condition-missing-reason", lambda s: s["conditions"][1].pop("reason"),
     ("status.conditions[1].reason", "Required value")),
    ("port-name-mismatch", lambda s: s["ports"][0].update(name="prefill-sidechannel-9"),
     ("status.ports[0].name", "<role>-<purpose>-<index>")),
    ("port-out-of-range", lambda s: s["ports"][1].update(port=70000), ("status.ports[1].port", "less than or equal")),
    ("port-duplicate-name", lambda s: s["ports"].append(dict(s["ports"][0])), ("status.ports[4]", "Duplicate value")),
    ("restarts-negative", lambda s: s.update(restarts=-1), ("status.restarts", "greater than or equal to 0")),
]


@pytest.mark.parametrize("mutate,expected", [(m, e) for _, m, e in BAD_STATUS], ids=[i for i, _, _ in BAD_STATUS])
def test_bad_status_is_refused(custom_api, crd_namespace, pair_with_status, mutate, expected):
    from kubernetes.client.rest import ApiException

    status = good_status()
    mutate(status)
    with pytest.raises(ApiException) as caught:
        patch_status(custom_api, crd_namespace, pair_with_status, status)
    message = json.loads(caught.value.body)["message"]
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in:\n{message}"


def test_spec_update_is_validated_too(custom_api, crd_namespace):
    """Rules hold on update, not only on create: a valid pair cannot be patched into an invalid one."""
    from kubernetes.client.rest import ApiException

    create(custom_api, crd_namespace, minimal("upd"))
    with pytest.raises(ApiException) as caught:
        custom_api.patch_namespaced_custom_object(contract.GROUP, contract.VERSION, crd_namespace, contract.PLURAL,
                                                  "upd", {"spec": {"prefill": {"tensorParallelSize": 4}}})
    assert "spec.prefill.tensorParallelSize" in json.loads(caught.value.body)["message"]
    # a valid change (a TP rollout on both roles) is accepted and bumps the generation
    updated = custom_api.patch_namespaced_custom_object(
        contract.GROUP, contract.VERSION, crd_namespace, contract.PLURAL, "upd",
        {"spec": {"prefill": {"tensorParallelSize": 4}, "decode": {"tensorParallelSize": 4}}})
    assert updated["metadata"]["generation"] == 2
    assert copy.deepcopy(updated["spec"]["decode"]) == {"replicas": 1, "tensorParallelSize": 4}
