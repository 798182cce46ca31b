"""Per-role scale objects (docs/xpyd.md section 2): pure rules, manifests and views, no client.

The operator keeps one `InferencePairRole` per role of a pair, named `<pair>-<role>` and owned by the pair, whose CRD
has the /scale subresource, so `kubectl scale`, the HorizontalPodAutoscaler and KEDA drive a role unchanged (the LWS
KEP-849 / RBG scaling-adapter pattern).

THE RULE (which count wins): once a role's object exists and is not being deleted, its `spec.replicas` is the role's
count; else the pair's inline `spec.<role>.replicas`. The inline count only seeds the object when the operator makes
it (scale_sync.py); a re-applied pair with another inline count does not move the role (else every `kubectl apply`
would undo the autoscaler), it is reported (`inline_overridden`: the ReplicasFromScaleTarget condition and an Event).
Deleting the role object hands the count back to the inline value until the operator makes it again from that value.

The planner consumes `effective_spec(spec, views)`; the executor (scale_sync.py) writes the objects.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from pdpair.contract import (
    COND_REPLICAS_FROM_SCALE_TARGET,
    GROUP,
    KIND,
    LABEL_PAIR_UID,
    LABEL_ROLE,
    ROLE_OBJECT_KIND,
    ROLE_OBJECT_SHORT_NAME,
    ROLES,
)

from pdpair.operator.model import spec_fields

# metadata.name of a custom object: a DNS-1123 subdomain, at most 253 characters. The pair's own name is one too,
# so `<pair>-<role>` can exceed it by up to len("-prefill"); such a name keeps a prefix of the pair's name and gets
# a digest of the whole (the same scheme as pods.pod_name). Names up to 253 - 8 characters are never shortened.
NAME_MAX = 253
DIGEST_CHARS = 8
COMPONENT = "scale-target"  # app.kubernetes.io/component of the role objects

REASON_OVERRIDDEN = "InlineReplicasOverridden"  # condition True: a role object's count differs from the inline one
REASON_INLINE_MATCHES = "InlineReplicasMatch"  # condition False: every role object agrees with the inline count
EVENT_REASON_OVERRIDDEN = "ReplicasFromScaleTarget"


def role_object_name(pair_name: str, role: str) -> str:
    """`<pair>-<role>`; for a pair name within 8 characters of the 253-character limit, a prefix of it, a digest of the
    whole name and the role (still unique per pair and stable, but not guessable: status.<role>.scaleTarget names it).
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    if not pair_name:
        raise ValueError("the pair has no name")
    name = f"{pair_name}-{role}"
    if len(name) <= NAME_MAX:
        return name
    digest = hashlib.sha256(pair_name.encode()).hexdigest()[:DIGEST_CHARS]
    suffix = f"-{digest}-{role}"
    return pair_name[: NAME_MAX - len(suffix)].rstrip("-.") + suffix


def role_selector(pair_uid: str, role: str) -> str:
    """The label selector (string form, what /scale's labelSelectorPath must hold) of the role's pods: every engine
    pod of the pair in that role carries both labels (pods.pod_labels); the router's role label is `router`."""
    return f"{LABEL_PAIR_UID}={pair_uid},{LABEL_ROLE}={role}"



def owner_uid(body: Mapping[str, Any]) -> str | None:
    """The uid of the InferencePair that controls this object (its controller ownerReference), or None."""
    for ref in (body.get("metadata") or {}).get("ownerReferences") or ():
        if (ref.get("controller") and ref.get("kind") == KIND
                and str(ref.get("apiVersion", "")).split("/", 1)[0] == GROUP and ref.get("uid")):
            return str(ref["uid"])
    return None


@dataclass(frozen=True)
class ScaleView:
    """The parts of an observed InferencePairRole the operator reads (the index keeps these, not the body)."""

    name: str
    role: str
    replicas: int  # spec.replicas: the role's count while this object exists and is not being deleted
    uid: str
    deleting: bool = False
    pair: str = ""  # spec.pair
    status_desired: int | None = None
    status_replicas: int | None = None
    selector: str | None = None

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> "ScaleView":
        meta = body.get("metadata") or {}
        spec = body.get("spec") or {}
        status = body.get("status") or {}
        return cls(
            name=str(meta.get("name", "")),
            role=str(spec.get("role", "")),
            replicas=int(spec.get("replicas") or 0),
            uid=str(meta.get("uid", "")),
            deleting=bool(meta.get("deletionTimestamp")),
            pair=str(spec.get("pair", "")),
            status_desired=_int_or_none(status.get("desired")),
            status_replicas=_int_or_none(status.get("replicas")),
            selector=status.get("selector"),
        )

    @property
    def status(self) -> tuple[int | None, int | None, str | None]:
        """(desired, replicas, selector) as observed; compared with `status_patch`'s values."""
        return (self.status_desired, self.status_replicas, self.selector)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def views_by_role(pair_name: str, views: Iterable[ScaleView]) -> dict[str, ScaleView]:
    """The pair's role objects by role, from the index's views (all owned by the pair): only an object whose name is
    the role's (`role_object_name`) and whose spec.role is a pair role counts; any other the pair owns is ignored."""
    out: dict[str, ScaleView] = {}
    for view in views:
        if view.role in ROLES and view.name == role_object_name(pair_name, view.role):
            out[view.role] = view
    return out


