"""What the engine hands back per request per step (plain data, safe to pass between threads)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling import TokenLogprob


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None
    # Speculative decoding so far for this request (cumulative).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
