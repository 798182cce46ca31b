"""Prefill -> decode through the router on real vLLM engines (tiny model), against a single plain engine.

Tests run in file order and share one stack (conftest.py); the signal-drop test is last because it leaves the decode
pod "hung" by the contract's definition (a real deficit), which is what it proves.
"""

from __future__ import annotations

import json
import re
import statistics
import threading
import time
import urllib.request

import pytest


from conftest import API_KEY, API_KEY_ENV, GENERATION, HANG_TIMEOUT_SECONDS
from engines import PREFILL_INSTANCE, http_get, http_post, router
from pdpair import contract
from pdpair.connector.deadlines import keyed_pull_deadline
from pdpair.connector.metadata import NOT_ACCEPTED, Refused
from tests.side_channel_support import TEST_KEY_BYTES, Stranger, answers_hello

AUTH = {"Authorization": f"Bearer {API_KEY}"}  # the pair's API key (conftest.API_KEY); the baseline ignores it

# Distinct prompts per test: decode's prefix cache must not serve them locally, so each one is really transferred.
# Lengths span 1 to 5 blocks of 32 tokens.
PROMPTS = [
    "The quick brown fox",
    "Prefill computes the prompt, decode generates the answer.",
    "Kubernetes runs pods; an operator watches custom resources. " * 3,
    "KV caches are moved between engines with one-sided puts and signals. " * 5,
    "Hello world! 0123456789 abcdefghijklmnopqrstuvwxyz",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ " * 8,
    "a",
    "The lazy dog sleeps while the fox jumps over it again and again, " * 4,
    "operator pods signals engines decode prefill " * 6,
]
# test_corrupted_puts_fail_the_request_never_change_its_text: about 150 tokens each (5 blocks), so every load has puts.
REJECTED_PROMPTS = [
    "Checksums guard every put; a flipped byte is refused on arrival. " * 3,
    "Decode verifies each block before the engine may read it. " * 4,
    "9876543210 zyxwvutsrq " * 8,
]
CORRUPT_PROMPTS = [
    "Signals and puts, puts and signals: " * 4,
    "Zebra yak xylophone walrus " * 6,
    "The decode engine trusts the bytes it receives. " * 3,
    "0123456789 " * 12,
]


def completion(url: str, prompt: str, max_tokens: int = 12, *, timeout: float = 120.0, auth: dict | None = None,
               **extra) -> tuple[int, dict]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
            **extra}
    status, payload, _ = http_post(url + "/v1/completions", body, timeout=timeout,
                                   headers=AUTH if auth is None else auth)
    return status, payload


def tokens(payload: dict) -> list[int]:
    choice = payload["choices"][0]
    ids = choice.get("token_ids")
    assert ids, f"no token_ids in {json.dumps(payload)[:300]}"
    return list(ids)


def metric(base_url: str, name: str, labels: dict[str, str] | None = None) -> float:
    status, body = http_get(base_url + "/metrics")
    assert status == 200
    return metric_in(body.decode(), name, labels, where=f"{base_url}/metrics")


def metric_in(exposition: str, name: str, labels: dict[str, str] | None = None, where: str = "the exposition") -> float:
    """The sum of `name`'s samples whose labels include `labels`, in a Prometheus text exposition."""
    total, found = 0.0, False
    for line in exposition.splitlines():
        if not line.startswith(name):
            continue
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if not match:
            continue
        if labels and not all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            continue
        total += float(match.group(2))
        found = True
    assert found, f"{name}{labels or ''} not exported at {where}"
    return total


def ok_transfers(stack) -> float:
    return metric(stack.decode_metrics, "pdpair_kv_transfers_total", {"outcome": "ok"})


def test_prefill_started_before_decode_retried_then_serves(stack):
    assert stack.prefill_healthy_before_decode_started, "prefill must serve /health while decode is still absent"
    assert stack.retries_before_decode_started >= 2, stack.prefill.log()[-2000:]
    match = re.search(r"paired with decode \S+ after (\d+) attempt", stack.prefill.log())
    assert match and int(match.group(1)) >= 3, "prefill should have paired only after several attempts"
    before = ok_transfers(stack)
    status, payload = completion(stack.router.url, "Started in the wrong order, served all the same.")
    assert status == 200, payload
    assert len(tokens(payload)) == 12
    assert ok_transfers(stack) == before + 1


def test_router_outputs_equal_single_engine_token_for_token(stack):
    before = ok_transfers(stack)
    bytes_before = metric(stack.decode_metrics, "pdpair_kv_transfer_bytes_total")
    for prompt in PROMPTS:
        status, via_pair = completion(stack.router.url, prompt)
        assert status == 200, via_pair
        status, single = completion(stack.baseline.url, prompt)
        assert status == 200, single
        assert tokens(via_pair) == tokens(single), f"prompt {prompt[:40]!r}"
        assert via_pair["choices"][0]["text"] == single["choices"][0]["text"]
    assert ok_transfers(stack) == before + len(PROMPTS), "every request must have moved its KV over the pair"
    assert metric(stack.decode_metrics, "pdpair_kv_transfer_bytes_total") > bytes_before
    # The vLLM-native view (KVConnectorStats -> build_prom_metrics) on vLLM's own /metrics.
    deadline = time.monotonic() + 30
    while metric(stack.decode.url, "vllm:pdpair_kv_transfers_total", {"outcome": "ok"}) < len(PROMPTS):
        assert time.monotonic() < deadline, "vllm:pdpair_kv_transfers_total did not reach the transfer count"
        time.sleep(1)
    assert metric(stack.decode.url, "vllm:pdpair_kv_transfer_seconds_count") >= len(PROMPTS)


