"""Result objects returned by LLM.generate (shaped like vLLM's)."""
from __future__ import annotations

from dataclasses import dataclass, field

from onespec.engine.request import RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    # SamplingParams(logprobs=N): per output token, {token id: Logprob} of the token and the
    # N likeliest (layers/logprobs.py)
    logprobs: list[dict] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # SamplingParams(prompt_logprobs=N): None for the first prompt token, then as above
    prompt_logprobs: list[dict | None] | None = None

    @property
    def num_cached_tokens(self) -> int | None:
        """Prompt tokens whose KV came from the prefix cache (None: never scheduled)."""
        return self.metrics.num_cached_tokens
