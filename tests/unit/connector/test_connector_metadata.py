"""Side-channel wire types: the compatibility hash is checked before the body is decoded."""

from __future__ import annotations

import pytest

from pdpair.connector.metadata import (
    CompatibilityError,
    Hello,
    KvLayout,
    Pull,
    compatibility_factors,
    compatibility_hash,
    decode,
    encode,
)

LAYOUT = KvLayout(["l0", "l1"], [16384, 16384], 32, "torch.float32", 1)


def test_roundtrip_with_matching_hash():
    local = compatibility_hash(compatibility_factors(LAYOUT, "0.32.0"))
    pull = Pull("decode-1", "prefill-1", 2, [5, 6, 7], 9, 6)
    assert decode(encode(pull, local), local) == pull
    hello = Hello(3, "pair", 0, "tcp", b"\x00uid", "prefill-0", b"n" * 32)
    assert decode(encode(hello, local), local) == hello


@pytest.mark.parametrize(
    "other",
    [
        compatibility_factors(KvLayout(["l0", "l1"], [8192, 8192], 32, "torch.float32", 1), "0.32.0"),
        compatibility_factors(KvLayout(["l0", "l1"], [16384, 16384], 16, "torch.float32", 1), "0.32.0"),
        compatibility_factors(LAYOUT, "0.33.0"),
    ],
)
def test_any_factor_change_is_a_clear_mismatch_not_a_decode_error(other):
    local = compatibility_hash(compatibility_factors(LAYOUT, "0.32.0"))
    peer = compatibility_hash(other)
    assert peer != local
    frames = encode(Pull("d", "p", 0, [1], 0, 2), peer)
    with pytest.raises(CompatibilityError, match=f"peer compatibility hash {peer} != local {local}"):
        decode(frames, local)


def test_malformed_message_is_refused():
    with pytest.raises(CompatibilityError, match="1 frame"):
        decode([b"only-one"], "x")


def test_a_pull_carries_its_transfer_tag_and_bounds_it():
    """Prefill copies the Pull's tag onto every put; a tag outside [0, 2^63) or a generation outside u32 is refused at
    decode time, before anything reads it (the native id is 64-bit, the side channel's ints stop at 2^63 - 1)."""
    import msgspec

    local = compatibility_hash(compatibility_factors(LAYOUT, "0.32.0"))
    pull = Pull("decode-1", "prefill-1", 0, [5], 9, 2, (1 << 63) - 1, (1 << 32) - 1)
    assert decode(encode(pull, local), local) == pull
    assert Pull("d", "p", 0, [], 0, 0).transfer_tag == 0  # a release-only Pull is untagged
    for tag, generation in (((1 << 63), 0), (0, 1 << 32), (-1, 0)):
        body = msgspec.msgpack.encode({"type": "pull", "transfer_id": "d", "remote_request_id": "p", "first_block": 0,
                                       "dst_block_ids": [1], "signal_slot": 0, "expected_signals": 2,
                                       "transfer_tag": tag, "transfer_generation": generation})
        with pytest.raises(ValueError):
            decode([local.encode(), body], local)
