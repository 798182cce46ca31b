"""Pod manifests: the contract's env, labels, owner, command, and the peer address only for prefill."""

import json
from pathlib import Path

import pytest

from pdpair import contract as c
from pdpair.operator.build.pods import ManifestError, engine_pod, pod_name, router_pod
from tests.pod_commands import without_preflight
from pdpair.operator.model.spec_fields import MissingDefaultedField
from pdpair.operator.decide.port_blocks import assign, status_ports
from tests.port_blocks_support import spec_blocks

from tests.crd_defaults import spec_schema, with_crd_defaults

REPO = Path(__file__).resolve().parents[3]

PAIR = with_crd_defaults({
    "metadata": {"name": "demo", "namespace": "ns1", "uid": "uid-1"},
    "spec": {
        "model": "tiny", "image": "img:1", "servedModelName": "t",
        "decode": {"tensorParallelSize": 2, "env": [{"name": "FOO", "value": "1"}], "args": ["--dtype", "float32"],
                   "tolerations": [{"key": "k", "operator": "Exists"}]},
        "prefill": {"tensorParallelSize": 2},
        "connector": {"transport": "tcp", "hangTimeoutSeconds": 30, "slots": 64},
        "network": {"hostNetwork": True},
    },
})


def leased():
    ports, nxt = [], 20000
    for block in spec_blocks(PAIR["spec"]):
        ports += assign(block, nxt)
        nxt += block.count
    return status_ports(ports)


def env_of(pod):
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def test_decode_pod():
    pod = engine_pod(PAIR, "decode", 4, leased(), "hash")
    env = env_of(pod)
    assert env[c.ENV_ROLE] == "decode" and env[c.ENV_GENERATION] == "4" and env[c.ENV_PAIR] == "demo"
    assert env[c.ENV_LISTEN_PORT_BASE] == "20000" and env[c.ENV_TRANSPORT] == "tcp"
    assert env[c.ENV_HANG_TIMEOUT_SECONDS] == "30" and env["FOO"] == "1"
    assert c.ENV_PEER_HOST not in env
    assert pod["metadata"]["name"] == "demo-decode-g4"
    labels = pod["metadata"]["labels"]
    assert labels[c.LABEL_PAIR_UID] == "uid-1" and labels[c.LABEL_GENERATION] == "4" and labels[c.LABEL_ROLE] == "decode"
    owner = pod["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == (c.KIND, "uid-1", True)
    assert pod["spec"]["hostNetwork"] is True and pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["tolerations"] == [{"key": "k", "operator": "Exists"}]
    cmd = without_preflight(pod["spec"]["containers"][0]["command"])  # the port preflight runs first (hostNetwork)
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "PdPairConnector", "kv_connector_module_path": "pdpair.connector",
                  "kv_role": "kv_consumer"}
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--port") + 1] == f"$({c.ENV_HTTP_PORT})"
    assert cmd[cmd.index("--served-model-name") + 1] == "t"
    # the user's args come first, so on a repeated flag vLLM keeps the operator's (test_engine_args.py proves it)
    assert cmd[3:5] == ["--dtype", "float32"] and cmd[5] == "--model"
    side = [p["containerPort"] for p in pod["spec"]["containers"][0]["ports"] if p["name"].startswith("side-")]
    assert side == [20000, 20001]


def test_prefill_pod_has_the_peer():
    pod = engine_pod(PAIR, "prefill", 4, leased(), "hash", peer_host="127.0.0.1")
    env = env_of(pod)
    assert env[c.ENV_PEER_HOST] == "127.0.0.1" and env[c.ENV_PEER_PORT_BASE] == "20000"
    assert env[c.ENV_LISTEN_PORT_BASE] != env[c.ENV_PEER_PORT_BASE]
    assert "kv_producer" in " ".join(pod["spec"]["containers"][0]["command"])


def test_served_model_name_defaults_to_the_model():
    pair = {**PAIR, "spec": {k: v for k, v in PAIR["spec"].items() if k != "servedModelName"}}
    cmd = engine_pod(pair, "decode", 1, leased(), "h")["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--served-model-name") + 1] == "tiny" == cmd[cmd.index("--model") + 1]


def test_args_an_older_crd_admitted_are_refused_naming_the_field():
    pair = {**PAIR, "spec": {**PAIR["spec"], "decode": {**PAIR["spec"]["decode"],
                                                        "args": ["--dtype", "float32", "--por=9999", "$(X)"]}}}
    with pytest.raises(ManifestError) as caught:
        engine_pod(pair, "decode", 1, leased(), "h")
    message = str(caught.value)
    assert "spec.decode.args[2] '--por=9999' is an operator-owned flag" in message
    assert "spec.decode.args[3] '$(X)' references an environment variable" in message
    assert "upgrade it" in message


def test_prefill_created_before_its_decode_has_an_address_takes_it_from_the_push():
    """Parallel start: a prefill made beside a decode with no address yet names no decode in its environment; it
    has the push token (the operator pushes the address once decode has one), which its connector requires then."""
    pod = engine_pod(PAIR, "prefill", 1, leased(), "h")
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert c.ENV_PEER_HOST not in env and c.ENV_PEER_PORT_BASE not in env and c.ENV_PEERS not in env
    assert env[c.ENV_PEERS_TOKEN]["valueFrom"]["secretKeyRef"]["key"] == "token"


