"""A pair that an older CRD admitted (Helm never upgrades CRDs) with an owned-flag spelling in its args: the operator
builds no engine pod and says why, in a ReconcileError Event naming the field and the entry.

Real control plane (devcluster), the real operator as a subprocess; the "older CRD" is the chart's CRD with the
args rules taken out, put in place for this test and replaced by the chart's afterwards.
"""

from __future__ import annotations

import copy
import time

import pytest
import yaml

from pdpair.contract import GROUP, LABEL_ROLE, PLURAL, ROLES
from devcluster import operator_process
from tests.e2e.operator_helpers import (
    Api,
    cleanup_pairs,
    operator,
    pool_of_free_ports,
)
from devcluster.waiting import wait_for

pytestmark = pytest.mark.cluster

CRD_PATH = operator_process.CHART_DIR / "crds" / "inferencepairs.pdpair.io.yaml"


def replace_crd(cluster, crd: dict) -> None:
    cluster.kubectl("replace", "-f", "-", input=yaml.safe_dump(crd))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{PLURAL}.{GROUP}")


@pytest.fixture
def older_crd(platform):  # noqa: F811
    cluster, _ = platform
    chart_crd = yaml.safe_load(CRD_PATH.read_text())
    older = copy.deepcopy(chart_crd)
    for version in older["spec"]["versions"]:
        roles = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        for role in ROLES:
            args = roles[role]["properties"]["args"]
            args.pop("x-kubernetes-validations", None)  # prefill and decode are one YAML anchor
            args["items"].pop("x-kubernetes-validations", None)
    replace_crd(cluster, older)
    try:
        yield
    finally:
        replace_crd(cluster, chart_crd)


def test_owned_flag_admitted_by_an_older_crd_gets_no_pod_and_an_event(platform, older_crd, cluster_namespace,
                                                                      tmp_path):
    cluster, _ = platform
    api = Api(cluster)
    ns = cluster_namespace
    args = ["--enforce-eager", "--kv-transfer-config.kv_role=kv_both"]
    # the older CRD lets the spelling in; it is created on the apiserver's word, not ours
    api.create_pair(ns, "older-crd", decode={"args": args})
    expected = "spec.decode.args[1] '--kv-transfer-config.kv_role=kv_both' is an operator-owned flag"
    with operator(platform, ns, pool_of_free_ports(20), tmp_path):
        event = wait_for(lambda: next((e for e in api.events(ns)
                                       if e.reason == "ReconcileError" and expected in (e.message or "")), None),
                         90, "a ReconcileError Event naming the args entry")
        assert "upgrade it" in event.message
        # Still no engine pod a while later: the operator retries with backoff and keeps refusing.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            assert [p["metadata"]["labels"].get(LABEL_ROLE) for p in api.pods(ns)] == []
            time.sleep(0.5)
        cleanup_pairs(api, ns)
    assert api.leases(ns) == []
