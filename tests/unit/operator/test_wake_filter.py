"""wake_filter: which watch events wake a pair's pass. The operator's own status writes to the pair
and its role objects, and the disruption controller's status updates of its PodDisruptionBudget, do not; a spec
change, a deletion, an annotation, a label, an owner change and the health watch's findings do, and so does the first
event of every object. Cost: milliseconds, no I/O."""

from __future__ import annotations

import copy

from pdpair.operator.decide.wake_filter import WakeFilter, dependent_key, pair_key


def _pair(generation=1, status=None, **meta):
    return {"metadata": {"name": "p", "uid": "u", "generation": generation, "resourceVersion": "1", **meta},
            "spec": {"model": "m"}, "status": status if status is not None else {"phase": "Pending"}}


def test_own_status_writes_do_not_wake_a_pair_but_everything_it_reads_does():
    f = WakeFilter()
    assert f.changed("pair", "u", pair_key(_pair()), "ADDED")  # the first event always wakes
    assert not f.changed("pair", "u", pair_key(_pair()), "MODIFIED")
    own = _pair(status={"phase": "Ready", "ports": [{"port": 20000}], "message": "serving"}, resourceVersion="9")
    assert not f.changed("pair", "u", pair_key(own), "MODIFIED")  # the reconciler's own write
    health = copy.deepcopy(own)
    health["status"]["health"] = {"generation": 1, "stuck": ["decode"]}
    assert f.changed("pair", "u", pair_key(health), "MODIFIED")  # the health watch's finding
    for changed in (_pair(generation=2, status=health["status"]),
                    _pair(generation=2, status=health["status"], annotations={"pdpair.io/restart-times": "[1]"}),
                    _pair(generation=2, status=health["status"], annotations={"pdpair.io/restart-times": "[1]"},
                          labels={"team": "a"}),
                    _pair(generation=2, status=health["status"], annotations={"pdpair.io/restart-times": "[1]"},
                          labels={"team": "a"}, deletionTimestamp="2026-12-05T00:00:00Z")):
        assert f.changed("pair", "u", pair_key(changed), "MODIFIED")
        assert not f.changed("pair", "u", pair_key(changed), "MODIFIED")


def test_a_spec_change_batched_with_an_own_write_still_wakes():
    """kopf hands over only the latest body of a burst: a spec change and the reconciler's status write that followed
    it arrive as one event, which differs from the last one seen by its generation."""
    f = WakeFilter()
    f.changed("pair", "u", pair_key(_pair()), None)  # the initial listing
    latest = _pair(generation=2, status={"phase": "Ready", "message": "own write"})
    assert f.changed("pair", "u", pair_key(latest), "MODIFIED")


def _budget(generation=1, status=None, **meta):
    return {"metadata": {"name": "b", "uid": "b1", "generation": generation, "labels": {"pdpair.io/pair-uid": "u"},
                         "ownerReferences": [{"uid": "u"}], **meta},
            "spec": {"maxUnavailable": 0}, "status": status or {}}


def test_dependents_wake_on_spec_owner_and_deletion_not_on_status():
    f = WakeFilter()
    assert f.changed("pdb", "b1", dependent_key(_budget()), "ADDED")
    assert not f.changed("pdb", "b1", dependent_key(_budget(status={"currentHealthy": 2, "observedGeneration": 1})),
                         "MODIFIED")
    assert f.changed("pdb", "b1", dependent_key(_budget(generation=2)), "MODIFIED")
    assert f.changed("pdb", "b1", dependent_key(_budget(generation=2, ownerReferences=[])), "MODIFIED")
    assert f.changed("pdb", "b1", dependent_key(_budget(generation=2, ownerReferences=[],
                                                        deletionTimestamp="t")), "MODIFIED")
    # a role object of the same uid string is another object: kinds are kept apart
    assert f.changed("role", "b1", dependent_key(_budget(generation=2)), "ADDED")


def test_a_deleted_object_wakes_and_is_forgotten():
    f = WakeFilter()
    f.changed("role", "r1", dependent_key(_budget()), "ADDED")
    assert len(f) == 1
    assert f.changed("role", "r1", dependent_key(_budget()), "DELETED")
    assert len(f) == 0
    assert f.changed("role", "r1", dependent_key(_budget()), "ADDED")  # made again: its first event wakes
