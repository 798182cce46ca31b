"""The router's instances and the choice among them: `Instance` (one engine: its load, cooldown, KV usage, whether
it drains), `Pool` (one role's instances: the choice by load, the pushed set replacing the old one), `Router` (both
pools, the pushed epoch and generation, the HTTP session)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from pdpair.contract import READYZ_PATH, ROLE_DECODE, ROLE_PREFILL
from pdpair.contract.router_peers import RouterMember
from pdpair.router.config import HEALTH_PATH, RouterConfig
from pdpair.router import testing_knobs
from pdpair.router.kv_blocks import KvBlockIndex, prompt_chain
from pdpair.router.kv_subscriber import KvEventSubscriber
from pdpair.router.prefix_index import PREFIX_LOAD_SLACK, PrefixIndex
from pdpair.router.prompt_tokenizer import PromptTokenizer
from pdpair.router.split import SplitPolicy

@dataclass(eq=False)
class Instance:
    role: str
    index: int
    url: str
    outstanding: int = 0  # requests in flight to it now: the choice's load count (`Pool.hold`)
    # Requests in flight that involve it for their whole life (`Pool.involve`): a prefill's from its choice until the
    # request's decode answer ended or failed (its KV push to decode may outlive its own answer), a decode's as
    # `outstanding`. Never the load (a prefill that answered is free for the next prompt): what a drain waits for.
    involved: int = 0
    cooldown_until: float = -math.inf  # on the pool's clock
    kv_usage: float | None = None
    kv_usage_at: float = -math.inf
    ready_url: str = ""  # where its own readiness is asked (the router's /readyz); "" = url + /health
    draining: bool = False  # pushed as draining, or gone from the pushed set: never chosen again


class Pool:
    """The instances of one role, the requests in flight to each through this router, and the choice among them.

    `instances` are the ones that may be chosen (in index order), `draining` the members of the pushed set marked
    draining, `leaving` (by URL) the instances that left the set with requests still in flight through this router
    (held or involved);
    `replace` swaps the set (docs/xpyd.md section 6)."""

    def __init__(self, role: str, urls: tuple[str, ...], cooldown_seconds: float,
                 kv_usage_max_age_seconds: float | None = None, clock: Callable[[], float] = time.monotonic,
                 ready_urls: tuple[str, ...] = ()) -> None:
        self.role = role
        ready_urls = ready_urls or tuple(url + HEALTH_PATH for url in urls)
        self.instances = [Instance(role, index, url, ready_url=ready)
                          for index, (url, ready) in enumerate(zip(urls, ready_urls, strict=True))]
        self.draining: list[Instance] = []
        self.leaving: dict[str, Instance] = {}
        self._cooldown = cooldown_seconds
        self._kv_max_age = kv_usage_max_age_seconds  # None: this role's choice ignores KV usage
        self._clock = clock
        self._cursor = 0  # round-robin: the index that wins the next exact tie

    def choose(self, exclude: Instance | None = None, affinity: Callable[[Instance], int] | None = None) -> Instance:
        """The instance with the fewest requests in flight; ties go to the lowest fresh KV-cache usage (when this
        pool tracks it), then round-robin. `exclude` (the instance a retry leaves) is chosen only if it is the only
        one. `affinity` (prefix_index.py: the prompt's chunks an instance was sent before): among the instances within
        PREFIX_LOAD_SLACK requests of the least loaded, those with the longest match > 0 are the candidates instead."""
        now = self._clock()
        candidates = [i for i in self.instances if i is not exclude] or self.instances
        # Fail open: when every candidate is cooling down, choose among them anyway. Skipping a failed instance only
        # helps while another can take the request; with one instance per role (what the operator runs today)
        # refusing would turn one transient error (a reset kept-alive connection, an engine restarting) into
        # failure_cooldown_seconds of certain 503s for a pair that may already serve again.
        candidates = [i for i in candidates if i.cooldown_until <= now] or candidates
        least = min(i.outstanding for i in candidates)
        if affinity is not None:
            near = [i for i in candidates if i.outstanding <= least + PREFIX_LOAD_SLACK]
            matched = [affinity(i) for i in near]
            if max(matched) > 0:
                candidates = [i for i, m in zip(near, matched) if m == max(matched)]
                least = min(i.outstanding for i in candidates)
        tied = [i for i in candidates if i.outstanding == least]
        if len(tied) > 1 and self._kv_max_age is not None:
            usages = [self.fresh_kv_usage(i, now) for i in tied]
            # Only when every tied decode has a fresh value: a missing or stale one says nothing about its load, and
            # ranking it above or below the known ones would starve it or prefer a decode whose /metrics fails.
            if None not in usages:
                low = min(usages)
                tied = [i for i, usage in zip(tied, usages) if usage == low]
        n = max(i.index for i in self.instances) + 1  # a pushed set's indexes may have gaps
        chosen = min(tied, key=lambda i: (i.index - self._cursor) % n)
        self._cursor = (chosen.index + 1) % n
        return chosen

    def member(self, index: int) -> Instance | None:
        """The instance that may be chosen with this index (X-Pdpair-Route), or None."""
        return next((i for i in self.instances if i.index == index), None)

    def replace(self, members: list[RouterMember]) -> None:
        """Makes `members` the role's set. Synchronous, so no request's choice sees half of it. An instance is kept
        by URL (its requests in flight, cooldown and KV usage stay); a new URL is a new instance; one marked
        draining, or gone from the set, is never chosen again while its requests in flight finish (`hold` and
        `involve` count them); one gone from the set is forgotten when its last one ends."""
        known = {i.url: i for i in (*self.instances, *self.draining, *self.leaving.values())}
        instances, draining = [], []
        for m in sorted(members, key=lambda m: m.index):
            instance = known.pop(m.url, None) or Instance(self.role, m.index, m.url)
            instance.index, instance.ready_url, instance.draining = m.index, m.ready_url, m.draining
            (draining if m.draining else instances).append(instance)
        for instance in known.values():
            instance.draining = True
        self.instances, self.draining = instances, draining
        self.leaving = {url: i for url, i in known.items() if i.outstanding > 0 or i.involved > 0}

    def hold(self, instance: Instance) -> contextlib.AbstractContextManager[Instance]:
        """Counts a request in flight to `instance` while the block runs (cancelled or failed included): its load
        (`outstanding`, what `choose` compares). Enter it right after `choose`, with no await between, so that
        concurrent requests see each other's choice."""
        return self._counting(instance, "outstanding")

    def involve(self, instance: Instance) -> contextlib.AbstractContextManager[Instance]:
        """Counts a request that involves `instance` while the block runs (cancelled or failed included):
        `involved`, what a drain waits for. `_proxy` enters it for the decode beside `hold`, and for each prefill a
        request is sent to from its choice until decode's answer ended (prefill's KV push outlives its answer)."""
        return self._counting(instance, "involved")

    @contextlib.contextmanager
    def _counting(self, instance: Instance, count: str) -> Iterator[Instance]:
        setattr(instance, count, getattr(instance, count) + 1)
        try:
            yield instance
        finally:
            setattr(instance, count, getattr(instance, count) - 1)
            if instance.outstanding == 0 and instance.involved == 0 and self.leaving.get(instance.url) is instance:
                del self.leaving[instance.url]  # it left the set and its last request ended: forgotten

    def failed(self, instance: Instance) -> None:
        instance.cooldown_until = self._clock() + self._cooldown

    def record_kv_usage(self, instance: Instance, usage: float) -> None:
        instance.kv_usage, instance.kv_usage_at = usage, self._clock()

    def fresh_kv_usage(self, instance: Instance, now: float | None = None) -> float | None:
        if self._kv_max_age is None or instance.kv_usage is None:
            return None
        now = self._clock() if now is None else now
        return instance.kv_usage if now - instance.kv_usage_at <= self._kv_max_age else None

    def outstanding(self) -> list[int]:
        return [i.outstanding for i in self.instances]

    def cooling(self) -> list[int]:
        now = self._clock()
        return [i.index for i in self.instances if i.cooldown_until > now]


IDENTITY_PARAMS = ("remote_instance", "remote_pair", "remote_generation")  # the connector's kv_transfer_params keys


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.prefills = Pool("prefill", config.prefill_urls, config.failure_cooldown_seconds,
                             ready_urls=config.prefill_ready_urls)
        self.decodes = Pool("decode", config.decode_urls, config.failure_cooldown_seconds,
                            kv_usage_max_age_seconds=config.kv_usage_max_age_seconds,
                            ready_urls=config.decode_ready_urls)
        self.session: aiohttp.ClientSession | None = None
        self.split = SplitPolicy(config.local_prompt_tokens, learn=config.learn_split_threshold)  # split or local, per request (split.py)
        # prefill URL -> what decode's kv_transfer_params must name of it (instance, pair, generation), from its last
        # answer: both legs go at once (--concurrent-legs) only to a prefill that answered before
        self.prefill_identity: dict[str, dict[str, Any]] = {}
        # what this router sent to each instance of each role (--prefix-affinity), and the chunks it routed and
        # found matched there (/metrics): a prefill's cache holds the prompts it computed, a decode's those it
        # computed alone and those whose KV it loaded
        self.prefix = {ROLE_PREFILL: PrefixIndex(), ROLE_DECODE: PrefixIndex()}
        self.prefix_chunks = {role: {"routed": 0, "matched": 0} for role in self.prefix}
        # Precise prefix affinity (--prefill-kv-events, --decode-kv-events): the blocks each engine's KV events say it
        # holds, one subscriber per engine (started with the app), the prompt's token ids (--tokenizer), and the
        # blocks routed and matched (/metrics).
        self.kv_index = KvBlockIndex()
        self.kv_subscribers: dict[str, dict[str, KvEventSubscriber]] = {ROLE_PREFILL: {}, ROLE_DECODE: {}}
        for role, urls, endpoints in ((ROLE_PREFILL, config.prefill_urls, config.prefill_kv_events),
                                      (ROLE_DECODE, config.decode_urls, config.decode_kv_events)):
            for url, endpoint in zip(urls, endpoints):
                self.kv_subscribers[role][url] = KvEventSubscriber(
                    url, endpoint, self.kv_index, topic=config.kv_events_topic,
                    drop_fraction=testing_knobs.kv_events_drop_fraction())
        self.prefix_blocks = {role: {"routed": 0, "matched": 0} for role in self.prefix}
        self.tokenizer = PromptTokenizer(config.tokenizer) if config.tokenizer else None
        # Sent with every request to an engine's API (prefill, decode, decode's /v1/models): the pair's API key, which
        # vLLM requires under /v1 when it has one; nothing without a key. Not to readiness URLs or /metrics (open).
        self.engine_headers: dict[str, str] = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        # The last pushed set's epoch and generation (None: the flags' set, nothing pushed yet).
        self.epoch: int | None = None
        self.generation: int | None = None

    def block_chain(self, role: str, pool: Pool, token_ids: list[int] | None,
                    chains: dict[int, list[bytes]] | None = None) -> tuple[list[bytes], int] | None:
        """(the prompt's chained block hashes, the block size) when `role` is matched by KV events: every instance
        that may be chosen has a subscriber and one of them has told its block size; else None (the approximate
        index decides). An instance whose events said nothing yet holds nothing, as far as the router knows.
        `chains` (block size -> chain) is the request's: both roles' choices hash the prompt once."""
        subscribers = self.kv_subscribers[role]
        if token_ids is None or not subscribers or any(i.url not in subscribers for i in pool.instances):
            return None
        size = next((s for s in (self.kv_index.block_size(i.url) for i in pool.instances) if s), None)
        if size is None:
            return None
        chains = {} if chains is None else chains
        if size not in chains:
            chains[size] = prompt_chain(token_ids, size)
        return chains[size], size

    def learn_prefill(self, url: str, params: dict[str, Any]) -> None:
        """Record the identity a prefill's answer carries (remote_instance, remote_pair, remote_generation); an
        answer without a usable one forgets it (that prefill is asked in sequence until it answers with one)."""
        identity = {k: params.get(k) for k in IDENTITY_PARAMS}
        if isinstance(identity["remote_instance"], str) and len(identity["remote_instance"]) <= 128 and \
                isinstance(identity["remote_pair"], str) and len(identity["remote_pair"]) <= 253 and \
                isinstance(identity["remote_generation"], int) and not isinstance(identity["remote_generation"], bool):
            self.prefill_identity[url] = identity
        else:
            self.prefill_identity.pop(url, None)

    def apply_peers(self, epoch: int, generation: int, prefills: list[RouterMember], decodes: list[RouterMember]) -> None:
        """Both roles' sets at once: synchronous, so no request sees one role swapped and not the other."""
        self.prefills.replace(prefills)
        self.decodes.replace(decodes)
        self.prefix[ROLE_PREFILL].forget({m.url for m in prefills})
        self.prefix[ROLE_DECODE].forget({m.url for m in decodes})
        self.prefill_identity = {url: v for url, v in self.prefill_identity.items() if url in {m.url for m in prefills}}
        self.epoch, self.generation = epoch, generation

    def peers_state(self) -> dict:
        """The answer of `PUT`/`GET /pdpair/v1/peers`: each role's members (draining included) with the requests in
        flight to each through this router (`outstanding`, the load) and those that involve it (`involved`: a
        prefill's until the request's decode answer ended), the instances that left the set with requests still in
        flight (`leaving`; one is gone from it when both counts reach 0), and `warnings` (a role with no instance
        that may be chosen: /readyz fails and requests are answered 503)."""
        def members(pool: Pool) -> list[dict]:
            return [{"index": i.index, "url": i.url, "outstanding": i.outstanding, "involved": i.involved,
                     "draining": i.draining}
                    for i in sorted((*pool.instances, *pool.draining), key=lambda i: i.index)]

        pools = (self.prefills, self.decodes)
        return {
            "epoch": self.epoch, "generation": self.generation,
            "prefills": members(self.prefills), "decodes": members(self.decodes),
            "leaving": [{"role": pool.role, "url": i.url, "outstanding": i.outstanding, "involved": i.involved}
                        for pool in pools for i in pool.leaving.values()],
            "warnings": [no_instance(pool.role) for pool in pools if not pool.instances],
        }


def no_instance(role: str) -> str:
    return (f"no {role} that may be chosen (the set is empty or every {role} is draining): the router's {READYZ_PATH} "
            f"fails and requests are answered 503 until one is pushed")


ROUTER = web.AppKey("router", Router)
