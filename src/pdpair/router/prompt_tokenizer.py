"""A prompt's token ids as the engine will compute them, for precise prefix affinity (kv_blocks.py): the model's own
tokenizer (`--tokenizer`, a directory or a Hugging Face name the router can load offline), applied the way vLLM's
OpenAI server applies it: a completion's text prompt with the tokenizer's special tokens (`add_special_tokens`,
default true, as vLLM), token ids as given; a chat's messages through the tokenizer's chat template with the generation
prompt (`add_generation_prompt`, default true) and no added special tokens. A prompt the router tokenizes
differently from the engine (another chat template, tools, images) only matches fewer blocks: routing moves load,
never changes an answer.

Bounded, because it runs on the router's event loop and the body is the client's: a chat whose messages are over
MAX_PROMPT_BYTES as JSON or MAX_MESSAGES in number, a text prompt over MAX_PROMPT_BYTES and a token-id prompt over
MAX_PROMPT_TOKENS are not tokenized (the approximate index decides for them); of the client's
`chat_template_kwargs` only short scalar values reach the template, never a template of the client's own (a Jinja
template the router rendered could loop or allocate without bound) nor the tokenizer's own options; and nothing a
client sends can raise out of `token_ids`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("pdpair.router.prompt_tokenizer")

MAX_PROMPT_BYTES = 256 * 1024  # about 64k tokens of English: a few ms of a fast tokenizer on the event loop
MAX_MESSAGES = 1024
MAX_PROMPT_TOKENS = 131_072
MAX_TOKEN_ID = 2**32 - 1
MAX_KWARG_CHARS = 256
# The template's own arguments and the tokenizer's options: never the client's to set.
_RESERVED_KWARGS = frozenset({"chat_template", "tokenize", "add_generation_prompt", "conversation", "messages",
                              "tokenizer_kwargs", "return_dict", "return_tensors", "return_assistant_tokens_mask",
                              "padding", "truncation", "max_length", "tools", "documents", "continue_final_message"})


class PromptTokenizer:
    def __init__(self, path: str) -> None:
        """A ValueError naming `path` when it cannot be loaded (a missing directory, no transformers)."""
        try:
            from transformers import AutoTokenizer  # only with --tokenizer: a second of import, and memory, otherwise

            self._tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # noqa: BLE001  OSError, ImportError, ValueError...: one clear error at start
            raise ValueError(f"--tokenizer {path!r} could not be loaded: {exc}") from None

    def token_ids(self, body: dict[str, Any], chat: bool) -> list[int] | None:
        """The prompt's token ids, or None (of an unknown shape, too long, or the tokenizer failed on it)."""
        try:
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES or \
                        len(json.dumps(messages)) > MAX_PROMPT_BYTES:
                    return None
                ids = self._tokenizer.apply_chat_template(
                    messages, tokenize=True, return_dict=False,
                    add_generation_prompt=body.get("add_generation_prompt", True) is True, **_chat_kwargs(body))
                if isinstance(ids, Mapping):  # a tokenizer that returns its encoding whatever it is asked
                    ids = ids["input_ids"]
                return _checked([int(t) for t in ids])
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                if len(prompt) > MAX_PROMPT_BYTES:
                    return None
                return _checked(list(self._tokenizer.encode(
                    prompt, add_special_tokens=body.get("add_special_tokens", True) is not False)))
            if isinstance(prompt, list) and prompt and len(prompt) <= MAX_PROMPT_TOKENS and all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in prompt):
                return prompt
        except Exception as exc:  # noqa: BLE001  a client's body must never fail the request here
            logger.debug("prompt not tokenized: %s", exc)
        return None


def _checked(ids: list[int]) -> list[int] | None:
    """The ids, or None when there are too many or one is outside what a block's hash packs (kv_blocks.chain)."""
    if len(ids) > MAX_PROMPT_TOKENS or any(not 0 <= t <= MAX_TOKEN_ID for t in ids):
        return None
    return ids


def _chat_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The client's chat_template_kwargs that may reach the template: short scalar values under names not reserved
    (e.g. enable_thinking), as the engine renders them too."""
    kwargs = body.get("chat_template_kwargs")
    if not isinstance(kwargs, dict):
        return {}
    return {k: v for k, v in kwargs.items()
            if isinstance(k, str) and k not in _RESERVED_KWARGS and len(k) <= MAX_KWARG_CHARS
            and (v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= MAX_KWARG_CHARS))}
