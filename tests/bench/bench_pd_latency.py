"""P/D latency and concurrency benchmark: pdpair vs vLLM's NixlConnector vs a single engine, all in one run.

    .venv/bin/python tests/bench/bench_pd_latency.py [--sequential 20] [--concurrency 1,4,16,64] \
        [--nixl-site DIR] [--bind] [--out results.json]

Starts a single engine, a pdpair prefill+decode pair, (when `nixl` imports, from --nixl-site or the venv) a vLLM
NixlConnector pair and "dp": two single engines behind a round-robin proxy (rr_proxy.py: the pair's two cores used
as data parallelism), same tiny model; both P/D pairs sit behind the same `pdpair.router`. The pdpair pair serves up
to three setups, each its own router in front of the same two engines: `pdpair` (`--no-concurrent-legs`: decode's
request once prefill answered), `pdpair-concurrent` (`--concurrent-legs`: both legs at once) and `pdpair-selective`
(`--concurrent-legs --local-prompt-tokens N`: prompts estimated shorter than N tokens go to decode alone, and N is
learned from then on). `pdpair-concurrent-whole` is a second pair whose prefill has layer-wise puts off
(PDPAIR_LAYERWISE_PUTS=false: every layer put after the request finished), behind its own `--concurrent-legs` router:
against `pdpair-concurrent` it shows what putting each layer while the prompt is computed gains; the prefills'
timelines (`layerwise_timeline`) show the overlap. `--layers N` builds the tiny model N layers deep. `--bind` pins each
engine's whole process tree (API server, engine core, worker) to one core with `taskset` and OMP_NUM_THREADS=1:
the single engine core 0 (`single-core1`, the same engine, core 1: decode's core, the baseline of a request decode computes alone); each pair's prefill core 0 and decode core 1; dp's engines cores 0 and 1. So a pair is
compared with a one-core engine on one core per engine, no engine oversubscribes the cores, and only one setup is
measured at a time (idle engines sleep). The router, the proxy and the client float. Then:
1. Sequential, round robin over the setups (one request in flight on the machine): streamed TTFT and time per output
   token (TPOT, first to last chunk / (chunks - 1)) at the client; ratios against the single engine of the same round.
2. pdpair's per-request timeline (PDPAIR_TIMELINE_LOG=1 on its engines and router), joined across processes by the
   router's X-Request-Id: median milliseconds of each stage.
3. Greedy outputs: the same prompts, non-streamed, temperature 0: each P/D setup must equal the single engine.
4. Concurrency: vLLM's own client (`vllm.benchmarks.serve`, random dataset, --input-len/--output-len, ignore_eos)
   at each --concurrency, setups one after another per level; requests/s, output tokens/s, TTFT p50/p99, TPOT
   median, failed requests.
The load average is recorded with every phase: on a shared box the absolute numbers are noise, the ratios less so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "engine"))
sys.path.insert(0, str(HERE.parents[1]))  # engines.py imports devcluster.ports
sys.path.insert(0, str(HERE))

from engines import Process, engine, free_port, http_post, pair_env, router  # noqa: E402
from pdpair import contract  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402

from bench_connector import histogram  # noqa: E402  (sum, count) of a histogram on a /metrics URL
import quiet  # noqa: E402  (tests/bench/quiet.py: the load guard)

VLLM_BENCH = (
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args())\n"
)
TIMELINE_ENV = {"PDPAIR_TIMELINE_LOG": "1"}
WORDS = "signal put decode prefill block layer engine pair router token cache region slot deadline".split()


def stream_chunks(url: str, prompt: str, max_tokens: int, request_id: str) -> list[float]:
    """Seconds from the request to each streamed text chunk."""
    import urllib.request

    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": request_id})
    started = time.perf_counter()
    times = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "choices" not in event:
                    raise RuntimeError(f"{url}: error event {line[:300]}")
                if event["choices"][0].get("text"):
                    times.append(time.perf_counter() - started)
    if not times:
        raise RuntimeError(f"no token streamed from {url}")
    return times


def text_prompt(i: int, words: int) -> str:
    return " ".join(f"{WORDS[(i + 7 * j) % len(WORDS)]}{i}" for j in range(words))


class Setup:
    def __init__(self, name: str, url: str, transfer=None) -> None:
        self.name, self.url, self.transfer = name, url, transfer
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.errors = 0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def timeline_report(log_dir: Path) -> dict:
    """Join pdpair timeline lines by the router's request id; median ms between consecutive stages."""
    lines: dict[str, dict[str, float]] = {}
    by_internal: dict[str, dict[str, float]] = {}
    pattern = re.compile(r"timeline (\S+) (\S+) (.*)$")
    for path in [*log_dir.glob("pdpair-decode.log"), *log_dir.glob("pdpair-prefill.log"), *log_dir.glob("pdpair-router.log")]:
        for line in path.read_text(errors="replace").splitlines():
            m = pattern.search(line)
            if not m:
                continue
            side, rid, fields = m.groups()
            stamps = {f"{side}.{k}": float(v) for k, v in (f.split("=") for f in fields.split())}
            if side == "router":
                lines.setdefault(rid, {}).update(stamps)
            else:
                by_internal.setdefault(rid, {}).update(stamps)
    for internal, stamps in by_internal.items():
        for rid in lines:
            if rid in internal:
                lines[rid].update(stamps)
                break
    order = [
        "router.received", "prefill-scheduler.finished", "router.prefill_answered", "decode-scheduler.allocated",
        "decode-worker.pull_sent", "prefill-worker.pull_received", "prefill-worker.first_put",
        "prefill-worker.last_put", "prefill-worker.flushed", "decode-worker.first_signal",
        "decode-worker.last_signal", "decode-worker.handed_to_engine", "decode-scheduler.load_reported",
        "decode-scheduler.scheduled", "router.decode_first_chunk", "router.done",
    ]
    complete = [s for s in lines.values() if all(k in s for k in order)]
    steps = {}
    for a, b in zip(order, order[1:]):
        steps[f"{a} -> {b}"] = round(1000 * statistics.median(s[b] - s[a] for s in complete), 3) if complete else None
    spans = {
        "kv transfer (decode pull_sent -> last_signal)": ("decode-worker.pull_sent", "decode-worker.last_signal"),
        "ttft at router (received -> decode first chunk)": ("router.received", "router.decode_first_chunk"),
        "prefill leg (received -> prefill answered)": ("router.received", "router.prefill_answered"),
        "decode leg to first chunk (prefill answered -> first chunk)": ("router.prefill_answered", "router.decode_first_chunk"),
    }
    summary = {}
    for name, (a, b) in spans.items():
        values = [s[b] - s[a] for s in complete]
        summary[name] = {"median_ms": round(1000 * statistics.median(values), 3), "p90_ms": round(1000 * pct(values, 0.9), 3)} if values else None
    return {"requests_joined": len(complete), "requests_seen": len(lines), "median_step_ms": steps, "spans": summary}


