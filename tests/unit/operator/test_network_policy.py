"""The pair's NetworkPolicy (operator/build/network_policy.py) and the executor's part of it
(`PairReconciler.ensure_network_policy`): who the manifest lets in, for which pairs there is one, and that the
executor makes a missing one, patches one that drifted, leaves another owner's alone with one Warning, and reads it
again only when its spec changes or after NETWORK_POLICY_RECHECK_RESYNCS resyncs.

Pure, with an in-memory stand-in for the CustomObjectsApi; no cluster (tests/e2e/test_chart_apply.py has the real
apiserver admit it). Whether a policy is enforced is the network plugin's business: nothing here can test that, and
the dev cluster's bridge CNI does not enforce policies. About 1 s."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest
import yaml

from pdpair.contract import LABEL_PAIR_UID, LABEL_ROLE, METRICS_PORT_NAME
from pdpair.operator.act import pair_objects
from pdpair.operator.act.reconciler import PairReconciler, Runtime
from pdpair.operator.build import network_policy as np
from pdpair.operator.model.config import OperatorConfig, PortPool

REPO = Path(__file__).resolve().parents[3]
UID = "uid-np-1"
PAIR = {"apiVersion": "pdpair.io/v1alpha1", "kind": "InferencePair",
        "metadata": {"name": "chat", "namespace": "team-a", "uid": UID, "generation": 1},
        "spec": {"network": {"hostNetwork": False}}}


def test_the_policy_admits_only_the_pairs_pods_and_the_operators_namespace():
    policy = np.pair_network_policy(PAIR, "pdpair-system")
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["kind"] == "NetworkPolicy"
    meta = policy["metadata"]
    assert (meta["name"], meta["namespace"]) == ("chat", "team-a")
    [owner] = meta["ownerReferences"]
    assert owner["uid"] == UID and owner["controller"] is True and np.owned_by(policy, UID)
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]  # egress untouched: engines still reach the model store, DNS
    # the engines of every generation, not the router (the pair's front door)
    assert spec["podSelector"] == {"matchLabels": {LABEL_PAIR_UID: UID}, "matchExpressions": [
        {"key": LABEL_ROLE, "operator": "In", "values": ["prefill", "decode"]}]}
    own, operator = spec["ingress"]
    # the pair's own pods, every port: side channel, metrics, http, and the transports' ephemeral data ports
    assert own == {"from": [{"podSelector": {"matchLabels": {LABEL_PAIR_UID: UID}}}]}
    assert operator["from"] == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "pdpair-system"}}}]
    assert [p["port"] for p in operator["ports"]] == [METRICS_PORT_NAME] + [f"side-{r}" for r in range(8)]
    assert {p["protocol"] for p in operator["ports"]} == {"TCP"}


def test_max_tp_is_the_crds():
    crd = yaml.load((REPO / "charts/pdpair/crds/inferencepairs.pdpair.io.yaml").read_text(),
                    Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml: the CRD is 7,700 lines
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert {spec[r]["properties"]["tensorParallelSize"]["maximum"] for r in ("prefill", "decode")} == {np.MAX_TP}


def test_the_side_port_names_are_the_pods():
    """pods.py names an engine's side-channel containerPorts side-<rank>; the policy names the same ones."""
    source = (REPO / "src/pdpair/operator/build/pods.py").read_text()
    assert '"name": f"side-{rank}"' in source
    assert np.side_port_names()[0] == "side-0" and len(np.side_port_names()) == np.MAX_TP


@pytest.mark.parametrize("network,enabled,expected", [
    ({}, True, False),  # the CRD's default is the host network
    ({"hostNetwork": True}, True, False),
    ({"hostNetwork": False}, True, True),
    ({"hostNetwork": False}, False, False),
])
def test_which_pairs_get_one(network, enabled, expected):
    assert np.wanted({"network": network} if network else {}, enabled) is expected


def test_the_digest_follows_the_spec_only():
    a = np.pair_network_policy(PAIR, "ops")
    b = copy.deepcopy(a)
    b["metadata"]["labels"]["x"] = "y"
    assert np.spec_digest(a) == np.spec_digest(b)
    assert np.spec_digest(a) != np.spec_digest(np.pair_network_policy(PAIR, "other"))


# --- the executor ------------------------------------------------------------------------------------------------
class ApiError(Exception):
    def __init__(self, status: int):
        super().__init__(f"({status})")
        self.status = status


