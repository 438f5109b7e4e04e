"""Tokenizer-side helpers: prompt encoding and decoding, per-token text/bytes for logprobs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from server.errors import bad_request
from server.protocol import check_unicode


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


def longest_token(tokenizer: Any) -> int:
    """Characters of the longest vocabulary entry: an upper bound on the text one token decodes to
    (byte-level BPE: one character per byte; SentencePiece pieces are no shorter than their text)."""
    return max(len(t) for t in tokenizer.get_vocab())


class TokenText:
    """Text and UTF-8 bytes of single tokens (cached), and prompt/chat encoding of texts up to
    `max_chars` characters."""

    def __init__(self, tokenizer: Any, max_chars: int) -> None:
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        # Every render gets them, as transformers' apply_chat_template passes them.
        self.special_tokens: dict[str, Any] = dict(getattr(tokenizer, "special_tokens_map", None) or {})
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
    def check_length(self, text: str, param: str) -> None:
        """The cheap check before tokenizing: no prompt that fits the model's context is longer."""
        if len(text) > self.max_chars:
            raise bad_request(f"{param} has {len(text)} characters; the limit is {self.max_chars} "
                              f"(--max-prompt-chars)", param=param, code="prompt_too_long")

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        self.check_length(text, param)
        check_unicode(text, param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.decode_many([token_ids], skip_special_tokens)[0]

    def decode_many(self, prompts: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """Texts of several id lists. Through the Rust tokenizer's batch decode where the Python one
        adds nothing (no space clean-up): it lets go of the GIL, a loop of single decodes holds it
        for each call (milliseconds per long prompt, the event loop waiting meanwhile)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(self.tokenizer, "clean_up_tokenization_spaces", True):
            return backend.decode_batch([list(p) for p in prompts], skip_special_tokens=skip_special_tokens)
        return [self.tokenizer.decode(list(p), skip_special_tokens=skip_special_tokens) for p in prompts]