def streamed_pieces(url: str, path: str, body: dict) -> list[str]:
    """The text of each streamed chunk of a completion (`text`) or a chat answer (`delta.content`)."""
    request = urllib.request.Request(url + path, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json", **AUTH})
    pieces = []
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert resp.status == 200
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                pieces.append(choice["text"] if "text" in choice else choice["delta"].get("content") or "")
    return pieces


def streamed_text(url: str, prompt: str, max_tokens: int = 12) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return "".join(streamed_pieces(url, "/v1/completions", body))


def test_selective_routing_sends_a_short_prompt_to_decode_alone_with_an_equal_output(stack, tmp_path):
    """A second router on the module's engines with --local-prompt-tokens 64: short prompts (streamed and not) go
    to decode alone (its choice log says so, no KV moves, prefill sees nothing) and answer exactly as the single
    engine; a prompt estimated at 64 tokens or more is split as before (one transfer each); the router's /metrics
    counts both. Cost: no cold start (a router process, about 1 s), about 5 s."""
    selective = router(tmp_path, stack.prefill.url, stack.decode.url, decode_timeout=60, extra_env=API_KEY_ENV,
                       extra_args=("--local-prompt-tokens", "64", "--log-choices"), name="selective-router").start()
    try:
        selective.wait_healthy(60)
        before = ok_transfers(stack)
        short = ["Short and local.", "Decode computes this one itself."]
        for prompt in short:
            status, via_decode = completion(selective.url, prompt)
            assert status == 200, via_decode
            status, single = completion(stack.baseline.url, prompt)
            assert status == 200, single
            assert tokens(via_decode) == tokens(single), prompt
            assert streamed_text(selective.url, prompt) == single["choices"][0]["text"]
        assert ok_transfers(stack) == before, "a local request must move no KV"
        assert selective.log().count("alone (about") == 2 * len(short), selective.log()[-2000:]
        long_prompt = "A prompt long enough to be worth a prefill of its own. " * 5  # 280 bytes: about 70 tokens
        status, split_answer = completion(selective.url, long_prompt)
        assert status == 200, split_answer
        status, single = completion(stack.baseline.url, long_prompt)
        assert tokens(split_answer) == tokens(single)
        assert ok_transfers(stack) == before + 1
        assert metric(selective.url, "pdpair_router_requests_total", {"mode": "local"}) == 2 * len(short)
        assert metric(selective.url, "pdpair_router_requests_total", {"mode": "split"}) == 1
        assert metric(selective.url, "pdpair_router_local_prompt_tokens") == 64  # only local samples: nothing to learn from
    finally:
        selective.stop()


def test_precise_prefix_affinity_matches_the_engines_own_kv_events(stack, tiny_model, tmp_path):
    """A router on the module's engines matching prefixes by their KV events (vLLM's ZMQ publisher, the engines'
    --kv-events-config; the router's --tokenizer, --prefill-kv-events, --decode-kv-events): a prompt sent a second
    time finds every whole block of it held by the prefill and the decode that served it the first time, as their
    own events say (so the router's tokenization and block hashing agree with the engine's), and both answers equal
    the single engine's. Cost: no cold start (a router process that loads the tokenizer, 3-5 s), about 10 s."""
    precise = router(tmp_path, stack.prefill.url, stack.decode.url, decode_timeout=60, extra_env=API_KEY_ENV,
                     extra_args=("--prefix-affinity", "--tokenizer", str(tiny_model),
                                 "--prefill-kv-events", f"tcp://127.0.0.1:{stack.kv_events_ports['prefill']}",
                                 "--decode-kv-events", f"tcp://127.0.0.1:{stack.kv_events_ports['decode']}"),
                     name="precise-router").start()
    try:
        precise.wait_healthy(60)
        prompt = "Precise affinity reads what each engine holds from its own events. " * 6  # about 8 blocks of 32
        status, single = completion(stack.baseline.url, prompt)
        assert status == 200, single
        status, first = completion(precise.url, prompt)
        assert status == 200, first
        assert tokens(first) == tokens(single)

        def routed_blocks(role: str, outcome: str) -> float:
            return metric(precise.url, "pdpair_router_prefix_blocks_total", {"role": role, "outcome": outcome}) or 0

        # the engines' events for the first request reach the router within a few seconds (a step's batch each)
        deadline = time.monotonic() + 30
        while True:
            before = {role: (routed_blocks(role, "routed"), routed_blocks(role, "matched"))
                      for role in ("prefill", "decode")}
            status, second = completion(precise.url, prompt)
            assert status == 200, second
            assert tokens(second) == tokens(single)
            gained = {role: (routed_blocks(role, "routed") - before[role][0],
                             routed_blocks(role, "matched") - before[role][1]) for role in ("prefill", "decode")}
            if all(routed > 0 and matched == routed for routed, matched in gained.values()):
                break
            assert time.monotonic() < deadline, (gained, precise.log()[-3000:])
            time.sleep(1)
        applied = metric(precise.url, "pdpair_router_kv_event_batches_total", {"role": "decode", "outcome": "applied"})
        assert applied and applied > 0
        assert not metric(precise.url, "pdpair_router_kv_event_batches_total", {"role": "decode", "outcome": "resync"})
    finally:
        precise.stop()


def test_both_legs_at_once_serve_like_the_single_engine_and_a_prefill_that_never_computes_fails_in_bound(stack,
                                                                                                        tmp_path):
    """A router with --concurrent-legs on the module's engines: after the prefill's first answer (which teaches the
    router its identity) decode gets each request together with prefill's, names the transfer by the router's key,
    pulls at once, and every output equals the single engine's (streamed too), one KV transfer each. Meanwhile (sent
    first, in a thread, so its 20 s wait overlaps the router's requests) decode's request for a key prefill never
    computes (a prefill leg that never arrives, no engine killed) fails once prefill's bound on a keyed Pull's wait
    passes (deadlines.keyed_pull_deadline: four hang timeouts, 20 s here), plus margin: the parked Pull is refused,
    no signal wait times out, and decode stays healthy all along (a Pull waiting for prefill's computation opens no
    transfer in its health accounts until prefill starts serving it), while the router's keyed Pulls on the same edge
    are served. Cost: no cold start (a router process), about 25 s (about 45 s in CI while the stranded request was
    waited for after the router's part)."""
    timeouts_before = metric(stack.decode_metrics, "pdpair_signal_wait_timeouts_total")
    key = "t-" + "0123456789abcdef" * 2
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": key,
              "pdpair_transfer_key": key, "remote_instance": PREFILL_INSTANCE, "remote_pair": "test-pair",
              "remote_generation": GENERATION}
    stranded: dict = {}

    def never_computed() -> None:
        started = time.monotonic()
        try:
            stranded["status"], stranded["payload"] = completion(stack.decode.url, "No prefill ever computes this one.",
                                                                 kv_transfer_params=params)
        except Exception as exc:  # reported below, with the rest of the outcome
            stranded["error"] = repr(exc)
        finally:
            stranded["elapsed"] = time.monotonic() - started

    bound = keyed_pull_deadline(HANG_TIMEOUT_SECONDS, 0.0)
    waiter = threading.Thread(target=never_computed, name="never-computed", daemon=True)
    waiter.start()
    concurrent = router(tmp_path, stack.prefill.url, stack.decode.url, decode_timeout=60, extra_env=API_KEY_ENV,
                        extra_args=("--concurrent-legs", "--log-choices"), name="concurrent-router").start()
    try:
        concurrent.wait_healthy(60)
        before = ok_transfers(stack)
        for prompt in PROMPTS:
            status, via_pair = completion(concurrent.url, prompt)
            assert status == 200, via_pair
            status, single = completion(stack.baseline.url, prompt)
            assert status == 200, single
            assert tokens(via_pair) == tokens(single), f"prompt {prompt[:40]!r}"
        streamed = "Streamed with both legs at once, token by token."
        status, single = completion(stack.baseline.url, streamed)
        assert streamed_text(concurrent.url, streamed) == single["choices"][0]["text"]
        assert ok_transfers(stack) == before + len(PROMPTS) + 1
        assert concurrent.log().count("both legs at once") == len(PROMPTS), concurrent.log()[-3000:]
    finally:
        concurrent.stop()

    waiter.join(150)  # completion()'s own client deadline is 120 s
    assert not waiter.is_alive() and "error" not in stranded, stranded
    status, payload, elapsed = stranded["status"], stranded["payload"], stranded["elapsed"]
    failed = status >= 500 or payload.get("choices", [{}])[0].get("finish_reason") == "error"
    assert failed, f"status {status}: {json.dumps(payload)[:500]}"
    assert bound * 0.9 <= elapsed <= bound + 15, elapsed
    assert metric(stack.decode_metrics, "pdpair_signal_wait_timeouts_total") == timeouts_before
    assert http_get(stack.decode_metrics + "/healthz")[0] == 200


