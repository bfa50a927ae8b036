"""Prometheus metrics, in a registry of the server's own (no process-global state).

Latency histograms and speculative counters carry vLLM's names with onespec's prefix
(vllm:time_to_first_token_seconds -> onespec_time_to_first_token_seconds), so dashboards
built for one read the other with the prefix changed."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from onespec.engine.request import RequestMetrics, RequestTimes
from onespec.serve.async_engine import EngineSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets (seconds), with sub-10-ms ones added for a GPU's inter-token gaps
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                   30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# finish reasons of requests that ran to their end (not aborted, not failed): their
# latencies are observed
COMPLETED = ("stop", "length")


class ServerMetrics:
    def __init__(self, max_draft_len: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("onespec_requests", "Finished HTTP generation requests",
                                ["endpoint", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("onespec_prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.generation_tokens = Counter("onespec_generation_tokens", "Tokens generated",
                                         registry=r)
        self.target_steps = Counter("onespec_target_steps",
                                    "Target forward steps that produced tokens", registry=r)
        self.draft_tokens = Counter("onespec_draft_tokens", "Draft tokens verified",
                                    registry=r)
        self.accepted_tokens = Counter("onespec_accepted_draft_tokens",
                                       "Draft tokens accepted", registry=r)
        self.cache_queries = Counter("onespec_prefix_cache_queries",
                                     "Prompt tokens looked up in the prefix cache", registry=r)
        self.cache_hits = Counter("onespec_prefix_cache_hits",
                                  "Prompt tokens whose KV came from the prefix cache",
                                  registry=r)
        self.cache_hit_rate = Gauge(
            "onespec_prefix_cache_hit_rate",
            "Engine-wide cached fraction of prompt tokens over finished requests", registry=r)
        self.sa_draft_tokens = Counter("onespec_sa_draft_tokens",
                                       "Draft tokens verified that the suffix automaton proposed",
                                       registry=r)
        self.sa_accepted_tokens = Counter("onespec_sa_accepted_draft_tokens",
                                          "Suffix-automaton draft tokens accepted", registry=r)
        buckets = [1.0 + 0.25 * i for i in range(4 * max(max_draft_len, 1) + 1)]
        self.acceptance_hist = Histogram(
            "onespec_request_acceptance_length",
            "Tokens per target step of each request (1 = no speculation gain)",
            buckets=buckets, registry=r)
        self.acceptance_length = Gauge(
            "onespec_acceptance_length",
            "Engine-wide generated tokens per target step over finished requests", registry=r)
        self.kv_blocks_total = Gauge("onespec_kv_blocks_total", "KV pool blocks", registry=r)
        self.kv_blocks_free = Gauge("onespec_kv_blocks_free", "Free KV pool blocks",
                                    registry=r)
        self.kv_usage = Gauge("onespec_kv_cache_usage", "Fraction of KV blocks in use",
                              registry=r)
        self.waiting = Gauge("onespec_num_requests_waiting", "Requests queued in the engine",
                             registry=r)
        self.running = Gauge("onespec_num_requests_running", "Requests running in the engine",
                             registry=r)
        # the load gauges again under vLLM's own names, which vllm-router's load-aware
        # policies read from a worker's /metrics (worker_routes.py)
        self.vllm_running = Gauge("vllm:num_requests_running",
                                  "Requests running in the engine (vLLM's name)", registry=r)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting",
                                  "Requests queued in the engine (vLLM's name)", registry=r)
        self.vllm_kv_usage = Gauge("vllm:kv_cache_usage_perc",
                                   "Fraction of KV blocks in use (vLLM's name)", registry=r)
        self.steps_by_k = Counter("onespec_draft_len_steps",
                                  "Engine steps run at each draft length K (chosen per step "
                                  "with draft_len_schedule='auto')", ["k"], registry=r)
        self.rate_estimate = Gauge("onespec_draft_len_acceptance_estimate",
                                   "Auto draft length: estimated acceptance rate of each draft "
                                   "position", ["position"], registry=r)
        self.step_time = Gauge("onespec_draft_len_step_seconds",
                               "Auto draft length: step time table by batch bucket and K",
                               ["bucket", "k"], registry=r)
        self.ttft = Histogram("onespec_time_to_first_token_seconds",
                              "Time from the engine taking a request to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("onespec_inter_token_latency_seconds",
                             "Time between a request's consecutive engine steps that emitted "
                             "tokens (a speculative step emits several)",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("onespec_e2e_request_latency_seconds",
                             "Time from the engine taking a request to its last token",
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("onespec_request_queue_time_seconds",
                                    "Time a request waited in the engine before its first step",
                                    buckets=REQUEST_BUCKETS, registry=r)
        self.drafts = Counter("onespec_spec_decode_num_drafts",
                              "Request-steps that verified drafts", registry=r)
        self.draft_tokens_per_pos = Counter(
            "onespec_spec_decode_num_draft_tokens_per_pos",
            "Draft tokens verified at each draft position (1 = the first draft)",
            ["position"], registry=r)
        self.accepted_per_pos = Counter(
            "onespec_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (1 = the first draft)",
            ["position"], registry=r)
        self._steps_seen: dict[int, int] = {}
        self._seen: dict[tuple, int] = {}

    def record_request(self, endpoint: str, finish_reason: str, num_prompt_tokens: int,
                       m: RequestMetrics, times: RequestTimes | None = None,
                       token_times: list[float] = (), end: float | None = None):
        """times: the engine's (arrival, first scheduled); token_times: when
        (time.monotonic()) each engine step that emitted tokens for the request reached the
        server; end: when its last one did. A request that ran to its end (COMPLETED) is
        observed in the latency histograms, measured from its arrival."""
        self.requests.labels(endpoint, finish_reason).inc()
        if finish_reason in COMPLETED and times is not None and times.arrival_time is not None:
            self._observe_latencies(times, list(token_times), end)
        self.prompt_tokens.inc(num_prompt_tokens)
        if m.num_cached_tokens is not None:            # None: never scheduled
            self.cache_queries.inc(num_prompt_tokens)
            self.cache_hits.inc(m.num_cached_tokens)
        self.generation_tokens.inc(m.num_generated_tokens)
        self.target_steps.inc(m.target_steps)
        self.draft_tokens.inc(m.num_draft_tokens)
        self.accepted_tokens.inc(m.num_accepted_draft_tokens)
        self.sa_draft_tokens.inc(m.num_sa_draft_tokens)
        self.sa_accepted_tokens.inc(m.num_sa_accepted_draft_tokens)
        if m.target_steps:
            self.acceptance_hist.observe(m.acceptance_length)

    def _observe_latencies(self, times: RequestTimes, token_times: list[float],
                           end: float | None):
        start = times.arrival_time
        if times.first_scheduled_time is not None:
            self.queue_time.observe(times.first_scheduled_time - start)
        if token_times:
            self.ttft.observe(token_times[0] - start)
            for before, after in zip(token_times, token_times[1:]):
                self.itl.observe(after - before)
        if end is not None:
            self.e2e.observe(end - start)

    def render(self, snap: EngineSnapshot) -> bytes:
        self.kv_blocks_total.set(snap.num_blocks)
        self.kv_blocks_free.set(snap.num_free_blocks)
        used = snap.num_blocks - snap.num_free_blocks
        self.kv_usage.set(used / snap.num_blocks if snap.num_blocks else 0.0)
        self.waiting.set(snap.num_waiting)
        self.running.set(snap.num_running)
        self.vllm_kv_usage.set(used / snap.num_blocks if snap.num_blocks else 0.0)
        self.vllm_waiting.set(snap.num_waiting)
        self.vllm_running.set(snap.num_running)
        self.acceptance_length.set(snap.stats.get("acceptance_length", 0.0))
        self.cache_hit_rate.set(snap.stats.get("prefix_cache_hit_rate", 0.0))
        self._render_draft_len(snap.stats)
        self._render_positions(snap.stats)
        return generate_latest(self.registry)

    def _advance(self, counter, key: tuple, total: int):
        """Moves a counter on by what the engine's running total gained since last time."""
        counter.inc(max(0, total - self._seen.get(key, 0)))
        self._seen[key] = total

    def _render_positions(self, stats: dict):
        """Per-position acceptance, from the engine's running totals (llm.stats())."""
        self._advance(self.drafts, ("drafts",),
                      sum(stats.get("accepted_path_length_counts", [])))
        for j, n in enumerate(stats.get("num_draft_tokens_per_position", [])):
            self._advance(self.draft_tokens_per_pos.labels(str(j + 1)), ("draft", j), n)
        for j, n in enumerate(stats.get("num_accepted_tokens_per_position", [])):
            self._advance(self.accepted_per_pos.labels(str(j + 1)), ("accepted", j), n)

    def _render_draft_len(self, stats: dict):
        """Chosen-K counters (moved on by the steps since the last scrape) and, with the
        auto draft length, its acceptance estimates and step-time table."""
        for k, n in stats.get("steps_by_draft_len", {}).items():
            self.steps_by_k.labels(str(k)).inc(n - self._steps_seen.get(k, 0))
            self._steps_seen[k] = n
        policy = stats.get("draft_len_policy")
        if policy is None:
            return
        for j, a in enumerate(policy["acceptance_rate_estimates"]):
            self.rate_estimate.labels(str(j + 1)).set(a)
        for key, ms in policy["step_ms"].items():
            bucket, k = key.split("x")
            self.step_time.labels(bucket, k).set(ms / 1e3)
