"""kopf_internals.NoDiffBaseStorage: kopf keeps no `last-handled-configuration` for this operator. Every
watch event that is not a deletion is "no change" to kopf (nothing built, copied or patched); a deletion still reaches
the on.delete handler; a handler that would need a diff-base is found at startup. Cost: milliseconds, no I/O."""

from __future__ import annotations

import kopf
from kopf._core.intents import causes

from pdpair.operator.glue.kopf_internals import NoDiffBaseStorage, diff_dependent_handlers

FINALIZER = "pdpair.io/finalizer"


class NoCopy:
    def __deepcopy__(self, memo):
        raise AssertionError("the body was copied")


def _pair(**meta):
    return kopf.Body({
        "apiVersion": "pdpair.io/v1alpha1", "kind": "InferencePair",
        "metadata": {"name": "p0001", "namespace": "scale", "uid": "u-1", "finalizers": [FINALIZER],
                     "managedFields": NoCopy(), **meta},
        "spec": {"model": "m", "huge": NoCopy()},
        "status": {"phase": "Ready", "ports": NoCopy()},
    })


def _cause(body, event_type="MODIFIED"):
    storage = NoDiffBaseStorage()
    old, new = storage.fetch(body=body), storage.build(body=body, extra_fields=["spec.model"])
    storage.store(body=body, patch=kopf.Patch(), essence=new)
    return causes.detect_changing_cause(
        finalizer=FINALIZER, raw_event={"type": event_type, "object": dict(body)}, body=body, old=old, new=new,
        diff=kopf.Diff(()) if old == new else None, initial=False, resource=None, indices=None, logger=None,
        patch=kopf.Patch(), memo=kopf.Memo())


def test_every_change_but_deletion_is_no_change_and_nothing_is_copied_or_patched():
    body = _pair(generation=7, annotations={"team": "a"})
    patch = kopf.Patch()
    NoDiffBaseStorage().store(body=body, patch=patch, essence=NoDiffBaseStorage().build(body=body))
    assert not patch  # no last-handled-configuration annotation: no PATCH of the pair
    assert _cause(body).reason == causes.Reason.NOOP


def test_a_deletion_still_reaches_the_delete_handler():
    assert _cause(_pair(deletionTimestamp="2026-12-05T00:00:00Z")).reason == causes.Reason.DELETE
    assert _cause(_pair(), "DELETED").reason == causes.Reason.GONE


def test_handlers_that_need_a_diff_base_are_found():
    registry = kopf.OperatorRegistry()

    @kopf.on.delete("pdpair.io", "v1alpha1", "inferencepairs", id="fine", registry=registry)
    def fine(**_):
        pass

    assert diff_dependent_handlers(registry) == []

    @kopf.on.update("pdpair.io", "v1alpha1", "inferencepairs", id="needs-diff", registry=registry)
    def needs_diff(**_):
        pass

    @kopf.on.field("pdpair.io", "v1alpha1", "inferencepairs", field="spec.model", id="field", registry=registry)
    def field(**_):
        pass

    assert sorted(diff_dependent_handlers(registry)) == ["field/spec.model", "needs-diff"]


def test_the_operators_own_handlers_need_none():
    import pdpair.operator.glue.handlers  # noqa: F401  (registers the operator's handlers in kopf's default registry)

    assert diff_dependent_handlers(kopf.get_default_registry()) == []
