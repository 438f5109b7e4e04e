"""Every Prometheus series the server exposes, with vLLM's names and `model_name` label, in one private
registry per app (several servers can live in one process). Counters and histograms are fed by
`on_iteration` on the engine thread; gauges read an engine snapshot at scrape time, so they are exact while
idle; `take_log_window` sums what the periodic stats log line reports."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from engine.sampling import TEMPERATURE_BUCKETS, temperature_bucket
from engine.stats import FinishedRequestStats, IterationStats, SpecDecodingStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Bucket bounds follow vLLM's so dashboards built for it read the same.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
# The acceptance-rate gauge covers this much recent history, summed per second on arrival so that its
# buffer has a fixed size however long /metrics goes unscraped.
_ACCEPTANCE_WINDOW_S = 60


@dataclass(slots=True)
class EngineSnapshot:
    num_running: int
    num_waiting: int
    kv_free_blocks: int
    kv_total_blocks: int

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.kv_free_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0


@dataclass(slots=True)
class LogWindow:
    """Totals since the previous stats log line."""

    seconds: float
    prompt_tokens: int
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int
    spec: SpecDecodingStats | None = None


@dataclass(slots=True)
class _SpecWindow:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)

    def add(self, spec: SpecDecodingStats) -> None:
        self.drafts += spec.num_drafts
        self.draft_tokens += spec.num_draft_tokens
        self.accepted += spec.num_accepted_tokens
        if len(self.per_pos) < len(spec.accepted_per_pos):
            self.per_pos.extend([0] * (len(spec.accepted_per_pos) - len(self.per_pos)))
        for i, n in enumerate(spec.accepted_per_pos):
            self.per_pos[i] += n


class Metrics:
    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot],
                 num_speculative_tokens: int = 0, spec_method: str = "",
                 rejection_sample_method: str = "standard") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._snapshot = snapshot
        self._lock = threading.Lock()
        self._window_start = time.monotonic()
        self._window_prompt = 0
        self._window_gen = 0
        self._prefix_queries = 0  # engine counters are cumulative: remember the last seen values
        self._prefix_hits = 0
        self._window_prefix = (0, 0)
        self._init_series()
        self.spec_enabled = num_speculative_tokens > 0
        self._spec_window = _SpecWindow()
        # [second, draft tokens, accepted] per second of the window
        self._recent: deque[list[int]] = deque(maxlen=_ACCEPTANCE_WINDOW_S + 1)
        if self.spec_enabled:
            self._init_spec(num_speculative_tokens)
            # Like vLLM's *_config_info series: which verification rule runs, and whether outputs still follow
            # the model's distribution (typical and synthetic acceptance do not).
            Gauge("specserve:spec_decode_config_info", "Speculative decoding configuration (value 1).",
                  ["model_name", "method", "rejection_sample_method", "lossless"], registry=self.registry,
                  ).labels(model_name, spec_method, rejection_sample_method,
                           str(rejection_sample_method in ("standard", "strict", "block")).lower()).set(1)

    def _init_series(self) -> None:
        """The series every server has (the speculative ones come from `_init_spec`)."""
        model_name = self.model_name
        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str, read: Callable[[EngineSnapshot], float]) -> None:
            Gauge(name, doc, labels, registry=reg).labels(model_name).set_function(
                lambda: read(self._snapshot()))

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              lambda s: s.num_running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
              lambda s: s.num_waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda s: s.kv_usage)
        gauge("specserve:kv_cache_free_blocks", "KV cache blocks free (cached prefixes included).",
              lambda s: s.kv_free_blocks)
        gauge("specserve:kv_cache_total_blocks", "KV cache blocks in the pool.", lambda s: s.kv_total_blocks)

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(name, doc, labels + (extra or []), registry=reg)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(
            model_name)
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.").labels(model_name)
        self.request_success = counter("vllm:request_success", "Count of finished requests.",
                                       ["finished_reason"])
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.").labels(
            model_name)
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.").labels(model_name)
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.").labels(
            model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in "
                              "seconds.", _TTFT_BUCKETS).labels(model_name)
        # vLLM's current pair: one observation per request-step after the first token (a speculative step
        # emitting several tokens counts once), and each finished request's mean time per output token.
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", _TPOT_BUCKETS).labels(model_name)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.",
                                      _TPOT_BUCKETS).labels(model_name)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in "
                             "seconds.", _LATENCY_BUCKETS).labels(model_name)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING "
                                    "phase for request.", _LATENCY_BUCKETS).labels(model_name)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens "
                                               "processed.", _TOKEN_BUCKETS).labels(model_name)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens", "Number of generation "
                                                   "tokens processed.", _TOKEN_BUCKETS).labels(model_name)

    def _init_spec(self, k: int) -> None:
        # vLLM's names and labels; counters get the `_total` suffix on exposition.
        labels = ["model_name", "engine"]
        reg, name = self.registry, self.model_name

        def counter(metric: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(metric, doc, labels + (extra or []), registry=reg)

        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.").labels(
            name, "0")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                         "Number of draft tokens.").labels(name, "0")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens",
                                     "Number of accepted tokens.").labels(name, "0")
        per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                          "Accepted tokens per draft position.", ["position"])
        self.spec_per_pos = [per_pos.labels(name, "0", str(i)) for i in range(k)]
        self._per_pos_family = per_pos
        Gauge("vllm:spec_decode_draft_acceptance_rate",
              f"Accepted / drafted tokens over the last {_ACCEPTANCE_WINDOW_S:.0f} s.", labels,
              registry=reg).labels(name, "0").set_function(self._recent_acceptance)
        # Acceptance against sampling temperature: our own series, labelled by temperature bucket (vLLM's
        # above keep vLLM's labels). Every bucket exists from the start, at zero.
        temp = ["model_name", "temperature"]
        acceptance = Histogram(
            "specserve:request_spec_decode_acceptance_rate",
            "Per finished request: accepted / drafted tokens (requests that drafted), by temperature bucket.",
            temp, buckets=_RATE_BUCKETS, registry=reg)
        self.request_acceptance = {b: acceptance.labels(name, b) for b in TEMPERATURE_BUCKETS}
        by_temp = [Counter(f"specserve:spec_decode_{metric}", f"{doc}, by temperature bucket.", temp,
                           registry=reg)
                   for metric, doc in (("num_drafts", "Number of spec decoding drafts"),
                                       ("num_draft_tokens", "Number of draft tokens"),
                                       ("num_accepted_tokens", "Number of accepted tokens"))]
        self.spec_by_temperature = {b: tuple(c.labels(name, b) for c in by_temp) for b in TEMPERATURE_BUCKETS}
        # The speculation choice of each step (static or "auto"), per candidate request.
        self.chosen_k = Histogram(
            "specserve:spec_decode_chosen_num_speculative_tokens",
            "Per request-step that could draft: the number of draft tokens chosen (0 = not drafting).",
            ["model_name"], buckets=[float(i) for i in range(max(k, 1) + 1)], registry=reg).labels(name)
        drafting = Gauge("specserve:spec_decode_num_requests",
                         "Running requests at the last step, by whether they draft for the next one.",
                         ["model_name", "drafting"], registry=reg)
        self.num_drafting = drafting.labels(name, "true")
        self.num_not_drafting = drafting.labels(name, "false")
        self.cost_estimates = Gauge(
            "specserve:spec_decode_cost_model_seconds",
            'Adaptive speculation\'s current cost model (`"num_speculative_tokens": "auto"`): step_1_token, '
            "step_per_token_at_8, step_per_token_at_64 and draft_per_token seconds.", ["model_name", "term"],
            registry=reg)

    def _recent_acceptance(self) -> float:
        with self._lock:
            cutoff = int(time.monotonic()) - _ACCEPTANCE_WINDOW_S
            drafted = sum(d for sec, d, _ in self._recent if sec >= cutoff)
            accepted = sum(a for sec, _, a in self._recent if sec >= cutoff)
        return accepted / drafted if drafted else 0.0

    # -- inputs --------------------------------------------------------------------------------
    def on_iteration(self, stats: IterationStats) -> None:
        """Engine-thread stats callback: one call per engine step."""
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.num_preempted:
            self.num_preemptions.inc(stats.num_preempted)
        for ttft in stats.time_to_first_tokens:
            self.ttft.observe(ttft)
        for itl in stats.inter_token_latencies:
            self.itl.observe(itl)
        for fin in stats.finished:
            self._observe_finished(fin)
        with self._lock:
            dq = max(0, stats.prefix_cache_queries - self._prefix_queries)
            dh = max(0, stats.prefix_cache_hits - self._prefix_hits)
            self._prefix_queries, self._prefix_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
            self._window_prompt += stats.num_prompt_tokens
            self._window_gen += stats.num_generation_tokens
        if dq:
            self.prefix_cache_queries.inc(dq)
        if dh:
            self.prefix_cache_hits.inc(dh)
        if stats.spec is not None:
            self._observe_spec(stats.spec)
        if self.spec_enabled:
            self._observe_choice(stats)

    def _observe_finished(self, fin: FinishedRequestStats) -> None:
        self.request_success.labels(self.model_name, fin.finish_reason).inc()
        self.e2e.observe(fin.e2e_latency)
        self.queue_time.observe(fin.queue_time)
        if fin.time_per_output_token is not None:
            self.request_tpot.observe(fin.time_per_output_token)
        if self.spec_enabled and fin.spec_num_draft_tokens:
            self.request_acceptance[temperature_bucket(fin.temperature)].observe(
                fin.spec_num_accepted_tokens / fin.spec_num_draft_tokens)
        self.request_prompt_tokens.observe(fin.num_prompt_tokens)
        self.request_generation_tokens.observe(fin.num_generation_tokens)

    def _observe_spec(self, spec: SpecDecodingStats) -> None:
        if not self.spec_enabled or spec.num_drafts == 0:
            return
        self.spec_drafts.inc(spec.num_drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens)
        self.spec_accepted.inc(spec.num_accepted_tokens)
        for i, n in enumerate(spec.accepted_per_pos):
            if i >= len(self.spec_per_pos):  # a longer draft than configured (should not happen)
                self.spec_per_pos.append(self._per_pos_family.labels(self.model_name, "0", str(i)))
            if n:
                self.spec_per_pos[i].inc(n)
        for bucket, c in spec.by_temperature.items():
            drafts, draft_tokens, accepted = self.spec_by_temperature[bucket]
            drafts.inc(c.num_drafts)
            draft_tokens.inc(c.num_draft_tokens)
            accepted.inc(c.num_accepted_tokens)
        with self._lock:
            self._spec_window.add(spec)
            sec = int(time.monotonic())
            if self._recent and self._recent[-1][0] == sec:
                self._recent[-1][1] += spec.num_draft_tokens
                self._recent[-1][2] += spec.num_accepted_tokens
            else:
                self._recent.append([sec, spec.num_draft_tokens, spec.num_accepted_tokens])

    def _observe_choice(self, stats: IterationStats) -> None:
        for k in stats.spec_chosen_k:
            self.chosen_k.observe(k)
        if stats.num_scheduled_requests:  # idle reports carry no choice: keep the last step's numbers
            drafting = sum(1 for k in stats.spec_chosen_k if k > 0)
            self.num_drafting.set(drafting)
            self.num_not_drafting.set(max(0, stats.num_running - drafting))
        for term, seconds in (stats.spec_cost_estimates or {}).items():
            self.cost_estimates.labels(self.model_name, term.removesuffix("_seconds")).set(seconds)

    # -- outputs -------------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot()

    def take_log_window(self) -> LogWindow:
        with self._lock:
            now = time.monotonic()
            q0, h0 = self._window_prefix
            spec = None
            if self.spec_enabled:
                w = self._spec_window
                spec = SpecDecodingStats(w.drafts, w.draft_tokens, w.accepted, list(w.per_pos))
                self._spec_window = _SpecWindow()
            window = LogWindow(now - self._window_start, self._window_prompt, self._window_gen,
                               self._prefix_queries - q0, self._prefix_hits - h0, spec)
            self._window_start, self._window_prompt, self._window_gen = now, 0, 0
            self._window_prefix = (self._prefix_queries, self._prefix_hits)
        return window


def format_stats_line(window: LogWindow, snap: EngineSnapshot) -> str:
    secs = max(window.seconds, 1e-9)
    hit = 100.0 * window.prefix_hits / window.prefix_queries if window.prefix_queries else 0.0
    return (f"Avg prompt throughput: {window.prompt_tokens / secs:.1f} tokens/s, "
            f"Avg generation throughput: {window.generation_tokens / secs:.1f} tokens/s, "
            f"Running: {snap.num_running} reqs, Waiting: {snap.num_waiting} reqs, "
            f"KV cache usage: {100.0 * snap.kv_usage:.1f}%, Prefix cache hit rate: {hit:.1f}%")


def format_spec_line(window: LogWindow) -> str | None:
    """vLLM's `SpecDecoding metrics:` line for the window, or None when nothing was drafted."""
    spec = window.spec
    if spec is None or spec.num_drafts == 0:
        return None
    secs = max(window.seconds, 1e-9)
    per_pos = ", ".join(f"{n / spec.num_drafts:.3f}" for n in spec.accepted_per_pos)
    rate = 100.0 * spec.num_accepted_tokens / spec.num_draft_tokens if spec.num_draft_tokens else 0.0
    mean_len = 1 + spec.num_accepted_tokens / spec.num_drafts
    return (f"SpecDecoding metrics: Mean acceptance length: {mean_len:.2f}, "
            f"Accepted throughput: {spec.num_accepted_tokens / secs:.2f} tokens/s, "
            f"Drafted throughput: {spec.num_draft_tokens / secs:.2f} tokens/s, "
            f"Accepted: {spec.num_accepted_tokens} tokens, Drafted: {spec.num_draft_tokens} tokens, "
            f"Per-position acceptance rate: {per_pos}, Avg Draft acceptance rate: {rate:.1f}%")


def merge_expositions(texts: dict[str, bytes]) -> bytes:
    """One Prometheus exposition from several replicas' expositions, each sample labelled `replica`."""
    families: dict[str, Any] = {}
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text.decode()):
            labelled = [s._replace(labels={**s.labels, "replica": replica}) for s in fam.samples]
            if fam.name in families:
                families[fam.name].samples.extend(labelled)
            else:
                fam.samples = labelled
                families[fam.name] = fam

    class _Collected:
        def collect(self) -> list[Any]:
            return list(families.values())

    return generate_latest(_Collected())
