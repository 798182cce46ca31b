"""Precise prefix affinity from the engines' KV events: the index (router/kv_blocks.py) built from vLLM's own event
classes, and the subscriber (router/kv_subscriber.py) following vLLM's own ZmqEventPublisher over TCP on this host,
through lost batches (gap, replay), a restarted engine and a replay buffer that moved on (resync).

Cost: about 10 s of vLLM import (its kv_events module) and 5-10 s of publishing; no engine."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import msgspec
import pytest

from pdpair.router.kv_blocks import ROOT, KvBlockIndex, chain, decode_batch, prompt_chain
from pdpair.router.kv_subscriber import KvEventSubscriber, replay_endpoint
from devcluster.ports import free_port

vllm_events = pytest.importorskip("vllm.distributed.kv_events")

BLOCK = 4


def stored(hashes, parent, tokens, medium="GPU", block_size=BLOCK):
    return vllm_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                                   block_size=block_size, lora_id=None, medium=medium, lora_name=None)


def batch(*events):
    return vllm_events.KVEventBatch(ts=time.time(), events=list(events))


def encode(b) -> bytes:
    return msgspec.msgpack.Encoder().encode(b)


def wire(*events) -> list:
    """vLLM's events as the router reads them: encoded by vLLM's classes, decoded by kv_blocks."""
    decoded, skipped, lost_removal = decode_batch(encode(batch(*events)))
    assert skipped == 0 and not lost_removal
    return decoded


def conversation_events(prompt: list[int], first_hash: int = 1000) -> list:
    """The BlockStored events an engine publishes for a prompt, one event per block (vLLM's hashes: any ints)."""
    events, parent = [], None
    for i in range(len(prompt) // BLOCK):
        h = first_hash + i
        events.append(stored([h], parent, prompt[i * BLOCK:(i + 1) * BLOCK]))
        parent = h
    return events


def test_vllms_own_batches_decode_and_index_by_token_content():
    prompt = list(range(100, 118))  # 4 whole blocks and 2 tokens
    index = KvBlockIndex()
    events, skipped, _ = decode_batch(encode(batch(*conversation_events(prompt))))
    assert skipped == 0 and len(events) == 4
    index.apply("http://d:1", events)
    assert index.block_size("http://d:1") == BLOCK
    chained = prompt_chain(prompt, BLOCK)
    assert len(chained) == 4 and chained[0] == chain(ROOT, prompt[:4])
    assert index.matched("http://d:1", chained) == 4
    other = prompt[:8] + [7, 7, 7, 7]  # shares two blocks
    assert index.matched("http://d:1", prompt_chain(other, BLOCK)) == 2
    assert index.matched("http://p:1", chained) == 0
    # one event storing several blocks at once chains the same way
    index2 = KvBlockIndex()
    index2.apply("u", decode_batch(encode(batch(stored([1, 2, 3, 4], None, prompt[:16]))))[0])
    assert index2.matched("u", chained) == 4


def test_removed_blocks_and_a_clear_take_them_out_and_a_copy_on_another_medium_stays():
    prompt = list(range(16))
    index = KvBlockIndex()
    index.apply("u", wire(*conversation_events(prompt)))
    index.apply("u", wire(stored([1000], None, prompt[:4], medium="CPU")))
    index.apply("u", wire(vllm_events.BlockRemoved(block_hashes=[1002], medium="GPU")))
    assert index.matched("u", prompt_chain(prompt, BLOCK)) == 2  # blocks 0 and 1 still held
    index.apply("u", wire(vllm_events.BlockRemoved(block_hashes=[1000], medium="GPU")))
    assert index.matched("u", prompt_chain(prompt, BLOCK)) == 2  # block 0 from the CPU tier's copy, block 1
    index.apply("u", wire(vllm_events.BlockRemoved(block_hashes=[1001], medium="GPU")))
    assert index.matched("u", prompt_chain(prompt, BLOCK)) == 1
    index.apply("u", wire(vllm_events.AllBlocksCleared()))
    assert index.matched("u", prompt_chain(prompt, BLOCK)) == 0 and index.size("u") == 0


def test_hostile_events_are_skipped_and_counted_never_indexed():
    index = KvBlockIndex(max_blocks=3)
    bad = [
        stored([1], None, [1, 2, 3]),  # 3 tokens for a block of 4
        stored([1], None, [1, 2, 3, -1]),
        stored([1], None, [1, 2, 3, 2**32]),
        vllm_events.BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                                medium=None, lora_name=None),
    ]
    index.apply("u", wire(*bad))
    assert index.stats["malformed"] == 4 and index.size("u") == 0
    index.apply("u", wire(stored([5], 999, [1, 2, 3, 4])))  # a parent it never heard of
    assert index.stats["orphan"] == 1 and index.size("u") == 0
    index.apply("u", wire(*conversation_events(list(range(20)))))  # 5 blocks, room for 3
    # the fourth block finds no room; the fifth's parent is then unknown
    assert index.size("u") == 3 and index.stats["full"] == 1 and index.stats["orphan"] == 2
    with pytest.raises(ValueError):
        decode_batch(b"\x93not msgpack")
    # an event type this module does not know is skipped, not the batch it came in
    raw = msgspec.msgpack.encode([1.0, [{"type": "BlockReused", "x": 1},
                                        msgspec.to_builtins(stored([7], None, [9, 9, 9, 9]))]])
    events, skipped, lost_removal = decode_batch(raw)
    assert skipped == 1 and len(events) == 1 and not lost_removal
    # a removal that does not decode is a lost removal: the subscriber then resyncs
    raw = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": "not a list"}]])
    assert decode_batch(raw)[1:] == (1, True)


def test_the_replay_endpoint_is_the_next_port_and_a_bad_endpoint_is_refused():
    assert replay_endpoint("tcp://10.0.0.1:5557") == "tcp://10.0.0.1:5558"
    assert replay_endpoint("tcp://[fd00::1]:5557") == "tcp://[fd00::1]:5558"
    for bad in ("ipc:///tmp/x", "tcp://h", "tcp://h:65535", "tcp://:1", "http://h:1"):
        with pytest.raises(ValueError):
            replay_endpoint(bad)


class Publisher:
    """vLLM's own publisher (PUB bound at `port`: vLLM binds a wildcard endpoint and connects to any other; the
    replay ROUTER at port + 1)."""

    def __init__(self, port: int, buffer_steps: int = 10_000) -> None:
        self.port = port
        self.pub = vllm_events.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}",
                                                 replay_endpoint=f"tcp://127.0.0.1:{port + 1}",
                                                 buffer_steps=buffer_steps)

    def publish(self, *events) -> None:
        self.pub.publish(batch(*events))

    def close(self) -> None:
        self.pub.shutdown()