def test_the_api_key_guards_the_pair_and_the_router_passes_it_through(stack):
    """spec.apiKeySecret's behaviour on real engines (VLLM_API_KEY on prefill, decode and the router, as the
    operator's pods get it from the Secret): the router refuses a request without the key or with a wrong one (401,
    a fixed body that echoes nothing of the request) and moves no KV for it; with the key it forwards with its own
    Bearer header, which vLLM on both engines accepts (every other test of this module goes through it). Each
    engine's /v1 refuses a caller without the key (vLLM's own check), its /health stays open, and the connector's
    warm-up, which calls the engine's own /v1 API, got through (its /readyz says "ok", not a 401). Cost: no cold
    start (the module's stack), about 2 s."""
    before = ok_transfers(stack)
    secret_prompt = "a prompt the refusal must not echo"
    for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": API_KEY}):
        status, payload, _ = http_post(stack.router.url + "/v1/completions",
                                       {"model": "tiny", "prompt": secret_prompt, "max_tokens": 4}, headers=headers)
        assert status == 401, (headers, payload)
        assert secret_prompt not in json.dumps(payload) and "not-the-key" not in json.dumps(payload), payload
    assert ok_transfers(stack) == before, "a refused request must not reach the engines"
    for engine in (stack.prefill, stack.decode):
        status, payload = completion(engine.url, "no key", max_tokens=2, auth={})
        assert status == 401, (engine.name, payload)
        assert http_get(engine.url + "/health")[0] == 200
    status, payload = completion(stack.router.url, "With the key, through the pair.")
    assert status == 200 and len(tokens(payload)) == 12, payload
    assert ok_transfers(stack) == before + 1
    # The first /readyz starts the warm-up (nothing probes these engines); it answers 200 once the warm-up ended.
    for port in (stack.prefill_metrics_port, stack.decode_metrics_port):
        deadline = time.monotonic() + 120
        while True:
            status, body = http_get(f"http://127.0.0.1:{port}/readyz")
            readyz = json.loads(body)
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert status == 200 and str(readyz.get("warmup", "")).startswith("ok"), readyz


