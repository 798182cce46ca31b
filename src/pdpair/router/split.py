"""Selective disaggregation: per request, whether the router splits it (prefill computes the prompt, decode loads
its KV and generates) or sends it to a decode instance alone (decode computes the prompt itself, as a single engine
would). A short prompt gains nothing from the split: two API servers in a row and a KV transfer cost more than
computing it where it is decoded.

The rule: a prompt whose estimated length (`prompt_tokens`) is below the threshold goes to decode alone. The
threshold starts at `--local-prompt-tokens` (0: every request is split, nothing is learned) and then follows what
this router measures, per length bucket (powers of two of the estimated tokens): the time from the request's arrival
to decode's first streamed chunk, of split and of local requests (an exponentially weighted mean of each). The
learned threshold is the bucket edge that best separates the buckets where local was faster (below it) from those
where split was (above it); the current threshold stays while no edge separates strictly better, so a threshold is
only moved by evidence. To keep both means current, a streamed request whose bucket has seen `EXPLORE_EVERY`
requests since the other way's last sample goes the other way once (at most one in EXPLORE_EVERY of a bucket; one in
EXPLORE_EVERY_COLD while the other way has fewer than MIN_SAMPLES samples there, so a new bucket learns quickly).
Only streamed requests are measured: a non-streamed answer comes whole, after its last token.

Why a learned threshold and not a fixed one: where the split pays depends on the model, the hardware, decode's load
and the network (llm-d and Dynamo take it as a fixed number of tokens); the router sees both costs as they are.
The estimate needs no tokenizer: token-id prompts are counted, text is its UTF-8 length over `BYTES_PER_TOKEN`;
the threshold is learned in that same unit, so only its order matters, not its accuracy.
With learning off (--no-learn-split-threshold) the threshold stays where it started and nothing is explored: a fixed
rule, and with a threshold above every prompt, a router that never splits.
With prefix affinity on (--prefix-affinity), the estimate is of the part of the prompt the chosen decode does not
hold: a decode's cache holds the prompts it computed alone and those whose KV it loaded, so the chunks of the prompt
the router sent that decode before (prefix_index.py) are taken off (`uncached_tokens`). A conversation's next turn,
whose history that decode holds, then counts only its new part and is computed there alone, as llm-d's
`nonCachedTokens` does. Without affinity the whole prompt counts (the router keeps no index to estimate with).

This module is pure: no clock, no I/O (app.py measures, decides through it and serves its figures).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pdpair.contract import ROUTER_MODES
from pdpair.router.prefix_index import CHUNK_BYTES

SPLIT, LOCAL = MODES = ROUTER_MODES  # the `mode` label of pdpair_router_requests_total

BYTES_PER_TOKEN = 4  # about a BPE token of English text; only the order of the estimates matters (above)
BUCKETS = 24  # bucket b holds estimates in [2**b, 2**(b+1)); 2**23 tokens is above any context length
MIN_SAMPLES = 3  # a bucket's mean counts once it has this many samples of each way
EXPLORE_EVERY = 16  # one streamed request in this many of a bucket goes the other way when that way's mean is stale
# ... and one in this many while that way has fewer than MIN_SAMPLES samples in the bucket: a bucket the threshold
# sends one way must still gather the other way's samples within a few dozen requests, or the threshold cannot move
# (a conversation trace kept every first turn in one bucket, split, for 768 requests: docs/benchmarks.md). At most
# 2 * MIN_SAMPLES such requests per bucket and way in a router's life (explored requests that fail give no sample).
EXPLORE_EVERY_COLD = 4
MEAN_WEIGHT = 0.2  # the weight of a new sample in a bucket's mean (about the last 5 samples count)


def prompt_tokens(body: dict[str, Any], chat: bool) -> int | None:
    """An estimate of the prompt's length in tokens, from the request body (OpenAI completions or chat), or None when
    the body has no prompt of a known shape (the engine refuses it; the router splits it, as before). Never raises:
    the body is the client's."""
    def text_tokens(text: str) -> int:
        return math.ceil(len(text.encode("utf-8", "replace")) / BYTES_PER_TOKEN)

    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        total = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                total += text_tokens(content)
            elif isinstance(content, list):  # parts: only text is counted (an image's tokens are unknown here)
                total += sum(text_tokens(part["text"]) for part in content
                             if isinstance(part, dict) and isinstance(part.get("text"), str))
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt)  # one prompt of token ids
        if all(isinstance(p, str) for p in prompt):
            return max(text_tokens(p) for p in prompt)  # a batch: each prompt is its own request in the engine
        if all(isinstance(p, list) for p in prompt):
            return max(len(p) for p in prompt)
    return None


TOKENS_PER_CHUNK = CHUNK_BYTES // BYTES_PER_TOKEN  # a prefix_index chunk in this module's unit (32)


