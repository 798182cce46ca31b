"""The P:D ratio band (docs/xpyd.md, "The P:D ratio band"): pure rules, no client, no clock.

`spec.scaling.ratio: {min, max}` bounds prefill instances per decode instance. Two writers on one count fight, so
each count has one owner while a band is set: the LEADER's count (decode; the other role when
`spec.scaling.follower` is decode) is what `kubectl scale` or an HPA sets on its InferencePairRole; the FOLLOWER's
count belongs to the operator, which keeps it inside the band. When the leader moves the follower out of the band,
the follower goes to the nearest count inside it (`follower_replicas`). A count someone else writes on the follower
is kept while it is inside the band and moved back when it is not (the `ScalingConflict` condition and an Event):
an HPA belongs on the leader only.

Who wrote the follower's count is read from the pair's own record, `status.scaling` (`Record`): the counts the
operator last planned from. A follower count other than the recorded one was written by someone else (the executor
overlays its own writes the index has not shown yet, scale_sync.with_own_writes, so its own lag never reads as
another writer). Being in status, the record survives an operator restart and a leader change.

`decide` is called by planner.scale_plan, the one place a pass's counts are settled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from pdpair.contract import (
    COND_SCALING_CONFLICT,
    MAX_REPLICAS,
    ROLE_DECODE,
    ROLE_OBJECT_KIND,
    ROLE_OBJECT_SHORT_NAME,
    ROLE_PREFILL,
)

from pdpair.operator.model import spec_fields
from pdpair.operator.model.conditions import FALSE, TRUE, Condition

# Products like 0.1 * 30 are 3.0000000000000004 in binary floating point: the band's ends are widened by this much so
# a count exactly on an end is inside the band.
EPSILON = 1e-9

EVENT_RATIO_BAND = "RatioBand"  # Normal: the leader moved, the follower was set into the band
EVENT_SCALING_CONFLICT = "ScalingConflict"  # Warning: another writer set the follower outside the band
REASON_CONFLICT = "FollowerWrittenOutsideBand"
REASON_NO_CONFLICT = "FollowerFollowsBand"
REASON_NO_BAND = "NoRatioBand"

Event = tuple[str, str, str]  # (type, reason, message), what the reconciler's emit() takes


def follower_bounds(leader: int, band_min: float, band_max: float, lo: int = 1,
                    hi: int = MAX_REPLICAS) -> tuple[int, int]:
    """The follower counts the band admits for `leader` instances of the leader, within [lo, hi]: (first, last).
    Empty (first > last) when the band is too narrow for this leader count."""
    return (max(lo, math.ceil(band_min * leader - EPSILON)), min(hi, math.floor(band_max * leader + EPSILON)))


def follower_replicas(leader: int, follower_now: int, band_min: float, band_max: float, lo: int = 1,
                      hi: int = MAX_REPLICAS) -> int:
    """THE RULE: the follower's count for `leader` leader instances, given its count now and the band (follower per
    leader): `follower_now` clamped into the counts the band admits (kept when already inside, the nearest end
    otherwise). When the band admits no count for this leader (e.g. [1.5, 1.6] at leader 1) the band's lower end,
    rounded up, within [lo, hi]: the follower never goes below lo (a role needs an instance) nor above hi."""
    first, last = follower_bounds(leader, band_min, band_max, lo, hi)
    if first > last:
        return min(hi, max(lo, math.ceil(band_min * leader - EPSILON)))
    return min(last, max(first, follower_now))


@dataclass(frozen=True)
class RatioBand:
    """spec.scaling as the operator reads it. `min`/`max` are always prefill per decode (as written); the follower's
    bounds per leader instance are `per_leader`."""

    min: float
    max: float
    follower: str

    @property
    def leader(self) -> str:
        return ROLE_DECODE if self.follower == ROLE_PREFILL else ROLE_PREFILL

    @property
    def per_leader(self) -> tuple[float, float]:
        """The band as follower instances per leader instance: P/D itself when prefill follows, D/P = the inverse
        band when decode follows."""
        if self.follower == ROLE_PREFILL:
            return (self.min, self.max)
        return (1.0 / self.max, 1.0 / self.min)

    def text(self) -> str:
        return f"[{self.min:g}, {self.max:g}]"

    def target(self, leader: int, follower_now: int) -> int:
        return follower_replicas(leader, follower_now, *self.per_leader)


def ratio_band(spec: Mapping[str, Any]) -> RatioBand | None:
    """The pair's band, or None when spec.scaling.ratio is absent (every pair made before the field: no band)."""
    ratio = (spec.get("scaling") or {}).get("ratio")
    if not ratio:
        return None
    return RatioBand(float(ratio["min"]), float(ratio["max"]), spec_fields.scaling_follower(spec))


@dataclass(frozen=True)
class Record:
    """status.scaling: what the operator last planned the band from (leader and follower counts), and the value of
    the last out-of-band write by someone else it reported (None: none since the leader last moved)."""

    leader: str
    follower: str
    leader_replicas: int
    follower_replicas: int
    conflict_replicas: int | None = None

    @classmethod
    def from_status(cls, status: Mapping[str, Any] | None) -> "Record | None":
        raw = (status or {}).get("scaling")
        if not isinstance(raw, Mapping):
            return None
        try:
            conflict = raw.get("conflictReplicas")
            return cls(str(raw["leader"]), str(raw["follower"]), int(raw["leaderReplicas"]),
                       int(raw["followerReplicas"]), None if conflict is None else int(conflict))
        except (KeyError, TypeError, ValueError):
            return None  # written by someone else in another shape: as if none (the next write replaces it)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"leader": self.leader, "follower": self.follower,
                               "leaderReplicas": self.leader_replicas, "followerReplicas": self.follower_replicas}
        if self.conflict_replicas is not None:
            out["conflictReplicas"] = self.conflict_replicas
        return out


