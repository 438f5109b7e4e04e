"""Per-request state owned by the scheduler (plain Python, no arrays)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}


@dataclass(slots=True)
class RequestTimes:
    arrival: float = field(default_factory=time.monotonic)
    scheduled: float | None = None  # first time it entered the running set
    first_token: float | None = None
    last_token: float | None = None
    inter_token: float | None = None  # seconds between the last two steps that emitted tokens
    finished: float | None = None


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against max_model_len
    eos_token_ids: list[int]
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose KV is in the cache and confirmed
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify next step
    spec_draft_probs: Any = None  # probabilistic drafters: q [drafts, vocab] of spec_token_ids
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at first schedule
    num_preemptions: int = 0
    spec_disabled: bool = False  # set when its proposer failed: decode plainly from then on
    spec_num_drafts: int = 0  # steps that verified drafts
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    times: RequestTimes = field(default_factory=RequestTimes)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def cache_salt(self) -> str | None:
        return self.params.cache_salt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    def append_output(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def drop_last_output(self, n: int) -> None:
        """Forget the last `n` output tokens (accepted drafts past a stop string), in place: proposers
        hold the request's token list."""
        if n > 0:
            del self.output_token_ids[-n:]
            del self.all_token_ids[-n:]
            self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)
