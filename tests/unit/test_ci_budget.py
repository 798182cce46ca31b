"""tests/ci_budget.py: the test command's per-tier wall times and its stop at the time budget, on a real pytest run
(a subprocess with tests.conftest as its plugin). Cost: about 10 s (four short pytest subprocesses)."""

import os
import pathlib
import signal
import subprocess
import sys
import time

from tests import ci_budget

REPO = pathlib.Path(__file__).resolve().parents[2]


def _pytest(tmp_path: pathlib.Path, body: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    test = tmp_path / "test_sample.py"
    test.write_text(body)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PDPAIR_CI_")}
    # SIGINT ignored, as in a process a non-interactive shell starts in the background (how CI runs .ci/run).
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(test)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**clean, **env},
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))


def test_the_tier_is_the_first_folder_under_tests():
    assert ci_budget.tier_of("tests/e2e_realnode/test_realnode_pair.py::test_x") == "e2e_realnode"
    assert ci_budget.tier_of("tests/unit/operator/test_pods.py::test_y[1]") == "unit"
    assert ci_budget.tier_of("test_sample.py::test_z") == "test_sample.py"


def test_a_run_past_the_budget_stops_naming_the_tier_and_the_test(tmp_path):
    phases = tmp_path / "phases"
    t0 = time.monotonic()
    reached = tmp_path / "reached"
    proc = _pytest(tmp_path, "import pathlib, time\ndef test_first(): pass\ndef test_sleeps(): time.sleep(60)\n"
                             f"def test_never_reached(): pathlib.Path({str(reached)!r}).touch()\n",
                   {ci_budget.STARTED_ENV: str(time.time()), ci_budget.BUDGET_ENV: "3",
                    ci_budget.PHASES_ENV: str(phases)})
    out = proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 50, out  # stopped inside the sleep, not after it
    assert proc.returncode == 2, out  # pytest's INTERRUPTED, not a pass
    assert "TIME BUDGET EXCEEDED" in out and "test_sample.py::test_sleeps" in out, out
    assert not reached.exists(), out  # nothing runs after the stop
    assert phases.read_text().startswith("pytest test_sample.py\t"), phases.read_text()


def test_builds_that_took_the_whole_budget_stop_pytest_before_the_first_test(tmp_path):
    proc = _pytest(tmp_path, "def test_ok(): pass\n",
                   {ci_budget.STARTED_ENV: str(time.time() - 100), ci_budget.BUDGET_ENV: "50"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "the builds before pytest already took the whole budget" in out, out


def test_within_the_budget_nothing_changes_and_each_tier_gets_a_line(tmp_path):
    phases = tmp_path / "phases"
    # A pytest that a test starts (as test_skip_fails_session does) must not inherit the budget or the phase file.
    proc = _pytest(tmp_path, "import os\ndef test_ok(): assert not [k for k in os.environ if k.startswith('PDPAIR_CI_')]\n",
                   {ci_budget.STARTED_ENV: str(time.time()), ci_budget.PHASES_ENV: str(phases)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [line] = phases.read_text().splitlines()
    assert line.split("\t")[0] == "pytest test_sample.py"
    table = ci_budget.report(str(phases))
    assert "pytest test_sample.py" in table and "wall" in table


def test_a_bad_budget_is_refused_with_its_name():
    env = {**os.environ, ci_budget.BUDGET_ENV: "soon"}
    proc = subprocess.run([sys.executable, "-c", "from tests import ci_budget; ci_budget.budget_seconds()"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and ci_budget.BUDGET_ENV in proc.stderr, proc.stderr


def test_every_tier_runs_in_exactly_one_stage_of_the_test_command():
    """hack/test.sh runs the tiers in stages (STAGE_* arrays): a tier folder left out of them would never run in CI,
    one listed twice would run twice. Every folder with tests is a tier of TIER_ORDER."""
    import re

    from tests import conftest

    script = (REPO / "hack" / "test.sh").read_text()
    staged = [folder for body in re.findall(r"^STAGE_\w+=\(([^)]*)\)", script, re.M) for folder in body.split()]
    assert sorted(staged) == sorted(f"tests/{tier}" for tier in conftest.TIER_ORDER)
    with_tests = {path.relative_to(REPO / "tests").parts[0] for path in (REPO / "tests").rglob("test_*.py")}
    assert with_tests <= set(conftest.TIER_ORDER), with_tests - set(conftest.TIER_ORDER)


def test_the_files_dealt_out_first_exist():
    """tests/conftest.py's LONGEST_FILES_FIRST names files by path: a renamed or removed one would silently fall back
    to the end of the deal, where a long file keeps one worker busy alone."""
    from tests import conftest

    missing = [path for path in conftest.LONGEST_FILES_FIRST if not (REPO / path).is_file()]
    assert not missing, missing
