"""A prompt's token ids as the engine will compute them, for precise prefix affinity (kv_blocks.py): the model's own
tokenizer (`--tokenizer`, a directory or a Hugging Face name the router can load offline), applied the way vLLM's
OpenAI server applies it: a completion's text prompt with the tokenizer's special tokens (`add_special_tokens`,
default true, as vLLM), token ids as given; a chat's messages through the tokenizer's chat template with the generation
prompt (`add_generation_prompt`, default true) and no added special tokens. A prompt the router tokenizes
differently from the engine (another chat template, tools, images) only matches fewer blocks: routing moves load,
never changes an answer.

Bounded: a prompt whose text is over MAX_PROMPT_BYTES is not tokenized (the router's event loop would stall on it;
such a request falls back to the approximate index), and nothing a client sends can raise out of `token_ids`.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("pdpair.router.prompt_tokenizer")

MAX_PROMPT_BYTES = 256 * 1024  # about 64k tokens of English: a few ms of a fast tokenizer on the event loop


class PromptTokenizer:
    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer  # only with --tokenizer: a second of import, and memory, otherwise

        self._tokenizer = AutoTokenizer.from_pretrained(path)

    def token_ids(self, body: dict[str, Any], chat: bool) -> list[int] | None:
        """The prompt's token ids, or None (of an unknown shape, too long, or the tokenizer failed on it)."""
        try:
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or _text_bytes(messages) > MAX_PROMPT_BYTES:
                    return None
                ids = self._tokenizer.apply_chat_template(
                    messages, tokenize=True, add_generation_prompt=body.get("add_generation_prompt", True) is True,
                    **_chat_kwargs(body))
                ids = ids.get("input_ids", ids) if isinstance(ids, dict) else ids
                return [int(t) for t in ids]
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                if len(prompt) > MAX_PROMPT_BYTES:
                    return None
                return list(self._tokenizer.encode(prompt, add_special_tokens=body.get("add_special_tokens", True)
                                                   is not False))
            if isinstance(prompt, list) and prompt and all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
                return prompt
        except Exception as exc:  # noqa: BLE001  a client's body must never fail the request here
            logger.debug("prompt not tokenized: %s", exc)
        return None


def _text_bytes(messages: list) -> int:
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part["text"]) for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return total


def _chat_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    if not isinstance(kwargs, dict):
        return {}
    return {k: v for k, v in kwargs.items() if isinstance(k, str) and k not in ("tokenize", "add_generation_prompt",
                                                                                 "conversation", "messages")}
