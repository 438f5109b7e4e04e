"""Stats objects the engine fills each step; server/metrics.py turns them into Prometheus series."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    queue_time: float
    time_to_first_token: float | None
    time_per_output_token: float | None  # mean over tokens after the first
    num_cached_tokens: int
    temperature: float  # the request's sampling temperature (0 = greedy)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


@dataclass(slots=True)
class SpecCounts:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class SpecDecodingStats:
    num_drafts: int = 0  # request-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # The same three counts per temperature bucket (engine.sampling.temperature_bucket).
    by_temperature: dict[str, SpecCounts] = field(default_factory=dict)

    def observe(self, num_draft_tokens: int, num_accepted: int, temperature: str | None = None) -> None:
        """One verification; `temperature`: the request's temperature bucket (None: not counted by bucket)."""
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if temperature is not None:
            c = self.by_temperature.get(temperature)
            if c is None:
                c = self.by_temperature[temperature] = SpecCounts()
            c.num_drafts += 1
            c.num_draft_tokens += num_draft_tokens
            c.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


@dataclass(slots=True)
class IterationStats:
    timestamp: float
    step_seconds: float
    num_scheduled_requests: int
    num_prompt_tokens: int  # prefill tokens computed this step
    num_generation_tokens: int  # tokens emitted this step
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preempted: int
    prefix_cache_queries: int  # cumulative
    prefix_cache_hits: int  # cumulative
    time_to_first_tokens: list[float] = field(default_factory=list)
    # One per request that emitted tokens this step and had before (vLLM's inter-token latency).
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    spec: SpecDecodingStats | None = None
    # K per candidate chosen for the next step (0: not drafting), and the cost model's terms under "auto".
    spec_chosen_k: list[int] = field(default_factory=list)
    spec_cost_estimates: dict[str, float] | None = None
    num_batched_tokens: int = 0  # tokens computed: prefill chunks, decode rows, drafts
    spec_propose_seconds: float = 0.0  # the proposer's time after the step (not in step_seconds)
