"""The CRD's pod-template schemas are what hack/gen_crd.py makes from the pinned apiserver's own OpenAPI.

The script runs against the test control plane (kube-apiserver v1.36.3, devcluster) in --check mode: any drift
between the committed CRD and the generated one fails, with the diff. The stored CRD must stay far below etcd's
1.5 MiB object limit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdpair import contract
from devcluster.build import kubectl_path
from tests.e2e.crd_support import CRD_PATH, install_crd

REPO = Path(__file__).resolve().parents[2]
ETCD_OBJECT_LIMIT = 1_572_864  # etcd's default --max-request-bytes, the largest object the apiserver can store

pytestmark = pytest.mark.cluster


def test_committed_crd_matches_the_apiserver_openapi(local_cluster):
    proc = subprocess.run(
        [sys.executable, str(REPO / "hack" / "gen_crd.py"), "--kubeconfig", str(local_cluster.kubeconfig),
         "--kubectl", str(kubectl_path()), "--check"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{CRD_PATH} differs from hack/gen_crd.py's output:\n{proc.stdout[-6000:]}{proc.stderr}"


def test_check_mode_catches_a_hand_edit(local_cluster, tmp_path):
    """A line removed inside a generated region comes back in the diff, and --check fails."""
    edited = tmp_path / "crd.yaml"
    lines = CRD_PATH.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if "# >>> generated: engine-template" in line)
    cut = next(i for i in range(start, len(lines)) if "x-kubernetes-list-type: map" in lines[i])
    marker = lines.pop(cut)
    edited.write_text("".join(lines))
    proc = subprocess.run(
        [sys.executable, str(REPO / "hack" / "gen_crd.py"), "--kubeconfig", str(local_cluster.kubeconfig),
         "--kubectl", str(kubectl_path()), "--crd", str(edited), "--check"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "+" + marker.rstrip("\n") in proc.stdout, proc.stdout[-3000:] + proc.stderr


def test_stored_crd_size(local_cluster):
    install_crd(local_cluster)
    # the object as the apiserver serves it, managedFields included, in compact JSON
    stored = local_cluster.kubectl(
        "get", "--raw", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{contract.PLURAL}.{contract.GROUP}").stdout
    size = len(json.dumps(json.loads(stored), separators=(",", ":")))
    print(f"\nstored InferencePair CRD: {size} bytes (compact JSON, managedFields included)")
    assert size < ETCD_OBJECT_LIMIT // 4, size
