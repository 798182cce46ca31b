"""Selective disaggregation (pdpair.router.split): the prompt-length estimate, the split-or-local rule, the threshold
it learns from measured times, and the router sending a short prompt to decode alone (real aiohttp servers standing
in for the engines). Cost: about 3 s, no engine."""

from __future__ import annotations

import math
import random

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdpair.router import split
from pdpair.router.__main__ import build_parser, config_from_args
from pdpair.router.app import make_app
from pdpair.router.config import RouterConfig
from pdpair.router.split import EXPLORE_EVERY, EXPLORE_EVERY_COLD, LOCAL, MIN_SAMPLES, SPLIT, SplitPolicy, prompt_tokens
from tests.router_support import PARAMS, Engine
from tests.router_support import engine_server as _engine_server
from tests.router_support import serve as _serve

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=20)


def test_the_estimate_counts_token_ids_and_text_bytes():
    assert prompt_tokens({"prompt": [5, 6, 7]}, chat=False) == 3
    assert prompt_tokens({"prompt": "abcdefgh"}, chat=False) == 8 // split.BYTES_PER_TOKEN
    assert prompt_tokens({"prompt": "é"}, chat=False) == 1  # two UTF-8 bytes, rounded up
    assert prompt_tokens({"prompt": ["ab", "abcdefghijkl"]}, chat=False) == 12 // split.BYTES_PER_TOKEN  # the longest
    assert prompt_tokens({"prompt": [[1, 2], [1, 2, 3, 4, 5]]}, chat=False) == 5
    chat = {"messages": [{"role": "system", "content": "a" * 40},
                         {"role": "user", "content": [{"type": "text", "text": "b" * 20}, {"type": "image_url"}]}]}
    assert prompt_tokens(chat, chat=True) == 15
    for unknown in ({}, {"prompt": 7}, {"prompt": []}, {"prompt": [1, "a"]}, {"prompt": [True, False]}):
        assert prompt_tokens(unknown, chat=False) is None, unknown
    assert prompt_tokens({"messages": "hi"}, chat=True) is None


@given(body=st.dictionaries(st.sampled_from(["prompt", "messages", "x"]), JSON, max_size=3), chat=st.booleans())
def test_the_estimate_of_any_body_is_a_count_or_none_and_never_raises(body, chat):
    """Any JSON object a client sends. Runs the hypothesis profile's count (tests/README.md)."""
    tokens = prompt_tokens(body, chat)
    assert tokens is None or (isinstance(tokens, int) and tokens >= 0)


def test_off_splits_every_request_and_learns_nothing():
    policy = SplitPolicy(0)
    assert not policy.enabled
    for tokens in (None, 0, 1, 10**6):
        assert policy.decide(tokens, measured=True) == SPLIT
    policy.observe(5, LOCAL, 0.001)
    assert policy.threshold == 0 and policy.means() == {SPLIT: {}, LOCAL: {}}
    assert policy.decisions == {SPLIT: 4, LOCAL: 0}


def test_below_the_threshold_is_local_and_an_unknown_length_is_split():
    policy = SplitPolicy(100)
    assert policy.decide(99, measured=False) == LOCAL
    assert policy.decide(100, measured=False) == SPLIT
    assert policy.decide(None, measured=True) == SPLIT
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="--local-prompt-tokens"):
            SplitPolicy(bad)


def test_exploration_is_one_request_in_explore_every_of_a_bucket_and_only_measured_ones():
    """The other way of a bucket is explored one measured request in EXPLORE_EVERY_COLD until it has MIN_SAMPLES
    samples there, then one in EXPLORE_EVERY; a request that is not measured never explores."""
    policy = SplitPolicy(100)
    modes = []
    for _ in range(EXPLORE_EVERY_COLD * MIN_SAMPLES + EXPLORE_EVERY * 4):
        mode = policy.decide(10, measured=True)
        policy.observe(10, mode, 0.01 if mode == LOCAL else 0.02)  # local faster, as the threshold has it
        modes.append(mode)
    cold = modes[:EXPLORE_EVERY_COLD * MIN_SAMPLES]
    assert cold.count(SPLIT) == MIN_SAMPLES and modes[len(cold):].count(SPLIT) == 4 and policy.threshold == 100
    assert all(policy.decide(10, measured=False) == LOCAL for _ in range(EXPLORE_EVERY * 4))


