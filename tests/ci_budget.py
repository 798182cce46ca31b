"""The test command's time budget: where the wall time of `bash hack/test.sh` goes, and a loud stop at the budget.

CI gives `.ci/run` 90 minutes on a 2-core machine, builds included. `hack/test.sh` records the moment it starts
(`PDPAIR_CI_STARTED`) and a phase file (`PDPAIR_CI_PHASES`): each install/build step appends its seconds, and the
pytest plugin below appends one line per test tier (the first folder under tests/: unit, native, e2e, engine,
e2e_realnode, ...). At the end `python -m tests.ci_budget report` prints the table, also after a failure.

When the whole command's wall time passes `PDPAIR_CI_BUDGET_SECONDS` (BUDGET_SECONDS, 80 minutes: 10 below CI's hard
limit, so the message and the fixtures' teardown still get out), a watchdog thread prints which tier and test were
running and sends the session SIGINT: pytest stops at once (also from inside a blocking wait), tears its clusters
down and exits non-zero. Without `PDPAIR_CI_STARTED` (a plain `pytest` run) there is no watchdog and no phase file.

    python -m tests.ci_budget report [PHASE_FILE]    # the table of phases and tiers
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

BUDGET_SECONDS = 80 * 60
STARTED_ENV = "PDPAIR_CI_STARTED"
BUDGET_ENV = "PDPAIR_CI_BUDGET_SECONDS"
PHASES_ENV = "PDPAIR_CI_PHASES"


def budget_seconds() -> float:
    raw = os.environ.get(BUDGET_ENV, "")
    if not raw:
        return float(BUDGET_SECONDS)
    try:
        value = float(raw)
    except ValueError:
        raise SystemExit(f"{BUDGET_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise SystemExit(f"{BUDGET_ENV}={raw!r} must be positive")
    return value


def started_at() -> float | None:
    raw = os.environ.get(STARTED_ENV, "")
    try:
        return float(raw) if raw else None
    except ValueError:
        raise SystemExit(f"{STARTED_ENV}={raw!r} is not a Unix time") from None


def record(phase: str, seconds: float, path: str | None) -> None:
    """Appends one phase to the phase file (a no-op without one)."""
    if path:
        with open(path, "a") as f:
            f.write(f"{phase}\t{seconds:.0f}\n")


def tier_of(nodeid: str) -> str:
    parts = nodeid.split("::", 1)[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]


def _fmt(seconds: float) -> str:
    return f"{int(seconds) // 60:d} min {int(seconds) % 60:02d} s"


def report(path: str) -> str:
    rows: list[tuple[str, float]] = []
    try:
        with open(path) as f:
            for line in f:
                name, _, secs = line.rstrip("\n").partition("\t")
                if secs:
                    rows.append((name, float(secs)))
    except FileNotFoundError:
        return f"(no phase file at {path})"
    width = max([len(n) for n, _ in rows] + [5])
    lines = [f"{'phase':<{width}}  {'wall':>12}"]
    lines += [f"{name:<{width}}  {_fmt(secs):>12}" for name, secs in rows]
    start = started_at()
    if start is not None:
        lines.append(f"{'total':<{width}}  {_fmt(time.time() - start):>12}  (budget {_fmt(budget_seconds())})")
    return "\n".join(lines)


class Budget:
    """pytest plugin: per-tier wall time into the phase file, and the watchdog at the budget."""

    def __init__(self, started: float, budget: float, phase_file: str | None):
        self.phase_file = phase_file
        self.deadline = started + budget
        self.budget = budget
        self.current: str | None = None  # the test running now (nodeid)
        self.tier: str | None = None  # the tier of the test running now
        # tier -> [its first test's start, its last test's end] (monotonic): under pytest-xdist the tiers of one run
        # interleave (stage 1 runs four on two workers), so a tier's wall time is its span, not a run of its tests
        self.spans: dict[str, list[float]] = {}
        self.expired = False
        self._timer: threading.Timer | None = None

    # -- tiers ---------------------------------------------------------------------------------------------------
    def _record_tiers(self) -> None:
        """One phase row per tier, in the order the tiers started; the tier that started last runs until now (its
        module and session fixtures' teardown)."""
        spans = sorted(self.spans.items(), key=lambda item: item[1][0])
        if spans:
            spans[-1][1][1] = time.monotonic()
        for tier, (first, last) in spans:
            record(f"pytest {tier}", last - first, self.phase_file)
        self.spans = {}

    def pytest_sessionstart(self, session) -> None:
        # A process started in the background by a non-interactive shell (CI runs `bash .ci/run` so) inherits
        # SIGINT ignored, and Python then leaves it ignored: the watchdog's SIGINT would do nothing. Take it back.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        left = self.deadline - time.time()
        if left <= 0:
            self._expire(f"the builds before pytest already took the whole budget of {_fmt(self.budget)}")
            return
        self._timer = threading.Timer(left, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        self.current = nodeid
        self.tier = tier_of(nodeid)
        now = time.monotonic()
        self.spans.setdefault(self.tier, [now, now])

    def pytest_runtest_logfinish(self, nodeid, location) -> None:
        span = self.spans.get(tier_of(nodeid))
        if span is not None:
            span[1] = time.monotonic()

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._record_tiers()
        if self.expired:
            import pytest
            session.exitstatus = pytest.ExitCode.INTERRUPTED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.expired:
            terminalreporter.write_sep("=", self.message, red=True)

    # -- the watchdog ----------------------------------------------------------------------------------------------
    def _expire(self, why: str | None = None) -> None:
        self.expired = True
        where = f"tier {self.tier or '(none yet)'}, test {self.current or '(none yet)'}"
        self.message = (f"TIME BUDGET EXCEEDED: the test command passed {_fmt(self.budget)} "
                        f"({BUDGET_ENV}) in {where}" + (f": {why}" if why else "")
                        + "; stopping here so CI's hard limit does not cut the run off silently")
        print(f"\n\n{'!' * 100}\n{self.message}\n{'!' * 100}\n", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGINT)  # a real signal: interrupts the main thread even inside a blocking wait


def plugin() -> Budget | None:
    """The plugin for this session, or None outside the test command. It takes the variables out of the
    environment: a pytest that a test starts as a subprocess is not the test command, and must neither stop at
    the budget nor write to the phase file."""
    started = started_at()
    if started is None:
        return None
    budget = Budget(started, budget_seconds(), os.environ.pop(PHASES_ENV, None))
    for name in (STARTED_ENV, BUDGET_ENV):
        os.environ.pop(name, None)
    return budget


def main(argv: list[str]) -> int:
    if len(argv) >= 1 and argv[0] == "report":
        path = argv[1] if len(argv) > 1 else os.environ.get(PHASES_ENV, "")
        if not path:
            print(f"usage: python -m tests.ci_budget report PHASE_FILE (or set {PHASES_ENV})", file=sys.stderr)
            return 2
        print(report(path))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
