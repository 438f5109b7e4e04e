"""Tokenizer-side helpers: prompt encoding, chat templates, per-token text/bytes for logprobs."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from server.errors import bad_request
from server.protocol import ChatMessage

logger = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: printable stand-in character -> byte value."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


class TokenText:
    """Text and UTF-8 bytes of single tokens (cached), and prompt/chat encoding."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._byte_level = self._is_byte_level(tokenizer)
        self._text = lru_cache(maxsize=1 << 16)(self._token_text)
        self._bytes = lru_cache(maxsize=1 << 16)(self._token_bytes)

    @staticmethod
    def _is_byte_level(tokenizer: Any) -> bool:
        try:
            spec = json.loads(tokenizer.backend_tokenizer.to_str())
        except Exception:  # noqa: BLE001 - slow/unknown tokenizers: fall back to decoded text
            return False
        return (spec.get("decoder") or {}).get("type") == "ByteLevel"

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _token_bytes(self, token_id: int) -> list[int]:
        # Byte-level BPE tokens may hold half a UTF-8 character: their decoded text is U+FFFD, but
        # the raw token string maps back to the exact bytes.
        if self._byte_level:
            raw = self.tokenizer.convert_ids_to_tokens(token_id)
            table = _byte_decoder()
            if isinstance(raw, str) and raw and all(c in table for c in raw):
                return [table[c] for c in raw]
        return list(self._token_text(token_id).encode("utf-8"))

    def text(self, token_id: int) -> str:
        return self._text(token_id)

    def bytes(self, token_id: int) -> list[int]:
        return self._bytes(token_id)

    # -- prompts -------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Apply the model's chat template and tokenize (the template adds any special tokens)."""
        conversation = []
        for i, m in enumerate(messages):
            role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for system
            conversation.append({"role": role, "content": m.text_of(i)})
        if continue_final_message and conversation[-1]["role"] != "assistant":
            raise bad_request("`continue_final_message` needs the last message to be the assistant's",
                              param="continue_final_message")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise bad_request("this model has no chat template; pass --chat-template or use /v1/completions")
        kwargs = dict(chat_template_kwargs or {})
        try:
            out = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=True, **kwargs)
        except Exception as e:  # noqa: BLE001 - template errors (e.g. role order) are the caller's
            raise bad_request(f"the chat template failed on these messages: {e}", param="messages") from e
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(t) for t in ids]
