r"""xPyD on one machine: 1P1D, 1P2D, 2P1D and 2P2D beside a single engine, vLLM's own client.

    PYTHONPATH=src:. .venv/bin/python tests/bench/bench_xpyd.py [--concurrency 1,16] [--prompts 64] \
        [--topologies 1P1D,1P2D,2P1D,2P2D] [--bind] [--out results.json]

Starts the engines once, for the largest topology asked: decodes 0 and 1 (each its own side-channel port), prefills 0
and 1, each paired with every decode through PDPAIR_PEERS (`127.0.0.1:<port>,...`, its own PDPAIR_INSTANCE), plus a
single engine (no connector) as the baseline of the same run; same tiny model as bench_pd_latency.py. Then, one
setup at a time (the idle engines sleep):
1. The single engine: vLLM's client at each --concurrency; its greedy outputs are the reference.
2. Each topology: a `pdpair.router` over that subset of the engines (prefill URLs 0..P-1, decode URLs 0..D-1, so the
   router's indexes are the instances'), with --log-choices and --debug-routing; then
   - greedy outputs: --greedy prompts at temperature 0 forced (X-Pdpair-Route) through EVERY (prefill, decode)
     combination of the topology; each must equal the single engine's token ids, and the router's log must show the
     forced route once per prompt; a mismatch is printed at once, "GREEDY MISMATCH", and fails the run;
   - vLLM's client (`vllm.benchmarks.serve`, exactly as bench_pd_latency.py runs it: random dataset, ignore_eos) at
     each --concurrency: requests/s, output tokens/s, TTFT p50/p99, TPOT p50/p99, failed requests, the ratio of
     requests/s to the single engine's at that concurrency;
   - requests per instance: the router's --log-choices lines written during that client run (unforced), counted per
     prefill index and per decode index, and the largest deviation from an even share in percent. vLLM's client's
     ready-check request goes through the router too, so a cell logs its prompts plus one or so;
   - the router's GET /pdpair/v1/peers after each client run (the router gets a random PDPAIR_PEERS_TOKEN for it):
     every member must be back at 0 requests outstanding;
   then the router stops.
The load average is printed (stderr) at every phase and recorded with every cell; tests/bench/quiet.py refuses to
start on a busy box. At the end: the JSON report (stdout, or --out), the markdown table for docs/benchmarks.md
(stdout), and the checks: 0 failed requests in every cell, every greedy output equal, every role with 2 instances
within --spread-limit percent (default 20) of even at each concurrency >= 16, nothing left outstanding. Exit status
1 when a check fails (the numbers are printed either way).

`--bind` (as bench_pd_latency.py): each engine's process tree on one core, OMP_NUM_THREADS=1: the single engine,
prefill 0 and decode 1 on core 0; decode 0 and prefill 1 on core 1. So 1P1D is bench_pd_latency's pair (prefill on
0, decode on 1) and 2P2D has one prefill and one decode per core. The routers and the client float.
On 2 cores the absolute numbers say little; what counts is 0 errors, equal outputs and the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_pd_latency as pdl  # noqa: E402  (also puts tests/engine and the repository root on sys.path)
from engines import Process, engine, free_port, http_post, pair_env, router  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402
import quiet  # noqa: E402  (tests/bench/quiet.py: the load guard)

from pdpair.contract import ENV_INSTANCE, ENV_PEERS, ENV_PEERS_TOKEN, PEERS_PATH  # noqa: E402

NAME = "bench_xpyd"
TOPOLOGIES = {"1P1D": (1, 1), "1P2D": (1, 2), "2P1D": (2, 1), "2P2D": (2, 2)}
SPREAD_FROM_CLIENTS = 16  # the "within 20 % of even at concurrency 16"
ROUTE_HEADER = "X-Pdpair-Route"
# The router's --log-choices line (router/app.py _log_choice; tests/e2e_realnode/test_realnode_xpyd.py reads it too).
CHOICE = re.compile(r"request (\S+): prefill (\d+) \S+, decode (\d+) \S+( \(forced by [^)]*\))?;")
# --bind: prefill 0 and decode 0 as bench_pd_latency's pair; the second instances on the other core.
XPYD_CORES = {"xpyd-prefill-0": "0", "xpyd-decode-0": "1", "xpyd-prefill-1": "1", "xpyd-decode-1": "0"}


# --- pure helpers (tests/unit/test_bench_xpyd.py) ------------------------------------------------------------------
def parse_topologies(text: str) -> list[str]:
    names = [t.strip().upper() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TOPOLOGIES]
    if unknown or not names:
        raise ValueError(f"--topologies {text!r}: choose among {', '.join(TOPOLOGIES)}")
    return names


def prompts_for(clients: int, prompts: int) -> int:
    """Prompts of one client run: --prompts at >= 16 clients, fewer below (max(16, 4 x clients), at most --prompts)."""
    return prompts if clients >= SPREAD_FROM_CLIENTS else min(prompts, max(16, 4 * clients))


def parse_choices(text: str) -> list[tuple[int, int, bool]]:
    """(prefill index, decode index, forced) of each --log-choices line in `text`, in order."""
    return [(int(m.group(2)), int(m.group(3)), bool(m.group(4))) for m in CHOICE.finditer(text)]


def per_instance(choices: list[tuple[int, int, bool]], prefills: int, decodes: int) -> dict:
    """Unforced choices counted per prefill and per decode index (an instance never chosen counts 0)."""
    free = [(p, d) for p, d, forced in choices if not forced]
    return {"prefill": [sum(1 for p, _ in free if p == i) for i in range(prefills)],
            "decode": [sum(1 for _, d in free if d == i) for i in range(decodes)]}


def deviation_pct(counts: list[int]) -> float | None:
    """Largest |count - even| / even in percent; None for one instance or no request (nothing to spread)."""
    total = sum(counts)
    if len(counts) < 2 or total == 0:
        return None
    even = total / len(counts)
    return round(100 * max(abs(c - even) for c in counts) / even, 1)


def spread_cell(counts: list[int]) -> str:
    """`33 / 32 (1.5 %)` for several instances, the count alone for one, `–` for none."""
    if not counts:
        return "–"
    dev = deviation_pct(counts)
    return " / ".join(map(str, counts)) + ("" if dev is None else f" ({dev:g} %)")


def markdown(report: dict) -> str:
    """The table for docs/benchmarks.md: one row per (clients, setup), then greedy outputs and the checks."""
    lines = ["| clients | setup | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | failed | vs single "
             "| requests per prefill (max dev.) | requests per decode (max dev.) | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for level, row in report.get("concurrency", {}).items():
        for setup, r in row.items():
            if "error" in r and "requests_per_s" not in r:
                lines.append(f"| {level[1:]} | {setup} | error: {r['error'][-80:]!r} | | | | {r.get('failed', '?')} "
                             f"| | | | {r.get('load_average_before', '')} |")
                continue
            inst = r.get("per_instance") or {}
            ratio = r.get("throughput_ratio_to_single")
            lines.append(
                f"| {level[1:]} | {setup} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.0f} "
                f"| {r['ttft_ms_p50']:.0f} / {r['ttft_ms_p99']:.0f} | {r['tpot_ms_p50']:.1f} / {r['tpot_ms_p99']:.1f} "
                f"| {r['failed']} | {'–' if ratio is None else f'{ratio:.2f}'} "
                f"| {spread_cell(inst.get('prefill', []))} | {spread_cell(inst.get('decode', []))} "
                f"| {r.get('load_average_before', '')} |")
    greedy = report.get("greedy", {})
    if greedy:
        lines.append("")
        lines.append("Greedy outputs equal to the single engine (every prefill, decode combination, forced): "
                     + ", ".join(f"{name} {g['equal']}/{g['checked']}" for name, g in greedy.items()) + ".")
    checks = report.get("checks")
    if checks:
        lines.append("")
        lines.append("Checks: " + ("all passed" if checks["passed"] else "FAILED: " + "; ".join(checks["failures"]))
                     + f" (spread limit {checks['spread_limit_pct']:g} % at >= {SPREAD_FROM_CLIENTS} clients"
                     + ("" if checks["spread_checked"] else ", not checked: no such level") + ").")
    return "\n".join(lines)


def evaluate(report: dict, spread_limit: float) -> dict:
    """The run's verdicts from the report: failed requests, greedy mismatches, spread, outstanding left."""
    failures: list[str] = []
    spread_checked = False
    for level, row in report.get("concurrency", {}).items():
        clients = int(level[1:])
        for setup, r in row.items():
            if r.get("failed"):
                failures.append(f"{setup} at {clients} clients: {r['failed']} failed requests")
            if "error" in r:
                failures.append(f"{setup} at {clients} clients: the client failed")
            if r.get("outstanding_after"):
                failures.append(f"{setup} at {clients} clients: outstanding after the run {r['outstanding_after']}")
            for role, counts in (r.get("per_instance") or {}).items():
                dev = deviation_pct(counts)
                if dev is None or clients < SPREAD_FROM_CLIENTS:
                    continue
                spread_checked = True
                if dev > spread_limit:
                    failures.append(f"{setup} at {clients} clients: {role} requests {counts}, {dev:g} % from even "
                                    f"(limit {spread_limit:g} %)")
    if report.get("aborted"):
        failures.append(f"the run stopped early: {report['aborted'][:300]}")
    for name, g in report.get("greedy", {}).items():
        if g["equal"] != g["checked"] or g["mismatches"]:
            failures.append(f"{name}: greedy {g['equal']}/{g['checked']} equal ({len(g['mismatches'])} problems)")
    return {"passed": not failures, "failures": failures, "spread_limit_pct": spread_limit,
            "spread_checked": spread_checked}


