"""Precise prefix affinity: which KV blocks each engine holds, as its own KV events say (vLLM's `--kv-events-config`,
published over ZMQ and read by kv_subscriber.py), and how many leading blocks of a prompt each one holds.

vLLM's events name blocks by its own block hashes (seeded per engine process unless PYTHONHASHSEED is fixed, and of an
algorithm the engine chooses), so the router cannot compute them for a new prompt. But every `BlockStored` event also
carries the block's token ids and its parent's hash: the index re-hashes each stored block with its own chained
hash (`chain`: the parent's chained hash and the block's token ids), keeps the engine's hash -> chained hash, and a
prompt, tokenized as the engine does (prompt_tokenizer.py), matches an engine by how many of its leading chained
hashes that engine holds. A `BlockRemoved` takes a block out (the engine evicted it: what the approximate index of
prefix_index.py cannot see), `AllBlocksCleared` everything (a reset of its prefix cache).

The wire format is vLLM's (vllm/distributed/kv_events.py): a msgpack `EventBatch` array [ts, events, dp_rank], each
event a map tagged by its class name in "type". Only the fields read here are declared; a field vLLM adds is ignored,
and an event of a type this module does not know is skipped (counted), never the batch it came in.

Everything here arrives over the network: a batch is bounded in size before it is decoded (kv_subscriber.py), an
event that does not hold together (token ids not `block_size` per hash, a token id outside 0..2**32-1, a block size
outside 1..MAX_BLOCK_SIZE) is skipped and counted, and each engine's index is bounded (MAX_BLOCKS_PER_INSTANCE: past
it new blocks are not indexed, so the index under-counts and never claims a block the engine lacks).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pdpair.router.prefix_index import leading_matches

ROOT = bytes(16)  # the chained hash "before" a prompt's first block
MAX_BLOCKS_PER_INSTANCE = 1 << 19  # ~524k blocks: 8.4M tokens at block size 16, about 60 MiB of index at most
MAX_BLOCK_SIZE = 4096
MAX_TOKEN_ID = 2**32 - 1

BlockHash = bytes | int  # vLLM's ExternalBlockHash (an int when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is set)


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    # A block of a LoRA adapter, or whose hash also covers a cache salt or multimodal data (extra_keys), is not the
    # same block as one of the same tokens without them: such blocks are not indexed (the router's prompt hashes
    # cover tokens only).
    lora_name: str | None = None
    lora_id: int | None = None
    extra_keys: list[Any] | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]  # decoded one by one: an unknown event type skips that event, not the batch
    data_parallel_rank: int | None = None


_batch_decoder = msgspec.msgpack.Decoder(EventBatch)
_event_decoder = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)


REMOVING_EVENTS = ("BlockRemoved", "AllBlocksCleared")


def decode_batch(payload: bytes) -> tuple[list[BlockStored | BlockRemoved | AllBlocksCleared], int, bool]:
    """The events of one published batch that this module reads, how many it skipped (of an unknown type or a shape
    that does not decode), and whether a skipped one was a removal (then the index may claim blocks the engine no
    longer holds: the caller resyncs). A ValueError when the batch itself is not one."""
    try:
        batch = _batch_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"not a KV event batch: {exc}") from None
    events, skipped, lost_removal = [], 0, False
    for raw in batch.events:
        try:
            events.append(_event_decoder.decode(raw))
        except (msgspec.DecodeError, msgspec.ValidationError):
            skipped += 1
            try:
                shape = msgspec.msgpack.decode(raw)
            except msgspec.DecodeError:
                shape = None
            lost_removal = lost_removal or not isinstance(shape, dict) or shape.get("type") in REMOVING_EVENTS
    return events, skipped, lost_removal


def chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chained hash of a block of `tokens` whose predecessor's chained hash is `parent` (ROOT for the first)."""
    return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}I", *tokens), digest_size=16).digest()


MAX_BLOCKS_PER_PROMPT = 8192  # 131k tokens at block size 16: beyond it the prefix is long enough to decide on


