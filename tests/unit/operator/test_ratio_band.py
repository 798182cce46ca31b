"""The P:D ratio band (spec.scaling.ratio; operator/ratio_band.py): THE RULE's properties over every leader and
follower count and a spread of bands, the planner's decision (planner.scale_plan: banded counts, the follower write,
RatioBand and ScalingConflict), and the executor's write and its overlay until the index shows it. Pure, seconds.
Each property tries 100 derandomized examples in CI, 3000 with PDPAIR_FULL_PROPERTY_TESTS=1; the small counts are
also covered exhaustively (test_every_small_case_exhaustively)."""

from __future__ import annotations

import asyncio
import copy
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdpair import contract
from pdpair.operator.decide import planner
from pdpair.operator.decide import ratio_band
from pdpair.operator.act import scale_sync
from pdpair.operator.decide.ratio_band import follower_bounds, follower_replicas
from pdpair.operator.act.reconciler import PairReconciler, Runtime
from pdpair.operator.model.config import OperatorConfig, PortPool
from pdpair.operator.decide.scale_targets import ScaleView
from pdpair.operator.model.conditions import apply_conditions
from tests.crd_defaults import with_crd_defaults

MAX = contract.MAX_REPLICAS
COUNTS = st.integers(min_value=1, max_value=MAX)
# Bands as a user writes them: (0, 16], max >= min; some exact fractions (ends hit exactly), some arbitrary floats.
ENDS = st.one_of(st.sampled_from([0.1, 0.25, 1 / 3, 0.5, 2 / 3, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 16.0]),
                 st.floats(min_value=0.01, max_value=16.0, allow_nan=False))
BANDS = st.tuples(ENDS, ENDS).map(sorted)
# The example count is the hypothesis profile's (tests/property_counts.py): 100 per property in CI, 3000 with
# PDPAIR_FULL_PROPERTY_TESTS=1.
PROPERTY = settings(derandomize=True)


def admitted(leader: int, band_min: float, band_max: float) -> range:
    first, last = follower_bounds(leader, band_min, band_max)
    return range(first, last + 1)


# --- THE RULE: properties -----------------------------------------------------------------------------------------
@PROPERTY
@given(COUNTS, COUNTS, BANDS)
def test_the_follower_stays_within_one_and_the_maximum(leader, follower, band):
    assert 1 <= follower_replicas(leader, follower, *band) <= MAX


@PROPERTY
@given(COUNTS, COUNTS, BANDS)
def test_inside_the_band_whenever_the_band_admits_a_count(leader, follower, band):
    allowed = admitted(leader, *band)
    result = follower_replicas(leader, follower, *band)
    if allowed:
        assert result in allowed
        assert band[0] - 1e-9 <= result / leader <= band[1] + 1e-9
    else:  # too narrow for this leader: the band's lower end, rounded up, clamped
        assert result == min(MAX, max(1, math.ceil(band[0] * leader - 1e-9)))


@PROPERTY
@given(COUNTS, COUNTS, BANDS)
def test_a_count_inside_the_band_is_kept_and_the_rule_is_idempotent(leader, follower, band):
    result = follower_replicas(leader, follower, *band)
    if follower in admitted(leader, *band):
        assert result == follower
    assert follower_replicas(leader, result, *band) == result


@PROPERTY
@given(COUNTS, COUNTS, BANDS)
def test_monotone_in_the_leader(follower, leader, band):
    if leader < MAX:
        assert follower_replicas(leader, follower, *band) <= follower_replicas(leader + 1, follower, *band)


@PROPERTY
@given(COUNTS, COUNTS, BANDS)
def test_the_nearest_count_inside_the_band(leader, follower, band):
    """Moved only as far as the band needs: no admitted count is closer to the count it had."""
    allowed = admitted(leader, *band)
    if allowed:
        result = follower_replicas(leader, follower, *band)
        assert abs(result - follower) == min(abs(n - follower) for n in allowed)


def test_every_small_case_exhaustively():
    """All leader and follower counts 1..16 for every band of quarters in (0, 4]: the same properties, no sampling."""
    ends = [q / 4 for q in range(1, 17)]
    for band_min in ends:
        for band_max in [e for e in ends if e >= band_min]:
            for leader in range(1, MAX + 1):
                allowed = admitted(leader, band_min, band_max)
                for follower in range(1, MAX + 1):
                    result = follower_replicas(leader, follower, band_min, band_max)
                    assert 1 <= result <= MAX
                    assert not allowed or result in allowed
                    assert follower not in allowed or result == follower
                    if leader < MAX:
                        assert result <= follower_replicas(leader + 1, follower, band_min, band_max)