def test_a_fixed_threshold_never_explores_and_never_moves():
    """--no-learn-split-threshold: every measured request goes its threshold's way, and measurements that would move
    a learning policy (split far faster at every length) leave it where it started."""
    learning, fixed = SplitPolicy(100), SplitPolicy(100, learn=False)
    for policy in (learning, fixed):
        modes = [policy.decide(10, measured=True) for _ in range(EXPLORE_EVERY * 4)]
        # no samples (the explored requests failed, say): the fast rate stops after 2 * MIN_SAMPLES explorations
        cold = EXPLORE_EVERY_COLD * 2 * MIN_SAMPLES
        assert modes.count(SPLIT) == (2 * MIN_SAMPLES + (EXPLORE_EVERY * 4 - cold) // EXPLORE_EVERY
                                      if policy.learn else 0)
        for tokens in (2, 50, 300, 5000):
            for mode in (SPLIT, LOCAL):
                for _ in range(MIN_SAMPLES):
                    policy.observe(tokens, mode, 0.001 if mode == SPLIT else 1.0)
    assert learning.threshold < 100 and fixed.threshold == 100 and fixed.means() == {SPLIT: {}, LOCAL: {}}
    never = SplitPolicy(2**20, learn=False)  # above every prompt: a router that never splits
    assert {never.decide(t, measured=True) for t in (1, 500, 100_000)} == {LOCAL}


def test_samples_of_one_way_only_never_move_the_threshold():
    policy = SplitPolicy(100)
    for tokens in (2, 50, 300, 5000):
        for _ in range(10):
            policy.observe(tokens, SPLIT, 0.01 * tokens)
    assert policy.threshold == 100


def run_with_costs(policy: SplitPolicy, crossover: float, requests: int, seed: int) -> list[tuple[int, str]]:
    """Streamed requests of log-uniform lengths 1..2**16 whose time to the first chunk is, with 10 % noise,
    `local`: 1 ms per token (a busy decode); `split`: a fixed cost (the second API server, the transfer) of half the
    crossover in ms + 0.5 ms per token: split is slower below `crossover` tokens and faster above it. Returns (tokens,
    mode) of each."""
    rng = random.Random(seed)
    seen = []
    for _ in range(requests):
        tokens = int(2 ** rng.uniform(0, 16))
        mode = policy.decide(tokens, measured=True)
        cost = 0.001 * tokens if mode == LOCAL else 0.0005 * crossover + 0.0005 * tokens
        policy.observe(tokens, mode, cost * rng.uniform(0.9, 1.1))
        seen.append((tokens, mode))
    return seen


@pytest.mark.parametrize("start", [1, 64, 16384])
@pytest.mark.parametrize("crossover", [100, 700, 3000])
def test_the_threshold_converges_to_the_bucket_of_the_crossover_from_any_start(start, crossover):
    """From a threshold far below, near or far above where split starts to pay, 4000 measured requests (seeded) bring
    it to one of the two power-of-two edges around that length (the bucket resolution); after that, requests far
    from it (where the ways differ by 30 % or more) go their faster way but for the exploration share."""
    policy = SplitPolicy(start)
    seen = run_with_costs(policy, crossover, 4000, seed=start * 7 + crossover)
    low = 2 ** math.floor(math.log2(crossover))
    assert policy.threshold in (low, low * 2), (policy.threshold, policy.means())
    late = seen[2000:]
    for far, faster in (([t for t, m in late if t < low / 4], LOCAL), ([t for t, m in late if t >= low * 8], SPLIT)):
        assert far, "the trace must reach both sides"
    wrong_short = sum(1 for t, m in late if t < low / 4 and m != LOCAL)
    wrong_long = sum(1 for t, m in late if t >= low * 8 and m != SPLIT)
    short = sum(1 for t, _ in late if t < low / 4)
    long_ = sum(1 for t, _ in late if t >= low * 8)
    # exploration: at most one in EXPLORE_EVERY per bucket, plus one per bucket for the rounding
    assert wrong_short <= short / EXPLORE_EVERY + split.BUCKETS, (wrong_short, short)
    assert wrong_long <= long_ / EXPLORE_EVERY + split.BUCKETS, (wrong_long, long_)


