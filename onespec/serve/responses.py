"""OpenAI response and stream-chunk bodies for completions and chat completions.

One HTTP request is a `Reply` of one or more `Job`s: a job is one choice, decoded by one
engine request (several prompts on /v1/completions, and `n` samples of each, give several,
indexed prompt-major as OpenAI indexes them: prompt p, sample s -> index p * n + s).

Besides the OpenAI fields, every final body carries the request's speculative-decoding
numbers under "onespec" (summed over its choices), and with `return_token_ids` (a vLLM
extension) each choice carries "token_ids" and the body "prompt_token_ids".
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from onespec.engine.request import RequestMetrics
from onespec.sampling_params import SamplingParams
from onespec.serve.detokenize import IncrementalDetokenizer
from onespec.serve.tools import ToolMode

COMPLETION, CHAT = "completion", "chat"
OBJECT_NAMES = {COMPLETION: ("text_completion", "text_completion"),
                CHAT: ("chat.completion", "chat.completion.chunk")}
ID_PREFIXES = {COMPLETION: "cmpl-", CHAT: "chatcmpl-"}
SPEC_FIELDS = ("target_steps", "num_draft_tokens", "num_accepted_draft_tokens",
               "num_sa_draft_tokens", "num_sa_accepted_draft_tokens")


@dataclass
class Job:
    """One choice: its prompt, its engine request, and what it has produced so far."""
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    detok: IncrementalDetokenizer
    index: int = 0                             # the choice's index in the reply
    counts_prompt: bool = True                 # its prompt's tokens count in usage
    request_id: str = ""                       # the engine request's id (set by the Reply)
    cache_salt: str | None = None              # its prefix-cache namespace
    compiled_grammar: Any = None               # xgrammar's grammar of its structured output
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    num_content_sent: int = 0                  # with tools: characters streamed as content
    logprobs: list = field(default_factory=list)   # per output token {id: Logprob}
    prompt_logprobs: list | None = None        # per prompt token after the first
    num_logprobs_sent: int = 0                 # entries already streamed


@dataclass
class Reply:
    """One HTTP generation request: its choices and the bodies that answer it."""
    kind: str                                  # COMPLETION or CHAT
    model: str
    jobs: list[Job]
    return_token_ids: bool = False
    include_usage: bool = False
    continuous_usage: bool = False             # usage on every chunk of a stream
    tools: ToolMode | None = None              # chat with tools: how calls are read
    logprobs: int | None = None                # alternatives per token, when asked for
    echo: bool = False                         # completions: the prompt leads the text
    echo_only: bool = False                    # ... and nothing is generated (max_tokens 0)
    num_samples: int = 1                       # samples decoded per prompt (best_of or n)
    num_returned: int = 1                      # n: choices returned per prompt (the best)
    token_text: Callable[[int], str] | None = None   # one token's text (for logprobs)
    prompt_text: list[str] = field(default_factory=list)  # per prompt, with echo
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        if not self.request_id:
            self.request_id = ID_PREFIXES[self.kind] + uuid.uuid4().hex
        for job in self.jobs:
            job.request_id = f"{self.request_id}-{job.index}"

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.jobs[0].prompt_token_ids

    def head(self, stream: bool) -> dict:
        return {"id": self.request_id, "object": OBJECT_NAMES[self.kind][int(stream)],
                "created": self.created, "model": self.model, "system_fingerprint": None}

    def usage(self) -> dict:
        """Prompt tokens once per prompt (not per sample), output tokens of every choice."""
        prompting = [j for j in self.jobs if j.counts_prompt]
        num_prompt = sum(len(j.prompt_token_ids) for j in prompting)
        num_out = sum(len(j.detok.token_ids) for j in self.jobs)
        cached = sum(j.metrics.num_cached_tokens or 0 for j in prompting)
        return {"prompt_tokens": num_prompt, "completion_tokens": num_out,
                "total_tokens": num_prompt + num_out,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def spec_metrics(self) -> dict:
        totals = {name: sum(getattr(j.metrics, name) for j in self.jobs)
                  for name in SPEC_FIELDS}
        generated = sum(j.metrics.num_generated_tokens for j in self.jobs)
        steps = totals["target_steps"]
        return {**totals, "acceptance_length": generated / steps if steps else 0.0}

    # ---- whole responses -----------------------------------------------------------------
    def choice(self, job: Job) -> dict:
        choice = {"index": job.index, "finish_reason": job.finish_reason, "logprobs": None}
        if self.logprobs is not None:
            choice["logprobs"] = self.logprobs_body(job, job.logprobs, list(job.detok.token_ids),
                                                    echo=self.echo)
        if self.tools is not None:
            content, calls, choice["finish_reason"] = self.tools.result(job.detok.text,
                                                                        job.finish_reason)
            choice["message"] = {"role": "assistant", "content": content}
            if calls:
                choice["message"]["tool_calls"] = [c.as_dict(i) for i, c in enumerate(calls)]
        elif self.kind == CHAT:
            choice["message"] = {"role": "assistant", "content": job.detok.text}
        else:
            choice["text"] = (self.prompt_text[job.index // self.num_samples]
                              if self.echo else "") + job.detok.text
        if self.return_token_ids:
            choice["token_ids"] = list(job.detok.token_ids)
        return choice

    def logprobs_body(self, job: Job, entries: list, tokens: list[int], echo: bool = False):
        """OpenAI's logprobs object for these tokens: chat's {"content": [...]}, or the
        completions' {"tokens", "token_logprobs", "top_logprobs", "text_offset"} (with echo,
        the prompt's tokens first, the very first with none)."""
        if self.kind == CHAT:
            return {"content": [self._chat_entry(t, e) for t, e in zip(tokens, entries)]}
        if echo:
            tokens = job.prompt_token_ids + tokens
            entries = [None, *(job.prompt_logprobs or [])] + entries
        texts = [self.token_text(t) for t in tokens]
        offsets, at = [], 0
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {"tokens": texts,
                "token_logprobs": [None if e is None else e[t].logprob
                                   for t, e in zip(tokens, entries)],
                "top_logprobs": [None if e is None else
                                 {self.token_text(i): lp.logprob for i, lp in
                                  sorted(e.items(), key=lambda kv: kv[1].rank)}
                                 for e in entries],
                "text_offset": offsets}

    def _chat_entry(self, token: int, entry: dict) -> dict:
        def item(t: int) -> dict:
            text = self.token_text(t)
            return {"token": text, "logprob": entry[t].logprob,
                    "bytes": list(text.encode("utf-8"))}
        top = sorted((t for t in entry if entry[t].rank <= self.logprobs),
                     key=lambda t: entry[t].rank)
        return {**item(token), "top_logprobs": [item(t) for t in top]}

    def returned(self) -> list[dict]:
        """The choices: every job, or with best_of the num_returned of each prompt's jobs
        with the highest sum of their tokens' log-probabilities, indexed from 0 again."""
        if self.num_returned == self.num_samples:
            return [self.choice(j) for j in self.jobs]
        choices, k = [], self.num_samples
        for p in range(len(self.jobs) // k):
            jobs = sorted(self.jobs[p * k:(p + 1) * k], key=_cumulative_logprob, reverse=True)
            for rank, job in enumerate(jobs[:self.num_returned]):
                choice = self.choice(job)
                choice["index"] = p * self.num_returned + rank
                choices.append(choice)
        return choices

    def response(self) -> dict:
        body = {**self.head(stream=False), "choices": self.returned(),
                "usage": self.usage(), "onespec": self.spec_metrics()}
        if self.return_token_ids:
            body["prompt_token_ids"] = list(self.prompt_token_ids)
        return body

    # ---- stream chunks (each one SSE event) ------------------------------------------------
    def chunk(self, job: Job, text: str, token_ids: list[int] | None = None,
              finish_reason: str | None = None, role: bool = False) -> str:
        choice = {"index": job.index, "finish_reason": finish_reason, "logprobs": None}
        if self.kind == CHAT:
            delta = {"role": "assistant", "content": text} if role else \
                ({"content": text} if text or finish_reason is None else {})
            choice["delta"] = delta
        else:
            choice["text"] = text
        if self.return_token_ids and token_ids is not None:
            choice["token_ids"] = list(token_ids)
        start, end = job.num_logprobs_sent, len(job.logprobs)
        if self.logprobs is not None and end > start:     # every entry not sent yet
            job.num_logprobs_sent = end
            choice["logprobs"] = self.logprobs_body(job, job.logprobs[start:end],
                                                    list(job.detok.token_ids[start:end]))
        body = {**self.head(stream=True), "choices": [choice]}
        if self.include_usage:
            body["usage"] = self.usage() if self.continuous_usage else None
        if finish_reason is not None:
            body["onespec"] = self.spec_metrics()
        return sse(body)

    def tool_chunks(self, job: Job, token_ids: list[int]) -> list[str]:
        """A tool-calling chat's chunks for one update: the content that is certainly no
        call yet; once the choice is finished, the rest of its content, its calls (one
        delta, each call whole) and its finish_reason."""
        text = job.detok.text
        chunks = []
        if job.finish_reason is None:
            content, calls = self.tools.visible(text), []
        else:
            content, calls, reason = self.tools.result(text, job.finish_reason)
            content = content if not calls else text[:job.num_content_sent]
        new = (content or "")[job.num_content_sent:]
        if new:
            job.num_content_sent += len(new)
            chunks.append(self.chunk(job, new, token_ids))
        if job.finish_reason is None:
            return chunks
        if calls:
            body = {**self.head(stream=True), "choices": [{
                "index": job.index, "finish_reason": None, "logprobs": None,
                "delta": {"tool_calls": [c.as_dict(i) for i, c in enumerate(calls)]}}]}
            chunks.append(sse(body))
        chunks.append(self.chunk(job, "", None, reason))
        return chunks

    def usage_chunk(self) -> str:
        return sse({**self.head(stream=True), "choices": [], "usage": self.usage(),
                    "onespec": self.spec_metrics()})


def _cumulative_logprob(job: Job) -> float:
    return sum(e[t].logprob for t, e in zip(job.detok.token_ids, job.logprobs))


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
