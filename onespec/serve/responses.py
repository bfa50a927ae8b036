"""OpenAI response and stream-chunk bodies for completions and chat completions.

Besides the OpenAI fields, every final body carries the request's speculative-decoding
numbers under "onespec", and with `return_token_ids` (a vLLM extension) the choice carries
"token_ids" and the body "prompt_token_ids".
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from onespec.engine.request import RequestMetrics
from onespec.sampling_params import SamplingParams
from onespec.serve.detokenize import IncrementalDetokenizer

COMPLETION, CHAT = "completion", "chat"
OBJECT_NAMES = {COMPLETION: ("text_completion", "text_completion"),
                CHAT: ("chat.completion", "chat.completion.chunk")}
ID_PREFIXES = {COMPLETION: "cmpl-", CHAT: "chatcmpl-"}


@dataclass
class Job:
    """One HTTP generation request and what it has produced so far."""
    kind: str                                  # COMPLETION or CHAT
    model: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    detok: IncrementalDetokenizer
    return_token_ids: bool = False
    include_usage: bool = False
    request_id: str = ""
    cache_salt: str | None = None              # its prefix-cache namespace
    compiled_grammar: Any = None               # xgrammar's grammar of its structured output
    created: int = field(default_factory=lambda: int(time.time()))
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    def __post_init__(self):
        if not self.request_id:
            self.request_id = ID_PREFIXES[self.kind] + uuid.uuid4().hex

    def head(self, stream: bool) -> dict:
        return {"id": self.request_id, "object": OBJECT_NAMES[self.kind][int(stream)],
                "created": self.created, "model": self.model, "system_fingerprint": None}

    def usage(self) -> dict:
        num_prompt, num_out = len(self.prompt_token_ids), len(self.detok.token_ids)
        return {"prompt_tokens": num_prompt, "completion_tokens": num_out,
                "total_tokens": num_prompt + num_out,
                "prompt_tokens_details": {"cached_tokens": self.metrics.num_cached_tokens or 0}}

    def spec_metrics(self) -> dict:
        m = self.metrics
        return {"target_steps": m.target_steps, "num_draft_tokens": m.num_draft_tokens,
                "num_accepted_draft_tokens": m.num_accepted_draft_tokens,
                "num_sa_draft_tokens": m.num_sa_draft_tokens,
                "num_sa_accepted_draft_tokens": m.num_sa_accepted_draft_tokens,
                "acceptance_length": m.acceptance_length}

    # ---- whole responses -----------------------------------------------------------------
    def response(self) -> dict:
        choice = {"index": 0, "finish_reason": self.finish_reason, "logprobs": None}
        if self.kind == CHAT:
            choice["message"] = {"role": "assistant", "content": self.detok.text}
        else:
            choice["text"] = self.detok.text
        body = {**self.head(stream=False), "choices": [choice], "usage": self.usage(),
                "onespec": self.spec_metrics()}
        if self.return_token_ids:
            choice["token_ids"] = list(self.detok.token_ids)
            body["prompt_token_ids"] = list(self.prompt_token_ids)
        return body

    # ---- stream chunks (each one SSE event) ------------------------------------------------
    def chunk(self, text: str, token_ids: list[int] | None = None,
              finish_reason: str | None = None, role: bool = False) -> str:
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.kind == CHAT:
            delta = {"role": "assistant", "content": text} if role else \
                ({"content": text} if text or finish_reason is None else {})
            choice["delta"] = delta
        else:
            choice["text"] = text
        if self.return_token_ids and token_ids is not None:
            choice["token_ids"] = list(token_ids)
        body = {**self.head(stream=True), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        if finish_reason is not None:
            body["onespec"] = self.spec_metrics()
        return sse(body)

    def usage_chunk(self) -> str:
        return sse({**self.head(stream=True), "choices": [], "usage": self.usage(),
                    "onespec": self.spec_metrics()})


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
