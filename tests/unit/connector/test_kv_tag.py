"""`remote_kv_tag` (connector/metadata.py): decode loads a prompt's KV only when prefill's tag verifies against
decode's own request, so params copied onto another prompt, edited, forged or missing make decode compute the prompt
itself. The engine tier replays the same cases through real engines
(`tests/engine/test_pd_engine.py::test_kv_transfer_params_that_are_not_this_prompts_are_computed_locally`).
Cost: well under a second (the fuzz case: the hypothesis profile's count, 100 in CI, 3000 with
PDPAIR_FULL_PROPERTY_TESTS=1)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdpair.connector.metadata import (
    PARAM_REMOTE_GENERATION,
    PARAM_REMOTE_INSTANCE,
    PARAM_REMOTE_KV_TAG,
    PARAM_REMOTE_NUM_BLOCKS,
    PARAM_REMOTE_NUM_TOKENS,
    PARAM_REMOTE_PAIR,
    PARAM_REMOTE_REQUEST_ID,
    kv_tag,
    kv_tag_key,
    kv_tag_verifies,
)

KEY = kv_tag_key("a-side-channel-key-of-the-pair-0123456789")
PROMPT = [101, 7, 42, 9000, 3, 3, 128000]


def tagged(prompt: list[int], **changes) -> dict:
    params = {PARAM_REMOTE_REQUEST_ID: "cmpl-abc-0", PARAM_REMOTE_PAIR: "demo", PARAM_REMOTE_INSTANCE: "prefill-0",
              PARAM_REMOTE_GENERATION: 3, PARAM_REMOTE_NUM_TOKENS: len(prompt), PARAM_REMOTE_NUM_BLOCKS: 1}
    params[PARAM_REMOTE_KV_TAG] = kv_tag(KEY, params, prompt)
    params.update(changes)
    return params


def test_the_prompt_prefill_computed_verifies():
    assert kv_tag_verifies(KEY, tagged(PROMPT), PROMPT)
    assert kv_tag_verifies(KEY, tagged(PROMPT), tuple(PROMPT))  # vLLM may hand a tuple or a ConstantList


def test_params_on_another_prompt_do_not_verify():
    other = PROMPT[:-1] + [128001]
    assert not kv_tag_verifies(KEY, tagged(PROMPT), other)
    assert not kv_tag_verifies(KEY, tagged(PROMPT), PROMPT + [5])  # same beginning, more tokens than prefill computed
    assert not kv_tag_verifies(KEY, tagged(PROMPT), PROMPT[:-1])


def test_an_edited_reference_does_not_verify():
    for field, value in ((PARAM_REMOTE_REQUEST_ID, "cmpl-other-0"), (PARAM_REMOTE_PAIR, "other"),
                         (PARAM_REMOTE_INSTANCE, "prefill-1"), (PARAM_REMOTE_GENERATION, 4),
                         (PARAM_REMOTE_NUM_TOKENS, len(PROMPT) - 1)):
        assert not kv_tag_verifies(KEY, tagged(PROMPT, **{field: value}), PROMPT), field


def test_missing_forged_or_foreign_tags_do_not_verify():
    params = tagged(PROMPT)
    del params[PARAM_REMOTE_KV_TAG]
    assert not kv_tag_verifies(KEY, params, PROMPT)
    assert not kv_tag_verifies(KEY, tagged(PROMPT, **{PARAM_REMOTE_KV_TAG: "0" * 64}), PROMPT)
    assert not kv_tag_verifies(KEY, tagged(PROMPT, **{PARAM_REMOTE_KV_TAG: 7}), PROMPT)
    assert not kv_tag_verifies(kv_tag_key("another-pair-s-side-channel-key-987654321"), tagged(PROMPT), PROMPT)


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20),
                    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@settings(deadline=None)
@given(st.dictionaries(st.sampled_from([PARAM_REMOTE_REQUEST_ID, PARAM_REMOTE_PAIR, PARAM_REMOTE_INSTANCE,
                                        PARAM_REMOTE_GENERATION, PARAM_REMOTE_NUM_TOKENS, PARAM_REMOTE_KV_TAG]),
                       _VALUES),
       st.lists(st.integers(min_value=0, max_value=2**31), max_size=16))
def test_any_params_from_a_client_only_ever_fail_to_verify(params, prompt):
    """kv_transfer_params come with the request: whatever their shape, checking them raises nothing."""
    assert kv_tag_verifies(KEY, params, prompt) in (True, False)
