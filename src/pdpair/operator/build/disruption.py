"""The pair's PodDisruptionBudget: a drain never takes a serving pair down before the operator has moved it. Pure
dicts, no client.

One `policy/v1` PodDisruptionBudget per pair, named after it, selecting every pod of the pair (any generation, by
the pair-uid label), `minAvailable` = NO_READY_POD_EVICTED: the Eviction API (`kubectl drain`, the cluster
autoscaler) refuses to evict a Ready pod of the pair (HTTP 429) and retries. Meanwhile the operator sees the node cordoned
(nodes.cordoned: drain cordons first) and moves the pair itself, in order: a Surge pair is re-homed beside the old
generation and switched without a gap (surge.py), a Recreate pair gets an ordered restart (planner.failure,
reason node_drain); it then deletes the old pods itself (a delete is not an eviction), and the drain's next try
finds them gone. `unhealthyPodEvictionPolicy: AlwaysAllow`: a pod that is not Ready serves nothing and may be
evicted at once (a pair that is starting or broken never blocks a drain). Owned by the pair (ownerReference): the
garbage collector removes it with the pair. The operator makes it when it is missing (a deleted one comes back);
it brings one that exists back to this spec (budget_outdated: a budget made by an older operator).

Why an integer `minAvailable` and not `maxUnavailable: 0`: the pair's pods are controlled by an InferencePair,
which has no `/scale` subresource. For `maxUnavailable` (or a percentage) the disruption controller must read
the expected pod count from each pod's controller's `/scale`; for a pair it cannot, so it fails safe (no eviction)
but posts a Warning Event `CalculateExpectedPodCountFailed` per pair on every sync (found in CI on 2026-12-03: the
idle operator test counted them). An integer `minAvailable` needs no controller: `disruptionsAllowed` is
`ready pods - minAvailable`, never above 0 while minAvailable exceeds any pair's pod count (the Kubernetes docs,
"Arbitrary workloads": only an integer minAvailable works for pods of a custom controller).
"""

from __future__ import annotations

from typing import Any, Mapping

from pdpair.contract import LABEL_PAIR_UID

from pdpair.operator.build.pods import owned_metadata


# More pods than a pair ever has (every generation of every role during a Surge), so no Ready pod is evictable.
NO_READY_POD_EVICTED = 10_000


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
            "minAvailable": NO_READY_POD_EVICTED,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def budget_shape(spec: Mapping[str, Any] | None) -> tuple[Any, Any, Any]:
    """What the operator owns of a budget's spec, as the index keeps it (the selector is fixed by the uid label)."""
    spec = spec or {}
    return spec.get("minAvailable"), spec.get("maxUnavailable"), spec.get("unhealthyPodEvictionPolicy")


def budget_outdated(shape: tuple[Any, Any, Any], pair: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch that brings an existing budget of the pair to pair_budget's spec, or None when it has it
    (an operator before 8b49220, 2026-12-03, made them with maxUnavailable 0: the patch drops it, `null` in a merge patch)."""
    desired = pair_budget(pair)["spec"]
    if shape == budget_shape(desired):
        return None
    return {"spec": {"minAvailable": desired["minAvailable"], "maxUnavailable": None,
                     "unhealthyPodEvictionPolicy": desired["unhealthyPodEvictionPolicy"]}}
