"""The chart's InferencePair CRD on the local control plane: its path and its installation (server-side apply, then
wait until the apiserver serves it). Used by tests/e2e/conftest.py's CRD fixtures and test_crd_generation.py."""
from __future__ import annotations

from pathlib import Path

from pdpair import contract

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "charts" / "pdpair" / "crds" / "inferencepairs.pdpair.io.yaml"


def install_crd(cluster) -> None:
    """Server-side apply of the chart's CRD, then wait until the apiserver serves it."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=pdpair-tests", "-f", str(CRD_PATH))
    cluster.wait_crd_established(f"{contract.PLURAL}.{contract.GROUP}")
