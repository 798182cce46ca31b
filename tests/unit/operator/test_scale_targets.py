"""Per-role scale objects (docs/xpyd.md section 2): THE RULE of which count wins (scale_targets.effective_replicas),
the overridden report, names at the length limit, the manifest's owner, the selector; and the executor's sync
(scale_sync.sync_scale_targets) against a fake CustomObjectsApi behind the operator's TimedApi. Pure, under a second."""

from __future__ import annotations

import asyncio
import re

import pytest
from kubernetes.client.exceptions import ApiException

from pdpair import contract
from pdpair.operator.build import pods
from pdpair.operator.act import scale_sync
from pdpair.operator.decide import scale_targets
from pdpair.operator.build.role_object import role_object
from pdpair.operator.act.kube_api import TimedApi
from pdpair.operator.decide.scale_targets import ScaleView
from tests.crd_defaults import with_crd_defaults

DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
UID = "0b7e1c7e-1111-2222-3333-444455556666"


def pair(name="p", prefill=None, decode=None, deleting=False):
    spec = {"model": "/models/tiny", "image": "img", "prefill": {}, "decode": {}}
    if prefill is not None:
        spec["prefill"]["replicas"] = prefill
    if decode is not None:
        spec["decode"]["replicas"] = decode
    body = with_crd_defaults({"apiVersion": contract.API_VERSION, "kind": contract.KIND,
                              "metadata": {"name": name, "namespace": "ns", "uid": UID}, "spec": spec})
    if deleting:
        body["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return body


def view(role, replicas, name=None, deleting=False, status=(None, None, None), uid=None):
    return ScaleView(name=name or f"p-{role}", role=role, replicas=replicas, uid=uid or f"uid-{role}",
                     deleting=deleting, pair="p", status_desired=status[0], status_replicas=status[1],
                     selector=status[2])


# --- THE RULE ---------------------------------------------------------------------------------------------------
# (case, inline prefill, inline decode, views, effective, overridden roles)
RULE = [
    ("no role objects: the inline counts", 2, 3, {}, {"prefill": 2, "decode": 3}, []),
    ("no inline and no object: the CRD's default 1", None, None, {}, {"prefill": 1, "decode": 1}, []),
    ("objects agree with inline", 2, 3, {"prefill": view("prefill", 2), "decode": view("decode", 3)},
     {"prefill": 2, "decode": 3}, []),
    ("re-applied inline 3 after kubectl scale to 2: effective 2, overridden reported", 1, 3,
     {"prefill": view("prefill", 1), "decode": view("decode", 2)}, {"prefill": 1, "decode": 2}, ["decode"]),
    ("an HPA scaled prefill up", 1, 1, {"prefill": view("prefill", 4)}, {"prefill": 4, "decode": 1}, ["prefill"]),
    ("deleted object: the inline count wins until it is made again", 1, 3,
     {"decode": view("decode", 2, deleting=True)}, {"prefill": 1, "decode": 3}, []),
    ("one object of two: the other role's inline count", 5, 3, {"decode": view("decode", 7)},
     {"prefill": 5, "decode": 7}, ["decode"]),
    ("an object without a count (older CRD): inline", 1, 3, {"decode": view("decode", 0)},
     {"prefill": 1, "decode": 3}, []),
]


@pytest.mark.parametrize("case,inline_p,inline_d,views,effective,overridden", RULE, ids=[r[0] for r in RULE])
def test_which_count_wins(case, inline_p, inline_d, views, effective, overridden):
    spec = pair(prefill=inline_p, decode=inline_d)["spec"]
    assert scale_targets.effective_replicas(spec, views) == effective
    assert [item[0] for item in scale_targets.inline_overridden(spec, views)] == overridden
    out = scale_targets.effective_spec(spec, views)
    assert {role: out[role]["replicas"] for role in contract.ROLES} == effective
    # the pair's own spec is untouched, everything but the counts is the same
    assert spec == pair(prefill=inline_p, decode=inline_d)["spec"]
    for role in contract.ROLES:
        assert {k: v for k, v in out[role].items() if k != "replicas"} == \
            {k: v for k, v in spec[role].items() if k != "replicas"}
    assert {k: v for k, v in out.items() if k not in contract.ROLES} == \
        {k: v for k, v in spec.items() if k not in contract.ROLES}


def test_overridden_reports_role_both_counts_and_the_object():
    spec = pair(prefill=1, decode=3)["spec"]
    views = {"decode": view("decode", 2)}
    items = scale_targets.inline_overridden(spec, views)
    assert items == [("decode", 3, 2, "p-decode")]
    type_, status, reason, message = scale_targets.overridden_condition(items)
    assert (type_, status, reason) == (contract.COND_REPLICAS_FROM_SCALE_TARGET, "True", "InlineReplicasOverridden")
    assert "spec.decode.replicas is 3" in message and "p-decode says 2" in message
    assert "kubectl scale ipr/p-decode --replicas=N" in message
    assert type_ in contract.CONDITIONS  # the pair's CRD admits it (tests/unit/test_crd_contract.py)
    assert scale_targets.overridden_condition([])[1:3] == ("False", "InlineReplicasMatch")
    [(key, event)] = scale_targets.overridden_events(items)
    assert key == ("decode", 3) and event[:2] == ("Normal", "ReplicasFromScaleTarget") and event[2] in message
    from pdpair.operator.model.conditions import Condition
    assert Condition(*scale_targets.overridden_condition(items)).status == "True"  # the reconciler's shape


def test_views_by_role_counts_only_the_roles_own_names():
    views = [view("decode", 2), view("prefill", 3, name="p-prefill-extra"), view("prefill", 1, name="p-decode")]
    assert scale_targets.views_by_role("p", views) == {"decode": view("decode", 2)}


# --- names ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [1, 63, 200, 245, 246, 252, 253])
@pytest.mark.parametrize("role", contract.ROLES)
def test_role_object_name_is_a_valid_unique_name_up_to_the_longest_pair_name(length, role):
    base = ("a" * 60 + ".") * 5
    pair_name = base[:length].rstrip(".-") or "a"
    pair_name = pair_name + "b" * (length - len(pair_name))
    assert len(pair_name) == length and DNS_SUBDOMAIN.fullmatch(pair_name)
    name = scale_targets.role_object_name(pair_name, role)
    assert len(name) <= scale_targets.NAME_MAX and DNS_SUBDOMAIN.fullmatch(name), name
    assert name.endswith(f"-{role}")
    if len(pair_name) + 1 + len(role) <= 253:
        assert name == f"{pair_name}-{role}"  # the documented name, unchanged
    # stable, and different for two long names that share the kept prefix
    assert scale_targets.role_object_name(pair_name, role) == name
    other = pair_name[:-1] + ("c" if pair_name[-1] != "c" else "d")
    assert scale_targets.role_object_name(other, role) != name


def test_role_object_name_refuses_what_is_not_a_pair_role():
    for bad in ("router", "Decode", ""):
        with pytest.raises(ValueError, match="role must be one of"):
            scale_targets.role_object_name("p", bad)


# --- manifest, selector, status -------------------------------------------------------------------------------------
def test_manifest_is_owned_by_the_pair_and_seeded_with_the_count():
    body = pair(name="chat", decode=3)
    manifest = role_object(body, "decode", 3)
    assert manifest["apiVersion"] == contract.API_VERSION and manifest["kind"] == contract.ROLE_OBJECT_KIND
    meta = manifest["metadata"]
    assert (meta["name"], meta["namespace"]) == ("chat-decode", "ns")
    assert meta["ownerReferences"] == [pods.owner_reference(body)]
    [ref] = meta["ownerReferences"]
    assert ref["controller"] is True and ref["uid"] == UID and ref["kind"] == contract.KIND
    assert meta["labels"] == {**pods.owned_labels(body, "scale-target"), contract.LABEL_ROLE: "decode"}
    assert manifest["spec"] == {"pair": "chat", "role": "decode", "replicas": 3}
    assert scale_targets.owner_uid(manifest) == UID


def test_owner_uid_needs_the_pair_as_controller():
    ref = {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "name": "p", "uid": "u", "controller": True}
    assert scale_targets.owner_uid({"metadata": {"ownerReferences": [ref]}}) == "u"
    assert scale_targets.owner_uid({"metadata": {"ownerReferences": [{**ref, "controller": False}]}}) is None
    assert scale_targets.owner_uid({"metadata": {"ownerReferences": [{**ref, "kind": "Deployment",
                                                                      "apiVersion": "apps/v1"}]}}) is None
    assert scale_targets.owner_uid({"metadata": {}}) is None


def test_selector_picks_the_roles_pods_and_not_the_router():
    selector = scale_targets.role_selector(UID, "decode")
    assert selector == f"{contract.LABEL_PAIR_UID}={UID},{contract.LABEL_ROLE}=decode"
    wanted = dict(kv.split("=", 1) for kv in selector.split(","))

    def matches(labels):
        return all(labels.get(k) == v for k, v in wanted.items())

    body = pair()
    assert matches(pods.pod_labels(body, "decode", 4))
    assert not matches(pods.pod_labels(body, "prefill", 4))
    assert not matches(pods.pod_labels(body, contract.ROLE_ROUTER, 4))


def test_status_patch_and_view_round_trip():
    patch = scale_targets.status_patch(3, 2, "a=b")
    assert patch == {"status": {"desired": 3, "replicas": 2, "selector": "a=b"}}
    body = {"metadata": {"name": "p-decode", "uid": "x", "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"pair": "p", "role": "decode", "replicas": 4}, **patch}
    seen = ScaleView.from_body(body)
    assert (seen.name, seen.role, seen.replicas, seen.uid, seen.deleting, seen.pair) == \
        ("p-decode", "decode", 4, "x", True, "p")
    assert seen.status == (3, 2, "a=b")
    assert ScaleView.from_body({"metadata": {"name": "n"}, "spec": {}}).status == (None, None, None)


# --- the executor's sync ----------------------------------------------------------------------------------------------
class FakeCustom:
    """CustomObjectsApi's three calls on a dict of objects; records each call with its kwargs."""

    def __init__(self, objects=None, fail=None):
        self.objects = dict(objects or {})
        self.calls = []
        self.fail = fail  # status to raise on create

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, **kw):
        self.calls.append(("create", body["metadata"]["name"], kw))
        assert (group, version, plural) == (contract.GROUP, contract.VERSION, contract.ROLE_OBJECT_PLURAL)
        if self.fail:
            raise ApiException(status=self.fail)
        if body["metadata"]["name"] in self.objects:
            raise ApiException(status=409, reason="AlreadyExists")
        self.objects[body["metadata"]["name"]] = body
        return body

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, **kw):
        self.calls.append(("get", name, kw))
        if name not in self.objects:
            raise ApiException(status=404)
        return self.objects[name]

    def patch_namespaced_custom_object_status(self, group, version, namespace, plural, name, body, **kw):
        self.calls.append(("patch-status", name, kw))
        if name not in self.objects:
            raise ApiException(status=404)
        self.objects[name].setdefault("status", {}).update(body["status"])
        return self.objects[name]


def sync(api, body, views, desired=None, ready=None, **kw):
    return asyncio.run(scale_sync.sync_scale_targets(
        TimedApi(api, 7.0), body, views, desired or {}, ready or {}, **kw))


def test_sync_creates_missing_objects_from_the_inline_count_with_deadlines():
    api = FakeCustom()
    events = sync(api, pair(prefill=2, decode=3), {})
    assert [(c[0], c[1]) for c in api.calls] == [("create", "p-prefill"), ("create", "p-decode")]
    assert all(c[2]["_request_timeout"] == (5.0, 7.0) for c in api.calls)  # TimedApi's deadline on every call
    assert api.objects["p-prefill"]["spec"]["replicas"] == 2 and api.objects["p-decode"]["spec"]["replicas"] == 3
    assert [e[1] for e in events] == ["ScaleTargetCreated", "ScaleTargetCreated"]


def test_sync_never_moves_an_existing_count_and_409_of_our_own_is_quiet():
    ours = role_object(pair(), "decode", 2)
    api = FakeCustom({"p-decode": ours})
    # the index has not shown p-decode yet: the create meets 409, the get shows it is ours
    events = sync(api, pair(decode=3), {"prefill": view("prefill", 1)})
    assert [(c[0], c[1]) for c in api.calls] == [("create", "p-decode"), ("get", "p-decode")]
    assert events == [] and api.objects["p-decode"]["spec"]["replicas"] == 2


def test_sync_reports_a_same_named_object_the_pair_does_not_own_once():
    foreign = {"metadata": {"name": "p-decode"}, "spec": {"pair": "p", "role": "decode", "replicas": 5}}
    api = FakeCustom({"p-decode": foreign})
    cache = scale_sync.ScaleSyncCache()
    views = {"prefill": view("prefill", 1)}
    events = sync(api, pair(), views, cache=cache, now=0.0)
    assert [e[:2] for e in events] == [("Warning", "ScaleTargetConflict")]
    assert sync(api, pair(), views, cache=cache, now=1.0) == []  # not again, and no call inside the TTL
    assert len(api.calls) == 2


def test_sync_tells_once_that_the_crd_is_missing():
    api = FakeCustom(fail=404)
    cache = scale_sync.ScaleSyncCache()
    events = sync(api, pair(), {}, cache=cache)
    assert [e[1] for e in events] == ["ScaleTargetUnavailable"]
    assert "inferencepairroles.pdpair.io" in events[0][2]
    assert sync(api, pair(), {}, cache=cache) == []


def test_sync_raises_other_api_errors():
    with pytest.raises(ApiException):
        sync(FakeCustom(fail=500), pair(), {})


def test_sync_makes_nothing_for_a_deleted_pair_or_over_a_deleting_object():
    api = FakeCustom()
    assert sync(api, pair(deleting=True), {}) == [] and api.calls == []
    views = {"prefill": view("prefill", 1), "decode": view("decode", 2, deleting=True)}
    assert sync(api, pair(), views, {"prefill": 1, "decode": 2}, {"prefill": 1, "decode": 2}, cache=None) == []
    assert [(c[0], c[1]) for c in api.calls] == [("patch-status", "p-prefill")]  # not p-decode: it is going


def test_sync_patches_status_only_when_it_differs_and_not_again_before_the_index_shows_it():
    sel = {role: scale_targets.role_selector(UID, role) for role in contract.ROLES}
    api = FakeCustom({"p-prefill": role_object(pair(), "prefill", 1),
                      "p-decode": role_object(pair(), "decode", 2)})
    cache = scale_sync.ScaleSyncCache()
    views = {"prefill": view("prefill", 1, status=(1, 1, sel["prefill"])), "decode": view("decode", 2)}
    desired, ready = {"prefill": 1, "decode": 2}, {"prefill": 1, "decode": 1}
    sync(api, pair(), views, desired, ready, cache=cache, now=0.0)
    assert [(c[0], c[1]) for c in api.calls] == [("patch-status", "p-decode")]
    assert api.objects["p-decode"]["status"] == {"desired": 2, "replicas": 1, "selector": sel["decode"]}
    sync(api, pair(), views, desired, ready, cache=cache, now=1.0)  # the index still shows the old status
    assert len(api.calls) == 1
    sync(api, pair(), views, desired, {"prefill": 1, "decode": 2}, cache=cache, now=2.0)  # a new count: written
    assert len(api.calls) == 2 and api.objects["p-decode"]["status"]["replicas"] == 2
    seen = {**views, "decode": view("decode", 2, status=(2, 2, sel["decode"]))}
    sync(api, pair(), seen, desired, {"prefill": 1, "decode": 2}, cache=cache, now=3.0)
    assert len(api.calls) == 2 and cache.patched == {}
    # someone else rewrote the status: written again at once
    other = {**views, "decode": view("decode", 2, status=(9, 9, "x=y"))}
    sync(api, pair(), other, desired, {"prefill": 1, "decode": 2}, cache=cache, now=4.0)
    assert len(api.calls) == 3


def test_sync_does_not_create_twice_before_the_index_shows_it_but_recreates_a_deleted_one():
    api = FakeCustom()
    cache = scale_sync.ScaleSyncCache()
    sync(api, pair(), {}, cache=cache, now=0.0)
    sync(api, pair(), {}, cache=cache, now=1.0)  # not in the index yet: no second create (no refused write)
    assert [c[0] for c in api.calls] == ["create", "create"]
    views = {"prefill": view("prefill", 1), "decode": view("decode", 1)}
    sync(api, pair(), views, cache=cache, now=2.0)  # seen
    del api.objects["p-decode"]  # kubectl delete ipr/p-decode: the index drops it
    events = sync(api, pair(decode=3), {"prefill": views["prefill"]}, cache=cache, now=3.0)
    assert api.calls[-1][:2] == ("create", "p-decode") and api.objects["p-decode"]["spec"]["replicas"] == 3
    assert [e[1] for e in events] == ["ScaleTargetCreated"]


def test_sync_seeds_a_missing_object_from_the_planned_count_when_a_band_moved_it():
    """spec.scaling.ratio: the follower's object is made with the count the pass planned (else the next pass would
    read the inline count there as another writer's)."""
    api = FakeCustom()
    events = sync(api, pair(prefill=1, decode=4), {}, seed_counts={"prefill": 2, "decode": 4})
    assert api.objects["p-prefill"]["spec"]["replicas"] == 2 and api.objects["p-decode"]["spec"]["replicas"] == 4
    assert "spec.prefill.replicas 1 brought into spec.scaling.ratio" in events[0][2]
    assert "(from spec.decode.replicas)" in events[1][2]
