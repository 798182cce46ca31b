"""Prefix affinity, approximate: which prefill most likely holds a prompt's prefix in its cache, from what this router
sent where. No engine is asked (vLLM's KV events are not read): the index remembers, per instance, the chained
hashes of the prompts it was sent, and a new prompt matches an instance by how many of its leading chunks that
instance was sent before.

A chunk is CHUNK_BYTES of the prompt's canonical bytes (text as UTF-8; token ids as 4-byte little-endian; chat
messages as role and text, in order), about one 32-token KV block of English text. Hashes chain (each covers every
byte before it), as vLLM's block hashes do, so a match is always a prefix. Approximate by design: the engine's cache
may have evicted what the router remembers, and a chunk boundary is not a block boundary; routing only moves load,
never changes an answer. Each instance's memory is bounded (MAX_CHUNKS_PER_INSTANCE, least recently sent first
out), and a prompt contributes at most MAX_CHUNKS_PER_PROMPT.

The choice (pools.Pool.choose) uses it only among the instances whose load is within PREFIX_LOAD_SLACK requests of
the least loaded one, so a popular prefix never sends every request to one hot instance.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Container, Sequence
from typing import Any

CHUNK_BYTES = 128
MAX_CHUNKS_PER_PROMPT = 4096  # 512 KiB of prompt: beyond it the prefix is long enough to decide on
MAX_CHUNKS_PER_INSTANCE = 65536  # about 8 MiB of prompt text per instance; ~5 MiB of router memory
PREFIX_LOAD_SLACK = 1  # an instance with a longer match may have at most this many more requests in flight


def _canonical(body: dict[str, Any], chat: bool) -> bytes | None:
    """The prompt's bytes in a stable form, or None when its shape is unknown (no affinity for it)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        parts = []
        for message in messages:
            if not isinstance(message, dict):
                return None
            role, content = message.get("role"), message.get("content")
            text = content if isinstance(content, str) else "".join(
                part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
            ) if isinstance(content, list) else ""
            parts.append(f"{role}\x1e{text}\x1f".encode("utf-8", "replace"))
        return b"".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt.encode("utf-8", "replace")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32
                                                   for t in prompt):
        return struct.pack(f"<{len(prompt)}I", *prompt)
    return None  # a batch or anything else


def prompt_hashes(body: dict[str, Any], chat: bool) -> list[bytes]:
    """The chained hashes of the prompt's whole chunks (empty: too short or of an unknown shape). Never raises."""
    data = _canonical(body, chat)
    if not data:
        return []
    hashes, previous = [], b""
    for start in range(0, min(len(data), MAX_CHUNKS_PER_PROMPT * CHUNK_BYTES) - CHUNK_BYTES + 1, CHUNK_BYTES):
        previous = hashlib.blake2b(previous + data[start:start + CHUNK_BYTES], digest_size=16).digest()
        hashes.append(previous)
    return hashes


def leading_matches(hashes: Sequence[bytes], held: Container[bytes]) -> int:
    """How many of the leading `hashes` are in `held` (chained hashes: a match is a prefix; also kv_blocks.py's)."""
    count = 0
    for h in hashes:
        if h not in held:
            break
        count += 1
    return count


class PrefixIndex:
    """Per instance (by URL), the chunk hashes of the prompts recently sent to it (bounded, least recently sent out)."""

    def __init__(self, max_chunks_per_instance: int = MAX_CHUNKS_PER_INSTANCE) -> None:
        self._max = max_chunks_per_instance
        self._sent: dict[str, OrderedDict[bytes, None]] = {}

    def matched(self, url: str, hashes: list[bytes]) -> int:
        """How many leading chunks of a prompt with these hashes were sent to `url` (and are still remembered)."""
        return leading_matches(hashes, self._sent.get(url) or ())

    def record(self, url: str, hashes: list[bytes]) -> None:
        """A prompt with these hashes was sent to `url`."""
        if not hashes:
            return
        sent = self._sent.setdefault(url, OrderedDict())
        for h in hashes:
            sent[h] = None
            sent.move_to_end(h)
        while len(sent) > self._max:
            sent.popitem(last=False)

    def forget(self, keep: set[str]) -> None:
        """Drop the memory of every instance not in `keep` (left the pushed set)."""
        for url in [u for u in self._sent if u not in keep]:
            del self._sent[url]

    def size(self, url: str) -> int:
        return len(self._sent.get(url) or ())
