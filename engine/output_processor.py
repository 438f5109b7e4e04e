"""The one place a request finishes, and where its new tokens become text and a `RequestOutput`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from engine.detokenize import IncrementalDetokenizer, StopMatcher, Tokenizer
from engine.faults import NO_FAULTS, FaultHooks
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling import TokenLogprob
from engine.scheduler import Scheduler, Update
from engine.stats import FinishedRequestStats, IterationStats
from engine.step import RunnerOutput, SchedulerOutput
from engine.structured import StructuredOutputManager

logger = logging.getLogger(__name__)

Logprobs = list[TokenLogprob] | None


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, structured: StructuredOutputManager,
                 release: Callable[[Request], None], max_model_len: int,
                 faults: FaultHooks = NO_FAULTS) -> None:
        """`release`: drops what other parts keep for a request that ended (grammar, speculation)."""
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.structured = structured
        self.release = release
        self.max_model_len = max_model_len
        self.faults = faults
        self._detok: dict[str, IncrementalDetokenizer] = {}
        # Requests that ended outside a step (aborts): reported with the next stats object.
        self.finished_backlog: list[FinishedRequestStats] = []

    def add(self, req: Request, stop_matcher: StopMatcher | None) -> None:
        self._detok[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params,
                                                             stop_matcher)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if req is None:
            return None
        self._detok.pop(request_id, None)
        self.release(req)
        self.finished_backlog.append(finished_stats(req))
        return request_output(req, [], "", None)

    def process(self, updates: list[Update], so: SchedulerOutput, res: RunnerOutput,
                stats: IterationStats) -> list[RequestOutput]:
        """Finish what ended this step and build every updated request's output."""
        logprobs = {sr.request_id: lp for sr, lp in zip(so.scheduled, res.logprobs, strict=True)}
        return [self._process(req, new_tokens, error, logprobs.get(req.request_id), stats)
                for req, new_tokens, error in updates]

    def _process(self, req: Request, new_tokens: list[int], error: str | None, logprobs: Logprobs,
                 stats: IterationStats) -> RequestOutput:
        if error is not None:
            self._fail(req, error)
        else:
            new_tokens = self._check_stop(req, new_tokens)
        if not self.structured.accept(req.request_id, new_tokens) and not req.status.finished:
            # Masked rows cannot leave the grammar: a request that did fails.
            self._fail(req, "the output left the request's grammar")
        text, new_tokens = self._detokenize_new(req, new_tokens)
        _count(req, new_tokens, stats)
        if req.status.finished:
            detok = self._detok.pop(req.request_id, None)
            if detok is not None and not isinstance(req.stop_reason, str) and req.error is None:
                text += self._detokenize(req, detok, None)[0]  # text held back for a stop string
            self.release(req)
            stats.finished.append(finished_stats(req))
        return request_output(req, new_tokens, text, logprobs)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status.finished:  # it ended earlier this step: only its final status changes
            req.status = status
        else:
            self.scheduler.finish_request(req.request_id, status)

    def _fail(self, req: Request, error: str) -> None:
        req.error = error
        self._finish(req, RequestStatus.FINISHED_ERROR)

    def _check_stop(self, req: Request, new_tokens: list[int]) -> list[int]:
        """EOS, stop ids, max_tokens and max_model_len: tokens after the first that ends the request are
        dropped."""
        p = req.params
        out_before = req.num_output_tokens - len(new_tokens)
        all_before = req.num_tokens - len(new_tokens)
        for i, tok in enumerate(new_tokens):
            n_out = out_before + i + 1
            status = None
            if ((not p.ignore_eos and tok in req.eos_token_ids) or tok in p.stop_token_ids) \
                    and n_out >= p.min_tokens:
                req.stop_reason = tok if tok in p.stop_token_ids else None
                status = RequestStatus.FINISHED_STOPPED
            elif n_out >= req.max_tokens or all_before + i + 1 >= self.max_model_len:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                req.drop_last_output(len(new_tokens) - i - 1)
                self._finish(req, status)
                return new_tokens[: i + 1]
        return new_tokens

    def _detokenize_new(self, req: Request, new_tokens: list[int]) -> tuple[str, list[int]]:
        """The new tokens' text; a stop string ends the request at the token that completed it."""
        detok = self._detok.get(req.request_id)
        if detok is None or not new_tokens:
            return "", new_tokens
        seen = len(detok.output_token_ids)
        text, stop_str = self._detokenize(req, detok, new_tokens)
        if stop_str is not None:
            kept = len(detok.output_token_ids) - seen
            req.drop_last_output(len(new_tokens) - kept)
            new_tokens = new_tokens[:kept]
            req.stop_reason = stop_str
            self._finish(req, RequestStatus.FINISHED_STOPPED)
        return text, new_tokens

    def _detokenize(self, req: Request, detok: IncrementalDetokenizer,
                    new_tokens: list[int] | None) -> tuple[str, str | None]:
        """(text, stop string) for new tokens (None: flush); a detokenizer failure fails this request only."""
        try:
            self.faults.raise_if("detokenize_error", [req.prompt_token_ids])
            return detok.add(new_tokens) if new_tokens is not None else (detok.flush(), None)
        except Exception:  # noqa: BLE001 - the engine thread must go on for everyone else
            logger.exception("detokenizing %s failed; failing the request", req.request_id)
            self._fail(req, "detokenization failed")  # the exception stays in the log
            return "", None


def _count(req: Request, new_tokens: list[int], stats: IterationStats) -> None:
    stats.num_generation_tokens += len(new_tokens)
    if new_tokens and req.num_output_tokens == len(new_tokens):
        # Prefill done: count the whole prompt (cached part included), as vLLM does.
        stats.num_prompt_tokens += req.num_prompt_tokens
        stats.time_to_first_tokens.append(stats.timestamp - req.times.arrival)
    elif new_tokens and req.times.inter_token is not None:
        stats.inter_token_latencies.append(req.times.inter_token)


def request_output(req: Request, new_tokens: list[int], text: str, logprobs: Logprobs) -> RequestOutput:
    finished = req.status.finished
    return RequestOutput(
        request_id=req.request_id, new_token_ids=new_tokens, new_text=text,
        new_logprobs=logprobs if new_tokens else None, finished=finished,
        finish_reason=req.status.value if finished else None, stop_reason=req.stop_reason,
        num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
        num_cached_tokens=req.num_cached_prompt_tokens, error=req.error,
        spec_num_drafts=req.spec_num_drafts, spec_num_draft_tokens=req.spec_num_draft_tokens,
        spec_num_accepted_tokens=req.spec_num_accepted_tokens)


def finished_stats(req: Request) -> FinishedRequestStats:
    t = req.times
    end = t.finished or time.monotonic()
    tpot = None
    if t.first_token is not None and t.last_token is not None and req.num_output_tokens > 1:
        tpot = (t.last_token - t.first_token) / (req.num_output_tokens - 1)
    return FinishedRequestStats(
        finish_reason=req.status.value, num_prompt_tokens=req.num_prompt_tokens,
        num_generation_tokens=req.num_output_tokens, e2e_latency=end - t.arrival,
        queue_time=(t.scheduled or end) - t.arrival,
        time_to_first_token=None if t.first_token is None else t.first_token - t.arrival,
        time_per_output_token=tpot, num_cached_tokens=req.num_cached_prompt_tokens,
        temperature=req.params.temperature, spec_num_draft_tokens=req.spec_num_draft_tokens,
        spec_num_accepted_tokens=req.spec_num_accepted_tokens)