async def until(check, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        await asyncio.sleep(0.02)


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(BLOCK * rng.randint(1, 6))] for _ in range(count)]


@pytest.mark.asyncio
async def test_lost_batches_are_replayed_and_the_index_ends_as_without_loss():
    """40 % of the live batches thrown away as they are read (the test knob): each gap is asked of vLLM's replay
    socket and the index holds exactly what a lossless subscriber's holds, removals included."""
    port = free_port(2)
    pub = Publisher(port)
    lossless_index, lossy_index = KvBlockIndex(), KvBlockIndex()
    lossless = KvEventSubscriber("u", f"tcp://127.0.0.1:{port}", lossless_index)
    lossy = KvEventSubscriber("u", f"tcp://127.0.0.1:{port}", lossy_index, drop_fraction=0.4,
                              rng=random.Random(3))
    try:
        lossless.start()
        lossy.start()
        await asyncio.sleep(0.3)  # the subscriptions reach the publisher (what is sent before is replayed anyway)
        sent = prompts(60, seed=1)
        for n, prompt in enumerate(sent):
            pub.publish(*conversation_events(prompt, first_hash=10_000 * (n + 1)))
            if n % 10 == 9:  # evict one prompt's blocks now and then
                pub.publish(vllm_events.BlockRemoved(block_hashes=[10_000 * (n - 3)], medium="GPU"))
        pub.publish(stored([1], None, [1, 1, 1, 1]))  # a last batch: both have seen everything once it is in
        await until(lambda: lossless_index.matched("u", prompt_chain([1, 1, 1, 1], BLOCK)) == 1, 20,
                    "the lossless subscriber's last batch")
        await until(lambda: lossy_index.matched("u", prompt_chain([1, 1, 1, 1], BLOCK)) == 1, 20,
                    "the lossy subscriber's last batch")
        assert lossy.stats["dropped_by_test"] > 5 and lossy.stats["gap"] > 0 and lossy.stats["replayed"] > 0
        assert lossy.stats["resync"] == 0, lossy.stats
        assert lossy_index.instances["u"].held == lossless_index.instances["u"].held
        for prompt in sent:
            assert lossy_index.matched("u", prompt_chain(prompt, BLOCK)) == \
                lossless_index.matched("u", prompt_chain(prompt, BLOCK))
    finally:
        await lossless.stop()
        await lossy.stop()
        pub.close()


