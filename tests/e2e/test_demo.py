"""The README's main command (hack/demo.sh minus the installs): hack/demo.py on a fresh local control plane."""

import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
DEMO = REPO / "hack" / "demo.py"
DEMO_DEADLINE_SECONDS = 420  # control plane start + Ready (the demo's own --timeout) + cleanup, on a loaded machine

pytestmark = pytest.mark.cluster


def test_demo_reaches_ready_and_leaves_no_leases():
    try:
        proc = subprocess.run([sys.executable, str(DEMO), "--timeout", "180"], cwd=REPO, capture_output=True,
                              text=True, timeout=DEMO_DEADLINE_SECONDS)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"hack/demo.py ran past {DEMO_DEADLINE_SECONDS}s; its output:\n{out[-4000:]}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"hack/demo.py exited {proc.returncode}:\n{output[-4000:]}"
    assert re.search(r"phase Ready: ", proc.stdout), f"the demo never printed the Ready phase:\n{output[-4000:]}"
    assert "pair deleted; 0 port leases left" in proc.stdout, f"leases left behind:\n{output[-4000:]}"
