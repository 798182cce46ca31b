"""Connector benchmark: TTFT and KV transfer time of pdpair (tcp transport) vs vLLM's in-tree NixlConnector (UCX on
the CPU, kv_buffer_device cpu), same machine, same tiny model, one run; plus a single-engine TTFT baseline.

    .venv/bin/python tests/bench/bench_connector.py [--requests 20] [--prompt-tokens 448] [--out results.json]
    .venv/bin/python tests/bench/bench_connector.py --setups single,pdpair,pdpair-tp2   # TP = 2 against TP = 1

All setups are started, warmed up, then measured with the same prompts one request at a time, round robin over the
setups (streaming; TTFT = time to the first non-empty token chunk at the client), so each sees the same load on a
shared machine and only one is busy at a time. Both P/D setups
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
sys.path.insert(0, str(HERE.parents[1]))  # engines.py imports devcluster.ports

from engines import Process, engine, free_port, http_get, pair_env, router  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402
import quiet  # noqa: E402  (tests/bench/quiet.py: the load guard)

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


class Setup:
    def __init__(self, name: str, url: str, transfer=None) -> None:
        self.name, self.url, self.transfer = name, url, transfer
        self.ttfts: list[float] = []
        self.totals: list[float] = []
        self.errors = 0
        self.warm_errors = 0
        self.before = (0.0, 0.0)

    def warm_up(self) -> None:
        # Retried: a connector's first request also pays its peer handshake (NIXL's can time out under load).
        for attempt in range(6):
            try:
                ttft_stream(self.url, f"warm up {attempt} " * 40, 4)
                ttft_stream(self.url, f"warm up again {attempt} " * 30, 4)
                return
            except RuntimeError as exc:
                self.warm_errors += 1
                print(f"{self.name}: warm-up attempt {attempt} failed: {exc}", file=sys.stderr)
        raise RuntimeError(f"{self.name}: warm-up failed 6 times")

    def one(self, text: str, max_tokens: int) -> None:
        try:
            first, total = ttft_stream(self.url, text, max_tokens)
        except RuntimeError as exc:
            self.errors += 1
            print(f"{self.name}: request failed: {exc}", file=sys.stderr)
            return
        self.ttfts.append(first)
        self.totals.append(total)

    def result(self) -> dict:
        if not self.ttfts:
            raise RuntimeError(f"{self.name}: every measured request failed")
        ttfts = sorted(self.ttfts)
        result = {
            "setup": self.name,
            "requests": len(ttfts),
            "failed_requests": self.errors,
            "failed_warmups": self.warm_errors,
            "ttft_ms_median": round(1000 * statistics.median(ttfts), 2),
            "ttft_ms_p90": round(1000 * ttfts[int(0.9 * (len(ttfts) - 1))], 2),
            "ttft_ms_mean": round(1000 * statistics.mean(ttfts), 2),
            "e2e_ms_median": round(1000 * statistics.median(self.totals), 2),
        }
        if self.transfer:
            after = self.transfer()
            n = after[1] - self.before[1]
            result["transfers"] = int(n)
            result["transfer_ms_mean"] = round(1000 * (after[0] - self.before[0]) / n, 3) if n else None
        return result


def stop_all(procs: list[Process]) -> None:
    for proc in reversed(procs):
        proc.stop()


def start_pdpair(model: Path, logs: Path, procs: list[Process], tp: int) -> Setup:
    """A pdpair prefill + decode pair at tensor parallel `tp` behind the router (both sides the same TP)."""
    suffix = "" if tp == 1 else f"-tp{tp}"
    listen, d_metrics = free_port(tp), free_port()
    decode = engine(f"pdpair-decode{suffix}", model, logs, kv_role="kv_consumer", tensor_parallel_size=tp,
                    pdpair_env=pair_env("decode", generation=1, listen_base=listen, metrics_port=d_metrics,
                                        hang_timeout=30))
    prefill = engine(f"pdpair-prefill{suffix}", model, logs, kv_role="kv_producer", tensor_parallel_size=tp,
                     pdpair_env=pair_env("prefill", generation=1, peer_base=listen, hang_timeout=30))
    procs += [decode.start(), prefill.start()]
    decode.wait_healthy()
    prefill.wait_healthy()
    for rank in range(tp):
        prefill.wait_log(f"pdpair-sidechannel-prefill-r{rank}: paired with decode", 60)
    rtr = router(logs, prefill.url, decode.url)
    rtr.name = f"router{suffix}"
    rtr.log_path = logs / f"router{suffix}.log"
    procs.append(rtr.start())
    rtr.wait_healthy(60)
    metrics = f"http://127.0.0.1:{d_metrics}/metrics"
    # At TP > 1 every rank moves its own shard and records its own transfer: the mean is per rank-transfer.
    label = "pdpair (tcp) via router" + ("" if tp == 1 else f", TP = {tp} (per-rank transfers)")
    return Setup(label, rtr.url, lambda: histogram(metrics, "pdpair_kv_transfer_seconds"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=448, help="approximate prompt length (max-model-len 512)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--setups", default="single,pdpair,nixl", help="any of single,pdpair,pdpair-tp2,nixl")
    parser.add_argument("--ucx-tls", default="", help="UCX_TLS for the NIXL engines (default: UCX chooses)")
    args = parser.parse_args()
    box_before = quiet.require_quiet("bench_connector")  # exits when the box is too busy to measure

    work = Path(tempfile.mkdtemp(prefix="pdpair-bench-"))
    model = build_tiny_model(work / "model")
    logs = work / "logs"
    logs.mkdir()
    texts = prompts(args.requests, args.prompt_tokens, model)
    wanted = args.setups.split(",")
    procs: list[Process] = []
    setups: list[Setup] = []
    try:
        if "single" in wanted:
            single = engine("single", model, logs)
            procs.append(single.start())
            single.wait_healthy()
            setups.append(Setup("single engine (no connector)", single.url))
        for tp in (1, 2):
            name = "pdpair" if tp == 1 else f"pdpair-tp{tp}"
            if name in wanted:
                setups.append(start_pdpair(model, logs, procs, tp))
        if "nixl" in wanted:
            pair = []
            for role in ("decode", "prefill"):
                config = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
                proc = engine(f"nixl-{role}", model, logs, kv_transfer_config=config,
                              extra_env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                                         "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                                         **({"UCX_TLS": args.ucx_tls} if args.ucx_tls else {})})
                procs.append(proc.start())
                pair.append(proc)
            for proc in pair:
                proc.wait_healthy()
            nixl_decode, nixl_prefill = pair
            rtr = router(logs, nixl_prefill.url, nixl_decode.url)
            rtr.name = "nixl-router"
            rtr.log_path = logs / "nixl-router.log"
            procs.append(rtr.start())
            rtr.wait_healthy(60)
            setups.append(Setup("vLLM NixlConnector (UCX, CPU) via router", rtr.url,
                                lambda: histogram(nixl_decode.url + "/metrics", "vllm:nixl_xfer_time_seconds")))
        for setup in setups:
            setup.warm_up()
        time.sleep(12)  # vLLM publishes connector stats to /metrics on its logging interval
        for setup in setups:
            if setup.transfer:
                setup.before = setup.transfer()
        # Round robin, one request at a time: every setup sees the same (shared, noisy) machine.
        for text in texts:
            for setup in setups:
                setup.one(text, args.max_tokens)
        time.sleep(12)  # vLLM publishes connector stats to /metrics on its logging interval
        results = [setup.result() for setup in setups]
    finally:
        stop_all(procs)

    report = {
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores, no GPU",
        "model": "tiny random Llama (2 layers, hidden 64, 2 KV heads x 32, float32, block 32)",
        "prompt_tokens_approx": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "ucx_tls": args.ucx_tls or "(UCX default)",
        "box_before": box_before,
        "box_after": quiet.report_after("bench_connector"),
        "results": results,
        "logs": str(logs),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
