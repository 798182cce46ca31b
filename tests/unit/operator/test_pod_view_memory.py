"""PodView keeps only what health.py reads of a pod (the pod index holds one per pod: at 1000 pairs, whole pods were
most of the operator's memory), and health.py's verdicts on that view equal its verdicts on the whole pod."""

from __future__ import annotations

import copy

import pytest

from pdpair.contract import LABEL_GENERATION, LABEL_ROLE
from pdpair.operator.decide import health
from pdpair.operator.model.observed import PodView


def whole_pod(**status) -> dict:
    return {
        "metadata": {
            "name": "p-decode-g1", "namespace": "ns", "uid": "u-1", "labels": {LABEL_ROLE: "decode", LABEL_GENERATION: "1"},
            "annotations": {"pdpair.io/spec-hash": "h"},
            "managedFields": [{"manager": "pdpair", "fieldsV1": {"f:spec": {f"f:c{i}": {} for i in range(50)}}}],
        },
        "spec": {
            "nodeName": "node-a",
            "containers": [{"name": "engine", "image": "img:1",
                            "env": [{"name": f"E{i}", "value": str(i)} for i in range(30)],
                            "ports": [{"name": "http", "containerPort": 20000}]}],
        },
        "status": {"phase": "Running", "podIP": "10.0.0.1",
                   "conditions": [{"type": "Ready", "status": "True"}, {"type": "PodScheduled", "status": "True"}],
                   "containerStatuses": [{"name": "engine", "restartCount": 0}], **status},
    }


def failed():
    return whole_pod(phase="Failed", reason="Evicted")


def succeeded():
    return whole_pod(phase="Succeeded")


def restarted():
    return whole_pod(containerStatuses=[{"name": "engine", "restartCount": 2,
                                         "lastState": {"terminated": {"reason": "OOMKilled"}}}])


def deleting():
    pod = whole_pod()
    pod["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return pod


def unscheduled():
    pod = whole_pod(phase="Pending", conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}])
    del pod["spec"]["nodeName"]
    return pod


def bound_pending():
    return whole_pod(phase="Pending", conditions=[])


@pytest.mark.parametrize("make", [whole_pod, failed, succeeded, restarted, deleting, unscheduled, bound_pending])
def test_health_reads_the_same_from_the_view(make):
    pod = make()
    view = PodView.from_pod(copy.deepcopy(pod))
    assert health.pod_fact("decode", view.raw) == health.pod_fact("decode", pod)  # incl. pending_scheduling


def test_the_view_drops_the_pod_spec_and_managed_fields():
    view = PodView.from_pod(whole_pod())
    assert "managedFields" not in view.raw["metadata"] and "labels" not in view.raw["metadata"]
    assert set(view.raw["spec"]) == {"nodeName"}
    assert view.raw["metadata"]["name"] == "p-decode-g1" and view.raw["status"]["phase"] == "Running"
    assert len(repr(view.raw)) < len(repr(whole_pod())) / 4
