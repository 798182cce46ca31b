"""Prefix affinity (pdpair.router.prefix_index and Pool.choose's `affinity`): chained chunk hashes, the bounded
per-instance memory, and the choice that prefers the prefill a prompt's prefix was sent to without ever letting one
instance run more than PREFIX_LOAD_SLACK + 1 requests ahead of the least loaded; with selective disaggregation, only
what the chosen decode does not hold counts against the threshold. Cost: about 2 s, no engine (the
property tests: the hypothesis profile's count)."""

from __future__ import annotations

import contextlib

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdpair.router.app import make_app
from pdpair.router.config import RouterConfig
from pdpair.router.pools import ROUTER, Pool
from pdpair.router.prefix_index import CHUNK_BYTES, PREFIX_LOAD_SLACK, PrefixIndex, prompt_hashes
from tests.router_support import Engine
from tests.router_support import engine_server as _engine_server
from tests.router_support import serve as _serve

SHARED = "You are a careful assistant. " * 40  # ~1.1 KiB: 9 chunks shared by every prompt below


def test_hashes_chain_so_a_match_is_always_a_prefix():
    a = prompt_hashes({"prompt": SHARED + "first question"}, chat=False)
    b = prompt_hashes({"prompt": SHARED + "another, longer question " * 10}, chat=False)
    shared = len(SHARED.encode()) // CHUNK_BYTES
    assert a[:shared] == b[:shared] and len(a) >= shared
    changed = prompt_hashes({"prompt": "X" + SHARED[1:] + "first question"}, chat=False)
    assert not set(changed) & set(a), "one changed byte in the first chunk changes every hash after it"
    assert prompt_hashes({"prompt": "short"}, chat=False) == []
    assert prompt_hashes({"prompt": list(range(100))}, chat=False) == prompt_hashes({"prompt": list(range(100))}, False)
    chat = {"messages": [{"role": "system", "content": SHARED}, {"role": "user", "content": "hi"}]}
    assert len(prompt_hashes(chat, chat=True)) == shared


@given(body=st.dictionaries(st.sampled_from(["prompt", "messages"]),
                            st.recursive(st.none() | st.integers() | st.text(), lambda c: st.lists(c, max_size=4)
                                         | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=20)),
       chat=st.booleans())
def test_any_body_gives_hashes_or_none_and_never_raises(body, chat):
    assert all(isinstance(h, bytes) and len(h) == 16 for h in prompt_hashes(body, chat))


def test_the_index_matches_leading_chunks_and_forgets_the_oldest_past_its_bound():
    index = PrefixIndex(max_chunks_per_instance=12)
    a = prompt_hashes({"prompt": SHARED + "a" * 300}, chat=False)
    index.record("p0", a)
    assert index.matched("p0", a) == len(a) and index.matched("p1", a) == 0
    other = prompt_hashes({"prompt": "Z" * 600}, chat=False)  # 4 new chunks push the oldest of `a` out
    index.record("p0", other)
    assert index.size("p0") == 12 and index.matched("p0", a) == 0  # its first chunk left: no prefix matches
    index.forget({"p1"})
    assert index.size("p0") == 0


def pool(n: int) -> Pool:
    return Pool("prefill", tuple(f"http://p{i}:1" for i in range(n)), 5.0, clock=lambda: 0.0)


def test_the_choice_prefers_the_instance_holding_the_prefix_within_the_slack():
    p, index = pool(3), PrefixIndex()
    hashes = prompt_hashes({"prompt": SHARED + "q"}, chat=False)
    index.record(p.instances[2].url, hashes)
    affinity = lambda i: index.matched(i.url, hashes)  # noqa: E731
    assert p.choose(affinity=affinity) is p.instances[2]
    with contextlib.ExitStack() as held:
        for _ in range(PREFIX_LOAD_SLACK):
            held.enter_context(p.hold(p.instances[2]))
        assert p.choose(affinity=affinity) is p.instances[2]  # busier by the slack: still the prefix's
        held.enter_context(p.hold(p.instances[2]))
        assert p.choose(affinity=affinity) is not p.instances[2]  # one more: load wins


@given(instances=st.integers(2, 4), prompts=st.lists(st.integers(0, 2), min_size=1, max_size=40),
       releases=st.lists(st.booleans(), min_size=40, max_size=40))