@pytest.mark.parametrize("leader,follower,band,want", [
    (4, 1, (0.5, 2), 2),  # the example: decode 4 -> prefill 1 outside [0.5, 2]: prefill set to 2
    (4, 9, (0.5, 2), 8),
    (4, 3, (0.5, 2), 3),  # inside: kept
    (1, 1, (1.5, 1.6), 2),  # no count admitted at leader 1: the lower end rounded up
    (16, 1, (2, 4), 16),  # never above 16
    (1, 5, (0.1, 0.2), 1),  # never below 1
    (30, 1, (0.1, 0.1), 3),  # 0.1 * 30 is 3.0000000000000004: the end itself is inside
    (3, 9, (1 / 3, 1 / 3), 1),
])
def test_examples(leader, follower, band, want):
    assert follower_replicas(leader, follower, *band) == want


# --- the planner's decision (planner.scale_plan) -------------------------------------------------------------------
def spec(prefill=1, decode=1, ratio=(0.5, 2.0), follower=None):
    raw = {"model": "m", "image": "img", "prefill": {"replicas": prefill}, "decode": {"replicas": decode}}
    if ratio is not None:
        raw["scaling"] = {"ratio": {"min": ratio[0], "max": ratio[1]}}
        if follower:
            raw["scaling"]["follower"] = follower
    return with_crd_defaults({"metadata": {"name": "p"}, "spec": raw})["spec"]


def view(role, replicas, uid=None, deleting=False):
    return ScaleView(name=f"p-{role}", role=role, replicas=replicas, uid=uid or f"uid-{role}", deleting=deleting,
                     pair="p")


def views(prefill, decode):
    return {"prefill": view("prefill", prefill), "decode": view("decode", decode)}


def recorded(status, plan):
    """The status the executor writes from a scale plan (its status fields and conditions), as the next pass reads."""
    out = copy.deepcopy(status)
    for key, value in plan.status_fields.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    out["conditions"], _ = apply_conditions(out.get("conditions"), plan.conditions)
    return out


def condition(status):
    return next(c for c in status["conditions"] if c["type"] == contract.COND_SCALING_CONFLICT)


def test_the_decode_hpa_moves_prefill_into_the_band_and_says_why():
    plan = planner.scale_plan(spec(), {}, views(prefill=1, decode=4))
    assert plan.spec["prefill"]["replicas"] == 2 and plan.spec["decode"]["replicas"] == 4
    assert plan.follower_write == ("p-prefill", 2)
    assert plan.events == (("Normal", "RatioBand", "decode 4 → prefill 1 outside [0.5, 2]: prefill set to 2"),)
    assert plan.status_fields == {"scaling": {"leader": "decode", "follower": "prefill", "leaderReplicas": 4,
                                              "followerReplicas": 2}}
    status = recorded({}, plan)
    assert condition(status)["status"] == "False"
    # the next pass sees its own write (the index, or scale_sync.with_own_writes): nothing more to do or tell
    again = planner.scale_plan(spec(), status, views(prefill=2, decode=4))
    assert again.follower_write is None and again.events == () and again.spec["prefill"]["replicas"] == 2
    assert again.status_fields == plan.status_fields


def test_inside_the_band_nothing_moves():
    plan = planner.scale_plan(spec(), {}, views(prefill=3, decode=4))
    assert plan.follower_write is None and plan.events == () and plan.spec["prefill"]["replicas"] == 3


def test_without_a_band_the_counts_are_the_role_objects_and_nothing_is_recorded():
    raw = spec(prefill=1, decode=1, ratio=None)
    plan = planner.scale_plan(raw, {}, views(prefill=1, decode=9))
    assert plan.spec == planner.effective_spec(raw, views(prefill=1, decode=9))
    assert (plan.follower_write, plan.events, plan.conditions, plan.status_fields) == (None, (), (), {})
    assert planner.scale_plan(raw, {}, None).spec is raw  # not watched: the spec as it is, as before


def test_removing_the_band_clears_the_record_and_the_condition():
    status = recorded({}, planner.scale_plan(spec(), {}, views(1, 4)))
    plan = planner.scale_plan(spec(ratio=None), status, views(2, 4))
    assert plan.status_fields == {"scaling": None}
    [cond] = plan.conditions
    assert (cond.type, cond.status, cond.reason) == (contract.COND_SCALING_CONFLICT, "False", "NoRatioBand")


