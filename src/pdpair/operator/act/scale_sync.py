"""The executor's part of the per-role scale objects (docs/xpyd.md section 2): IO only, no decisions.

`sync_scale_targets` makes a missing InferencePairRole from the pair's INLINE count (scale_targets.role_object; a
band's follower from the plan's count) and writes each object's status (desired, replicas = ready, selector) when it
differs from what the index shows. `write_replicas` carries out a plan's write to a follower's spec.replicas
(spec.scaling.ratio), and `with_own_writes` shows the planner its own writes that the index does not show yet.
Which count the pair runs is planner.scale_plan's, decided before this is called; the counts passed in are the plan's.

Deadlines: every call goes through `custom_api`, which must be the operator's `TimedApi`-wrapped CustomObjectsApi
(Runtime.custom): kube_api.py sets `_request_timeout` on each call there, nowhere else. The calls run in the default
executor (the operator's API thread pool), like the reconciler's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from pdpair.contract import GROUP, ROLE_OBJECT_KIND, ROLE_OBJECT_PLURAL, ROLES, VERSION

from pdpair.operator.model import spec_fields
from pdpair.operator.decide.scale_targets import ScaleView, owner_uid, role_object_name, role_selector, status_patch
from pdpair.operator.build.role_object import role_object

Event = tuple[str, str, str]  # (type, reason, message), what the reconciler's emit() takes
UNSEEN_TTL = 120.0  # how long an own write may stay unseen by the index before it is done again (reconciler's too)


@dataclass
class ScaleSyncCache:
    """The executor's memory of its own writes until the index shows them, per pair (rebuildable: losing it costs a
    409 on a create or one repeated status patch). Without it a pass that runs before the watch delivered the last
    pass's write would create again (a refused write) or patch the same status again."""

    created: dict[str, float] = field(default_factory=dict)  # object name -> when created, until the index shows it
    # object uid -> (status seen before the patch, status written, when): skip while the index still shows the former
    patched: dict[str, tuple[tuple, tuple, float]] = field(default_factory=dict)
    crd_missing_told: bool = False
    # object name -> when a create met an object of that name the pair does not own: not tried again for UNSEEN_TTL
    foreign: dict[str, float] = field(default_factory=dict)
    foreign_told: set[str] = field(default_factory=set)  # such names already reported in an Event
    # object uid -> (spec.replicas seen before, spec.replicas written, when): a band's write to the follower
    # (write_replicas), overlaid on the index's view until it shows it (with_own_writes)
    replicas_written: dict[str, tuple[int, int, float]] = field(default_factory=dict)


def api_status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def with_own_writes(views: Mapping[str, ScaleView], cache: ScaleSyncCache, now: float | None = None
                    ) -> dict[str, ScaleView]:
    """The views as they will be once the index shows this executor's own spec.replicas writes (write_replicas):
    an object still showing the count seen before the write holds the written one, for at most UNSEEN_TTL. Without
    it the pass after a band's write would see the old count and take it for another writer's (ratio_band)."""
    now = time.monotonic() if now is None else now
    out = dict(views)
    for role, view in views.items():
        written = cache.replicas_written.get(view.uid)
        if written is None:
            continue
        before, after, at = written
        if view.replicas == before and now - at < UNSEEN_TTL:
            out[role] = dataclasses.replace(view, replicas=after)
        else:  # shown, or changed by someone since, or never shown: the index is right again
            cache.replicas_written.pop(view.uid, None)
    return out


async def write_replicas(custom_api: Any, namespace: str, view: ScaleView, replicas: int,
                         cache: ScaleSyncCache | None = None, now: float | None = None) -> bool:
    """Set a role object's spec.replicas (a plan's follower write: planner.ScalePlan.follower_write) with a merge
    patch, and remember it until the index shows it. False when the object is gone (404: the next pass sees that)."""
    try:
        await asyncio.to_thread(custom_api.patch_namespaced_custom_object, GROUP, VERSION, namespace,
                                ROLE_OBJECT_PLURAL, view.name, {"spec": {"replicas": int(replicas)}})
    except Exception as exc:
        if api_status(exc) == 404:
            return False
        raise
    if cache is not None:
        cache.replicas_written[view.uid] = (view.replicas, int(replicas), time.monotonic() if now is None else now)
    return True