# --- the run -------------------------------------------------------------------------------------------------------
class Phases:
    """Prints and records the load average (and seconds since the start) at each phase."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.seen: list[dict] = []

    def __call__(self, what: str) -> None:
        load = [round(x, 2) for x in os.getloadavg()]
        at = round(time.monotonic() - self.t0, 1)
        self.seen.append({"phase": what, "t_s": at, "load_average": load})
        print(f"[{NAME}] +{at:.0f}s {what}: load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
              file=sys.stderr, flush=True)


def log_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def log_since(path: Path, offset: int) -> str:
    time.sleep(0.5)  # the router logs per line; give the last one a moment
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def peers_state(url: str, token: str) -> dict:
    req = urllib.request.Request(url + PEERS_PATH, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def outstanding_left(state: dict) -> dict:
    """Members (and leaving instances) of the router's set with requests still outstanding, by role and index."""
    left = {f"{role[:-1]} {m['index']}": m["outstanding"] for role in ("prefills", "decodes")
            for m in state.get(role, []) if m.get("outstanding")}
    left.update({f"leaving {e['role']} {e['url']}": e["outstanding"] for e in state.get("leaving", [])})
    return left


def xpyd_router(log_dir: Path, name: str, prefill_urls: list[str], decode_urls: list[str], token: str) -> Process:
    """engines.router's process with every instance of the topology (flag order = index), choices logged, forced
    routes honoured, and GET /pdpair/v1/peers served (its token)."""
    rtr = router(log_dir, prefill_urls[0], decode_urls[0])
    for url in prefill_urls[1:]:
        rtr.argv += ["--prefill", url]
    for url in decode_urls[1:]:
        rtr.argv += ["--decode", url]
    rtr.argv += ["--log-choices", "--debug-routing"]
    rtr.name, rtr.log_path = f"router-{name}", log_dir / f"router-{name}.log"
    rtr.env = {**rtr.env, ENV_PEERS_TOKEN: token}
    return rtr