def test_an_hpa_on_the_follower_is_kept_inside_the_band_and_moved_back_and_reported_once_outside():
    status = recorded({}, planner.scale_plan(spec(), {}, views(2, 4)))
    # kubectl scale ipr/p-prefill --replicas=3: inside [2, 8] at decode 4, kept, nothing reported
    inside = planner.scale_plan(spec(), status, views(3, 4))
    assert inside.follower_write is None and inside.events == () and inside.spec["prefill"]["replicas"] == 3
    status = recorded(status, inside)
    assert condition(status)["status"] == "False" and status["scaling"]["followerReplicas"] == 3
    # an HPA on the follower writes 12: outside, moved back to 8, reported with the writer's value
    outside = planner.scale_plan(spec(), status, views(12, 4))
    assert outside.follower_write == ("p-prefill", 8) and outside.spec["prefill"]["replicas"] == 8
    [(kind, reason, message)] = outside.events
    assert (kind, reason) == ("Warning", "ScalingConflict")
    assert "p-prefill spec.replicas was set to 12" in message and "moved it back to 8" in message
    assert "ipr/p-decode" in message and "HPA" in message
    status = recorded(status, outside)
    cond = condition(status)
    assert (cond["status"], cond["reason"]) == ("True", "FollowerWrittenOutsideBand") and "set to 12" in cond["message"]
    assert status["scaling"]["conflictReplicas"] == 12
    # our write shows; the condition stands
    settled = planner.scale_plan(spec(), status, views(8, 4))
    assert settled.events == () and settled.follower_write is None
    status = recorded(status, settled)
    assert condition(status)["status"] == "True"
    # the HPA writes 12 again: moved back again, but not told again (the condition says it)
    repeat = planner.scale_plan(spec(), status, views(12, 4))
    assert repeat.follower_write == ("p-prefill", 8) and repeat.events == ()
    status = recorded(status, repeat)
    # the leader moves: a fresh decision, the conflict is over until another one
    moved = planner.scale_plan(spec(), status, views(8, 6))
    assert moved.events == () and moved.follower_write is None  # 8 is inside [3, 12]
    status = recorded(status, moved)
    assert condition(status)["status"] == "False" and "conflictReplicas" not in status["scaling"]


def test_a_leader_move_is_never_reported_as_a_conflict_even_after_a_restart():
    """The record lives in status: a fresh operator (no memory) reads the same record and decides the same."""
    status = recorded({}, planner.scale_plan(spec(), {}, views(2, 4)))
    plan = planner.scale_plan(spec(), copy.deepcopy(status), views(2, 16))
    assert plan.follower_write == ("p-prefill", 8)
    assert [e[1] for e in plan.events] == ["RatioBand"]
    assert condition(recorded(status, plan))["status"] == "False"


def test_without_a_follower_object_the_banded_count_is_planned_and_told_once():
    """Scale objects not watched (or not made yet): nothing to write, the inline count stays as the user wrote it."""
    first = planner.scale_plan(spec(prefill=1, decode=4), {}, None)
    assert first.spec["prefill"]["replicas"] == 2 and first.follower_write is None
    [(_, reason, message)] = first.events
    assert reason == "RatioBand" and "prefill set to 2" in message and "planned" in message
    again = planner.scale_plan(spec(prefill=1, decode=4), recorded({}, first), None)
    assert again.events == () and again.spec["prefill"]["replicas"] == 2
    # only the leader's object exists: its count leads, the follower's inline count is banded, never a conflict
    only_leader = planner.scale_plan(spec(prefill=1, decode=1), recorded({}, first), {"decode": view("decode", 8)})
    assert only_leader.spec["prefill"]["replicas"] == 4 and only_leader.follower_write is None
    assert [e[1] for e in only_leader.events] == ["RatioBand"]


def test_a_deleting_follower_object_is_not_written():
    plan = planner.scale_plan(spec(prefill=1), {}, {"prefill": view("prefill", 1, deleting=True),
                                                    "decode": view("decode", 4)})
    assert plan.follower_write is None and plan.spec["prefill"]["replicas"] == 2


def test_decode_can_follow_with_the_band_still_prefill_per_decode():
    plan = planner.scale_plan(spec(follower="decode"), {}, views(prefill=8, decode=1))
    # P/D in [0.5, 2] with prefill 8: decode in [4, 16], the nearest to 1 is 4
    assert plan.follower_write == ("p-decode", 4) and plan.spec["decode"]["replicas"] == 4
    assert plan.events[0][2] == "prefill 8 → decode 1 outside [0.5, 2]: decode set to 4"
    assert plan.status_fields["scaling"]["leader"] == "prefill"