@dataclass(frozen=True)
class BandDecision:
    """What the band decides for one pass (all empty without a band)."""

    counts: Mapping[str, int]  # the counts to plan from: the follower's is inside the band
    write: tuple[str, int] | None = None  # (follower's InferencePairRole name, spec.replicas) for the executor
    events: tuple[Event, ...] = ()
    conditions: tuple[Condition, ...] = ()
    record: Record | None = None  # status.scaling (None: removed)


def decide(spec: Mapping[str, Any], counts: Mapping[str, int], follower_object: str | None,
           status: Mapping[str, Any] | None, leader_object: str = "") -> BandDecision:
    """Apply the pair's band to this pass's counts (scale_targets.effective_replicas: a live role object's count,
    else the inline one).

    `follower_object`: the name of the follower's live InferencePairRole (None: none, or not watched; then the
    banded count is planned but nothing can be written, the inline count being the user's); `leader_object`: the
    leader's, for the messages. `status`: the pair's status (the record and the ScalingConflict condition)."""
    band = ratio_band(spec)
    if band is None:
        had_condition = any(c.get("type") == COND_SCALING_CONFLICT for c in (status or {}).get("conditions") or ())
        cleared = (Condition(COND_SCALING_CONFLICT, FALSE, REASON_NO_BAND, "no spec.scaling.ratio: each role's "
                             "count is its own"),) if had_condition else ()
        return BandDecision(dict(counts), conditions=cleared)

    leader, follower = band.leader, band.follower
    leader_n, follower_n = int(counts[leader]), int(counts[follower])
    target = band.target(leader_n, follower_n)
    recorded = Record.from_status(status)
    if recorded is not None and (recorded.leader, recorded.follower) != (leader, follower):
        recorded = None  # the roles were swapped: the old record says nothing about this follower
    # Another writer set the follower: its object holds a count other than the one the operator last planned.
    foreign = follower_object is not None and recorded is not None and follower_n != recorded.follower_replicas
    leader_moved = recorded is None or recorded.leader_replicas != leader_n
    conflict = None if leader_moved else recorded.conflict_replicas  # a new leader count is a fresh decision
    if foreign and target == follower_n:
        conflict = None  # the other writer's count is inside the band: kept, and nothing stands against it

    events: list[Event] = []
    if target != follower_n and foreign:
        conflict = follower_n
        if recorded is None or recorded.conflict_replicas != follower_n:  # once per distinct value
            events.append(("Warning", EVENT_SCALING_CONFLICT,
                           conflict_text(band, leader_n, follower_n, target, follower_object or "",
                                         leader_object)))
    elif target != follower_n and (recorded is None or (recorded.leader_replicas, recorded.follower_replicas)
                                   != (leader_n, target)):
        # Once per decision: without a follower object to write, every pass sees the same inline count again.
        events.append(("Normal", EVENT_RATIO_BAND, moved_text(band, leader_n, follower_n, target,
                                                              written=follower_object is not None)))

    if conflict is not None:
        condition = Condition(COND_SCALING_CONFLICT, TRUE, REASON_CONFLICT,
                              conflict_text(band, leader_n, conflict, target, follower_object or "", leader_object))
    else:
        condition = Condition(COND_SCALING_CONFLICT, FALSE, REASON_NO_CONFLICT,
                              f"{follower} follows {leader} inside P:D {band.text()}: {leader} {leader_n}, "
                              f"{follower} {target}")
    write = (follower_object, target) if follower_object is not None and target != follower_n else None
    return BandDecision({**counts, follower: target}, write, tuple(events), (condition,),
                        Record(leader, follower, leader_n, target, conflict))


def moved_text(band: RatioBand, leader_n: int, follower_n: int, target: int, written: bool = True) -> str:
    """'decode 4 → prefill 1 outside [0.5, 2]: prefill set to 2' (the RatioBand Event)."""
    text = (f"{band.leader} {leader_n} → {band.follower} {follower_n} outside {band.text()}: "
            f"{band.follower} set to {target}")
    first, last = follower_bounds(leader_n, *band.per_leader)
    if first > last:
        text += f" (the band admits no {band.follower} count at {band.leader} {leader_n}: the nearest)"
    if not written:
        text += f" (planned; spec.{band.follower}.replicas stays as written until its {ROLE_OBJECT_KIND} exists)"
    return text


def conflict_text(band: RatioBand, leader_n: int, written: int, target: int, follower_object: str,
                  leader_object: str) -> str:
    """The ScalingConflict condition's message and Event: the other writer's value, what the operator did, and
    where the count should be set instead."""
    leader_ref = f"{ROLE_OBJECT_SHORT_NAME}/{leader_object}" if leader_object else f"the {band.leader} role"
    return (f"{ROLE_OBJECT_KIND} {follower_object} spec.replicas was set to {written} by another writer (an HPA or "
            f"kubectl scale on the follower); {band.follower} {written} for {band.leader} {leader_n} is outside "
            f"P:D {band.text()} (spec.scaling.ratio), so the operator moved it back to {target}. With a band the "
            f"{band.follower} count follows the {band.leader} count: scale {leader_ref} and put an HPA on it only")