def uncached_tokens(tokens: int | None, held_tokens: int) -> int | None:
    """The prompt's length less the `held_tokens` leading tokens the chosen instance holds (None stays None)."""
    if tokens is None:
        return None
    return max(0, tokens - held_tokens)


def bucket(tokens: int) -> int:
    """The length bucket of an estimate: floor(log2(tokens)), 0 for 0 and 1, at most BUCKETS - 1."""
    return min(max(int(tokens), 1).bit_length() - 1, BUCKETS - 1)


@dataclass
class _Mean:
    value: float = 0.0
    samples: int = 0
    stale_for: int = 0  # requests of this bucket decided since this way's last sample
    explored: int = 0  # requests of this bucket sent this way by exploration


@dataclass
class SplitPolicy:
    """The split-or-local rule and its learned threshold (module docstring). `start_tokens` 0: always split.
    `learn` False: the threshold stays at `start_tokens` and no request explores the other way."""

    start_tokens: int = 0
    learn: bool = True
    threshold: int = field(init=False)
    decisions: dict[str, int] = field(init=False)
    _means: dict[str, list[_Mean]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.start_tokens, bool) or not isinstance(self.start_tokens, int) or self.start_tokens < 0:
            raise ValueError(f"--local-prompt-tokens must be an integer >= 0, got {self.start_tokens!r}")
        self.threshold = self.start_tokens
        self.decisions = {mode: 0 for mode in MODES}
        self._means = {mode: [_Mean() for _ in range(BUCKETS)] for mode in MODES}

    @property
    def enabled(self) -> bool:
        return self.start_tokens > 0

    def decide(self, tokens: int | None, measured: bool) -> str:
        """SPLIT or LOCAL for a request of `tokens` estimated prompt tokens (None: unknown, split). `measured`: its
        time to the first chunk will be observed (a streamed request), so it may explore the other way."""
        mode = SPLIT
        if self.enabled and tokens is not None:
            mode = LOCAL if tokens < self.threshold else SPLIT
            if measured and self.learn:
                other = self._means[LOCAL if mode == SPLIT else SPLIT][bucket(tokens)]
                other.stale_for += 1
                # cold only while few were sent that way (explored requests that fail give no sample: the fast
                # rate must not last for ever)
                cold = other.samples < MIN_SAMPLES and other.explored < 2 * MIN_SAMPLES
                if other.stale_for >= (EXPLORE_EVERY_COLD if cold else EXPLORE_EVERY):
                    other.stale_for = 0
                    other.explored += 1
                    mode = LOCAL if mode == SPLIT else SPLIT
        self.decisions[mode] += 1
        return mode

    def observe(self, tokens: int, mode: str, seconds: float) -> None:
        """A measured request: `seconds` from its arrival to decode's first chunk, sent `mode`."""
        if not (self.enabled and self.learn) or mode not in MODES or not (seconds >= 0 and math.isfinite(seconds)):
            return
        mean = self._means[mode][bucket(tokens)]
        mean.value = seconds if mean.samples == 0 else mean.value + MEAN_WEIGHT * (seconds - mean.value)
        mean.samples += 1
        mean.stale_for = 0
        self.threshold = self._fit()

    def means(self) -> dict[str, dict[int, tuple[float, int]]]:
        """Per way, the buckets with samples: bucket -> (mean seconds, samples). For logs and tests."""
        return {mode: {b: (m.value, m.samples) for b, m in enumerate(self._means[mode]) if m.samples}
                for mode in MODES}

    def _fit(self) -> int:
        """The threshold the means support best (module docstring)."""
        faster: dict[int, str] = {}
        for b in range(BUCKETS):
            split, local = self._means[SPLIT][b], self._means[LOCAL][b]
            if split.samples >= MIN_SAMPLES and local.samples >= MIN_SAMPLES:
                faster[b] = SPLIT if split.value <= local.value else LOCAL
        if not faster:
            return self.threshold

        def wrong(local_below: float) -> int:  # buckets on the wrong side of an edge at 2**local_below tokens
            return sum(1 for b, mode in faster.items()
                       if (mode == SPLIT and b < local_below) or (mode == LOCAL and b >= local_below))

        # The current threshold's edge, in buckets: the bucket holding it is mixed (counted on neither side).
        current = math.log2(self.threshold) if self.threshold >= 1 else 0.0
        mixed = None if current.is_integer() else int(current)
        kept = sum(1 for b, mode in faster.items() if b != mixed and
                   ((mode == SPLIT and b < current) or (mode == LOCAL and b >= current)))
        best = min(range(BUCKETS + 1), key=lambda e: (wrong(e), abs(e - current)))
        if wrong(best) >= kept:
            return self.threshold
        return 2 ** best
