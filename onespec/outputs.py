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


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def num_cached_tokens(self) -> int | None:
        """Prompt tokens whose KV came from the prefix cache (None: never scheduled)."""
        return self.metrics.num_cached_tokens