def test_a_hot_prefix_never_sends_a_request_to_an_instance_more_than_the_slack_ahead(instances, prompts, releases):
    """Every prompt shares one of three prefixes; requests stay in flight (some end, as `releases` says). No choice
    goes to an instance more than PREFIX_LOAD_SLACK requests busier than the least loaded, and with nothing ending
    the busiest is never more than PREFIX_LOAD_SLACK + 1 ahead."""
    p, index = pool(instances), PrefixIndex()
    in_flight: list[contextlib.ExitStack] = []
    for prompt, release in zip(prompts, releases):
        hashes = prompt_hashes({"prompt": f"prefix {prompt} " + SHARED}, chat=False)
        chosen = p.choose(affinity=lambda i: index.matched(i.url, hashes))
        assert chosen.outstanding <= min(i.outstanding for i in p.instances) + PREFIX_LOAD_SLACK
        index.record(chosen.url, hashes)
        stack = contextlib.ExitStack()
        stack.enter_context(p.hold(chosen))
        in_flight.append(stack)
        loads = [i.outstanding for i in p.instances]
        if not any(releases):
            assert max(loads) - min(loads) <= PREFIX_LOAD_SLACK + 1, loads
        if release and in_flight:
            in_flight.pop(0).close()


@pytest.mark.asyncio
async def test_the_router_sends_a_shared_prefix_to_one_prefill_and_counts_the_matches():
    engines = [Engine("prefill"), Engine("prefill"), Engine("decode")]
    runners, urls = [], []
    for engine in engines:
        runner, url = await _engine_server(engine)
        runners.append(runner)
        urls.append(url)
    app = make_app(RouterConfig(tuple(urls[:2]), (urls[2],), prefix_affinity=True))
    runner, router = await _serve(app)
    runners.append(runner)
    try:
        async with aiohttp.ClientSession() as client:
            for question in range(6):
                body = {"prompt": SHARED + f"question {question}", "max_tokens": 2}
                async with client.post(router + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
            async with client.get(router + "/metrics") as resp:
                text = await resp.text()
        # sequential requests: every load ties, so the shared prefix keeps them on the first prefill chosen
        assert sorted(len(e.received) for e in engines[:2]) == [0, 6]
        chunks = app[ROUTER].prefix_chunks["prefill"]
        shared = len(SHARED.encode()) // CHUNK_BYTES
        assert chunks["matched"] >= 5 * shared and chunks["routed"] >= 6 * shared
        assert f'pdpair_router_prefix_chunks_total{{outcome="matched",role="prefill"}} {float(chunks["matched"])}' \
            in text
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.mark.asyncio
async def test_a_conversations_next_turn_goes_alone_to_the_decode_holding_its_history():
    """Selective disaggregation with prefix affinity: two prefills, two decodes, two conversations taking turns.
    A first turn (about 290 estimated tokens, none of them held) is split; each next turn (its history plus a short
    new part) goes to the decode that served the history, alone, because only the new part counts against the
    threshold (128); the other conversation's turns go to the other decode (its load was lower when it started).
    Without affinity the same turns would be split: the whole prompt counts. Cost: under 1 s, fake engines."""
    engines = [Engine("prefill"), Engine("prefill"), Engine("decode"), Engine("decode")]
    runners, urls = [], []
    for engine in engines:
        runner, url = await _engine_server(engine)
        runners.append(runner)
        urls.append(url)
    app = make_app(RouterConfig(tuple(urls[:2]), tuple(urls[2:]), prefix_affinity=True, local_prompt_tokens=128,
                                concurrent_legs=False))
    runner, router = await _serve(app)
    runners.append(runner)
    histories = {c: f"Conversation {c}. " + SHARED for c in (0, 1)}
    try:
        async with aiohttp.ClientSession() as client:
            for turn in range(3):
                for c in (0, 1):
                    histories[c] += f" User turn {turn}: a short new question?"
                    body = {"prompt": histories[c], "max_tokens": 2}
                    async with client.post(router + "/v1/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                    histories[c] += " Assistant: an answer."
        decisions = app[ROUTER].split.decisions
        assert decisions == {"split": 2, "local": 4}, decisions
        prefilled = [b["prompt"][:15] for e in engines[:2] for _, b, _ in e.received]
        assert sorted(prefilled) == ["Conversation 0.", "Conversation 1."]  # only the first turns
        for decode in engines[2:]:
            firsts = {b["prompt"][:15] for _, b, _ in decode.received}
            assert len(decode.received) == 3 and len(firsts) == 1, [b["prompt"][:15] for _, b, _ in decode.received]
            local = [b for _, b, _ in decode.received if "kv_transfer_params" not in b]
            assert len(local) == 2  # the next turns, computed where the history is
        chunks = app[ROUTER].prefix_chunks["decode"]
        assert chunks["matched"] >= 4 * (len(SHARED.encode()) // CHUNK_BYTES)
    finally:
        for runner in runners:
            await runner.cleanup()