def warm_up(name: str, url: str) -> None:
    for attempt in range(3):
        try:
            pdl.stream_chunks(url, f"warm up {attempt} " * 30, 4, f"warm-{uuid.uuid4().hex}")
            pdl.stream_chunks(url, f"warm up again {attempt} " * 20, 4, f"warm-{uuid.uuid4().hex}")
            return
        except Exception as exc:  # noqa: BLE001
            print(f"{name}: warm-up {attempt} failed: {exc}", file=sys.stderr, flush=True)
    raise RuntimeError(f"{name}: warm-up failed 3 times")


def greedy_body(i: int) -> dict:
    # bench_pd_latency's greedy prompts: 10..45 words, well under the 512-token limit
    return {"model": "tiny", "prompt": pdl.text_prompt(100 + i, 10 + 5 * i), "max_tokens": 16, "temperature": 0,
            "return_token_ids": True}


def greedy_reference(url: str, count: int) -> list[list[int] | str]:
    """The single engine's token ids per prompt (a string: why there is none)."""
    out: list[list[int] | str] = []
    for i in range(count):
        status, got, _ = http_post(url + "/v1/completions", greedy_body(i))
        out.append(got["choices"][0]["token_ids"] if status == 200 else f"single engine answered {status}: "
                   f"{str(got)[:200]}")
    return out