def test_chat_streaming_and_request_id_through_router(stack):
    messages = [{"role": "user", "content": "Tell me about signals and puts in a pair of engines."}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 0}
    status, single, _ = http_post(stack.baseline.url + "/v1/chat/completions", body, headers=AUTH)
    assert status == 200, single
    status, plain, headers = http_post(stack.router.url + "/v1/chat/completions", body,
                                     headers={"X-Request-Id": "chat-1", **AUTH})
    assert status == 200, plain
    assert headers.get("X-Request-Id") == "chat-1"
    assert plain["choices"][0]["message"]["content"] == single["choices"][0]["message"]["content"]

    stream_body = {**body, "messages": [{"role": "user", "content": "Streaming: decode sends tokens one by one."}],
                   "stream": True}
    status, single_stream, _ = http_post(stack.baseline.url + "/v1/chat/completions", {**stream_body, "stream": False},
                                           headers=AUTH)
    pieces = streamed_pieces(stack.router.url, "/v1/chat/completions", stream_body)
    assert len([p for p in pieces if p]) > 1, "the answer should arrive in several chunks"
    assert "".join(pieces) == single_stream["choices"][0]["message"]["content"]


def first_token_logprob(payload: dict) -> float:
    values = payload["choices"][0].get("logprobs", {}).get("token_logprobs") or []
    assert values and values[0] is not None, f"no token_logprobs in {json.dumps(payload)[:300]}"
    return float(values[0])


def failed_with_an_error(status: int, payload: dict) -> bool:
    """The request ended with an error: a 5xx (vLLM's kv_load_failure_policy=fail answers 500, the router 502), or a
    200 whose choice finished with "error"."""
    return status >= 500 or payload.get("choices", [{}])[0].get("finish_reason") == "error"


def rejected(stack, reason: str) -> float:
    return metric(stack.decode_metrics, "pdpair_kv_transfers_rejected_total", {"reason": reason})


@pytest.mark.parametrize("reason", [contract.REJECTED_CHECKSUM, contract.REJECTED_OUTSIDE_WINDOW,
                                    contract.REJECTED_UNEXPECTED_TRANSFER, contract.REJECTED_INCOMPLETE])
def test_corrupted_puts_fail_the_request_never_change_its_text(stack, reason):
    """Puts damaged on the way, one fault per case: prefill's TEST ONLY corrupt-puts knob (test_corrupt_puts_file)
    makes its tcp connection damage every put as the file's content names, by the refusal it must cause:
    `checksum` flips one payload byte after the put's CRC32C was taken; `outside_window` sends every put into block 0
    (a block id outside the Pull: vLLM's null block); `unexpected_transfer` tags every put with the previous
    transfer's tag (a stale or reused transfer reference, whose blocks may be another request's by now);
    `incomplete` sends half of every block with that half's checksum (a put cut short, otherwise well formed).
    Decode must refuse those puts and never serve their bytes: through the router no request may answer 200 with
    text other than the single engine's greedy output. The stack runs vLLM's default kv_load_failure_policy (`fail`),
    so every such request must end with an error (a `recompute` decode would answer the single engine's text instead;
    both pass the first check), at the refusal rather than at the 5 s hang timeout (each answer comes sooner than
    HANG_TIMEOUT_SECONDS, and no signal wait timed out), each counted in decode's
    pdpair_kv_transfers_rejected_total under its reason. With the file gone the same prompts are answered with the
    single engine's output again, each moving its KV over the same edge (no new handshake), and decode's /healthz
    stays 200 (a refused transfer leaves no open wait). Prompts are the case's own (decode's prefix cache would
    otherwise serve a prompt an earlier case loaded).
    Cost: 9 completions per case on the module's existing stack (no new engine start), a few seconds on 2 cores."""
    prompts = [f"[{reason}] {prompt}" for prompt in REJECTED_PROMPTS]
    expected = {}
    for prompt in prompts:
        status, single = completion(stack.baseline.url, prompt)
        assert status == 200, single
        expected[prompt] = (tokens(single), single["choices"][0]["text"])
    ok_before, rejected_before = ok_transfers(stack), rejected(stack, reason)
    timeouts_before = metric(stack.decode_metrics, "pdpair_signal_wait_timeouts_total")
    handshakes_before = _handshakes(stack, "ok")
    refusal_line = f"failed: a put of it was refused on arrival ({reason})"
    refusals_logged = stack.decode.log().count(refusal_line)

    stack.corrupt_puts_knob.write_text(reason)
    try:
        answers = {}
        for prompt in prompts:
            started = time.monotonic()
            status, via_pair = completion(stack.router.url, prompt, timeout=60)
            answers[prompt] = (status, via_pair, time.monotonic() - started)
    finally:
        stack.corrupt_puts_knob.unlink()

    # Never silently wrong, whatever the policy: an answer that is not an error is the single engine's.
    for prompt, (status, via_pair, _) in answers.items():
        if status == 200 and not failed_with_an_error(status, via_pair):
            assert (tokens(via_pair), via_pair["choices"][0]["text"]) == expected[prompt], \
                f"a 200 with other text than the single engine's for {prompt[:40]!r}: {json.dumps(via_pair)[:300]}"
    # kv_load_failure_policy=fail: each ends with an error, at the refusal, not at the deadline.
    for prompt, (status, via_pair, elapsed) in answers.items():
        assert failed_with_an_error(status, via_pair), \
            f"{prompt[:40]!r}: status {status} after {elapsed:.1f}s: {json.dumps(via_pair)[:500]}"
        assert elapsed < HANG_TIMEOUT_SECONDS, f"{prompt[:40]!r} failed after {elapsed:.1f}s, not at the refusal"
    assert metric(stack.decode_metrics, "pdpair_signal_wait_timeouts_total") == timeouts_before
    assert ok_transfers(stack) == ok_before, "a load with damaged puts was counted ok"
    assert rejected(stack, reason) == rejected_before + len(prompts)
    assert stack.decode.log().count(refusal_line) == refusals_logged + len(prompts), stack.decode.log()[-3000:]
    assert "corrupts every put on the way" in stack.prefill.log()

    # The knob is off: the same prompts (decode never cached their refused blocks) come back right, over the same edge.
    for prompt in prompts:
        status, via_pair = completion(stack.router.url, prompt)
        assert status == 200, via_pair
        assert (tokens(via_pair), via_pair["choices"][0]["text"]) == expected[prompt], f"prompt {prompt[:40]!r}"
    assert ok_transfers(stack) == ok_before + len(prompts), "every answer must have moved its KV again"
    assert rejected(stack, reason) == rejected_before + len(prompts)
    assert _handshakes(stack, "ok") == handshakes_before, "the edge was replaced instead of serving on"
    status, body = http_get(stack.decode_metrics + "/healthz")
    assert status == 200, body[:500]