def live_view(views: Mapping[str, ScaleView], role: str) -> ScaleView | None:
    """The role's object while its count is the role's (exists, not being deleted, holds a count), else None."""
    view = views.get(role)
    return view if view is not None and not view.deleting and view.replicas >= 1 else None


def effective_replicas(spec: Mapping[str, Any], views: Mapping[str, ScaleView]) -> dict[str, int]:
    """THE RULE, per role: the role object's spec.replicas while it exists and is not being deleted, else the pair's
    inline spec.<role>.replicas (spec_fields.replicas)."""
    out: dict[str, int] = {}
    for role in ROLES:
        view = live_view(views, role)
        out[role] = view.replicas if view is not None else spec_fields.replicas(spec, role)
    return out


def effective_spec(spec: Mapping[str, Any], views: Mapping[str, ScaleView]) -> dict[str, Any]:
    """A copy of `spec` whose spec.<role>.replicas are the effective counts (what the planner plans from)."""
    return with_counts(spec, effective_replicas(spec, views))


def with_counts(spec: Mapping[str, Any], counts: Mapping[str, int]) -> dict[str, Any]:
    """A copy of `spec` with spec.<role>.replicas = counts[role]. Only the top level and the two role dicts are
    copied (templates are shared with `spec`: the planner does not mutate)."""
    out = dict(spec)
    for role in ROLES:
        out[role] = {**(spec.get(role) or {}), "replicas": int(counts[role])}
    return out


def inline_overridden(spec: Mapping[str, Any], views: Mapping[str, ScaleView]) -> list[tuple[str, int, int, str]]:
    """The roles whose role object holds a count other than the inline one: (role, inline, object_count, object_name),
    in ROLES order. Empty when every live role object agrees (or none exists)."""
    out: list[tuple[str, int, int, str]] = []
    for role in ROLES:
        view = live_view(views, role)
        if view is None:
            continue
        inline = spec_fields.replicas(spec, role)
        if view.replicas != inline:
            out.append((role, inline, view.replicas, view.name))
    return out


def overridden_text(role: str, inline: int, count: int, name: str) -> str:
    """One role's line for the condition message and the Event (what, which count wins, how to change it)."""
    return (f"spec.{role}.replicas is {inline} but {ROLE_OBJECT_KIND} {name} says {count}: the role object's count "
            f"wins (it was set by kubectl scale or an autoscaler); change it with `kubectl scale "
            f"{ROLE_OBJECT_SHORT_NAME}/{name} --replicas=N`, or delete {name} to have it made again from "
            f"spec.{role}.replicas")


def overridden_condition(items: list[tuple[str, int, int, str]]) -> tuple[str, str, str, str]:
    """(type, status, reason, message) of the pair's ReplicasFromScaleTarget condition for `inline_overridden`'s
    result: True while a role object's count differs from the inline one, else False."""
    if items:
        return (COND_REPLICAS_FROM_SCALE_TARGET, "True", REASON_OVERRIDDEN,
                "; ".join(overridden_text(*item) for item in items))
    return (COND_REPLICAS_FROM_SCALE_TARGET, "False", REASON_INLINE_MATCHES,
            "every role's count is its spec.<role>.replicas (or its role object agrees with it)")


def overridden_events(items: list[tuple[str, int, int, str]]) -> list[tuple[tuple[str, int], tuple[str, str, str]]]:
    """(key, (type, reason, message)) of the pair's Event per overridden role; the key is (role, inline count): post an
    Event once per distinct key (docs/xpyd.md: once per distinct inline value), remembered by the reconciler."""
    return [((role, inline), ("Normal", EVENT_REASON_OVERRIDDEN, overridden_text(role, inline, count, name)))
            for role, inline, count, name in items]


def status_patch(desired: int, ready: int, selector: str) -> dict[str, Any]:
    """The status patch of a role object: the planned count, the ready instances of the serving generation (the
    /scale status replicas) and the role's pod selector (the /scale labelSelector)."""
    return {"status": {"desired": int(desired), "replicas": int(ready), "selector": selector}}
