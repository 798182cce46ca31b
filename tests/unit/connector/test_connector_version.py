"""The connector refuses any vLLM but the one its KV-connector API was written for, with an actionable message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdpair.connector.connector import SUPPORTED_VLLM_VERSION, UnsupportedVllmVersion, check_vllm_version


def test_installed_vllm_is_the_supported_one():
    assert check_vllm_version().split("+")[0] == SUPPORTED_VLLM_VERSION == "0.32.0"


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "0.32.1", "1.0.0+cpu"])
def test_other_versions_are_refused(version):
    with pytest.raises(UnsupportedVllmVersion, match=rf"supports vLLM 0\.32\.0 only .* found {version.replace('+', '[+]')}"):
        check_vllm_version(version)


def test_local_build_tag_is_accepted():
    assert check_vllm_version("0.32.0+cpu") == "0.32.0+cpu"


def test_importing_the_package_does_not_import_vllm():
    code = "import sys, pdpair.connector, pdpair.connector.pod_server; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
