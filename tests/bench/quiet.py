"""A benchmark runs on a quiet box or not at all: figures taken at load 20 said little (docs/benchmarks.md).

Every benchmark in this folder calls `require_quiet(name)` before it starts anything: it prints the load average and
the engines already running, and exits (status 1, the reason on stderr) when the 1-minute load is above PDPAIR_BENCH_MAX_LOAD
(default 3; the box has 2 cores). `report_after(name)` prints the same at the end, so a neighbour that started
meanwhile shows in the output. Both return what they print, for the benchmark's JSON report.
"""

from __future__ import annotations

import os
import sys

ENV_MAX_LOAD = "PDPAIR_BENCH_MAX_LOAD"
DEFAULT_MAX_LOAD = 3.0
# What an engine process's command line holds: vLLM's API server (a pair's pods, a single engine, NixlConnector's
# pair), or its engine core.
ENGINE_MARKERS = ("vllm.entrypoints", "vllm serve", "VLLM::EngineCore")


def max_load() -> float:
    raw = os.environ.get(ENV_MAX_LOAD, "")
    try:
        return float(raw) if raw else DEFAULT_MAX_LOAD
    except ValueError:
        raise SystemExit(f"{ENV_MAX_LOAD}={raw!r}: expected a number (the highest 1-minute load to start at)") from None


def running_engines() -> list[int]:
    """Pids of vLLM processes on this machine (their own process excluded), from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/comm", "rb") as f:
                comm = f.read().decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if any(m in cmdline for m in ENGINE_MARKERS) or comm.startswith("VLLM::"):
            pids.append(int(entry))
    return pids


def snapshot() -> dict:
    return {"load_average": os.getloadavg(), "engines_running": len(running_engines()), "cpus": os.cpu_count()}


def _say(name: str, when: str, state: dict) -> None:
    one, five, fifteen = state["load_average"]
    print(f"[{name}] {when}: load average {one:.2f} {five:.2f} {fifteen:.2f} on {state['cpus']} CPUs; "
          f"{state['engines_running']} vLLM processes running", file=sys.stderr, flush=True)


def require_quiet(name: str) -> dict:
    """Print the state of the box and exit when it is too busy to measure."""
    state = snapshot()
    _say(name, "before", state)
    limit = max_load()
    if state["load_average"][0] > limit:
        raise SystemExit(f"[{name}] refusing to measure: the 1-minute load is {state['load_average'][0]:.2f} > "
                         f"{limit:g} ({ENV_MAX_LOAD}); stop the other clusters and engines, wait for the load to "
                         f"fall, and run it again alone")
    return state


# After its engines started (a start takes both cores for a minute), a benchmark waits for the 1-minute load to fall
# to this before it measures, at most SETTLE_LIMIT_SECONDS (the average decays by 1/e a minute: 10 -> 2 takes ~100 s).
SETTLE_LOAD = 2.0
SETTLE_LIMIT_SECONDS = 150.0


def settle(name: str, load: float = SETTLE_LOAD, limit: float = SETTLE_LIMIT_SECONDS) -> float:
    """Wait until the 1-minute load is at most `load` or `limit` seconds passed; print and return the load then
    (a benchmark reports it: the first setup measured right after the engines' start would pay for it)."""
    import time

    deadline = time.monotonic() + limit
    while os.getloadavg()[0] > load and time.monotonic() < deadline:
        time.sleep(2)
    now = os.getloadavg()[0]
    print(f"[{name}] settled: 1-minute load {now:.2f} (wanted <= {load:g}, waited at most {limit:g} s)",
          file=sys.stderr, flush=True)
    return now


def report_after(name: str) -> dict:
    state = snapshot()
    _say(name, "after", state)
    return state


def finish(name: str, report: dict, box_before: dict, out=None) -> None:
    """The end of a benchmark's JSON report: the load at the end, the box before and after (`report_after`), printed
    and, with `out` (a path), written there."""
    import json

    report["load_average_end"] = os.getloadavg()
    report["box_before"], report["box_after"] = box_before, report_after(name)
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.write_text(text)