def greedy_through(name: str, rtr: Process, reference: list, prefills: int, decodes: int) -> dict:
    """Every prompt forced through every (prefill, decode) combination; compared with the reference."""
    offset = log_size(rtr.log_path)
    equal, checked, mismatches = 0, 0, []
    for p in range(prefills):
        for d in range(decodes):
            for i, want in enumerate(reference):
                checked += 1
                if isinstance(want, str):
                    mismatches.append(f"prompt {i}: {want}")
                    continue
                status, got, _ = http_post(rtr.url + "/v1/completions", greedy_body(i),
                                           headers={ROUTE_HEADER: f"{p},{d}"})
                if status != 200:
                    mismatches.append(f"prompt {i} via prefill {p}, decode {d}: answered {status}: {str(got)[:200]}")
                    continue
                ids = got["choices"][0]["token_ids"]
                if ids == want:
                    equal += 1
                else:
                    at = next((k for k, (x, y) in enumerate(zip(want, ids)) if x != y), min(len(want), len(ids)))
                    mismatches.append(f"prompt {i} via prefill {p}, decode {d}: differs from token {at}")
    forced: dict[str, int] = {}
    for p, d, was_forced in parse_choices(log_since(rtr.log_path, offset)):
        if was_forced:
            forced[f"{p},{d}"] = forced.get(f"{p},{d}", 0) + 1
    for p in range(prefills):
        for d in range(decodes):
            if forced.get(f"{p},{d}", 0) != len(reference):
                mismatches.append(f"the router logged {forced.get(f'{p},{d}', 0)} forced choices of prefill {p}, "
                                  f"decode {d}; {len(reference)} were sent")
    for line in mismatches:
        print(f"GREEDY MISMATCH {name}: {line}", file=sys.stderr, flush=True)
    return {"equal": equal, "checked": checked, "forced_choices_logged": forced, "mismatches": mismatches}


