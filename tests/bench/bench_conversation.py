"""Multi-turn conversations with shared prefixes: what the prefix cache saves in each setup, against an oracle.

    PYTHONPATH=src:. .venv/bin/python tests/bench/bench_conversation.py --bind [--conversations 24] [--turns 4] \
        [--clients 8] [--setups single,dp,decode-alone,pdpair,pdpair-concurrent,pdpair-smart,pdpair-never] \
        [--out results.json]

The trace (seeded, printed with the results): `--system-prompts` system prompts of about 120 tokens, each shared by
the conversations that draw it; each conversation takes `--turns` turns, a turn's prompt being its system prompt and
every earlier turn (the user's message and the assistant's reply as recorded in the trace, not as generated, the way
a ShareGPT replay goes) plus the new user message (10-25 tokens); a recorded reply is 25-50 tokens; each request asks
for `--output-len` tokens (ignore_eos). A conversation stops early where its next prompt would pass 440 tokens (the
engines' context is 512). `--clients` clients each run whole conversations, turn after turn (the next turn is sent
once the answer to the last one has ended), streaming.

The setups (the same tiny model and engine flags as bench_pd_latency.py, `--bind`: one core per engine): `single`
(one engine), `dp` (two single engines behind a round-robin proxy), and one pdpair pair behind four routers in turn:
`pdpair` (sequential legs), `pdpair-concurrent` (both legs at once, every request split), `pdpair-smart` (both legs
at once, selective disaggregation from `--local-prompt-tokens` and prefix affinity: a next turn whose history the
decode holds goes to it alone) and `pdpair-never` (never split: `--local-prompt-tokens 1048576
--no-learn-split-threshold`, every prompt to decode alone, through the same router), and `decode-alone` (the pair's
decode asked directly: never split, without the router's hop either). `pdpair-events` is `pdpair-smart` matching
prefixes by the engines' own KV events (the pair's engines then run with `--kv-events-config`, a ZMQ publisher each,
and the router with `--tokenizer`, `--prefill-kv-events`, `--decode-kv-events`) instead of what it sent where;
`pdpair-events-drop` the same with `--kv-events-drop` (default 0.1) of the event batches thrown away as the router
reads them (the router's test knob), so that gap detection and replay carry it. Every setup's prompts start with a word of
its own, so the pair's routers never hit what another setup left in the engines' caches (vLLM's block hashes chain
from the first block).

Reported per setup: requests, failed, requests/s, TTFT and TPOT p50/p99 at the client, and the prefix cache:
`computed` = the prompt tokens its engines computed (vLLM's `vllm:prompt_tokens_by_source{source="local_compute"}`,
summed over the setup's engines; tokens a decode loaded over the KV connector are not computed), `hit rate` = 1 -
computed / the prompt tokens the clients sent; the oracle's hit rate from the trace itself: one cache of unbounded
size that every request reaches, holding whole 32-token blocks of every earlier prompt (in the order the requests were
sent), less the last token vLLM always computes. The pair's routers add their split and local counts. The load
average is printed at the start and at the end of each setup.

What it cannot show on this box: prefix affinity choosing among several prefills (one pair of one prefill and one
decode fits two cores); a model whose prompt costs more than the hop (the tiny model's prefill is cheap, so a hit
saves little time here: the hit rates and computed tokens are the result, the times are reported beside them).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "engine"))
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

import bench_pd_latency as pd_bench  # noqa: E402  (start, rr_proxy, stream_chunks, router_modes, pct)
import quiet  # noqa: E402
from engines import engine, free_port, http_get, pair_env, router  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402

BLOCK_TOKENS = 32  # the engines' --block-size (engines.ENGINE_ARGS)
MAX_PROMPT_TOKENS = 440  # the engines' --max-model-len is 512: room for the answer
WORDS = ("the pair moves each block of the prompt from prefill to decode over one edge while the router keeps "
         "its load low and the operator leases every port so no engine binds a port another holds and the "
         "signals arrive before the deadline of the wait").split()


def words(rng: random.Random, tokenizer, low: int, high: int) -> str:
    """Text of about `low`..`high` tokens (drawn words, measured with the model's tokenizer)."""
    target = rng.randint(low, high)
    text = ""
    while len(tokenizer.encode(text, add_special_tokens=False)) < target:
        text += " " + rng.choice(WORDS)
    return text.strip()


def build_trace(seed: int, tokenizer, system_prompts: int, conversations: int, turns: int) -> list[dict]:
    """[{"system": i, "turns": [(user, reply), ...]}]; see the module docstring for the shape."""
    rng = random.Random(seed)
    systems = [f"System {i}: " + words(rng, tokenizer, 110, 130) for i in range(system_prompts)]
    trace = []
    for c in range(conversations):
        system = rng.randrange(system_prompts)
        trace.append({"system": systems[system], "system_index": system,
                      "turns": [(words(rng, tokenizer, 10, 25), words(rng, tokenizer, 25, 50)) for _ in range(turns)]})
    return trace


def prompts_of(conversation: dict, tag: str) -> list[str]:
    """The conversation's turn prompts, each its history plus the new user message, led by the setup's tag."""
    prompts, history = [], f"{tag} {conversation['system']}"
    for user, reply in conversation["turns"]:
        prompts.append(f"{history}\nUser: {user}\nAssistant:")
        history = f"{prompts[-1]} {reply}"
    return prompts


def oracle_computed(sent: list[list[int]]) -> int:
    """Prompt tokens an unbounded single prefix cache of whole blocks would leave to compute, in this order."""
    computed = 0
    seen: set[tuple[int, ...]] = set()  # every whole-block prefix seen so far
    for tokens in sent:
        cacheable = (len(tokens) - 1) // BLOCK_TOKENS  # vLLM computes at least the last token
        hit = 0
        while hit < cacheable and tuple(tokens[:(hit + 1) * BLOCK_TOKENS]) in seen:
            hit += 1
        computed += len(tokens) - hit * BLOCK_TOKENS
        for b in range(1, len(tokens) // BLOCK_TOKENS + 1):
            seen.add(tuple(tokens[:b * BLOCK_TOKENS]))
    return computed


def prompt_sources(urls: list[str]) -> dict[str, float]:
    """vllm:prompt_tokens_by_source summed over the engines at `urls`, per source."""
    total: dict[str, float] = {}
    for url in urls:
        status, body = http_get(url + "/metrics", timeout=10)
        if status != 200:
            raise RuntimeError(f"{url}/metrics answered {status}")
        for line in body.decode().splitlines():
            if line.startswith("vllm:prompt_tokens_by_source_total{"):
                source = line.split('source="', 1)[1].split('"', 1)[0]
                total[source] = total.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def run_setup(name: str, url: str, engine_urls: list[str], trace: list[dict], tokenizer, clients: int,
              output_len: int) -> dict:
    tag = f"{name}-{uuid.uuid4().hex[:6]}"
    todo: queue.Queue = queue.Queue()
    for conversation in trace:
        todo.put(conversation)
    lock = threading.Lock()
    sent: list[list[int]] = []
    ttft, tpot, failed = [], [], []

    def client() -> None:
        while True:
            try:
                conversation = todo.get_nowait()
            except queue.Empty:
                return
            for turn, prompt in enumerate(prompts_of(conversation, tag)):
                tokens = tokenizer.encode(prompt)
                if len(tokens) > MAX_PROMPT_TOKENS:
                    break
                with lock:
                    sent.append(tokens)
                try:
                    times = pd_bench.stream_chunks(url, prompt, output_len, f"conv-{tag}-{uuid.uuid4().hex[:8]}")
                except Exception as exc:  # noqa: BLE001
                    with lock:
                        failed.append(f"turn {turn}: {exc}"[:300])
                    break  # the conversation cannot go on without its answer
                with lock:
                    ttft.append(times[0])
                    if len(times) > 1:
                        tpot.append((times[-1] - times[0]) / (len(times) - 1))

    before = prompt_sources(engine_urls)
    load_start = os.getloadavg()
    started = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=1800)
    elapsed = time.perf_counter() - started
    time.sleep(12)  # vLLM publishes its counters to /metrics on its logging interval (10 s)
    after = prompt_sources(engine_urls)
    sources = {k: round(after.get(k, 0.0) - before.get(k, 0.0)) for k in set(after) | set(before)}
    sent_tokens = sum(len(t) for t in sent)
    computed = sources.get("local_compute", 0)
    oracle = oracle_computed(sent)
    row = {
        "requests": len(ttft), "failed": len(failed), "failures": failed[:3],
        "requests_per_s": round(len(ttft) / elapsed, 3),
        "ttft_ms_p50": round(1000 * statistics.median(ttft), 2) if ttft else None,
        "ttft_ms_p99": round(1000 * pd_bench.pct(ttft, 0.99), 2) if ttft else None,
        "tpot_ms_p50": round(1000 * statistics.median(tpot), 3) if tpot else None,
        "tpot_ms_p99": round(1000 * pd_bench.pct(tpot, 0.99), 3) if tpot else None,
        "prompt_tokens_sent": sent_tokens, "prompt_tokens_by_source": sources,
        "prompt_tokens_computed": computed,
        "hit_rate": round(1 - computed / sent_tokens, 3) if sent_tokens else None,
        "oracle_hit_rate": round(1 - oracle / sent_tokens, 3) if sent_tokens else None,
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
    }
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--system-prompts", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--local-prompt-tokens", type=int, default=128,
                        help="pdpair-smart's starting threshold (the router's --local-prompt-tokens)")
    parser.add_argument("--setups",
                        default="single,dp,decode-alone,pdpair,pdpair-concurrent,pdpair-smart,pdpair-never")
    parser.add_argument("--kv-events-drop", type=float, default=0.1,
                        help="pdpair-events-drop: the share of KV event batches its router throws away")
    parser.add_argument("--bind", action="store_true", help="one core per engine process tree (bench_pd_latency.py)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    pd_bench.BIND = args.bind
    box_before = quiet.require_quiet("bench_conversation")
    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="pdpair-conversation-"))
    model = build_tiny_model(work / "model")
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    logs = work / "logs"
    logs.mkdir()
    trace = build_trace(args.seed, tokenizer, args.system_prompts, args.conversations, args.turns)
    wanted = args.setups.split(",")
    report: dict = {
        "trace": {"seed": args.seed, "system_prompts": args.system_prompts, "conversations": args.conversations,
                  "turns": args.turns, "clients": args.clients, "output_len": args.output_len,
                  "system_prompt_tokens": [len(tokenizer.encode(t["system"], add_special_tokens=False))
                                           for t in trace[:args.system_prompts]]},
        "binding": "taskset, one core per engine" if args.bind else "none",
        "load_average_start": os.getloadavg(), "setups": {},
    }
    procs = []
    try:
        ready = []  # (name, url, engine urls)
        if "single" in wanted:
            single = pd_bench.start(procs, engine("single", model, logs))
        if "dp" in wanted:
            dp = [pd_bench.start(procs, engine(f"dp-{i}", model, logs)) for i in range(2)]
        routers = [n for n in ("pdpair", "pdpair-concurrent", "pdpair-smart", "pdpair-never", "pdpair-events",
                               "pdpair-events-drop") if n in wanted]
        events = {role: free_port(2) for role in ("prefill", "decode")} \
            if {"pdpair-events", "pdpair-events-drop"} & set(wanted) else {}

        def kv_events_args(role: str) -> tuple[str, ...]:
            if not events:
                return ()
            port = events[role]
            return ("--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                "replay_endpoint": f"tcp://*:{port + 1}"}))

        if routers or "decode-alone" in wanted:
            listen = free_port()
            decode = pd_bench.start(procs, engine("pdpair-decode", model, logs, kv_role="kv_consumer",
                                                  pdpair_env=pair_env("decode", generation=1, listen_base=listen,
                                                                      hang_timeout=30),
                                                  extra_args=kv_events_args("decode")))
            prefill = pd_bench.start(procs, engine("pdpair-prefill", model, logs, kv_role="kv_producer",
                                                   pdpair_env=pair_env("prefill", generation=1, peer_base=listen,
                                                                       hang_timeout=30),
                                                   extra_args=kv_events_args("prefill")))
        if "single" in wanted:
            single.wait_healthy()
            ready.append(("single", single.url, [single.url]))
        if "dp" in wanted:
            for proc in dp:
                proc.wait_healthy()
            proxy = pd_bench.start(procs, pd_bench.rr_proxy(logs, [p.url for p in dp]))
            proxy.wait_healthy(60)
            ready.append(("dp", proxy.url, [p.url for p in dp]))
        if routers or "decode-alone" in wanted:
            decode.wait_healthy()
            prefill.wait_healthy()
            prefill.wait_log("paired with decode", 60)
        if "decode-alone" in wanted:  # never split, and no router: decode computes every prompt itself
            ready.append(("decode-alone", decode.url, [decode.url]))
        if routers:
            flags = {"pdpair": ("--no-concurrent-legs",), "pdpair-concurrent": ("--concurrent-legs",),
                     "pdpair-smart": ("--concurrent-legs", "--local-prompt-tokens", str(args.local_prompt_tokens),
                                      "--prefix-affinity"),
                     "pdpair-never": ("--concurrent-legs", "--local-prompt-tokens", "1048576",
                                      "--no-learn-split-threshold", "--prefix-affinity")}
            if events:
                flags["pdpair-events"] = flags["pdpair-events-drop"] = (
                    *flags["pdpair-smart"], "--tokenizer", str(model),
                    "--prefill-kv-events", f"tcp://127.0.0.1:{events['prefill']}",
                    "--decode-kv-events", f"tcp://127.0.0.1:{events['decode']}")
            for name in routers:
                env = {"TEST_ONLY_PDPAIR_KV_EVENTS_DROP": str(args.kv_events_drop)} \
                    if name == "pdpair-events-drop" else None
                rtr = pd_bench.start(procs, router(logs, prefill.url, decode.url, extra_args=flags[name],
                                                   name=f"{name}-router", extra_env=env))
                rtr.wait_healthy(60)
                ready.append((name, rtr.url, [prefill.url, decode.url]))
        for name, url, _ in ready:  # warm-up: a request each (the concurrent routers learn prefill's identity)
            for attempt in range(3):
                try:
                    pd_bench.stream_chunks(url, f"warm up {name} {attempt} " * 12, 4, f"warm-{uuid.uuid4().hex}")
                    break
                except Exception as exc:  # noqa: BLE001
                    print(f"{name}: warm-up {attempt} failed: {exc}", file=sys.stderr)
        ready.sort(key=lambda setup: wanted.index(setup[0]))  # run in the order --setups gives (the box drifts)
        report["load_settled"] = quiet.settle("bench_conversation")  # the engines' starts are over
        for name, url, engine_urls in ready:
            cpu_before = {proc.name: proc.cpu_seconds() for proc in procs if proc.alive()}
            row = run_setup(name, url, engine_urls, trace, tokenizer, args.clients, args.output_len)
            # Where the two cores went: CPU ms per request of every process tree of the bench over this setup's
            # run (idle ones near 0), so a setup's cost is seen by process, not only its latency
            done = max(1, row.get("requests", 0))
            cpu = {proc.name: round(1000 * (proc.cpu_seconds() - cpu_before[proc.name]) / done, 2)
                   for proc in procs if proc.alive() and proc.name in cpu_before}
            row["cpu_ms_per_request"] = {**{k: v for k, v in cpu.items() if v >= 0.05},
                                         "all": round(sum(cpu.values()), 2)}
            report["setups"][name] = row
            print(f"{name}: {json.dumps(row)}", file=sys.stderr, flush=True)
        modes = pd_bench.router_modes([pd_bench.Setup(name, url) for name, url, _ in ready])
        for name, values in modes.items():
            report["setups"][name]["router"] = values
        base = report["setups"].get("single")
        dp_row = report["setups"].get("dp")
        for name, row in report["setups"].items():
            if base and name != "single" and row["ttft_ms_p50"] and base["ttft_ms_p50"]:
                row["ttft_p50_ratio_to_single"] = round(row["ttft_ms_p50"] / base["ttft_ms_p50"], 2)
            if dp_row and name.startswith("pdpair") and dp_row["requests_per_s"]:
                row["requests_per_s_ratio_to_dp"] = round(row["requests_per_s"] / dp_row["requests_per_s"], 3)
    finally:
        for proc in reversed(procs):
            proc.stop()
    quiet.finish("bench_conversation", report, box_before, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