def layerwise_report(prefill_log: Path) -> dict:
    """The prefill's transfers of both legs at once, from its timeline lines (connector/timeline.py): served layer by
    layer while the prompt was computed (`step_started`, `first_layer_written`, `last_layer_written` present) or
    after the request finished. Medians in ms: for the streamed ones, from the step's start to the first put and to
    the last layer written (the computation), and what is left after it (last layer written -> flushed); the share of
    them whose first put came before the last layer was written (compute and transfer overlapped)."""
    streamed, whole = [], []
    pattern = re.compile(r"timeline prefill-worker (\S+) (.*)$")
    for line in prefill_log.read_text(errors="replace").splitlines():
        m = pattern.search(line)
        if not m:
            continue
        stamps = {k: float(v) for k, v in (f.split("=") for f in m.group(2).split())}
        (streamed if "step_started" in stamps else whole).append(stamps)
    out: dict = {"streamed": len(streamed), "after_finish": len(whole)}
    if streamed:
        def med(a: str, b: str) -> float:
            return round(1000 * statistics.median(s[b] - s[a] for s in streamed), 3)
        out.update({
            "step_start_to_first_put_ms": med("step_started", "first_put"),
            "step_start_to_last_layer_written_ms": med("step_started", "last_layer_written"),
            "last_layer_written_to_flushed_ms": med("last_layer_written", "flushed"),
            "pull_to_flushed_ms": med("pull_received", "flushed"),
            "overlapped_share": round(sum(s["first_put"] < s["last_layer_written"] for s in streamed) / len(streamed), 3),
        })
    if whole:
        out["after_finish_pull_to_flushed_ms"] = round(
            1000 * statistics.median(s["flushed"] - s["pull_received"] for s in whole), 3)
    return out