def test_decode_computes_from_the_transferred_kv(stack):
    """Not a transfer fault, and not a guarantee: a control that the pair's answers are computed from the KV that
    moved (so the equality test above is not passing because decode recomputes the prompt, and the corrupted-puts
    test's errors come from the checks). Decode's TEST ONLY corrupt-KV knob overwrites every received block with one
    fixed byte (deterministic, finite values) AFTER the load passed every check, in decode's own memory, where no
    transfer check can see it: a load pulls every block of its prompt (the partial last one too), so every prompt's
    first decoded token is computed over the overwritten KV, and all outputs change, and so does the first token's
    log-probability. A
    corruption on the way is refused instead (test_corrupted_puts_fail_the_request_never_change_its_text). Its prompts
    are its own: the overwritten blocks stay in decode's prefix cache. Cost: 8 completions on the existing stack."""
    expected = {}
    for prompt in CORRUPT_PROMPTS:
        status, single = completion(stack.baseline.url, prompt, logprobs=1)
        assert status == 200, single
        expected[prompt] = (tokens(single), first_token_logprob(single))
    stack.corrupt_knob.write_text("1")
    try:
        observed = {}
        for prompt in CORRUPT_PROMPTS:
            status, via_pair = completion(stack.router.url, prompt, logprobs=1)
            assert status == 200, via_pair
            observed[prompt] = (tokens(via_pair), first_token_logprob(via_pair))
    finally:
        stack.corrupt_knob.unlink()
    assert stack.decode.log().count("corrupting the received KV") >= len(CORRUPT_PROMPTS)
    unchanged = [p[:30] for p in CORRUPT_PROMPTS if observed[p][0] == expected[p][0]]
    assert not unchanged, f"overwriting the transferred KV must change decode's output; unchanged for {unchanged}"
    same_logprob = [
        (p[:30], expected[p][1], observed[p][1]) for p in CORRUPT_PROMPTS if abs(observed[p][1] - expected[p][1]) < 1e-4
    ]
    assert not same_logprob, f"the first decoded token's logprob did not change: {same_logprob}"


# test_kv_transfer_params_that_are_not_this_prompts_are_computed_locally: one prompt per case (decode's prefix cache
# would otherwise serve a prompt an earlier case computed).
TAGGED_PROMPT = "Prefill tags the reference to the KV it computed for exactly this prompt. " * 3
FOREIGN_PARAMS_PROMPTS = {
    "another_prompt": "A different prompt carrying the first prompt's reference must not get its KV. " * 3,
    "edited_reference": "Counts edited in the reference do not make its KV this prompt's own. " * 3,
    "unknown_request": "An unknown request id on decode is recomputed, never pulled. " * 3,
    "untagged": "Params without a tag are a client's own, not prefill's. " * 3,
    "forged_tag": "A forged tag is as good as none at all, here or anywhere. " * 3,
}


