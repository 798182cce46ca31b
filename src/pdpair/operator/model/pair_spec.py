"""An InferencePair's spec as one pass plans from it: the mapping the API gave (with the pass's counts settled,
planner.scale_plan) and, beside it, every value the decisions read from it, each computed here once: the pods'
fingerprint (which spec change rolls the pods), each role's count, whether the router runs, the rollout strategy
and its clocks. The planner reads the spec into a `PairSpec` once per pass (`read`); recreate.py, surge.py,
instances.py and leases.py read these attributes instead of each deriving them again.

A `PairSpec` is a dict (the spec's own keys and values, unchanged), so everything that builds from the mapping
(manifests, the port blocks, the band) takes it as it is. Pure: no client, no clock.
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from typing import Any, Mapping

from pdpair.contract import ROLE_DECODE, ROLE_PREFILL, ROLE_ROUTER, ROLES, ROLLOUT_SURGE
from pdpair.operator.model import spec_fields

# The spec fields pods are built from; a change to any of them is a rollout. Every property of the CRD's spec is in
# exactly one of these two tuples (tests/unit/operator/test_spec_fingerprint.py fails on a new field in neither, so a
# new pod-affecting field can not silently never roll out). The fingerprint of every example is pinned there too:
# changing this list rolls every serving pair on operator upgrade.
POD_SPEC_FIELDS = ("model", "servedModelName", "image", "prefill", "decode", "connector", "network", "router",
                   "startupTimeoutSeconds", "apiKeySecret")
# Pod fields that came after pairs were already serving, with no CRD default: absent, a field of these is left out of
# the fingerprint (not hashed as null), so a pair that does not use it keeps the fingerprint it had and does not roll
# when the operator is upgraded; setting, changing or removing it rolls the pods like any pod field.
OMITTED_WHEN_ABSENT = ("apiKeySecret",)
# How to roll, restart and scale, not what: spec.scaling (the P:D band) moves counts, like replicas.
SPEC_FIELDS_NOT_IN_PODS = ("rolloutStrategy", "rollout", "restartPolicy", "scaling")
# Inside the role specs (the router's too), what is not a pod field: the instance count (xPyD, router replicas).
# Scaling 2 -> 3 must leave every existing pod alone, and a pair stored before the field existed (defaulted on read)
# must keep its fingerprint.
ROLE_FIELDS_NOT_IN_PODS = ("replicas",)


def spec_fingerprint(spec: Mapping[str, Any]) -> str:
    """The hash of the spec fields the pods are built from (annotation pdpair.io/spec-hash on every pod)."""
    relevant = {k: spec.get(k) for k in POD_SPEC_FIELDS if k not in OMITTED_WHEN_ABSENT or spec.get(k) is not None}
    for role in (ROLE_PREFILL, ROLE_DECODE, ROLE_ROUTER):
        if isinstance(relevant.get(role), Mapping):
            relevant[role] = {k: v for k, v in relevant[role].items() if k not in ROLE_FIELDS_NOT_IN_PODS}
    text = json.dumps(relevant, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def router_enabled(spec: Mapping[str, Any]) -> bool:
    return bool((spec.get("router") or {}).get("enabled", True))


class PairSpec(dict):
    """The spec (a dict of it) and what the decisions read from it, computed once (module docstring)."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        super().__init__(spec)
        self.fingerprint = spec_fingerprint(spec)
        self.replicas: Mapping[str, int] = {role: spec_fields.replicas(spec, role) for role in ROLES}
        self.router_enabled = router_enabled(spec)
        self.router_replicas = spec_fields.router_replicas(spec) if self.router_enabled else 0
        self.surge = spec.get("rolloutStrategy") == ROLLOUT_SURGE

    # Read when a decision needs them, not before: the CRD defaults them, and a spec that never drains or rolls out
    # (a unit test's, one an older CRD stored) may lack them without being wrong (spec_fields.defaulted says which).
    @cached_property
    def drain_seconds(self) -> float:
        """spec.rollout.drainSeconds: how long a draining instance or generation keeps its in-flight requests."""
        return float(spec_fields.defaulted(self, "rollout", "drainSeconds"))

    @cached_property
    def progress_deadline_seconds(self) -> float:
        """spec.rollout.progressDeadlineSeconds: how long a Surge rollout's new generation has to be Ready."""
        return float(spec_fields.defaulted(self, "rollout", "progressDeadlineSeconds"))

    @property
    def engine_instances(self) -> int:
        """Prefill and decode instances together: more than 2 is an xPyD pair (instances.heals_alone)."""
        return sum(self.replicas.values())


def read(spec: Mapping[str, Any]) -> PairSpec:
    """`spec` as a PairSpec (itself when it is one already: a pass reads its spec once)."""
    return spec if isinstance(spec, PairSpec) else PairSpec(spec)