def counts_of(role_status: Mapping[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """(desired, ready) per role, from a plan's role status (status.prefill / status.decode)."""
    return ({role: int(entry["desired"]) for role, entry in role_status.items()},
            {role: int(entry["ready"]) for role, entry in role_status.items()})


async def sync_scale_targets(
    custom_api: Any,
    pair_body: Mapping[str, Any],
    views: Mapping[str, ScaleView],
    desired_counts: Mapping[str, int],
    ready_counts: Mapping[str, int],
    *,
    cache: ScaleSyncCache | None = None,
    now: float | None = None,
    seed_counts: Mapping[str, int] | None = None,
) -> list[Event]:
    """Make each missing role object (seeded from spec.<role>.replicas, or seed_counts[role] when the plan moved
    that count: a band's follower; 409 = already there) and patch each live object's status when
    (desired_counts[role], ready_counts[role], selector) differs from the observed one.

    `views`: the pair's role objects by role (scale_targets.views_by_role over the index). A role absent from
    `desired_counts` or `ready_counts` gets no status write. Nothing is created for a pair being deleted, and nothing
    is written to an object being deleted. Returns the Events to post on the pair; raises the API errors other than
    404 (object or CRD gone) and 409 (already exists), so the pass fails and is retried like any other API error."""
    meta = pair_body["metadata"]
    namespace, pair_name, pair_uid = meta["namespace"], meta["name"], meta["uid"]
    cache = cache if cache is not None else ScaleSyncCache()
    now = time.monotonic() if now is None else now
    events: list[Event] = []
    for role in ROLES:
        name = role_object_name(pair_name, role)
        view = views.get(role)
        if view is not None:  # the index shows ours: an earlier create is seen, a foreign one is gone
            cache.created.pop(name, None)
            cache.foreign.pop(name, None)
            cache.foreign_told.discard(name)
        if view is None:
            if meta.get("deletionTimestamp"):
                continue  # the garbage collector removes the others; never make one for a pair that is going
            made = cache.created.get(name)
            if made is not None and now - made < UNSEEN_TTL:
                continue  # made by an earlier pass, not in the index yet
            met = cache.foreign.get(name)
            if met is not None and now - met < UNSEEN_TTL:
                continue  # an object of that name the pair does not own: looked at again later
            events += await _create(custom_api, pair_body, role, name, namespace, pair_uid, cache, now,
                                    (seed_counts or {}).get(role))
            continue
        if view.deleting:
            continue  # deleted by someone: the inline count counts; made again once it is gone
        if role not in desired_counts or role not in ready_counts:
            continue
        want = (int(desired_counts[role]), int(ready_counts[role]), role_selector(pair_uid, role))
        seen = view.status
        if seen == want:
            cache.patched.pop(view.uid, None)
            continue
        written = cache.patched.get(view.uid)
        if written is not None and written[0] == seen and written[1] == want and now - written[2] < UNSEEN_TTL:
            continue  # our patch is not in the index yet
        try:
            await asyncio.to_thread(custom_api.patch_namespaced_custom_object_status, GROUP, VERSION, namespace,
                                    ROLE_OBJECT_PLURAL, view.name, status_patch(*want))
        except Exception as exc:
            if api_status(exc) == 404:
                continue  # deleted meanwhile: the watch tells the next pass
            raise
        cache.patched[view.uid] = (seen, want, now)
    return events


async def _create(custom_api: Any, pair_body: Mapping[str, Any], role: str, name: str, namespace: str,
                  pair_uid: str, cache: ScaleSyncCache, now: float, seed: int | None = None) -> list[Event]:
    inline = spec_fields.replicas(pair_body.get("spec") or {}, role)
    count = inline if seed is None else int(seed)
    body = role_object(pair_body, role, count)
    try:
        await asyncio.to_thread(custom_api.create_namespaced_custom_object, GROUP, VERSION, namespace,
                                ROLE_OBJECT_PLURAL, body)
    except Exception as exc:
        status = api_status(exc)
        if status == 409:
            return await _exists(custom_api, name, namespace, pair_uid, pair_body["metadata"]["name"], cache, now)
        if status == 404:  # the InferencePairRole CRD is not installed (Helm never adds a new CRD on upgrade)
            if cache.crd_missing_told:
                return []
            cache.crd_missing_told = True
            return [("Warning", "ScaleTargetUnavailable",
                     f"cannot make {ROLE_OBJECT_KIND} {name}: the {ROLE_OBJECT_PLURAL}.{GROUP} CRD is not installed "
                     "(apply charts/pdpair/crds/inferencepairroles.pdpair.io.yaml); until then the pair's inline "
                     "spec.<role>.replicas are the counts")]
        raise
    cache.crd_missing_told = False
    cache.created[name] = now
    source = (f"from spec.{role}.replicas" if count == inline
              else f"spec.{role}.replicas {inline} brought into spec.scaling.ratio")
    return [("Normal", "ScaleTargetCreated",
             f"created {ROLE_OBJECT_KIND} {name} with replicas {count} ({source}); from now on its "
             f"spec.replicas is the {role} count (kubectl scale ipr/{name} --replicas=N, or an autoscaler)")]


async def _exists(custom_api: Any, name: str, namespace: str, pair_uid: str, pair_name: str, cache: ScaleSyncCache,
                  now: float) -> list[Event]:
    """409 on create: ours (the index has not shown it yet) is fine; one the pair does not own is reported."""
    try:
        found = await asyncio.to_thread(custom_api.get_namespaced_custom_object, GROUP, VERSION, namespace,
                                        ROLE_OBJECT_PLURAL, name)
    except Exception as exc:
        if api_status(exc) == 404:
            return []  # gone again: the next pass makes it
        raise
    if owner_uid(found) == pair_uid:
        cache.created[name] = now  # ours, not in the index yet
        return []
    cache.foreign[name] = now
    if name in cache.foreign_told:
        return []
    cache.foreign_told.add(name)
    return [("Warning", "ScaleTargetConflict",
             f"{ROLE_OBJECT_KIND} {name} exists but is not owned by this pair, so it does not scale it and the "
             f"pair's inline replicas count; delete it (the operator then makes its own) or rename the pair "
             f"{pair_name}")]
