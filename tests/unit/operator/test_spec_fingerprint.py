"""The rollout rule (pair_spec.POD_SPEC_FIELDS): which spec fields roll the pods, checked against the CRD, and the
fingerprint of every example pinned, so a refactor or an upgrade of the operator does not roll serving pairs.

Cost: under a second; no cluster.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdpair import contract
from pdpair.operator.model.pair_spec import POD_SPEC_FIELDS, SPEC_FIELDS_NOT_IN_PODS, spec_fingerprint
from tests.crd_defaults import spec_schema, with_crd_defaults

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

# spec_fingerprint of each example as the operator sees it (CRD defaults filled in), measured on 2207864. A change
# here means every serving pair of that shape rolls when the new operator starts: only on purpose, and say so in
# the release notes. flagcx-rdma and gpu-pair were re-pinned when the examples (not the operator) changed their
# spec.image to the CUDA engine image (images/engine-cuda).
PINNED = {
    "cpu-pvc-model.yaml": "60234ea509fa92dd",
    "flagcx-rdma.yaml": "bd5e2d0792cf42bb",
    "gang-scheduled.yaml": "7e6fb674bcd74c84",
    "gpu-pair.yaml": "a89daf5d1c950055",
    "hub-download.yaml": "944efbc96edf0f26",
    "inferencepair.yaml": "b61f3b01839fcadf",
}


def test_every_spec_field_of_the_crd_either_rolls_the_pods_or_is_named_as_not_in_them():
    properties = set(spec_schema()["properties"])
    assert not set(POD_SPEC_FIELDS) & set(SPEC_FIELDS_NOT_IN_PODS)
    unruled = properties - set(POD_SPEC_FIELDS) - set(SPEC_FIELDS_NOT_IN_PODS)
    assert not unruled, (f"new spec fields {sorted(unruled)}: add each to pair_spec.POD_SPEC_FIELDS (its change rolls "
                         "the pods) or SPEC_FIELDS_NOT_IN_PODS")
    assert set(POD_SPEC_FIELDS) | set(SPEC_FIELDS_NOT_IN_PODS) <= properties


def pairs_in(path: Path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == contract.KIND]


def test_every_example_is_pinned():
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml") if pairs_in(p)) == sorted(PINNED)


@pytest.mark.parametrize("name", sorted(PINNED))
def test_the_fingerprint_of_each_example_is_unchanged(name):
    [pair] = pairs_in(EXAMPLES / name)
    assert spec_fingerprint(with_crd_defaults(pair)["spec"]) == PINNED[name]


def test_fields_outside_the_pods_do_not_change_the_fingerprint_and_a_pod_field_does():
    [pair] = pairs_in(EXAMPLES / "inferencepair.yaml")
    spec = with_crd_defaults(pair)["spec"]
    base = spec_fingerprint(spec)
    for key in SPEC_FIELDS_NOT_IN_PODS:
        assert spec_fingerprint({**spec, key: {"changed": True}}) == base, key
    for key in POD_SPEC_FIELDS:
        assert spec_fingerprint({**spec, key: {"changed": True}}) != base, key