@pytest.mark.asyncio
async def test_a_replay_buffer_that_moved_on_forgets_the_blocks_and_rebuilds_from_what_follows():
    port = free_port(2)
    pub = Publisher(port, buffer_steps=3)
    index = KvBlockIndex()
    sub = KvEventSubscriber("u", f"tcp://127.0.0.1:{port}", index)
    try:
        sub.start()
        await asyncio.sleep(0.3)
        first = [5, 6, 7, 8]
        pub.publish(stored([1], None, first))
        await until(lambda: index.matched("u", prompt_chain(first, BLOCK)) == 1, 20, "the first block")
        # lose 5 batches on purpose: the buffer of 3 cannot replay them all -> resync (blocks forgotten), then the
        # index rebuilds from what the replay still had and what follows
        sub._drop, sub._rng = 1.0, random.Random(0)
        for n in range(5):
            pub.publish(stored([100 + n], None, [n] * 4))
        await until(lambda: sub.stats["dropped_by_test"] == 5, 20, "five batches thrown away")
        sub._drop = 0.0
        pub.publish(stored([200], None, [9, 9, 9, 9]))
        await until(lambda: index.matched("u", prompt_chain([9, 9, 9, 9], BLOCK)) == 1, 20, "the batch after")
        assert sub.stats["resync"] == 1, sub.stats
        assert index.matched("u", prompt_chain(first, BLOCK)) == 0  # forgotten with the rest
        assert index.matched("u", prompt_chain([4] * 4, BLOCK)) == 1  # replayed: still in the buffer
    finally:
        await sub.stop()
        pub.close()


@contextlib.asynccontextmanager
async def raw_publisher():
    """A raw ZMQ PUB socket playing an engine (the wire format is vLLM's, as the tests above show) and a subscriber
    following it into an index: (pub, index, subscriber)."""
    import zmq
    import zmq.asyncio

    port = free_port(2)
    pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    index = KvBlockIndex()
    sub = KvEventSubscriber("u", f"tcp://127.0.0.1:{port}", index)
    try:
        sub.start()
        await asyncio.sleep(0.3)  # the subscription reaches the socket
        yield pub, index, sub
    finally:
        await sub.stop()
        pub.close(linger=0)


@pytest.mark.asyncio
async def test_a_restarted_engine_numbering_from_0_again_is_forgotten_and_followed():
    """An engine that restarts on the same endpoint publishes from sequence number 0 again, with an empty cache (a
    raw PUB socket plays it: the wire format is vLLM's, as the tests above show)."""
    async with raw_publisher() as (pub, index, sub):
        for seq, tokens in enumerate(([1] * 4, [2] * 4)):
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), encode(batch(stored([seq], None, tokens)))])
        await until(lambda: index.matched("u", prompt_chain([2] * 4, BLOCK)) == 1, 10, "the second block")
        await pub.send_multipart([b"", (0).to_bytes(8, "big"), encode(batch(stored([0], None, [3] * 4)))])
        await until(lambda: index.matched("u", prompt_chain([3] * 4, BLOCK)) == 1, 10, "the restarted engine's block")
        assert sub.stats["restart"] == 1 and sub.stats["gap"] == 0, sub.stats
        assert index.matched("u", prompt_chain([1] * 4, BLOCK)) == 0 and index.size("u") == 1
        for seq, tokens in ((1, [4] * 4), (2, [5] * 4)):
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), encode(batch(stored([seq], None, tokens)))])
        await until(lambda: index.matched("u", prompt_chain([5] * 4, BLOCK)) == 1, 10, "the engine's later blocks")
        # it restarts again and its 0 is lost: its 1 (not above the last number applied, 2) still says so; the 0 is
        # asked of the replay socket (none here: within its deadline, a resync)
        await pub.send_multipart([b"", (1).to_bytes(8, "big"), encode(batch(stored([1], None, [6] * 4)))])
        await until(lambda: index.matched("u", prompt_chain([6] * 4, BLOCK)) == 1, 10, "the third engine's block")
        assert sub.stats["restart"] == 2 and sub.stats["resync"] == 1, sub.stats
        assert index.size("u") == 1  # nothing of the engines before


