"""The chart's CRDs (InferencePair, InferencePairRole) on the local control plane: their paths and their installation
(server-side apply, then wait until the apiserver serves them). Used by tests/e2e/conftest.py's CRD fixtures and test_crd_generation.py."""
from __future__ import annotations

from pathlib import Path

from pdpair import contract

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "charts" / "pdpair" / "crds" / "inferencepairs.pdpair.io.yaml"
# The per-role scale objects' CRD (docs/xpyd.md section 2), installed wherever the InferencePair CRD is.
ROLE_CRD_PATH = REPO / "charts" / "pdpair" / "crds" / "inferencepairroles.pdpair.io.yaml"


def install_crd(cluster) -> None:
    """Server-side apply of the chart's CRDs, then wait until the apiserver serves them."""
    for path, name in ((CRD_PATH, f"{contract.PLURAL}.{contract.GROUP}"),
                       (ROLE_CRD_PATH, f"{contract.ROLE_OBJECT_PLURAL}.{contract.GROUP}")):
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=pdpair-tests", "-f", str(path))
        cluster.wait_crd_established(name)
