"""tests/conftest.py: any skip fails the pytest session (skips are never counted as passes)."""

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _pytest(tmp_path: pathlib.Path, body: str) -> subprocess.CompletedProcess:
    test = tmp_path / "test_sample.py"
    test.write_text(body)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(test)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("body", [
    "import pytest\ndef test_ok(): pass\ndef test_skip(): pytest.skip('missing')\n",
    "import pytest\npytest.importorskip('no_such_module_pdpair')\ndef test_ok(): pass\n",
])
def test_a_skip_fails_the_session(tmp_path, body):
    proc = _pytest(tmp_path, body)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "skips never count as passes" in proc.stdout


def test_no_skip_passes(tmp_path):
    proc = _pytest(tmp_path, "def test_ok(): pass\n")
    assert proc.returncode == 0, proc.stdout + proc.stderr