def client_run(url: str, model: Path, label: str, clients: int, prompts: int, args, results_dir: Path) -> dict:
    """bench_pd_latency's vllm_bench; a client that fails is a row with its error, not the end of the run."""
    try:
        row = pdl.vllm_bench(url, model, clients, prompts, args.input_len, args.output_len, results_dir, label)
    except (RuntimeError, subprocess.TimeoutExpired, KeyError, ValueError, OSError) as exc:
        row = {"error": str(exc)[-2000:], "requests": 0, "failed": prompts,
               "load_average_before": round(os.getloadavg()[0], 2)}
        print(f"CLIENT FAILED {label} at {clients} clients: {str(exc)[-500:]}", file=sys.stderr, flush=True)
    row["prompts"] = prompts
    row["failed"] = max(row.get("failed", 0), prompts - row.get("requests", 0))
    row["load_average_after"] = round(os.getloadavg()[0], 2)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,16", help="vllm bench serve concurrency levels")
    parser.add_argument("--prompts", type=int, default=64,
                        help=f"prompts per client run at >= {SPREAD_FROM_CLIENTS} clients; below, max(16, 4 x clients) "
                             "(at most this)")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--topologies", default=",".join(TOPOLOGIES), help="which of " + ", ".join(TOPOLOGIES))
    parser.add_argument("--greedy", type=int, default=4, help="greedy prompts per (prefill, decode) combination")
    parser.add_argument("--spread-limit", type=float, default=20.0,
                        help=f"largest deviation from an even share, percent, at >= {SPREAD_FROM_CLIENTS} clients")
    parser.add_argument("--bind", action="store_true", help="one core per engine process tree (module docstring)")
    parser.add_argument("--out", type=Path, help="write the JSON report here (else it goes to stdout)")
    args = parser.parse_args()
    try:
        topologies = parse_topologies(args.topologies)
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    if not levels or min(levels) < 1 or args.prompts < 1 or args.greedy < 1:
        parser.error("--concurrency needs levels >= 1, --prompts and --greedy at least 1")
    pdl.BIND = args.bind  # bench_pd_latency.start reads both
    pdl.CORES.update(XPYD_CORES)
    # SIGTERM (a `timeout`, a kill) ends the run through the finally below, which stops every process it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    box_before = quiet.require_quiet(NAME)  # exits when the box is too busy to measure
    phase = Phases()
    n_prefills = max(TOPOLOGIES[t][0] for t in topologies)
    n_decodes = max(TOPOLOGIES[t][1] for t in topologies)
    work = Path(tempfile.mkdtemp(prefix="pdpair-xpyd-"))
    model = build_tiny_model(work / "model")
    logs = work / "logs"
    logs.mkdir()
    results_dir = work / "vllm-bench"
    results_dir.mkdir()
    token = uuid.uuid4().hex  # 32 characters: the router's GET /pdpair/v1/peers
    report: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU",
        "model": "tiny random Llama (2 layers, hidden 64, 2 KV heads x 32, float32, block 32)",
        "engines": f"single + {n_prefills} prefills x {n_decodes} decodes (every prefill paired with every decode)",
        "binding": {"mode": "taskset, one core per engine", "cores": {k: pdl.CORES[k] for k in ("single", *XPYD_CORES)}}
        if args.bind else {"mode": "none"},
        "client": {"input_len": args.input_len, "output_len": args.output_len,
                   "prompts": {f"c{c}": prompts_for(c, args.prompts) for c in levels}},
        "logs": str(logs),
        "phases": phase.seen,
    }
    print(f"[{NAME}] logs in {logs}", file=sys.stderr, flush=True)
    procs: list[Process] = []
    conc: dict[str, dict] = {f"c{c}": {} for c in levels}
    report["concurrency"] = conc
    report["greedy"] = {}
    try:
        phase("starting engines")
        single = pdl.start(procs, engine("single", model, logs))
        listen = [free_port() for _ in range(n_decodes)]
        decodes = [pdl.start(procs, engine(f"xpyd-decode-{i}", model, logs, kv_role="kv_consumer", pdpair_env=pair_env(
            "decode", generation=1, listen_base=listen[i], hang_timeout=30))) for i in range(n_decodes)]
        peers = ",".join(f"127.0.0.1:{port}" for port in listen)
        prefills = [pdl.start(procs, engine(f"xpyd-prefill-{j}", model, logs, kv_role="kv_producer", pdpair_env={
            **pair_env("prefill", generation=1, hang_timeout=30), ENV_PEERS: peers,
            ENV_INSTANCE: f"test-prefill-{j}"})) for j in range(n_prefills)]
        for proc in (single, *decodes, *prefills):
            proc.wait_healthy()
        for proc in prefills:
            for port in listen:
                proc.wait_log(f"paired with decode 127.0.0.1:{port} after", 120)
        phase("engines healthy, every prefill paired with every decode")

        # 1. The single engine: the reference outputs and the baseline of each concurrency.
        warm_up("single", single.url)
        reference = greedy_reference(single.url, args.greedy)
        for c in levels:
            n = prompts_for(c, args.prompts)
            phase(f"single, {c} clients, {n} prompts")
            conc[f"c{c}"]["single"] = client_run(single.url, model, "single", c, n, args, results_dir)
            print(f"c={c} single: {json.dumps(conc[f'c{c}']['single'])}", file=sys.stderr, flush=True)

        # 2. Each topology behind its own router, one at a time.
        for name in topologies:
            n_p, n_d = TOPOLOGIES[name]
            rtr = pdl.start(procs, xpyd_router(logs, name, [p.url for p in prefills[:n_p]],
                                               [d.url for d in decodes[:n_d]], token))
            rtr.wait_healthy(60)
            phase(f"{name}: router up")
            warm_up(name, rtr.url)
            report["greedy"][name] = greedy_through(name, rtr, reference, n_p, n_d)
            g = report["greedy"][name]
            print(f"{name}: greedy {g['equal']}/{g['checked']} equal", file=sys.stderr, flush=True)
            for c in levels:
                n = prompts_for(c, args.prompts)
                phase(f"{name}, {c} clients, {n} prompts")
                offset = log_size(rtr.log_path)
                row = client_run(rtr.url, model, name, c, n, args, results_dir)
                choices = parse_choices(log_since(rtr.log_path, offset))
                row["choices_logged"] = sum(1 for *_, forced in choices if not forced)
                row["per_instance"] = per_instance(choices, n_p, n_d)
                row["deviation_pct"] = {role: deviation_pct(counts) for role, counts in row["per_instance"].items()}
                try:
                    row["outstanding_after"] = outstanding_left(peers_state(rtr.url, token))
                except (OSError, ValueError) as exc:
                    row["outstanding_after"] = {"GET /pdpair/v1/peers failed": str(exc)}
                base = conc[f"c{c}"]["single"].get("requests_per_s")
                if base and "requests_per_s" in row:
                    row["throughput_ratio_to_single"] = round(row["requests_per_s"] / base, 3)
                conc[f"c{c}"][name] = row
                print(f"c={c} {name}: {json.dumps(row)}", file=sys.stderr, flush=True)
            rtr.stop()
            phase(f"{name}: router stopped")
    except Exception as exc:  # noqa: BLE001  (what was measured is still reported; the run fails)
        traceback.print_exc()
        report["aborted"] = f"{type(exc).__name__}: {exc}"[-3000:]
    finally:
        for proc in reversed(procs):
            proc.stop()
        phase("every process stopped")
    report["box_before"], report["box_after"] = box_before, quiet.report_after(NAME)
    report["checks"] = evaluate(report, args.spread_limit)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
        print(f"[{NAME}] JSON report in {args.out}", file=sys.stderr, flush=True)
    else:
        print(json.dumps(report, indent=2))
    print()
    print(markdown(report))
    for failure in report["checks"]["failures"]:
        print(f"CHECK FAILED: {failure}", file=sys.stderr, flush=True)
    return 0 if report["checks"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
