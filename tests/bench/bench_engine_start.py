#!/usr/bin/env python3
"""What pdpair's connector adds to one engine's start (where the pair's cold start goes).

The real-node cold-start bench (bench_cold_start.py) finds decode's side-channel listener opening 1.7-7.9 s after a
lone single engine is Ready on the same box, also with one CPU per engine. This separates the connector's own cost
from the two engines' contention: each engine starts ALONE, on the same core, from the same tiny model, in rounds that
alternate the order:
- single: a vLLM API server, no connector;
- decode: the same server with PdPairConnector as a decode (kv_consumer, the tcp transport, its side-channel
  listener on a free port), as the operator starts one (pair_env).
Each is timed from the process start to its /health answering 200 (and, for decode, to its listener's log line),
then stopped, and the next waits until no vLLM process is left. The ratio decode / single is the connector's cost on
a lone start; whatever the pair's cold start loses beyond it is the two engines starting on one box.

    PYTHONPATH=src:. .venv/bin/python tests/bench/bench_engine_start.py [--repeats 5] [--bind] [--out F]

`--bind`: each engine's process tree on core 0 (taskset, OMP_NUM_THREADS=1), as bench_pd_latency.py's --bind.
Cost: 2 x --repeats vLLM cold starts, one at a time, about 20 s each here: about 4 minutes at the default.
Run it alone: it refuses to start above the load tests/bench/quiet.py allows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pd_latency as pdl  # noqa: E402  (also puts tests/engine and the repository root on sys.path)
from engines import engine, free_port, pair_env  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402
import quiet  # noqa: E402

NAME = "bench_engine_start"
LISTENER_LINE = "side-channel listener on"  # connector/side_channel.py, logged when decode's listener accepts
GONE_TIMEOUT = 60.0


def say(text: str) -> None:
    print(f"[{NAME} {time.strftime('%H:%M:%S')}] {text}", flush=True)


def one_start(kind: str, model: Path, logs: Path, round_no: int) -> dict:
    """Start one engine of `kind` alone, time it, stop it, wait until its processes are gone."""
    name = f"start-{kind}-{round_no}"
    if kind == "single":
        proc = engine(name, model, logs)
    else:
        proc = engine(name, model, logs, kv_role="kv_consumer",
                      pdpair_env=pair_env("decode", generation=1, listen_base=free_port(), hang_timeout=30))
    pdl.CORES[name] = "0"
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    pdl.start([], proc)
    try:
        # polled every 0.1 s (the default 0.5 s is too coarse for a difference of about a second); from the spawn
        proc.wait_healthy(interval=0.1)
        healthy = time.monotonic() - t0
        result = {"healthy_s": round(healthy, 2), "load_before": round(load, 2)}
        if kind == "decode":
            # The connector opens decode's listener while the engine starts (before /health answers): checked, so a
            # decode whose connector did not come up cannot pass as one.
            result["listener_logged"] = LISTENER_LINE in proc.log()
    finally:
        proc.stop()
    deadline = time.monotonic() + GONE_TIMEOUT
    while quiet.running_engines() and time.monotonic() < deadline:
        time.sleep(0.5)
    result["wall_s"] = round(time.monotonic() - t0, 2)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bind", action="store_true", help="each engine's process tree on core 0")
    parser.add_argument("--out", default="/tmp/bench_engine_start.json")
    args = parser.parse_args()
    before = quiet.require_quiet(NAME)
    pdl.BIND = args.bind
    work = Path(tempfile.mkdtemp(prefix="pdpair-engine-start-"))
    model = build_tiny_model(work / "model")
    logs = work / "logs"
    logs.mkdir()
    rounds = []
    for i in range(args.repeats):
        order = ("single", "decode") if i % 2 == 0 else ("decode", "single")
        entry = {"round": i, "order": list(order)}
        for kind in order:
            entry[kind] = one_start(kind, model, logs, i)
            say(f"round {i + 1}/{args.repeats}: {kind} healthy in {entry[kind]['healthy_s']} s "
                f"(load before {entry[kind]['load_before']})")
        rounds.append(entry)
    after = quiet.report_after(NAME)
    single = statistics.median(r["single"]["healthy_s"] for r in rounds)
    decode = statistics.median(r["decode"]["healthy_s"] for r in rounds)
    report = {"args": vars(args), "quiet_before": before, "quiet_after": after, "rounds": rounds,
              "median_single_s": single, "median_decode_s": decode, "ratio": round(decode / single, 3),
              "listener_logged": all(r["decode"].get("listener_logged") for r in rounds)}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print("\n| round | single: start -> /health 200 (s) | decode with the connector (s) | decode / single |")
    print("|---|---|---|---|")
    for r in rounds:
        print(f"| {r['round']} | {r['single']['healthy_s']} | {r['decode']['healthy_s']} | "
              f"{r['decode']['healthy_s'] / r['single']['healthy_s']:.3f} |")
    print(f"| median | {single} | {decode} | {decode / single:.3f} |")
    print(f"\nbinding: {'core 0, OMP_NUM_THREADS=1' if args.bind else 'none'}; decode's listener logged in every "
          f"round: {report['listener_logged']}; report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