def prompt_chain(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hashes of the prompt's whole blocks (a partial last block is never cached by the engine), at most
    MAX_BLOCKS_PER_PROMPT."""
    hashes, parent = [], ROOT
    end = min(len(token_ids), MAX_BLOCKS_PER_PROMPT * block_size)
    for start in range(0, end - block_size + 1, block_size):
        parent = chain(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class InstanceBlocks:
    """One engine's blocks: (medium, its hash) -> our chained hash, and how many of its blocks carry each chained
    hash (a block on the CPU tier and its copy on the GPU are two blocks with one content)."""

    block_size: int | None = None
    chained_of: dict[tuple[str | None, BlockHash], bytes] = field(default_factory=dict)
    held: dict[bytes, int] = field(default_factory=dict)

    def clear(self) -> None:
        self.chained_of.clear()
        self.held.clear()


@dataclass
class KvBlockIndex:
    """Per engine (by its URL), the blocks its events say it holds; `stats` counts what was skipped and why."""

    max_blocks: int = MAX_BLOCKS_PER_INSTANCE
    instances: dict[str, InstanceBlocks] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=lambda: {
        "stored": 0, "removed": 0, "cleared": 0, "orphan": 0, "malformed": 0, "unknown": 0, "full": 0,
        "not_indexed": 0})

    def apply(self, url: str, events: Sequence[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        blocks = self.instances.setdefault(url, InstanceBlocks())
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(blocks, event)
            elif isinstance(event, BlockRemoved):
                for block in event.block_hashes:
                    chained = blocks.chained_of.pop((event.medium, block), None)
                    if chained is not None:
                        self.stats["removed"] += 1
                        left = blocks.held[chained] - 1
                        if left:
                            blocks.held[chained] = left
                        else:
                            del blocks.held[chained]
            elif isinstance(event, AllBlocksCleared):
                blocks.clear()
                self.stats["cleared"] += 1

    def _stored(self, blocks: InstanceBlocks, event: BlockStored) -> None:
        size, hashes, tokens = event.block_size, event.block_hashes, event.token_ids
        if event.lora_name is not None or event.lora_id is not None or any(key for key in event.extra_keys or ()):
            self.stats["not_indexed"] += len(hashes)  # its children are then orphans: not indexed either
            return
        if not (isinstance(size, int) and 1 <= size <= MAX_BLOCK_SIZE and len(tokens) == size * len(hashes)
                and all(isinstance(t, int) and 0 <= t <= MAX_TOKEN_ID for t in tokens)):
            self.stats["malformed"] += 1
            return
        # The engine's block size is the largest seen: vLLM also announces partial blocks (of its hash block size,
        # smaller), which a prompt's chain of whole blocks never matches; should one come first, the whole blocks
        # that follow replace what it started.
        if blocks.block_size is None or size > blocks.block_size:
            if blocks.block_size is not None:
                self.stats["not_indexed"] += len(blocks.chained_of)
                blocks.clear()
            blocks.block_size = size
        elif size < blocks.block_size:
            self.stats["not_indexed"] += len(hashes)
            return
        if event.parent_block_hash is None:
            parent = ROOT
        else:
            known = blocks.chained_of.get((event.medium, event.parent_block_hash))
            if known is None:  # stored before this router listened, or its event was lost: unchainable
                self.stats["orphan"] += len(hashes)
                return
            parent = known
        for i, block in enumerate(hashes):
            parent = chain(parent, tokens[i * size:(i + 1) * size])
            key = (event.medium, block)
            if key in blocks.chained_of:
                continue
            if len(blocks.chained_of) >= self.max_blocks:
                self.stats["full"] += 1
                continue
            blocks.chained_of[key] = parent
            blocks.held[parent] = blocks.held.get(parent, 0) + 1
            self.stats["stored"] += 1

    def block_size(self, url: str) -> int | None:
        blocks = self.instances.get(url)
        return blocks.block_size if blocks else None

    def matched(self, url: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt with these chained hashes the engine at `url` holds."""
        blocks = self.instances.get(url)
        return leading_matches(hashes, blocks.held) if blocks else 0

    def reset(self, url: str) -> None:
        """Forget what `url` holds (its events can no longer be followed: kv_subscriber.py resyncs)."""
        blocks = self.instances.get(url)
        if blocks:
            blocks.clear()

    def forget(self, keep: set[str]) -> None:
        for url in [u for u in self.instances if u not in keep]:
            del self.instances[url]

    def size(self, url: str) -> int:
        blocks = self.instances.get(url)
        return len(blocks.chained_of) if blocks else 0