def test_missing_ports_are_named():
    with pytest.raises(ManifestError, match="side-channel"):
        engine_pod(PAIR, "decode", 1, [], "h")


def test_router_pod():
    pod = router_pod(PAIR, 1, leased(), "h", "10.0.0.2", "10.0.0.1")
    cmd = without_preflight(pod["spec"]["containers"][0]["command"])
    assert cmd[:3] == ["python", "-m", "pdpair.router"]
    assert cmd[cmd.index("--prefill") + 1].startswith("http://10.0.0.2:")
    assert cmd[cmd.index("--decode") + 1].startswith("http://10.0.0.1:")
    assert "--local-prompt-tokens" not in cmd  # unset: the router's own default


def test_router_pod_passes_the_selective_disaggregation_threshold():
    pair = {**PAIR, "spec": {**PAIR["spec"], "router": {"localPromptTokens": 256}}}
    cmd = router_pod(pair, 1, leased(), "h", "10.0.0.2", "10.0.0.1")["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--local-prompt-tokens") + 1] == "256"
    assert "--concurrent-legs" not in cmd and "--no-concurrent-legs" not in cmd  # unset: the router's default
    for field, value, flag in (("concurrentLegs", True, "--concurrent-legs"),
                               ("concurrentLegs", False, "--no-concurrent-legs"),
                               ("prefixAffinity", True, "--prefix-affinity"),
                               ("prefixAffinity", False, "--no-prefix-affinity"),
                               ("learnSplitThreshold", True, "--learn-split-threshold"),
                               ("learnSplitThreshold", False, "--no-learn-split-threshold")):
        pair = {**PAIR, "spec": {**PAIR["spec"], "router": {field: value}}}
        assert flag in router_pod(pair, 1, leased(), "h", "10.0.0.2", "10.0.0.1")["spec"]["containers"][0]["command"]


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_engine_pods_carry_the_transport_slots(role):
    pod = engine_pod(PAIR, role, 1, leased(), "h", peer_host="127.0.0.1")
    assert env_of(pod)[c.ENV_TRANSPORT_SLOTS] == "64"


def test_layerwise_puts_reach_prefill_only_and_only_when_set():
    """spec.connector.layerwisePuts has no CRD default (a pair stored before it keeps its fingerprint): unset, no pod
    gets PDPAIR_LAYERWISE_PUTS and the connector's own default applies; set, prefill gets it, decode never."""
    assert c.ENV_LAYERWISE_PUTS not in env_of(engine_pod(PAIR, "prefill", 1, leased(), "h", peer_host="127.0.0.1"))
    assert "default" not in spec_schema()["properties"]["connector"]["properties"]["layerwisePuts"]
    for value, text in ((True, "true"), (False, "false")):
        pair = {**PAIR, "spec": {**PAIR["spec"], "connector": {**PAIR["spec"]["connector"], "layerwisePuts": value}}}
        assert env_of(engine_pod(pair, "prefill", 1, leased(), "h", peer_host="127.0.0.1"))[c.ENV_LAYERWISE_PUTS] == text
        assert c.ENV_LAYERWISE_PUTS not in env_of(engine_pod(pair, "decode", 1, leased(), "h"))


def test_connector_settings_come_from_the_crd_defaults_only():
    """The operator states no default of its own: an empty spec.connector, defaulted as the apiserver does, gives
    the CRD's values; a spec that bypassed the CRD fails naming the field instead of guessing."""
    connector = spec_schema()["properties"]["connector"]["properties"]
    bare = {**PAIR, "spec": {k: v for k, v in PAIR["spec"].items() if k != "connector"}}
    env = env_of(engine_pod(with_crd_defaults(bare), "decode", 1, leased(), "h"))
    assert env[c.ENV_TRANSPORT_SLOTS] == str(connector["slots"]["default"])
    assert env[c.ENV_TRANSPORT] == connector["transport"]["default"] == "flagcx"
    assert env[c.ENV_HANG_TIMEOUT_SECONDS] == str(connector["hangTimeoutSeconds"]["default"])
    with pytest.raises(MissingDefaultedField, match=r"spec\.connector\.transport is missing"):
        engine_pod({**PAIR, "spec": {**PAIR["spec"], "connector": {"slots": 8, "hangTimeoutSeconds": 5}}},
                   "decode", 1, leased(), "h")


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_metrics_container_port_has_the_podmonitor_name(role):
    pod = engine_pod(PAIR, role, 1, leased(), "h", peer_host="127.0.0.1")
    by_name = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert by_name[c.METRICS_PORT_NAME] == int(env_of(pod)[c.ENV_METRICS_PORT])


def test_long_names_stay_within_63():
    name = pod_name("x" * 60, "prefill", 123)
    assert len(name) <= 63 and name.endswith("-prefill-g123")
    assert pod_name("x" * 60, "prefill", 123) != pod_name("x" * 59 + "y", "prefill", 123)
