"""Prometheus metrics, in a registry of the server's own (no process-global state)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from onespec.engine.request import RequestMetrics
from onespec.serve.async_engine import EngineSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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
        self.steps_by_k = Counter("onespec_draft_len_steps",
                                  "Engine steps run at each draft length K (chosen per step "
                                  "with draft_len_schedule='auto')", ["k"], registry=r)
        self.rate_estimate = Gauge("onespec_draft_len_acceptance_estimate",
                                   "Auto draft length: estimated acceptance rate of each draft "
                                   "position", ["position"], registry=r)
        self.step_time = Gauge("onespec_draft_len_step_seconds",
                               "Auto draft length: step time table by batch bucket and K",
                               ["bucket", "k"], registry=r)
        self._steps_seen: dict[int, int] = {}

    def record_request(self, endpoint: str, finish_reason: str, num_prompt_tokens: int,
                       m: RequestMetrics):
        self.requests.labels(endpoint, finish_reason).inc()
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

    def render(self, snap: EngineSnapshot) -> bytes:
        self.kv_blocks_total.set(snap.num_blocks)
        self.kv_blocks_free.set(snap.num_free_blocks)
        used = snap.num_blocks - snap.num_free_blocks
        self.kv_usage.set(used / snap.num_blocks if snap.num_blocks else 0.0)
        self.waiting.set(snap.num_waiting)
        self.running.set(snap.num_running)
        self.acceptance_length.set(snap.stats.get("acceptance_length", 0.0))
        self.cache_hit_rate.set(snap.stats.get("prefix_cache_hit_rate", 0.0))
        self._render_draft_len(snap.stats)
        return generate_latest(self.registry)

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
