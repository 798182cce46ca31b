"""The pair's NetworkPolicy (PDPAIR_NETWORK_POLICY, chart value `operator.networkPolicy.enabled`): only the pair's own
pods reach its engines. Pure dicts, no client.

One `networking.k8s.io/v1` NetworkPolicy per pair, named after it (like its Service and PodDisruptionBudget), owned
by it, selecting the pair's engine pods (prefill and decode, every generation: the pair-uid and role labels), Ingress
only:
- from the pair's own pods (same namespace, pair-uid label), every port: the side channel (`side-<rank>`), the
  connector's `metrics` port (the router's readiness asks it), the engines' `http` port (the router's requests),
  and the tcp transport's data connection and FlagCX's bootstrap, which listen on ephemeral ports a port list
  cannot name;
- from the operator's namespace, the `metrics` port (health scrapes, the peer push to prefill) and the side-channel
  ports (the listener probe that gates Ready), by name, so a TP or port-set change needs no new policy.
The router is not selected: its `http` port is the pair's front door (clients, through the Service), and whether
clients may reach it is the namespace's own policies' call; the operator's push and read of its peer set go there
too, with the pair's bearer token.

Only for pairs with `spec.network.hostNetwork: false`: a NetworkPolicy does not apply to pods on the host network
(charts/pdpair/README.md, "Network isolation", has the host-firewall rules for those). Policies are additive: a
Prometheus in another namespace scraping the engines (the chart's PodMonitor) needs a policy of its own that allows
it (the README has one). Whether the cluster enforces any of this is its network plugin's business (the dev cluster's
bridge CNI does not).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from pdpair.contract import LABEL_PAIR_UID, LABEL_ROLE, METRICS_PORT_NAME, ROLE_DECODE, ROLE_PREFILL

from pdpair.operator.build.pods import owned_metadata

# The CRD's maximum spec.<role>.tensorParallelSize: the side-channel ports the operator may probe are side-0 ..
# side-(MAX_TP-1) (pods.py names them); a named port a pod lacks matches nothing. tests/unit/operator/
# test_network_policy.py holds it to the CRD.
MAX_TP = 8
COMPONENT = "network-policy"
GROUP, VERSION, PLURAL = "networking.k8s.io", "v1", "networkpolicies"  # the executor's calls (CustomObjectsApi)
# Every pod in a namespace carries this label with the namespace's name (kube-apiserver sets it, since 1.21).
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def policy_name(pair_name: str) -> str:
    return pair_name


def wanted(spec: Mapping[str, Any], enabled: bool) -> bool:
    """Whether the pair gets a NetworkPolicy: the option is on and its pods are not on the host network (the CRD's
    default is hostNetwork true, as pods.py reads it)."""
    return bool(enabled) and not bool((spec.get("network") or {}).get("hostNetwork", True))


def side_port_names() -> list[str]:
    return [f"side-{rank}" for rank in range(MAX_TP)]


def pair_network_policy(pair: Mapping[str, Any], operator_namespace: str) -> dict[str, Any]:
    meta = pair["metadata"]
    tcp = lambda name: {"protocol": "TCP", "port": name}  # noqa: E731
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "NetworkPolicy",
        "metadata": owned_metadata(pair, policy_name(meta["name"]), COMPONENT),
        "spec": {
            "podSelector": {
                "matchLabels": {LABEL_PAIR_UID: meta["uid"]},
                "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": [ROLE_PREFILL, ROLE_DECODE]}],
            },
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {LABEL_PAIR_UID: meta["uid"]}}}]},
                {"from": [{"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: operator_namespace}}}],
                 "ports": [tcp(METRICS_PORT_NAME)] + [tcp(name) for name in side_port_names()]},
            ],
        },
    }


def spec_digest(manifest: Mapping[str, Any]) -> str:
    """What the executor compares: the operator's spec of a policy, canonical JSON, hashed."""
    return hashlib.sha256(json.dumps(manifest["spec"], sort_keys=True).encode()).hexdigest()[:16]


def owned_by(obj: Mapping[str, Any], pair_uid: str) -> bool:
    """The object names the pair as its controller owner (else it is someone else's and stays as it is)."""
    refs = ((obj.get("metadata") or {}).get("ownerReferences")) or []
    return any(r.get("uid") == pair_uid and r.get("controller") for r in refs)
