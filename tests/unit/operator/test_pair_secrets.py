"""The pair's side-channel key: derived per pair, distinct from the push token, in a Secret of its own that only the
engine pods reference, made by the executor before the first pod that needs it. Pure and fake-API tests, < 1 s."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from pdpair import contract as c
from pdpair.connector.config import check_side_channel_key
from pdpair.operator.act.push import pair_token
from pdpair.operator.act.reconciler import PairReconciler, Runtime
from pdpair.operator.build.pair_secrets import side_channel_key, side_channel_secret
from pdpair.operator.build.pods import (
    POD_SECRETS,
    SECRET_PEERS,
    SECRET_SIDE_CHANNEL,
    engine_pod,
    owned_labels,
    peers_secret_name,
    router_pod,
    side_channel_secret_name,
)
from pdpair.operator.decide.recreate import Plan
from pdpair.operator.model.config import OperatorConfig, PortPool
from tests.unit.operator.test_pods import PAIR, leased

KEY = "operator-key-" + "k" * 32


def env_entries(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}


def test_the_key_is_per_pair_stable_and_not_the_push_token():
    key = side_channel_key(KEY, "uid-1")
    assert len(key) == 43 and check_side_channel_key(key) == key  # the connector's own rule
    assert key == side_channel_key(KEY, "uid-1")  # derived: the same after an operator restart
    assert key != side_channel_key(KEY, "uid-2") and key != side_channel_key("another-" + KEY, "uid-1")
    # the router holds the push token: it must not be the key (a distinct HMAC label)
    assert key != pair_token(KEY, "uid-1")


def test_the_secret_is_owned_by_the_pair_and_holds_only_the_key():
    secret = side_channel_secret(PAIR, "k" * 43)
    assert (secret["apiVersion"], secret["kind"], secret["type"]) == ("v1", "Secret", "Opaque")
    assert secret["stringData"] == {c.SIDE_CHANNEL_SECRET_KEY: "k" * 43} and "data" not in secret
    meta = secret["metadata"]
    assert (meta["name"], meta["namespace"]) == ("demo-side-channel", "ns1") != (peers_secret_name("demo"), "ns1")
    assert meta["labels"] == owned_labels(PAIR, "side-channel-key")
    [owner] = meta["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == (c.KIND, "uid-1", True)


def test_a_long_pair_name_keeps_the_secret_name_valid():
    name = side_channel_secret_name("p" * 63)
    assert len(name) <= 63 and name.endswith("-side-channel") and name != side_channel_secret_name("p" * 62 + "q")


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_engines_take_the_key_from_the_secret(role):
    env = env_entries(engine_pod(PAIR, role, 1, leased(), "h", peer_host="10.0.0.1"))
    assert "value" not in env[c.ENV_SIDE_CHANNEL_KEY]  # never inline: it would show in the pod object
    assert env[c.ENV_SIDE_CHANNEL_KEY]["valueFrom"] == {
        "secretKeyRef": {"name": "demo-side-channel", "key": c.SIDE_CHANNEL_SECRET_KEY}}


def test_the_router_never_gets_the_key():
    pod = router_pod(PAIR, 1, leased(), "h", "10.0.0.2", "10.0.0.1")
    env = env_entries(pod)
    assert c.ENV_SIDE_CHANNEL_KEY not in env and c.ENV_PEERS_TOKEN in env
    assert "side-channel" not in str(pod)  # no other reference to the Secret either


def test_a_template_cannot_replace_the_key():
    """A template's PDPAIR_* env is refused by the CRD; a body that bypassed it still gets the operator's entry."""
    pair = {**PAIR, "spec": {**PAIR["spec"], "decode": {**PAIR["spec"]["decode"], "env": [
        {"name": c.ENV_SIDE_CHANNEL_KEY, "value": "x" * 40}]}}}
    env = env_entries(engine_pod(pair, "decode", 1, leased(), "h"))
    assert "secretKeyRef" in env[c.ENV_SIDE_CHANNEL_KEY]["valueFrom"]


def test_pod_secrets_name_what_each_role_references():
    for role, needs in POD_SECRETS.items():
        pod = (router_pod(PAIR, 1, leased(), "h", "10.0.0.2", "10.0.0.1") if role == "router"
               else engine_pod(PAIR, role, 1, leased(), "h", peer_host="10.0.0.1"))
        refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in env_entries(pod).values()
                if "secretKeyRef" in (e.get("valueFrom") or {})}
        want = {SECRET_PEERS: peers_secret_name("demo"), SECRET_SIDE_CHANNEL: side_channel_secret_name("demo")}
        assert refs == {want[n] for n in needs}, role


# --- the executor: the Secret exists before the first pod that references it ------------------------------------
class Reply:
    def read(self) -> bytes:
        return b"{}"

    def release_conn(self) -> None:
        pass


class Core:
    """Records Secret and pod creates in order; `exists` answers a Secret create with 409."""

    def __init__(self, exists: bool = False) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.exists = exists

    def create_namespaced_secret(self, namespace, body):
        self.calls.append(("secret", body))
        if self.exists:
            raise ApiException(status=409, reason="AlreadyExists")

    def create_namespaced_pod(self, namespace, body, _preload_content=True):
        self.calls.append(("pod", body.to_dict()))
        return Reply()


def reconciler(core: Core) -> PairReconciler:
    config = OperatorConfig(namespace="ops", port_pool=PortPool(20000, 20099), peers_key=KEY)
    body = {"metadata": {**PAIR["metadata"], "generation": 1, "resourceVersion": "1"}, "spec": PAIR["spec"]}
    rec = PairReconciler(Runtime(config=config, core=core, custom=None, leaser=None), body, emit=lambda *e: None)
    rec.ports = leased()
    return rec


def plan(role: str) -> Plan:
    return Plan("create", 1, "Starting", (), "", create=role)


@pytest.mark.parametrize("exists", [False, True])
def test_the_executor_makes_the_secret_once_before_the_first_engine_pod(exists):
    core = Core(exists=exists)  # exists: made by this operator before a restart (409 is fine)
    rec = reconciler(core)
    asyncio.run(rec._create(plan("decode"), (), 1))
    asyncio.run(rec._create(plan("prefill"), (), 1))
    kinds = [(kind, body["metadata"]["name"]) for kind, body in core.calls]
    assert kinds == [("secret", "demo-side-channel"), ("pod", "demo-decode-g1"),
                     ("secret", "demo-peers"), ("pod", "demo-prefill-g1")]
    secret = core.calls[0][1]
    assert secret["stringData"] == {c.SIDE_CHANNEL_SECRET_KEY: side_channel_key(KEY, "uid-1")}


def test_the_router_pod_makes_no_side_channel_secret():
    core = Core()
    rec = reconciler(core)
    rec.peers_token = "t" * 43  # the peers Secret is made; nothing else is due for the router
    rec._manifest = lambda plan, pods: router_pod(PAIR, 1, leased(), "h", "10.0.0.2", "10.0.0.1")
    asyncio.run(rec._create(plan("router"), (), 1))
    assert [kind for kind, _ in core.calls] == ["pod"]


def test_a_refused_secret_create_stops_the_pod():
    """Anything but 409 fails the pass (retried with backoff): a pod whose Secret is missing would never start."""
    class Refusing(Core):
        def create_namespaced_secret(self, namespace, body):
            raise ApiException(status=403, reason="Forbidden")
    core = Refusing()
    with pytest.raises(ApiException):
        asyncio.run(reconciler(core)._create(plan("decode"), (), 1))
    assert core.calls == []