class Reply:
    def __init__(self, obj):
        self.body = json.dumps(obj).encode()

    def read(self):
        return self.body

    def release_conn(self):
        pass


class Policies:
    """The NetworkPolicy calls of a CustomObjectsApi, in memory; records each call."""

    def __init__(self):
        self.objects: dict[tuple[str, str], dict] = {}
        self.calls: list[str] = []

    def get_namespaced_custom_object(self, group, version, ns, plural, name, **kw):
        assert (group, version, plural) == ("networking.k8s.io", "v1", "networkpolicies")
        self.calls.append("get")
        if (ns, name) not in self.objects:
            raise ApiError(404)
        return Reply(self.objects[(ns, name)])

    def create_namespaced_custom_object(self, group, version, ns, plural, body, **kw):
        self.calls.append("create")
        if (ns, body["metadata"]["name"]) in self.objects:
            raise ApiError(409)
        self.objects[(ns, body["metadata"]["name"])] = copy.deepcopy(body)
        return Reply(body)

    def patch_namespaced_custom_object(self, group, version, ns, plural, name, body, **kw):
        self.calls.append("patch")
        self.objects[(ns, name)]["spec"] = copy.deepcopy(body["spec"])
        return Reply(self.objects[(ns, name)])


def reconciler(policies: Policies, enabled: bool = True, pair=PAIR):
    config = OperatorConfig(namespace="pdpair-system", port_pool=PortPool(20000, 20099), network_policy=enabled)
    events: list[tuple[str, str, str]] = []
    rec = PairReconciler(Runtime(config=config, core=None, custom=policies, leaser=None), copy.deepcopy(pair),
                         emit=lambda *event: events.append(event))
    return rec, events


def test_the_executor_makes_it_once_and_reads_it_again_only_later(monkeypatch):
    policies = Policies()
    rec, events = reconciler(policies)
    asyncio.run(rec.ensure_network_policy())
    assert policies.calls == ["get", "create"]
    assert [e[1] for e in events] == ["NetworkPolicyCreated"]
    assert policies.objects[("team-a", "chat")] == np.pair_network_policy(PAIR, "pdpair-system")
    asyncio.run(rec.ensure_network_policy())
    assert policies.calls == ["get", "create"]  # nothing while it is known right
    # deleted behind the operator's back: back at the recheck
    del policies.objects[("team-a", "chat")]
    clock = [pair_objects.time.monotonic()]
    monkeypatch.setattr(pair_objects.time, "monotonic", lambda: clock[0])
    clock[0] += rec.rt.config.resync_interval * pair_objects.NETWORK_POLICY_RECHECK_RESYNCS + 1
    asyncio.run(rec.ensure_network_policy())
    assert policies.calls == ["get", "create", "get", "create"]


def test_a_drifted_policy_is_patched_back():
    policies = Policies()
    drifted = np.pair_network_policy(PAIR, "pdpair-system")
    drifted["spec"]["ingress"].append({})  # someone allowed everyone
    policies.objects[("team-a", "chat")] = drifted
    rec, events = reconciler(policies)
    asyncio.run(rec.ensure_network_policy())
    assert policies.calls == ["get", "patch"] and [e[1] for e in events] == ["NetworkPolicyUpdated"]
    assert policies.objects[("team-a", "chat")]["spec"] == np.pair_network_policy(PAIR, "pdpair-system")["spec"]


def test_another_owners_policy_is_left_alone_and_told_once():
    policies = Policies()
    theirs = np.pair_network_policy(PAIR, "pdpair-system")
    theirs["metadata"]["ownerReferences"] = []
    theirs["spec"]["ingress"] = [{}]
    policies.objects[("team-a", "chat")] = theirs
    rec, events = reconciler(policies)
    asyncio.run(rec.ensure_network_policy())
    asyncio.run(rec.ensure_network_policy())
    assert policies.calls == ["get", "get"] and policies.objects[("team-a", "chat")]["spec"]["ingress"] == [{}]
    [(kind, reason, message)] = events
    assert (kind, reason) == ("Warning", "NetworkPolicyError") and "does not own" in message


@pytest.mark.parametrize("enabled,host_network", [(False, False), (True, True)])
def test_no_call_when_off_or_on_the_host_network(enabled, host_network):
    policies = Policies()
    pair = {**PAIR, "spec": {"network": {"hostNetwork": host_network}}}
    rec, events = reconciler(policies, enabled=enabled, pair=pair)
    asyncio.run(rec.ensure_network_policy())
    assert policies.calls == [] and events == []