def test_the_same_measurements_give_the_same_threshold():
    a, b = SplitPolicy(64), SplitPolicy(64)
    assert run_with_costs(a, 500, 1000, seed=3) == run_with_costs(b, 500, 1000, seed=3)
    assert a.threshold == b.threshold and a.means() == b.means()


def test_the_flag_is_checked_at_start():
    args = build_parser().parse_args(["--port", "0", "--prefill", "http://p:1", "--decode", "http://d:1",
                                      "--local-prompt-tokens", "256"])
    assert config_from_args(args, {}).local_prompt_tokens == 256
    assert config_from_args(args, {}).learn_split_threshold is True
    assert config_from_args(build_parser().parse_args(["--port", "0", "--no-learn-split-threshold"]),
                            {}).learn_split_threshold is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--port", "0", "--local-prompt-tokens", "-1"])
    with pytest.raises(ValueError, match="--local-prompt-tokens"):
        make_app(RouterConfig(("http://p:1",), ("http://d:1",), local_prompt_tokens=-5))


@pytest.mark.asyncio
async def test_a_short_prompt_goes_to_decode_alone_and_a_long_one_is_split():
    prefill, decode = Engine("prefill"), Engine("decode")
    p_runner, p_url = await _engine_server(prefill)
    d_runner, d_url = await _engine_server(decode)
    r_runner, router = await _serve(make_app(RouterConfig((p_url,), (d_url,), local_prompt_tokens=100)))
    try:
        async with aiohttp.ClientSession() as client:
            # a client's own kv_transfer_params never reach decode
            short = {"prompt": "short", "max_tokens": 3, "kv_transfer_params": {"do_remote_prefill": True}}
            async with client.post(router + "/v1/completions", json=short) as resp:
                assert resp.status == 200 and (await resp.json())["id"] == "decode-answer"
            assert prefill.received == []
            (_, d_body, _), = decode.received
            assert d_body["prompt"] == "short" and "kv_transfer_params" not in d_body
            long_ = {"prompt": "x" * 4 * 200, "max_tokens": 3}
            async with client.post(router + "/v1/completions", json=long_) as resp:
                assert resp.status == 200
            assert len(prefill.received) == 1 and decode.received[1][1]["kv_transfer_params"] == PARAMS
            async with client.get(router + "/metrics") as resp:
                assert resp.status == 200
                text = await resp.text()
        assert 'pdpair_router_requests_total{mode="local"} 1.0' in text
        assert 'pdpair_router_requests_total{mode="split"} 1.0' in text
        assert "pdpair_router_local_prompt_tokens 100.0" in text
    finally:
        for runner in (r_runner, p_runner, d_runner):
            await runner.cleanup()


@pytest.mark.asyncio
async def test_a_streamed_local_answer_is_measured_and_a_forced_route_is_split():
    prefill, decode = Engine("prefill"), Engine("decode")
    p_runner, p_url = await _engine_server(prefill)
    d_runner, d_url = await _engine_server(decode)
    app = make_app(RouterConfig((p_url,), (d_url,), local_prompt_tokens=100, debug_routing=True))
    r_runner, router = await _serve(app)
    try:
        async with aiohttp.ClientSession() as client:
            body = {"prompt": "short", "max_tokens": 3, "stream": True}
            async with client.post(router + "/v1/completions", json=body) as resp:
                assert await resp.read() == b"".join(decode.stream_chunks)
            async with client.post(router + "/v1/completions", json=body, headers={"X-Pdpair-Route": "0,0"}) as resp:
                assert resp.status == 200
        from pdpair.router.pools import ROUTER
        means = app[ROUTER].split.means()
        assert list(means[LOCAL]) == [split.bucket(2)] and means[LOCAL][split.bucket(2)][1] == 1
        assert means[SPLIT] == {}  # the forced request is split but not measured as a choice
        assert len(prefill.received) == 1
    finally:
        for runner in (r_runner, p_runner, d_runner):
            await runner.cleanup()
