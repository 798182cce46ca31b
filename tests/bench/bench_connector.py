"""Connector benchmark: TTFT and KV transfer time of pdpair (tcp transport) vs vLLM's in-tree NixlConnector (UCX on
the CPU, kv_buffer_device cpu), same machine, same tiny model, one run; plus a single-engine TTFT baseline.

    .venv/bin/python tests/bench/bench_connector.py [--requests 20] [--prompt-tokens 448] [--out results.json]

Each setup is started, warmed up, measured with the same prompts one request at a time (streaming; TTFT = time to
the first non-empty token chunk at the client), then stopped, so the setups never share the 2 cores. Both P/D setups
go through the same pdpair router. Transfer time is the decode side's own per-transfer histogram:
pdpair_kv_transfer_seconds (Pull sent -> last signal) and vllm:nixl_xfer_time_seconds (READ posted -> done).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "engine"))

from engines import ENGINE_ENV, Process, engine, free_port, http_get, http_post, pair_env, router  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402

WORDS = "signal put decode prefill block layer engine pair router token cache region slot deadline".split()


def prompts(count: int, approx_tokens: int, tokenizer_dir: Path) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    out = []
    for i in range(count):
        words, text = [], ""
        j = i
        while True:
            words.append(f"{WORDS[j % len(WORDS)]}{i}")
            j += 7
            candidate = " ".join(words)
            if len(tok(candidate)["input_ids"]) > approx_tokens:
                break
            text = candidate
        out.append(text)
    return out


def ttft_stream(url: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    first = None
    with urllib.request.urlopen(request, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "choices" not in event:
                    raise RuntimeError(f"{url}: error event {line[:300]}")
                if event["choices"][0].get("text"):
                    first = time.perf_counter() - started
    total = time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"no token streamed from {url}")
    return first, total


def histogram(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram on url's /metrics, summed over its label sets."""
    status, body = http_get(url)
    assert status == 200, url
    total = count = 0.0
    for line in body.decode().splitlines():
        m = re.match(rf"^{re.escape(name)}_(sum|count)(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            if m.group(1) == "sum":
                total += float(m.group(3))
            else:
                count += float(m.group(3))
    return total, count


def measure(name: str, url: str, texts: list[str], max_tokens: int, transfer=None) -> dict:
    # Warm-up, retried: a connector's first request also pays its peer handshake (NIXL's can time out here).
    warm_errors = 0
    for attempt in range(6):
        try:
            ttft_stream(url, f"warm up {attempt} " * 40, 4)
            ttft_stream(url, f"warm up again {attempt} " * 30, 4)
            break
        except RuntimeError as exc:
            warm_errors += 1
            print(f"{name}: warm-up attempt {attempt} failed: {exc}", file=sys.stderr)
    before = transfer() if transfer else None
    ttfts, totals, errors = [], [], 0
    for text in texts:
        try:
            first, total = ttft_stream(url, text, max_tokens)
        except RuntimeError as exc:
            errors += 1
            print(f"{name}: request failed: {exc}", file=sys.stderr)
            continue
        ttfts.append(first)
        totals.append(total)
    if not ttfts:
        raise RuntimeError(f"{name}: every measured request failed")
    result = {
        "setup": name,
        "requests": len(ttfts),
        "failed_requests": errors,
        "failed_warmups": warm_errors,
        "ttft_ms_median": round(1000 * statistics.median(ttfts), 2),
        "ttft_ms_p90": round(1000 * sorted(ttfts)[int(0.9 * (len(ttfts) - 1))], 2),
        "ttft_ms_mean": round(1000 * statistics.mean(ttfts), 2),
        "e2e_ms_median": round(1000 * statistics.median(totals), 2),
    }
    if transfer:
        after = transfer()
        n = after[1] - before[1]
        result["transfers"] = int(n)
        result["transfer_ms_mean"] = round(1000 * (after[0] - before[0]) / n, 3) if n else None
    return result


def run_setup(procs: list[Process], ready: list[Process]) -> None:
    for proc in procs:
        proc.start()
    for proc in ready:
        proc.wait_healthy()


def stop_all(procs: list[Process]) -> None:
    for proc in reversed(procs):
        proc.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=448, help="approximate prompt length (max-model-len 512)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--setups", default="single,pdpair,nixl")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="pdpair-bench-"))
    model = build_tiny_model(work / "model")
    logs = work / "logs"
    logs.mkdir()
    texts = prompts(args.requests, args.prompt_tokens, model)
    results = []
    setups = args.setups.split(",")

    if "single" in setups:
        single = engine("single", model, logs)
        try:
            run_setup([single], [single])
            results.append(measure("single engine (no connector)", single.url, texts, args.max_tokens))
        finally:
            stop_all([single])

    if "pdpair" in setups:
        listen, d_metrics = free_port(), free_port()
        decode = engine("pdpair-decode", model, logs, kv_role="kv_consumer",
                        pdpair_env=pair_env("decode", generation=1, listen_base=listen, metrics_port=d_metrics,
                                            hang_timeout=30))
        prefill = engine("pdpair-prefill", model, logs, kv_role="kv_producer",
                         pdpair_env=pair_env("prefill", generation=1, peer_base=listen, hang_timeout=30))
        procs = [decode, prefill]
        try:
            run_setup(procs, procs)
            prefill.wait_log("paired with decode", 60)
            rtr = router(logs, prefill.url, decode.url).start()
            procs.append(rtr)
            rtr.wait_healthy(60)
            metrics = f"http://127.0.0.1:{d_metrics}/metrics"
            results.append(measure("pdpair (tcp transport) via router", rtr.url, texts, args.max_tokens,
                                   transfer=lambda: histogram(metrics, "pdpair_kv_transfer_seconds")))
        finally:
            stop_all(procs)

    if "nixl" in setups:
        procs = []
        try:
            for role in ("decode", "prefill"):
                config = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
                proc = engine(f"nixl-{role}", model, logs, kv_transfer_config=config,
                              extra_env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                                         "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                                         "UCX_TLS": "tcp,self,sm"})
                procs.append(proc)
            run_setup(procs, procs)
            decode, prefill = procs
            rtr = router(logs, prefill.url, decode.url).start()
            procs.append(rtr)
            rtr.wait_healthy(60)
            results.append(measure("vLLM NixlConnector (UCX, CPU) via router", rtr.url, texts, args.max_tokens,
                                   transfer=lambda: histogram(decode.url + "/metrics", "vllm:nixl_xfer_time_seconds")))
        finally:
            stop_all(procs)

    report = {
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores, no GPU",
        "model": "tiny random Llama (2 layers, hidden 64, 2 KV heads x 32, float32, block 32)",
        "prompt_tokens_approx": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "results": results,
        "logs": str(logs),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
