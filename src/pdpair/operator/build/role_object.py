"""The InferencePairRole manifest of one role of a pair (`role_object`): the per-role scale object the HPA and
`kubectl scale` write; its name and the rule of which count wins are decisions (decide/scale_targets.py)."""

from __future__ import annotations

from typing import Any, Mapping

from pdpair.contract import API_VERSION, LABEL_ROLE, ROLE_OBJECT_KIND
from pdpair.operator.build.pods import owned_metadata
from pdpair.operator.decide.scale_targets import COMPONENT, role_object_name

def role_object(pair: Mapping[str, Any], role: str, replicas: int) -> dict[str, Any]:
    """The InferencePairRole manifest for `role` of `pair`: in the pair's namespace, the labels of everything the pair
    owns (pods.owned_labels: note the pair-name label limits the pair's name to 63 characters, as for its pods) plus
    the role, and the pair as controller owner, so the garbage collector deletes it with the pair."""
    name = role_object_name(pair["metadata"]["name"], role)
    return {
        "apiVersion": API_VERSION,
        "kind": ROLE_OBJECT_KIND,
        "metadata": owned_metadata(pair, name, COMPONENT, **{LABEL_ROLE: role}),
        "spec": {"pair": pair["metadata"]["name"], "role": role, "replicas": int(replicas)},
    }