@pytest.mark.asyncio
async def test_garbage_on_the_wire_never_ends_the_subscription():
    async with raw_publisher() as (pub, index, sub):
        for frames in ([b"", b"short", b"x"], [b"", (0).to_bytes(8, "big"), b"\xc1garbage"], [b"only one"],
                       [b"", (1).to_bytes(8, "big"), encode(batch(stored([1], None, [4, 4, 4, 4])))]):
            await pub.send_multipart(frames)
        await until(lambda: index.matched("u", prompt_chain([4] * 4, BLOCK)) == 1, 10, "the good batch after garbage")
        assert sub.stats["malformed"] >= 2


async def deliver(pub: Publisher, check, what: str, seconds: float = 20, diagnose=lambda: "") -> None:
    """Waits for `check`; every half second publishes an empty batch, whose number shows a subscriber that joined
    late the gap, so that it asks the replay socket for what it missed (a PUB socket sends nothing to a subscriber
    that is not connected yet)."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}; {diagnose()}")
        pub.publish()
        await asyncio.sleep(0.5)


@pytest.mark.asyncio
async def test_the_router_sends_a_prompt_to_the_prefill_whose_events_say_it_holds_its_blocks(tmp_path):
    """Two prefills (stand-ins) whose KV events vLLM's publisher sends: each prompt goes to the prefill that holds
    its blocks, though round robin would send it to the other; once that prefill's events remove the blocks, no
    block matches. The decode, without events, keeps the approximate index. Cost: about 2 s beside the vLLM import
    above."""
    import aiohttp

    from pdpair.router.app import make_app
    from pdpair.router.config import RouterConfig
    from pdpair.router.pools import ROUTER
    from tests.engine.tiny_model import build_tiny_tokenizer
    from tests.router_support import Engine, engine_server, serve

    tokenizer = build_tiny_tokenizer(tmp_path / "tokenizer")
    engines = [Engine("prefill-0"), Engine("prefill-1"), Engine("decode")]
    runners, urls = [], []
    for engine in engines:
        runner, url = await engine_server(engine)
        runners.append(runner)
        urls.append(url)
    ports = [free_port(2), free_port(2)]
    pubs = [Publisher(port) for port in ports]
    app = make_app(RouterConfig(tuple(urls[:2]), (urls[2],), prefix_affinity=True, concurrent_legs=False,
                                tokenizer=str(tmp_path / "tokenizer"),
                                prefill_kv_events=tuple(f"tcp://127.0.0.1:{p}" for p in ports)))
    router = app[ROUTER]
    runner, base = await serve(app)
    runners.append(runner)
    prompts = [f"Conversation {n}: " + "the pair moves each block of the prompt over one edge " * 6 for n in (0, 1)]
    block = 16
    try:
        for n, holder in ((0, 1), (1, 0)):  # prompt 0's blocks on prefill 1, prompt 1's on prefill 0
            ids = tokenizer.encode(prompts[n])
            whole = len(ids) // block
            pubs[holder].publish(*[stored([n * 1000 + i], None if i == 0 else n * 1000 + i - 1,
                                          ids[i * block:(i + 1) * block], block_size=block) for i in range(whole)])
            await deliver(pubs[holder], lambda: router.kv_index.size(urls[holder]) == whole,
                          f"prefill {holder}'s blocks", diagnose=lambda: (
                              [s.stats for s in router.kv_subscribers["prefill"].values()], router.kv_index.stats))
        # the router's own tokenization matches the engine's blocks for each prompt
        assert router.kv_index.matched(urls[1], router.block_chain(
            "prefill", router.prefills, router.tokenizer.token_ids({"prompt": prompts[0]}, False))[0]) == whole
        async with aiohttp.ClientSession() as client:
            for n in (0, 1, 0, 1):
                async with client.post(base + "/v1/completions", json={"prompt": prompts[n], "max_tokens": 2}) as r:
                    assert r.status == 200, await r.text()
            got = [[b["prompt"][:14] for _, b, _ in e.received] for e in engines[:2]]
            assert got == [["Conversation 1"] * 2, ["Conversation 0"] * 2], got
            blocks = dict(router.prefix_blocks["prefill"])
            assert blocks["matched"] == blocks["routed"] > 0, blocks
            assert router.prefix_chunks["decode"]["routed"] > 0  # no events for decode: the approximate index
            assert router.prefix_chunks["prefill"]["routed"] == 0
            # prefill 1 evicts prompt 0's first block: nothing of prompt 0 matches anywhere
            pubs[1].publish(vllm_events.BlockRemoved(block_hashes=[0], medium="GPU"))
            await deliver(pubs[1], lambda: router.kv_index.size(urls[1]) == whole - 1, "the removal")
            async with client.post(base + "/v1/completions", json={"prompt": prompts[0], "max_tokens": 2}) as r:
                assert r.status == 200
            assert router.prefix_blocks["prefill"]["matched"] == blocks["matched"]
            async with client.get(base + "/metrics") as r:
                text = await r.text()
        assert f'pdpair_router_prefix_blocks_total{{outcome="matched",role="prefill"}} {float(blocks["matched"])}' \
            in text
        assert 'pdpair_router_kv_event_batches_total{outcome="applied",role="prefill"}' in text
        assert 'pdpair_router_kv_event_batches_total{outcome="applied",role="decode"}' not in text
    finally:
        for runner in runners:
            await runner.cleanup()
        for pub in pubs:
            pub.close()


def test_kv_events_need_affinity_and_a_tokenizer_and_one_endpoint_per_instance():
    from pdpair.router.app import make_app
    from pdpair.router.config import RouterConfig

    urls = ("http://p:1", "http://p:2")
    for config, message in (
            (RouterConfig(urls, ("http://d:1",), prefill_kv_events=("tcp://p:5", "tcp://p:7")), "--tokenizer"),
            (RouterConfig(urls, ("http://d:1",), prefix_affinity=True, tokenizer="x",
                          prefill_kv_events=("tcp://p:5",)), "once per instance"),
            (RouterConfig(urls, ("http://d:1",), prefix_affinity=True, tokenizer="x",
                          decode_kv_events=("ipc:///tmp/x",)), "--decode-kv-events"),
    ):
        with pytest.raises(ValueError, match=message):
            make_app(config)


def test_the_prompt_is_tokenized_as_the_engine_does_and_a_clients_body_cannot_take_the_router(tmp_path):
    """Chat through the model's template (the ids, not the tokenizer's encoding object), completions with the
    tokenizer's special tokens; a client's own template, too many messages or a token id no block can hold are not
    tokenized (the approximate index decides), and no body raises."""
    from pdpair.router.prompt_tokenizer import MAX_MESSAGES, PromptTokenizer
    from tests.engine.tiny_model import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(tmp_path / "tokenizer")
    prompt = PromptTokenizer(str(tmp_path / "tokenizer"))
    messages = [{"role": "system", "content": "the pair moves each block"}, {"role": "user", "content": "why?"}]
    want = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert prompt.token_ids({"messages": messages}, chat=True) == list(want) and len(want) > 5
    assert prompt.token_ids({"prompt": "the pair moves"}, chat=False) == tokenizer.encode("the pair moves")
    assert prompt.token_ids({"prompt": [1, 2, 3]}, chat=False) == [1, 2, 3]
    hostile = {"messages": messages, "chat_template_kwargs": {
        "chat_template": "{% for i in range(10**9) %}{% for j in range(10**9) %}{% endfor %}{% endfor %}",
        "tokenizer_kwargs": {"x": 1}, "padding": True, "max_length": 1}}
    assert prompt.token_ids(hostile, chat=True) == list(want)  # the client's template never reaches the tokenizer
    assert prompt.token_ids({"messages": [{"role": "user", "content": ""}] * (MAX_MESSAGES + 1)}, chat=True) is None
    assert prompt.token_ids({"prompt": [1, 2**32]}, chat=False) is None
    for body in ({"messages": "x"}, {"messages": [None, 3]}, {"prompt": None}, {"prompt": [True]}, {}):
        prompt.token_ids(body, chat="messages" in body)  # never raises
    with pytest.raises(ValueError, match="--tokenizer"):
        PromptTokenizer(str(tmp_path / "missing"))
