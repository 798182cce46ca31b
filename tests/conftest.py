# Keep this file small: shared fixtures live next to what they set up.
import pytest

from tests import box_pressure, ci_budget


_skipped: list[str] = []


# The order the test tiers run in (the first folder under tests/; pytest's own order is alphabetical): the cheap
# tiers first, so a broken change fails in minutes, and the real-node tier last, because hack/test.sh builds the
# real-node binaries and images in the background meanwhile (only that tier needs them). A tier missing here runs
# before the real-node tier.
TIER_ORDER = ("unit", "native", "promtool", "flagcx_abi", "e2e", "engine", "e2e_realnode")

# Within a tier, these files first, longest first: hack/test.sh runs tests/e2e on 2 pytest-xdist workers, a file to a
# worker (--dist loadfile, --no-loadscope-reorder: the files go out in this order), and a long file dealt out last
# keeps one worker busy while the other idles. Measured alone on the 2-core box (2026-12-07, 446 passed in 644.9 s):
# the worker that drew test_operator_health_status.py last (its hung-pod test waits out a 150 s backoff) ran 640.6 s
# of tests, the other 582.8 s. Each file's seconds that run: health_status 238, lifecycle 209, port_guarantees 152,
# chaos 73, rollout 62, restart 61, scale_targets 49, chart_apply 41. The hung-pod test no longer waits out its whole
# 150 s backoff (about 90 s less): health_status about 150 s, after lifecycle (to be measured again alone).
LONGEST_FILES_FIRST = tuple(f"tests/e2e/{name}.py" for name in (
    "test_operator_lifecycle", "test_operator_health_status", "test_port_guarantees", "test_operator_chaos",
    "test_operator_rollout", "test_operator_restart", "test_scale_targets", "test_chart_apply"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {tier: i for i, tier in enumerate(TIER_ORDER)}
    last = rank["e2e_realnode"]
    first = {path: i for i, path in enumerate(LONGEST_FILES_FIRST)}
    # stable: otherwise the file order stays
    items.sort(key=lambda item: (rank.get(ci_budget.tier_of(item.nodeid), last - 0.5),
                                 first.get(item.nodeid.split("::", 1)[0], len(first))))


def pytest_configure(config: pytest.Config) -> None:
    budget = ci_budget.plugin()  # only under hack/test.sh: per-tier wall time and the stop at the budget
    if budget is not None:
        config.pluginmanager.register(budget, "pdpair-ci-budget")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append(report.nodeid)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:  # a module-level skip / importorskip
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Team rule: a skip is never a pass, so any skip fails the session (the test command installs everything).
    if _skipped and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter:
            reporter.write_line("")
            reporter.write_sep("=", f"FAILED: {len(_skipped)} skipped (skips never count as passes): "
                                    f"{', '.join(_skipped[:5])}", red=True)


# --- how much the box stalled during each test (tests/box_pressure.py) ----------------------------------------
_started: dict[str, box_pressure.Snapshot] = {}
_stalls: list[tuple[float, str, box_pressure.Stalls]] = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    snap = box_pressure.snapshot()
    if snap is not None:
        _started[item.nodeid] = snap


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    start = _started.get(item.nodeid)
    if start is None or (report.when != "teardown" and not report.failed):
        return
    end = box_pressure.snapshot()
    if end is None:
        return
    stalls = box_pressure.between(start, end)
    if report.failed:
        report.sections.append(("box pressure", f"{stalls.describe()}\n{box_pressure.busiest_processes()}"))
    if report.when == "teardown":
        _stalls.append((stalls.worst(), item.nodeid, stalls))
        del _started[item.nodeid]


def pytest_terminal_summary(terminalreporter) -> None:
    worst = sorted((s for s in _stalls if s[0] >= 1.0), key=lambda s: s[0], reverse=True)[:10]
    if worst:
        terminalreporter.write_sep("=", "tests during which the box stalled most (io/memory full, /proc/pressure)")
        for _, nodeid, stalls in worst:
            terminalreporter.write_line(f"{nodeid}: {stalls.describe()}")
