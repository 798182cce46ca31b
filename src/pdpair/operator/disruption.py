"""The pair's PodDisruptionBudget: a drain never takes a serving pair down before the operator has moved it. Pure
dicts, no client.

One `policy/v1` PodDisruptionBudget per pair, named after it, selecting every pod of the pair (any generation, by
the pair-uid label), `maxUnavailable: 0`: the Eviction API (`kubectl drain`, the cluster autoscaler) refuses to
evict a Ready pod of the pair (HTTP 429) and retries. Meanwhile the operator sees the node cordoned
(nodes.cordoned: drain cordons first) and moves the pair itself, in order: a Surge pair is re-homed beside the old
generation and switched without a gap (rollout.py), a Recreate pair gets an ordered restart (planner.failure,
reason node_drain); it then deletes the old pods itself (a delete is not an eviction), and the drain's next try
finds them gone. `unhealthyPodEvictionPolicy: AlwaysAllow`: a pod that is not Ready serves nothing and may be
evicted at once (a pair that is starting or broken never blocks a drain). Owned by the pair (ownerReference): the
garbage collector removes it with the pair. The operator makes it when it is missing (a deleted one comes back);
it never changes one that exists.
"""

from __future__ import annotations

from typing import Any, Mapping

from pdpair.contract import LABEL_PAIR_UID

from .pods import owned_metadata


def budget_name(pair_name: str) -> str:
    return pair_name  # as the router Service: the CRD keeps pair names short DNS labels


def pair_budget(pair: Mapping[str, Any]) -> dict[str, Any]:
    meta = pair["metadata"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": owned_metadata(pair, budget_name(meta["name"]), "disruption-budget"),
        "spec": {
            "selector": {"matchLabels": {LABEL_PAIR_UID: meta["uid"]}},
            "maxUnavailable": 0,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