def router_modes(setups: list[Setup]) -> dict:
    """Per pdpair setup, its router's split and local decisions so far (warm-up included) and the current threshold
    of selective disaggregation (the router's /metrics)."""
    from engines import http_get

    out = {}
    for setup in setups:
        if not setup.name.startswith("pdpair"):
            continue
        status, body = http_get(setup.url + "/metrics")
        if status != 200:
            out[setup.name] = f"/metrics answered {status}"
            continue
        values = {}
        for line in body.decode().splitlines():
            m = re.match(r'^pdpair_router_(requests_total\{mode="(\w+)"\}|local_prompt_tokens) (\S+)$', line)
            if m:
                values[m.group(2) or "threshold"] = float(m.group(3))
            # precise prefix affinity: the blocks routed and matched, and the KV event batches by outcome
            m = re.match(r'^pdpair_router_(prefix_blocks|kv_event_batches)_total\{outcome="(\w+)",role="(\w+)"\} '
                         r'(\S+)$', line)
            if m and float(m.group(4)):
                values[f"{m.group(1)}_{m.group(3)}_{m.group(2)}"] = float(m.group(4))
        out[setup.name] = values
    return out


def vllm_bench(url: str, model_dir: Path, concurrency: int, prompts: int, input_len: int, output_len: int,
               result_dir: Path, label: str) -> dict:
    filename = f"{label}-c{concurrency}.json"
    argv = [sys.executable, "-c", VLLM_BENCH, "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", "tiny", "--tokenizer", str(model_dir), "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--ignore-eos",
            "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99", "--seed", "1",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", filename]
    load = os.getloadavg()[0]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve against {label} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    data = json.loads((result_dir / filename).read_text())
    return {
        "requests": data["completed"], "failed": data.get("failed", 0),
        "requests_per_s": round(data["request_throughput"], 3),
        "output_tokens_per_s": round(data["output_throughput"], 2),
        "ttft_ms_p50": round(data["median_ttft_ms"], 2), "ttft_ms_p99": round(data["p99_ttft_ms"], 2),
        "tpot_ms_p50": round(data["median_tpot_ms"], 3), "tpot_ms_p99": round(data["p99_tpot_ms"], 3),
        "e2e_ms_p50": round(data["median_e2el_ms"], 2),
        "load_average_before": round(load, 2),
    }


# --bind: the core of each engine process tree (by Process name); see the module docstring.
CORES = {"single": "0", "single-core1": "1", "pdpair-prefill": "0", "pdpair-decode": "1", "pdpair-before-prefill": "0",
         "pdpair-before-decode": "1", "pdpair-whole-prefill": "0", "pdpair-whole-decode": "1", "nixl-prefill": "0", "nixl-decode": "1", "dp-0": "0", "dp-1": "1"}
BIND = False  # set from --bind in main()


def start(procs: list[Process], proc: Process) -> Process:
    core = CORES.get(proc.name) if BIND else None
    if core is not None:
        # taskset execs the engine (same pid); its spawned engine core and workers inherit the mask. vLLM keeps an
        # OMP_NUM_THREADS set from outside, and "<core>" makes its worker pin its one OpenMP thread there too.
        proc.argv = ["taskset", "-c", core, *proc.argv]
        proc.env = {**proc.env, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": core}
    procs.append(proc.start())
    return proc


def rr_proxy(log_dir: Path, backends: list[str]) -> Process:
    port = free_port()
    argv = [sys.executable, str(HERE / "rr_proxy.py"), "--port", str(port)]
    for url in backends:
        argv += ["--backend", url]
    return Process("dp-proxy", argv, dict(os.environ), log_dir / "dp-proxy.log", port)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequential", type=int, default=20, help="sequential requests per setup (phase 1)")
    parser.add_argument("--prompt-words", type=int, default=60, help="words per sequential prompt (~2 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens of a sequential request")
    parser.add_argument("--concurrency", default="1,4,16,64", help="vllm bench serve concurrency levels ('' = skip)")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prompts-per-client", type=int, default=4, help="vllm bench prompts = max(16, this x concurrency)")
    parser.add_argument("--setups", default="single,single-core1,pdpair,pdpair-concurrent,pdpair-selective,nixl,dp")
    parser.add_argument("--local-prompt-tokens", type=int, default=128,
                        help="pdpair-selective's starting threshold (the router's --local-prompt-tokens)")
    parser.add_argument("--layers", type=int, default=2,
                        help="the tiny model's layers (layer-wise puts overlap layers: compare at 8 or more)")
    parser.add_argument("--bind", action="store_true", help="one core per engine process tree (module docstring)")
    parser.add_argument("--nixl-site", type=Path, help="a pip --target dir holding nixl (kept off the shared venv)")
    parser.add_argument("--before", type=Path,
                        help="source root of an older connector (e.g. `git archive <commit> src` (`connector` before the one source tree), plus the "
                             "native .so): adds setup pdpair-before, same flow, its own pair and router")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    global BIND
    BIND = args.bind
    box_before = quiet.require_quiet("bench_pd_latency")  # exits when the box is too busy to measure
    if args.before:
        wanted_extra = ["pdpair-before"]
    else:
        wanted_extra = []

    work = Path(tempfile.mkdtemp(prefix="pdpair-latency-"))
    model = build_tiny_model(work / "model", layers=args.layers)
    logs = work / "logs"
    logs.mkdir()
    results_dir = work / "vllm-bench"
    results_dir.mkdir()
    wanted = args.setups.split(",") + wanted_extra
    procs: list[Process] = []
    setups: list[Setup] = []
    report: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU",
        "model": f"tiny random Llama ({args.layers} layers, hidden 64, 2 KV heads x 32, float32, block 32)",
        "load_average_start": os.getloadavg(),
        "binding": {"mode": "taskset, one core per engine", "cores": CORES} if args.bind else {"mode": "none"},
        "logs": str(logs),
    }
    try:
        if "single" in wanted:
            single = start(procs, engine("single", model, logs))
        if "single-core1" in wanted:  # the same engine on decode's core: the baseline of a request decode computes alone
            single1 = start(procs, engine("single-core1", model, logs))
        pd_routers = [name for name in ("pdpair", "pdpair-concurrent", "pdpair-selective") if name in wanted]
        if pd_routers:
            listen = free_port()
            pd_decode = start(procs, engine("pdpair-decode", model, logs, kv_role="kv_consumer", pdpair_env={
                **pair_env("decode", generation=1, listen_base=listen, hang_timeout=30), **TIMELINE_ENV}))
            pd_prefill = start(procs, engine("pdpair-prefill", model, logs, kv_role="kv_producer", pdpair_env={
                **pair_env("prefill", generation=1, peer_base=listen, hang_timeout=30), **TIMELINE_ENV}))
        if "pdpair-concurrent-whole" in wanted:  # a second pair: prefill puts every layer after the request finished
            listen_whole = free_port()
            whole_off = {contract.ENV_LAYERWISE_PUTS: "false"}
            whole_decode = start(procs, engine("pdpair-whole-decode", model, logs, kv_role="kv_consumer", pdpair_env={
                **pair_env("decode", generation=1, listen_base=listen_whole, hang_timeout=30), **TIMELINE_ENV}))
            whole_prefill = start(procs, engine("pdpair-whole-prefill", model, logs, kv_role="kv_producer", pdpair_env={
                **pair_env("prefill", generation=1, peer_base=listen_whole, hang_timeout=30), **TIMELINE_ENV,
                **whole_off}))
        if "pdpair-before" in wanted:
            old_path = {"PYTHONPATH": f"{args.before}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            listen_old = free_port()
            old_decode = start(procs, engine("pdpair-before-decode", model, logs, kv_role="kv_consumer",
                                             pdpair_env=pair_env("decode", generation=1, listen_base=listen_old,
                                                                 hang_timeout=30), extra_env=old_path))
            old_prefill = start(procs, engine("pdpair-before-prefill", model, logs, kv_role="kv_producer",
                                              pdpair_env=pair_env("prefill", generation=1, peer_base=listen_old,
                                                                  hang_timeout=30), extra_env=old_path))
        if "nixl" in wanted:
            extra_path = {}
            if args.nixl_site:
                extra_path = {"PYTHONPATH": f"{args.nixl_site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            nixl = []
            for role in ("decode", "prefill"):
                config = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
                nixl.append(start(procs, engine(f"nixl-{role}", model, logs, kv_transfer_config=config, extra_env={
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                    **extra_path})))
        if "dp" in wanted:
            dp = [start(procs, engine(f"dp-{i}", model, logs)) for i in range(2)]
        if "single" in wanted:
            single.wait_healthy()
            setups.append(Setup("single", single.url))
        if "single-core1" in wanted:
            single1.wait_healthy()
            setups.append(Setup("single-core1", single1.url))
        if pd_routers:
            pd_decode.wait_healthy()
            pd_prefill.wait_healthy()
            pd_prefill.wait_log("paired with decode", 60)
            flags = {"pdpair": ("--no-concurrent-legs",), "pdpair-concurrent": ("--concurrent-legs",),
                     "pdpair-selective": ("--concurrent-legs", "--local-prompt-tokens", str(args.local_prompt_tokens))}
            for name in pd_routers:
                rtr = router(logs, pd_prefill.url, pd_decode.url, extra_args=flags[name], name=f"{name}-router")
                if name == "pdpair":  # the timeline report joins this router's lines only (sequential legs)
                    rtr.env = {**rtr.env, **TIMELINE_ENV}
                start(procs, rtr).wait_healthy(60)
                # one decode serves every pdpair setup: its transfer histogram (the mean over all of their
                # transfers in the round) is reported once, on `pdpair`
                setups.append(Setup(name, rtr.url, (lambda: histogram(pd_decode.url + "/metrics",
                                                                      "vllm:pdpair_kv_transfer_seconds"))
                                    if name == "pdpair" else None))
        if "pdpair-concurrent-whole" in wanted:
            whole_decode.wait_healthy()
            whole_prefill.wait_healthy()
            whole_prefill.wait_log("paired with decode", 60)
            wrtr = router(logs, whole_prefill.url, whole_decode.url, extra_args=("--concurrent-legs",),
                          name="pdpair-concurrent-whole-router")
            start(procs, wrtr).wait_healthy(60)
            setups.append(Setup("pdpair-concurrent-whole", wrtr.url))
        if "pdpair-before" in wanted:
            old_decode.wait_healthy()
            old_prefill.wait_healthy()
            old_prefill.wait_log("paired with decode", 60)
            ortr = router(logs, old_prefill.url, old_decode.url)
            ortr.name, ortr.log_path = "before-router", logs / "before-router.log"
            ortr.env = {**ortr.env, **old_path}
            start(procs, ortr).wait_healthy(60)
            setups.append(Setup("pdpair-before", ortr.url,
                                lambda: histogram(old_decode.url + "/metrics", "vllm:pdpair_kv_transfer_seconds")))
        if "nixl" in wanted:
            for proc in nixl:
                proc.wait_healthy()
            nrtr = router(logs, nixl[1].url, nixl[0].url)
            nrtr.name, nrtr.log_path = "nixl-router", logs / "nixl-router.log"
            start(procs, nrtr).wait_healthy(60)
            setups.append(Setup("nixl", nrtr.url, lambda: histogram(nixl[0].url + "/metrics", "vllm:nixl_xfer_time_seconds")))

        if "dp" in wanted:
            for proc in dp:
                proc.wait_healthy()
            start(procs, rr_proxy(logs, [proc.url for proc in dp])).wait_healthy(60)
            setups.append(Setup("dp", procs[-1].url))

        # Warm-up (NIXL's first request also does its handshake and may fail under load: retried).
        for setup in setups:
            for attempt in range(6):
                try:
                    stream_chunks(setup.url, f"warm up {attempt} " * 30, 4, f"warm-{uuid.uuid4().hex}")
                    stream_chunks(setup.url, f"warm up again {attempt} " * 20, 4, f"warm-{uuid.uuid4().hex}")
                    break
                except Exception as exc:  # noqa: BLE001
                    print(f"{setup.name}: warm-up {attempt} failed: {exc}", file=sys.stderr)
            else:
                raise RuntimeError(f"{setup.name}: warm-up failed 6 times")

        # 1. Sequential, round robin.
        time.sleep(12)  # vLLM publishes connector stats to /metrics on its logging interval (10 s)
        report["load_settled"] = quiet.settle("bench_pd_latency")  # the engines' starts are over
        before = {s.name: s.transfer() for s in setups if s.transfer}
        report["load_average_sequential_start"] = os.getloadavg()
        for i in range(args.sequential):
            for number, setup in enumerate(setups):
                # a prompt of its own per setup (a different first word, the same rest): the pdpair setups share
                # their engines, and a prompt one of them sent would be a prefix-cache hit for the next (vLLM's
                # block hashes chain from the first block, so one different token makes every block differ)
                prompt = f"{WORDS[number % len(WORDS)]}{number} {text_prompt(i, args.prompt_words)}"
                try:
                    times = stream_chunks(setup.url, prompt, args.max_tokens, f"seq-{setup.name}-{i}-{uuid.uuid4().hex[:8]}")
                except Exception as exc:  # noqa: BLE001
                    setup.errors += 1
                    print(f"{setup.name}: request failed: {exc}", file=sys.stderr)
                    continue
                setup.ttft.append(times[0])
                if len(times) > 1:
                    setup.tpot.append((times[-1] - times[0]) / (len(times) - 1))
        report["load_average_sequential_end"] = os.getloadavg()
        time.sleep(12)
        transfer_ms = {}
        for setup in setups:
            if setup.transfer:
                total, count = setup.transfer()
                n = count - before[setup.name][1]
                transfer_ms[setup.name] = round(1000 * (total - before[setup.name][0]) / n, 3) if n else None
        base = next((s for s in setups if s.name == "single"), None)
        seq = {}
        for setup in setups:
            row = {"requests": len(setup.ttft), "errors": setup.errors,
                   "ttft_ms_p50": round(1000 * statistics.median(setup.ttft), 2),
                   "ttft_ms_p90": round(1000 * pct(setup.ttft, 0.9), 2),
                   "tpot_ms_p50": round(1000 * statistics.median(setup.tpot), 3)}
            if base is not None and setup is not base:
                row["ttft_ratio_to_single"] = round(statistics.median(setup.ttft) / statistics.median(base.ttft), 2)
                row["tpot_ratio_to_single"] = round(statistics.median(setup.tpot) / statistics.median(base.tpot), 2)
            other_core = next((s for s in setups if s.name == "single-core1"), None)
            if other_core is not None and setup.name.startswith(("pdpair", "nixl")):
                row["ttft_ratio_to_single_core1"] = round(statistics.median(setup.ttft) / statistics.median(other_core.ttft), 2)
                row["tpot_ratio_to_single_core1"] = round(statistics.median(setup.tpot) / statistics.median(other_core.tpot), 2)
            if setup.name in transfer_ms:
                row["kv_transfer_ms_mean"] = transfer_ms[setup.name]
            seq[setup.name] = row
        report["sequential"] = {"prompt_words": args.prompt_words, "max_tokens": args.max_tokens, "setups": seq}
        report["router_modes_sequential"] = router_modes(setups)
        print(json.dumps({"sequential": report["sequential"]}), file=sys.stderr, flush=True)  # kept if stopped later
        if "pdpair" in wanted:
            time.sleep(1)  # log lines are flushed per line; give the last ones a moment
            report["pdpair_timeline"] = timeline_report(logs)
            print(json.dumps({"pdpair_timeline": report["pdpair_timeline"]}), file=sys.stderr, flush=True)
        if "pdpair-concurrent" in wanted or "pdpair-concurrent-whole" in wanted:
            time.sleep(1)
            report["layerwise_timeline"] = {name: layerwise_report(logs / f"{name}.log")
                                            for name in ("pdpair-prefill", "pdpair-whole-prefill")
                                            if (logs / f"{name}.log").exists()}
            print(json.dumps({"layerwise_timeline": report["layerwise_timeline"]}), file=sys.stderr, flush=True)

        # 3. Greedy outputs equal to the single engine (token ids; a mismatch is reported with its cause).
        if base is not None:
            equal = {s.name: 0 for s in setups if s is not base}
            mismatches: list[str] = []
            checked = 8
            for i in range(checked):
                body = {"model": "tiny", "prompt": text_prompt(100 + i, 10 + 5 * i), "max_tokens": 16,
                        "temperature": 0, "return_token_ids": True}
                status, want, _ = http_post(base.url + "/v1/completions", body)
                if status != 200:
                    mismatches.append(f"prompt {i}: single engine answered {status}: {str(want)[:200]}")
                    continue
                for setup in setups:
                    if setup is base:
                        continue
                    status, got, _ = http_post(setup.url + "/v1/completions", body)
                    if status != 200:
                        mismatches.append(f"prompt {i}: {setup.name} answered {status}: {str(got)[:200]}")
                    elif got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]:
                        equal[setup.name] += 1
                    else:
                        a, b = want["choices"][0]["token_ids"], got["choices"][0]["token_ids"]
                        at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                        mismatches.append(f"prompt {i}: {setup.name} differs from token {at}")
            report["greedy_equal_to_single"] = {name: f"{n}/{checked}" for name, n in equal.items()}
            report["greedy_mismatches"] = mismatches
            print(json.dumps({"greedy": report["greedy_equal_to_single"], "mismatches": mismatches}),
                  file=sys.stderr, flush=True)

        # 4. Concurrency with vLLM's own client.
        levels = [int(c) for c in args.concurrency.split(",") if c]
        conc: dict[str, dict] = {}
        for level in levels:
            prompts = max(16, args.prompts_per_client * level)
            row = {}
            for setup in setups:
                row[setup.name] = vllm_bench(setup.url, model, level, prompts, args.input_len, args.output_len,
                                             results_dir, setup.name)
                print(f"c={level} {setup.name}: {row[setup.name]}", file=sys.stderr, flush=True)
            if "single" in row:
                for name, r in row.items():
                    if name != "single":
                        r["throughput_ratio_to_single"] = round(r["requests_per_s"] / row["single"]["requests_per_s"], 3)
            if "dp" in row:
                for name in row:
                    if name.startswith(("pdpair", "nixl")):
                        row[name]["throughput_ratio_to_dp"] = round(row[name]["requests_per_s"] / row["dp"]["requests_per_s"], 3)
            if "nixl" in row:
                for name in row:
                    if name.startswith("pdpair"):
                        row[name]["throughput_ratio_to_nixl"] = round(row[name]["requests_per_s"] / row["nixl"]["requests_per_s"], 3)
            conc[f"c{level}"] = row
        report["concurrency"] = {"input_len": args.input_len, "output_len": args.output_len, "levels": conc}
        report["router_modes_end"] = router_modes(setups)
    finally:
        for proc in reversed(procs):
            proc.stop()
    quiet.finish("bench_pd_latency", report, box_before, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
