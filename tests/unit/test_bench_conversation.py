"""tests/bench/bench_conversation.py's pure parts: the oracle's computed tokens (whole blocks of earlier prompts, the
last token always computed), the trace's shape and each turn's prompt holding the one before it. A tokenizer of
whitespace-separated words stands in for the model's. No engine; under 1 s."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "engine"))
import bench_conversation as bc  # noqa: E402

B = bc.BLOCK_TOKENS


class WordTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [hash(w) % 1000 for w in text.split()]


def test_the_oracle_counts_whole_blocks_of_earlier_prompts_and_always_the_last_token():
    a = list(range(100))
    assert bc.oracle_computed([a]) == 100
    assert bc.oracle_computed([a, a]) == 100 + (100 - 3 * B)  # 99 cacheable tokens: 3 whole blocks
    shares_two_blocks = list(range(70)) + [999] * 30
    assert bc.oracle_computed([a, shares_two_blocks]) == 100 + (100 - 2 * B)
    exactly_two_blocks = list(range(2 * B))
    assert bc.oracle_computed([a, exactly_two_blocks]) == 100 + (B + 0)  # its last block holds its last token
    assert bc.oracle_computed([[5] + a[1:], a]) == 200  # a different first token: no block matches


def test_the_trace_is_seeded_and_each_turn_holds_the_one_before():
    tok = WordTokenizer()
    trace = bc.build_trace(3, tok, system_prompts=2, conversations=5, turns=3)
    assert trace == bc.build_trace(3, tok, system_prompts=2, conversations=5, turns=3)
    assert len(trace) == 5 and all(len(c["turns"]) == 3 for c in trace)
    assert {c["system_index"] for c in trace} <= {0, 1}
    for conversation in trace:
        prompts = bc.prompts_of(conversation, "tag")
        assert all(p.startswith("tag System ") for p in prompts)
        for before, after in zip(prompts, prompts[1:]):
            assert after.startswith(before) and len(tok.encode(after)) > len(tok.encode(before))
