"""tests/bench/quiet.py, the benchmarks' load guard: it counts the vLLM processes on the box and refuses to measure
above the load limit. Costs two short-lived `sleep` children, well under a second."""

import pathlib
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import quiet  # noqa: E402


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError as e:
        return f"unreadable: {e}"


def test_a_vllm_process_is_counted_and_others_are_not():
    # argv[1] carries the marker, as `python -m vllm.entrypoints.openai.api_server` does
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "vllm.entrypoints.openai.api_server"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "something.else"])
    try:
        # Polled, not read once: one CI run read the list right after Popen and found nothing (the child's /proc
        # entry not yet showing its new command line); 10 s is far above any exec seen.
        deadline = time.monotonic() + 10
        found = quiet.running_engines()
        while engine.pid not in found and time.monotonic() < deadline:
            time.sleep(0.1)
            found = quiet.running_engines()
        assert engine.pid in found, (found, _cmdline(engine.pid), engine.poll())
        assert other.pid not in found
    finally:
        for proc in (engine, other):
            proc.kill()
            proc.wait()
    assert engine.pid not in quiet.running_engines()


def test_it_refuses_above_the_limit_and_passes_below(monkeypatch, capsys):
    monkeypatch.setenv(quiet.ENV_MAX_LOAD, "-1")  # any load is above it
    with pytest.raises(SystemExit, match="refusing to measure"):
        quiet.require_quiet("t")
    monkeypatch.setenv(quiet.ENV_MAX_LOAD, "1000000")
    state = quiet.require_quiet("t")
    assert state["engines_running"] >= 0 and len(state["load_average"]) == 3
    assert "load average" in capsys.readouterr().err


def test_a_bad_limit_is_named(monkeypatch):
    monkeypatch.setenv(quiet.ENV_MAX_LOAD, "three")
    with pytest.raises(SystemExit, match="PDPAIR_BENCH_MAX_LOAD='three'"):
        quiet.max_load()
