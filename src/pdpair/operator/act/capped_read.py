"""Reading a pod's HTTP answer with a size cap. The operator is shared by every tenant, and a pair's pods run the
tenant's image: an answer read whole (aiohttp's `resp.text()`) lets one pod grow the operator's memory without bound
and kill it for every pair. Each read of a pod's answer (scrape.py: /metrics, /healthz; push.py: the push's answer,
read_peers) goes through `read_capped`, which stops at the cap; the caller judges such a pod as it judges one that
did not answer (scrape: unreachable) or refused (push). The time bound is the caller's (each read already runs under
a deadline), so a pod that drips an answer under the cap is cut off by that.

No aiohttp import: the response object is duck-typed, so push.py's pure part still loads no HTTP client.
"""

from __future__ import annotations

from typing import Any

# Chunks pulled off the response stream at a time: large enough for few wake-ups, small beside every cap below.
CHUNK_BYTES = 64 * 1024


class AnswerTooLarge(ValueError):
    """A pod's answer is larger than the cap; nothing more of it is read."""

    def __init__(self, limit: int, declared: int | None = None):
        self.limit = limit
        self.declared = declared
        said = f" (Content-Length {declared})" if declared is not None else ""
        super().__init__(f"answer larger than {format_bytes(limit)}{said}: not read")


def format_bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


async def read_capped(resp: Any, limit: int) -> bytes:
    """The body of `resp` (an aiohttp ClientResponse), at most `limit` bytes after decompression; AnswerTooLarge as
    soon as a declared Content-Length or the bytes read pass it (the rest is never read: the connection is dropped
    with the response)."""
    declared = resp.content_length
    if declared is not None and declared > limit:
        raise AnswerTooLarge(limit, declared)
    chunks: list[bytes] = []
    total = 0
    # Content-Length may be absent (chunked) or lie, and a compressed body inflates: count what arrives.
    async for chunk in resp.content.iter_chunked(CHUNK_BYTES):
        total += len(chunk)
        if total > limit:
            raise AnswerTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def decode(body: bytes, resp: Any) -> str:
    """The text of a body read by read_capped: the charset the answer names, else UTF-8; bad bytes replaced (the
    parsers judge the text, a decode error must not be a second kind of failure)."""
    charset = getattr(resp, "charset", None) or "utf-8"
    try:
        return body.decode(charset, errors="replace")
    except LookupError:  # a charset Python does not know
        return body.decode("utf-8", errors="replace")
