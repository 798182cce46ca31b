# Keep this file small: shared fixtures live next to what they set up.
import pytest


_skipped: list[str] = []


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