def test_kv_transfer_params_that_are_not_this_prompts_are_computed_locally(stack):
    """vLLM's NIXL path answered HTTP 200 with wrong text when decode was sent kv_transfer_params that did not belong
    to the prompt (vllm-project/vllm#52234: out-of-range block ids, a consumed reference reused, a stale reference
    after prefill reused its blocks). Here decode is driven directly, with the pair's API key as the router does,
    with the real params of a prompt prefill still holds (prefill's own answer to the router's prefill request): on
    another prompt; with the reference edited (its token and block counts grown); with an unknown
    request id; without the tag; with a forged tag. The tag (`remote_kv_tag`, metadata.kv_tag) does not verify
    against any of those prompts, so decode computes each itself: every answer is the single engine's text, no Pull
    is sent (no transfer counted, ok or error), and decode logs each. Then the same params on their own prompt load
    the held KV (one ok transfer, the single engine's text). Reused once more on that prompt (the reference is
    consumed, its blocks freed and maybe another request's by now), decode's Pull finds nothing held: an error
    within the parked Pull's deadline (half the hang timeout: 2.5 s), or the single engine's text; never other text;
    and no signal wait timed out, so decode's /healthz stays 200 (a replayed reference must not get the pair judged
    hung and restarted).
    Cost: 14 completions on the module's existing stack (no new engine start), about 10 s on 2 cores."""
    expected = {}
    for prompt in [TAGGED_PROMPT, *FOREIGN_PARAMS_PROMPTS.values()]:
        status, single = completion(stack.baseline.url, prompt)
        assert status == 200, single
        expected[prompt] = (tokens(single), single["choices"][0]["text"])
    status, answer = completion(stack.prefill.url, TAGGED_PROMPT, max_tokens=1,
                                kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    assert isinstance(params.get("remote_kv_tag"), str), params
    forged = {
        "another_prompt": params,
        "edited_reference": {**params, "remote_num_tokens": params["remote_num_tokens"] + 5,
                             "remote_num_blocks": params["remote_num_blocks"] + 1},
        "unknown_request": {**params, "remote_request_id": "cmpl-unknown-0-0"},
        "untagged": {k: v for k, v in params.items() if k != "remote_kv_tag"},
        "forged_tag": {**params, "remote_kv_tag": "0" * 64},
    }
    transfers = lambda: (ok_transfers(stack),  # noqa: E731
                         metric(stack.decode_metrics, "pdpair_kv_transfers_total", {"outcome": "error"}))
    before = transfers()
    warned = stack.decode.log().count("do not verify against its own prompt")
    for case, prompt in FOREIGN_PARAMS_PROMPTS.items():
        status, direct = completion(stack.decode.url, prompt, kv_transfer_params=dict(forged[case]))
        assert status == 200, (case, direct)
        assert (tokens(direct), direct["choices"][0]["text"]) == expected[prompt], \
            f"{case}: decode answered other text than the single engine's: {json.dumps(direct)[:300]}"
    assert transfers() == before, "decode pulled KV for params that were not its prompt's"
    assert stack.decode.log().count("do not verify against its own prompt") == warned + len(FOREIGN_PARAMS_PROMPTS)

    status, direct = completion(stack.decode.url, TAGGED_PROMPT, kv_transfer_params=dict(params))
    assert status == 200, direct
    assert (tokens(direct), direct["choices"][0]["text"]) == expected[TAGGED_PROMPT]
    assert transfers() == (before[0] + 1, before[1]), "the prompt's own params must load its KV"

    timeouts = metric(stack.decode_metrics, "pdpair_signal_wait_timeouts_total")
    started = time.monotonic()
    status, again = completion(stack.decode.url, TAGGED_PROMPT, kv_transfer_params=dict(params), timeout=60)
    elapsed = time.monotonic() - started
    if not failed_with_an_error(status, again):
        assert status == 200 and (tokens(again), again["choices"][0]["text"]) == expected[TAGGED_PROMPT], \
            f"a consumed reference answered other text: status {status}: {json.dumps(again)[:300]}"
    # Prefill answers the Pull it holds nothing for (PullFailed at deadlines.PARKED_PULL_SHARE of the hang timeout)
    # before decode's own wait ends: a clean failure, not a timeout that would leave decode's pod judged hung.
    assert elapsed < HANG_TIMEOUT_SECONDS + 5, f"the consumed reference took {elapsed:.1f}s"
    assert metric(stack.decode_metrics, "pdpair_signal_wait_timeouts_total") == timeouts
    assert http_get(stack.decode_metrics + "/healthz")[0] == 200, "a replayed reference left decode judged hung"


def _side_channel_port(stack) -> int:
    return int(stack.decode.env[contract.ENV_LISTEN_PORT_BASE])


def _handshakes(stack, outcome: str) -> float:
    """Decode's pdpair_handshakes_total{outcome}; 0 while no such handshake happened (no series yet)."""
    try:
        return metric(stack.decode_metrics, "pdpair_handshakes_total", {"outcome": outcome})
    except AssertionError:
        return 0.0


def _decode_hash(stack) -> bytes:
    """Decode's compatibility hash, as only a holder of the pair's key can learn it: an authenticated Hello under a
    wrong hash is refused naming both."""
    with Stranger(_side_channel_port(stack), timeout=10) as keyholder:
        answers, _ = keyholder.hello(b"0" * 16, TEST_KEY_BYTES, generation=GENERATION, instance="keyholder")
    match = re.search(r"!= local ([0-9a-f]{16})", answers[-1].reason)
    assert match, answers
    return match.group(1).encode()


def test_side_channel_refusals_name_neither_hash_nor_generation(stack):
    """A process that is not one of the pair's pods sends Hellos with a wrong hash and with a wrong generation
    (under decode's own hash too), without the key: each gets a Challenge and `not accepted`, under its own hash
    frame; no byte decode sent names its hash or its generation; the pair keeps serving. About 2 s."""
    decode_hash = _decode_hash(stack)
    before = _handshakes(stack, "unauthenticated")
    for hash_frame, generation in ((b"0" * 16, GENERATION), (decode_hash, GENERATION + 1), (b"f" * 16, 0)):
        with Stranger(_side_channel_port(stack), timeout=10) as stranger:
            answers, _ = stranger.hello(hash_frame, None, generation=generation, instance="outsider")
            stranger.send([hash_frame, b"\x81\xa4type\xa4pull"])  # and a Pull that decodes to nothing
            extra = stranger.recv(5)
        assert isinstance(answers[-1], Refused) and answers[-1].reason == NOT_ACCEPTED, answers
        # Every frame decode sends a stranger starts with the stranger's OWN hash frame (echoed; the second case sends
        # decode's hash itself, having learnt it elsewhere): only the frames after it are decode's words.
        assert not extra or extra[0] == hash_frame, extra
        for text in (answers[-1].reason, repr(extra[1:] if extra else extra)):
            assert decode_hash.decode() not in text and f"={GENERATION}" not in text and "has 7" not in text
    assert _handshakes(stack, "unauthenticated") == before + 3
    status, payload = completion(stack.router.url, "Refused strangers change nothing.")
    assert status == 200, payload


def test_side_channel_bad_uid_leaves_the_pair_serving(stack):
    """The listener kill: a Hello with a tcp token of -1 (and a port out of range), from a stranger without the key
    and from a holder of the key. The first is `not accepted`, the second refused naming the uid; the listener still
    challenges a Hello and completions through the router still move their KV. About 3 s."""
    decode_hash = _decode_hash(stack)
    for uid in (b'{"host": "127.0.0.1", "port": 20000, "token": -1}', b'{"host": "127.0.0.1", "port": 70000, "token": 1}'):
        for key in (None, TEST_KEY_BYTES):
            with Stranger(_side_channel_port(stack), timeout=10) as stranger:
                answers, _ = stranger.hello(decode_hash, key, generation=GENERATION, unique_id=uid, instance="bad-uid")
            assert isinstance(answers[-1], Refused), answers
            assert answers[-1].reason == NOT_ACCEPTED if key is None else "malformed unique id" in answers[-1].reason
    assert answers_hello(_side_channel_port(stack), decode_hash)
    before = ok_transfers(stack)
    status, payload = completion(stack.router.url, "The listener outlived a bad uid.")
    assert status == 200, payload
    assert ok_transfers(stack) == before + 1


def test_side_channel_hijack_without_the_key_leaves_the_edge_serving(stack):
    """A Hello with decode's hash and generation naming the paired prefill's instance, with a proof made without the
    key: refused, no new handshake on decode, and the next completion still moves its KV over the same edge.
    About 2 s."""
    decode_hash = _decode_hash(stack)
    ok_before = _handshakes(stack, "ok")
    for _ in range(3):
        with Stranger(_side_channel_port(stack), timeout=10) as stranger:
            uid = b'{"host": "127.0.0.1", "port": 9, "token": 5}'
            answers, _ = stranger.hello(decode_hash, None, generation=GENERATION, unique_id=uid,
                                        instance=PREFILL_INSTANCE)
        assert isinstance(answers[-1], Refused) and answers[-1].reason == NOT_ACCEPTED, answers
    before = ok_transfers(stack)
    status, payload = completion(stack.router.url, "The edge still belongs to its prefill.")
    assert status == 200, payload
    assert ok_transfers(stack) == before + 1
    assert _handshakes(stack, "ok") == ok_before


# The steady client of the side-channel attack test: requests per phase, and the bound on the median latency during
# the attack over the one without it (the test's docstring says why the median, not the p99).
STEADY_REQUESTS = 30
STEADY_MEDIAN_RATIO = 2.0
ATTACK_READY_SECONDS = 60.0


def _steady_client(stack, phase: str) -> list[float]:
    """STEADY_REQUESTS completions through the router, one after another, each a fresh prompt of the same length
    (decode's prefix cache holds none of them: each moves its KV); the seconds each took. Any failure fails."""
    latencies = []
    before = ok_transfers(stack)
    for i in range(STEADY_REQUESTS):
        prompt = f"{phase} {i:03d}: a steady client asks while the side channel is probed. " * 2
        started = time.monotonic()
        status, payload = completion(stack.router.url, prompt, max_tokens=8, timeout=60)
        latencies.append(time.monotonic() - started)
        assert status == 200 and len(tokens(payload)) == 8, f"{phase} request {i}: {status} {json.dumps(payload)[:300]}"
    assert ok_transfers(stack) == before + STEADY_REQUESTS, "every request must have moved its KV over the edge"
    return latencies


def _p99(latencies: list[float]) -> float:
    return statistics.quantiles(latencies, n=100, method="inclusive")[98]


def test_side_channel_attack_does_not_slow_the_serving_edge(stack):
    """A process that is not one of the pair's pods (`side_channel_support.attack_side_channel`, run in a process
    of its own) attacks decode's side channel while a steady client sends completions through the router:
    strangers without the key send Proof-less Hellos (50/s from 80 connections, more than decode keeps challenges
    for, so they are evicted), Hellos with a Proof made without the key (5/s), and Hellos they never read the answers
    of (300/s, from a socket with the least receive room: decode's queue for it fills and its answers are dropped);
    and, the worst case, a holder of the pair's key (the test uses the pair's own key to play a COMPROMISED peer: an
    outsider cannot get this far) keeps decode's MAX_CONCURRENT_HANDSHAKES handshakes stalled at all times, their tcp
    uids pointing at a listener that accepts and never answers (each stalls its handshake thread until its deadline,
    min(HANDSHAKE_SECONDS, hang timeout) = 5 s here, then is refused; one more is refused busy; each goes again).
    The client sees no failure (every request moves its KV over the one real edge), and its median latency during
    the attack stays within 2x its median without the attack in the same run (STEADY_REQUESTS, 30, just before
    and 30 just after it; the larger of the two is the baseline, so a change of the box's load between phases is not counted
    against the attack); afterwards no edge was replaced and the listener answers. The p99 is printed, not
    asserted: of 30 samples it is the slowest one, which the box's load sets more than the attack does.

    The margin: what the attack may cost the client is CPU on a 2-core box (the attacker's own process, and decode's
    worker handling about 350 Hellos a second), a ratio a little above 1. The stalls this test is there for (a
    handshake on the loop thread, a send waiting SNDTIMEO for a stranger's full queue) hold a Pull for 5 s at a time,
    back to back while the attack goes on: its request waits out the hang timeout (5 s) and fails, which the
    no-failure assertion catches whatever the ratio. The ratio catches a lesser slow-down that every request pays (a
    stall of a second a Pull is 2-3x these medians), and 2 leaves room for a shared box: the medians before and after
    the attack, with no attack in either, differed by 1.33x in a CI run at load 18 (2026-12-07: 0.607 s and 0.809 s,
    the attack's 1.217 s a ratio of 1.50 against the bound of 1.5 it had then); measured 1.46, 0.98, 0.58, 2.39
    and 1.01 in five runs at load average 8-22 (other sessions' control planes and unit tiers beside it); the 2.39
    run failed with an image
    build (buildah, 110 % CPU) beside it when it ended (p99 2.2 s before, 5.2 s during; the box stalled on CPU 207 s
    of its 251 s), and in the others the p99 moved between 1.9 and 4.9 s from one phase to the next with or
    without the attack (those runs measured the baseline before the attack only); a cold CI run (2026-12-06, load
    20) measured a p99 ratio of 1.52. The median moves far less with the load and still shows a slow-down that
    every request pays. 90-150 s at that load (3 x 30 completions of 0.7-5 s each, the attack's start, its last
    stalled handshakes ending; 150-250 s with 50 a phase before 2026-12-07); vLLM cold starts: 0 (the module's stack)."""
    import subprocess
    import sys
    from pathlib import Path

    from pdpair.connector.decode_pairing import MAX_CONCURRENT_HANDSHAKES
    from tests.side_channel_support import TEST_SIDE_CHANNEL_KEY

    decode_hash = _decode_hash(stack)
    counts_before = {o: _handshakes(stack, o) for o in ("ok", "error", "busy", "unauthenticated")}
    before = _steady_client(stack, "before")
    args = {"port": _side_channel_port(stack), "decode_hash": decode_hash.decode(), "generation": GENERATION,
            "key": TEST_SIDE_CHANNEL_KEY, "handshakes": MAX_CONCURRENT_HANDSHAKES + 1}
    root = Path(__file__).resolve().parents[2]
    attacker = subprocess.Popen([sys.executable, "-m", "tests.side_channel_support", json.dumps(args)], cwd=root,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        import select

        assert select.select([attacker.stdout], [], [], ATTACK_READY_SECONDS)[0], "the attack did not start in time"
        assert attacker.stdout.readline().strip() == "ready", "the attack did not get under way"
        during = _steady_client(stack, "during")
        attacker.stdin.write("stop\n")
        attacker.stdin.flush()
        assert select.select([attacker.stdout], [], [], 60)[0], "the attack did not end"
        counts = json.loads(attacker.stdout.readline())
    finally:
        if attacker.poll() is None:
            attacker.kill()
        attacker.wait(10)
    # The baseline is measured on both sides of the attack, and the larger median counts: on a shared box the load
    # beside the test moves between phases (one run's p99 went 2.2 -> 5.2 s as an image build started beside it,
    # with or without an attack), and a drift that lasts shows in the phase after as much as in the one during.
    after = _steady_client(stack, "after")
    baseline = max(statistics.median(before), statistics.median(after))
    ratio = statistics.median(during) / baseline
    seen = (f"steady client p99 before {_p99(before):.3f}s, during {_p99(during):.3f}s, after {_p99(after):.3f}s, "
            f"median {statistics.median(before):.3f}s / {statistics.median(during):.3f}s / "
            f"{statistics.median(after):.3f}s, median ratio {ratio:.2f}; attack {counts}")
    print("\n" + seen)
    assert not counts["errors"], counts
    assert counts["keyholder_stalled_then_refused"] >= MAX_CONCURRENT_HANDSHAKES and counts["keyholder_busy"] >= 1
    assert counts["silent_accepted"] >= MAX_CONCURRENT_HANDSHAKES, "decode never dialled the silent listener"
    assert counts["stall_seconds_min"] >= 4.0, "the stalled handshakes did not last until their deadline"
    assert _handshakes(stack, "error") >= counts_before["error"] + counts["keyholder_stalled_then_refused"]
    assert _handshakes(stack, "unauthenticated") >= counts_before["unauthenticated"] + counts["wrong_proofs_refused"]
    assert _handshakes(stack, "busy") > counts_before["busy"]
    assert _handshakes(stack, "ok") == counts_before["ok"], "an attacker's handshake must never pair"
    assert answers_hello(_side_channel_port(stack), decode_hash)
    assert ratio <= STEADY_MEDIAN_RATIO, f"the median during the attack is {ratio:.2f}x the one without it: {seen}"


def test_dropped_signals_fail_the_request_within_the_deadline(stack):
    timeouts_before = metric(stack.decode_metrics, "pdpair_signal_wait_timeouts_total")
    status, _ = http_get(stack.decode_metrics + "/healthz")
    assert status == 200
    stack.drop_knob.write_text("2")  # the native sender omits every 2nd signal
    try:
        started = time.monotonic()
        status, payload = completion(stack.router.url, "This transfer loses half of its signals. " * 3)
        elapsed = time.monotonic() - started
    finally:
        stack.drop_knob.unlink()
    # vLLM's kv_load_failure_policy=fail ends the request with an error instead of hanging.
    failed = status >= 500 or payload.get("choices", [{}])[0].get("finish_reason") == "error"
    assert failed, f"status {status}: {json.dumps(payload)[:500]}"
    assert HANG_TIMEOUT_SECONDS * 0.8 <= elapsed <= HANG_TIMEOUT_SECONDS + 15, elapsed
    log = stack.decode.log()
    assert re.search(r"timed out after 5\.0s .*expected \d+ signals on slot \d+, received \d+, missing \d+", log), log[-3000:]

    assert metric(stack.decode_metrics, "pdpair_signal_deficit") > 0
    assert metric(stack.decode_metrics, "pdpair_signal_wait_timeouts_total") == timeouts_before + 1
    status, body = http_get(stack.decode_metrics + "/healthz")
    health = json.loads(body)
    assert status == 503, health
    assert health["transfer"]["expected"] > health["transfer"]["received"]

    # The engine is still responsive: its own health and a request it computes locally.
    status, _ = http_get(stack.decode.url + "/health")
    assert status == 200
    started = time.monotonic()
    status, payload = completion(stack.decode.url, "Computed locally after the failure.")
    assert status == 200 and len(tokens(payload)) == 12
    assert time.monotonic() - started < 30