def test_the_follower_default_comes_from_the_crd():
    assert spec()["scaling"]["follower"] == contract.ROLE_PREFILL
    assert ratio_band.ratio_band(spec()) == ratio_band.RatioBand(0.5, 2.0, contract.ROLE_PREFILL)
    assert ratio_band.ratio_band(spec(ratio=None)) is None


# --- the executor: the write, and its own write overlaid until the index shows it ----------------------------------
class FakeCustom:
    """The role objects' CustomObjectsApi spec patch; records each call."""

    def __init__(self, missing=()):
        self.calls = []
        self.missing = set(missing)

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body, **kw):
        from kubernetes.client.exceptions import ApiException

        assert (group, version, plural) == (contract.GROUP, contract.VERSION, contract.ROLE_OBJECT_PLURAL)
        self.calls.append((namespace, name, body))
        if name in self.missing:
            raise ApiException(status=404)
        return {}


def test_write_replicas_patches_spec_and_overlays_it_until_the_index_shows_it():
    api, cache = FakeCustom(), scale_sync.ScaleSyncCache()
    assert asyncio.run(scale_sync.write_replicas(api, "ns", view("prefill", 1), 2, cache, now=0.0))
    assert api.calls == [("ns", "p-prefill", {"spec": {"replicas": 2}})]
    lagging = views(1, 4)
    assert scale_sync.with_own_writes(lagging, cache, now=1.0)["prefill"].replicas == 2
    assert scale_sync.with_own_writes(views(2, 4), cache, now=2.0)["prefill"].replicas == 2  # shown: forgotten
    assert cache.replicas_written == {}
    # someone else's count after ours, or ours never shown within the TTL: the index is right
    asyncio.run(scale_sync.write_replicas(api, "ns", view("prefill", 1), 2, cache, now=0.0))
    assert scale_sync.with_own_writes(views(5, 4), cache, now=1.0)["prefill"].replicas == 5
    asyncio.run(scale_sync.write_replicas(api, "ns", view("prefill", 1), 2, cache, now=0.0))
    assert scale_sync.with_own_writes(lagging, cache, now=scale_sync.UNSEEN_TTL + 1)["prefill"].replicas == 1


def test_write_replicas_to_a_gone_object_is_quiet():
    api, cache = FakeCustom(missing={"p-prefill"}), scale_sync.ScaleSyncCache()
    assert not asyncio.run(scale_sync.write_replicas(api, "ns", view("prefill", 1), 2, cache))
    assert cache.replicas_written == {}


def reconciler(body, api, events):
    config = OperatorConfig(namespace="ops", port_pool=PortPool(20000, 20099))
    rt = Runtime(config=config, core=None, custom=api, leaser=None)
    return PairReconciler(rt, body, emit=lambda *event: events.append(event))


def band(events):
    return [e[1] for e in events if e[1] != "ReplicasFromScaleTarget"]


def test_the_executor_writes_before_telling_and_its_lagging_index_is_no_conflict():
    """reconciler.settle_counts over passes whose index lags the write: one write, one RatioBand Event, and the
    pass before the index shows the write neither writes again nor reports a conflict. The leader's role object
    holds another count than its inline one, then the follower's (the HPA's 12): one ReplicasFromScaleTarget Event
    for each, however many passes see it."""
    body = {"metadata": {"name": "p", "namespace": "ns", "uid": "u", "generation": 1}, "spec": spec(), "status": {}}
    api, events = FakeCustom(), []
    r = reconciler(body, api, events)
    first = asyncio.run(r.settle_counts(views(1, 4)))
    assert first.spec["prefill"]["replicas"] == 2 and api.calls == [("ns", "p-prefill", {"spec": {"replicas": 2}})]
    assert band(events) == ["RatioBand"]
    r.status = recorded(r.status, first)  # what the pass's status write records
    second = asyncio.run(r.settle_counts(views(1, 4)))  # the index still shows 1
    assert second.spec["prefill"]["replicas"] == 2 and len(api.calls) == 1 and len(band(events)) == 1
    assert condition(recorded(r.status, second))["status"] == "False"
    # an HPA on the follower sets 12: one write back, one Warning
    r.status = recorded(r.status, second)
    third = asyncio.run(r.settle_counts(views(12, 4)))
    assert api.calls[-1] == ("ns", "p-prefill", {"spec": {"replicas": 8}}) and third.spec["prefill"]["replicas"] == 8
    assert band(events) == ["RatioBand", "ScalingConflict"] and events[-1][0] == "Warning"
    told = [e[2].split(" but ")[0] for e in events if e[1] == "ReplicasFromScaleTarget"]
    assert told == ["spec.decode.replicas is 1", "spec.prefill.replicas is 1"]  # each (role, inline count) once
