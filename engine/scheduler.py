"""Token-budget scheduler (vLLM v1 style): every running request gets the tokens it still needs under
`max_num_batched_tokens`, then waiting requests are admitted; out of blocks, the newest running request is
preempted (recomputed later)."""

from __future__ import annotations

import contextlib
import time
from collections import deque

from engine.kv.block_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.step import RunnerOutput, ScheduledRequest, SchedulerOutput

# Per request a step served: the request, its new tokens (appended), the runner's error.
Update = tuple[Request, list[int], str | None]


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- admission ---------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        req.status = status
        req.spec_token_ids, req.spec_draft_probs = [], None
        req.times.finished = time.monotonic()
        self.kv.free(request_id)
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- one step ------------------------------------------------------------------------------
    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids, victim.spec_draft_probs = [], None
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted_ids.append(victim.request_id)

    def _entry(self, req: Request, num_new: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        known = req.num_tokens
        end = start + num_new
        token_ids = req.all_token_ids[start:min(end, known)]
        spec: list[int] = []
        if end > known:  # the tail of this chunk is draft tokens
            spec = req.spec_token_ids[: end - known]
            token_ids = token_ids + spec
        num_logits = (1 + len(spec)) if end >= known else 0
        return ScheduledRequest(
            request_id=req.request_id, token_ids=token_ids, start_pos=start,
            block_table=self.kv.block_table(req.request_id), num_logits=num_logits,
            spec_token_ids=spec, params=req.params, prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids, eos_token_ids=req.eos_token_ids,
            draft_probs=req.spec_draft_probs if spec else None)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = req.num_tokens_with_spec - req.num_computed_tokens
            if num_new > budget:
                if req.num_computed_tokens + budget < req.num_tokens:
                    num_new = budget  # a prefill chunk
                else:
                    # Drafts that do not fit the budget: verify none rather than part.
                    req.spec_token_ids, req.spec_draft_probs = [], None
                    num_new = req.num_tokens - req.num_computed_tokens
            assert num_new > 0, (req.request_id, req.num_computed_tokens, req.num_tokens)
            while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append(self._entry(req, num_new))
                scheduled_ids.add(req.request_id)
                budget -= num_new
                i += 1
                continue
            # `req` itself was preempted; the list shifted, do not advance i.

        if not out.preempted_ids:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                hits, num_hit = self.kv.get_computed_blocks(req.request_id, req.all_token_ids, req.cache_salt)
                num_new = min(req.num_tokens - num_hit, budget)
                if not self.kv.allocate_slots(req.request_id, num_hit, num_new, new_computed_blocks=hits):
                    break
                self.waiting.popleft()
                if req.times.scheduled is None:
                    req.times.scheduled = time.monotonic()
                    req.num_cached_prompt_tokens = num_hit
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = num_hit
                self.running.append(req)
                out.scheduled.append(self._entry(req, num_new))
                budget -= num_new

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def update(self, out: SchedulerOutput, res: RunnerOutput) -> list[Update]:
        """Apply the runner's tokens: computed positions (rejected drafts rolled back), tokens appended, full
        blocks cached; the output processor decides who finishes."""
        updates: list[Update] = []
        now = time.monotonic()
        for sr, new_tokens, err in zip(out.scheduled, res.sampled_token_ids, res.errors, strict=True):
            req = self.requests.get(sr.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if err is not None:
                updates.append((req, [], err))
                continue
            num_spec = len(sr.spec_token_ids)
            req.spec_token_ids, req.spec_draft_probs = [], None
            if not new_tokens:  # mid-prefill chunk
                req.num_computed_tokens += len(sr.token_ids)
                continue
            # KV is valid for every computed token except rejected drafts.
            num_rejected = num_spec - (len(new_tokens) - 1)
            req.num_computed_tokens += len(sr.token_ids) - num_rejected
            req.append_output(new_tokens)
            if req.times.first_token is None:
                req.times.first_token = now
            if req.times.last_token is not None:
                req.times.inter_token = now - req.times.last_token
            req.times.last_token = now
            # Only confirmed tokens become prefix-cache blocks.
            self.kv.cache_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens,
                                      req.cache_salt)
            updates.append((req, new_tokens, None))
        return updates
