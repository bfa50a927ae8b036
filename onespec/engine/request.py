"""One request: its tokens, KV bookkeeping, draft tokens and statistics.

Invariant between steps: `num_computed` tokens have target KV in the cache. In the context
phase (`in_context`) chunks of token_ids[num_computed:] are fed until all are computed and
the last chunk's logits give the next token; in the generation phase num_computed ==
len(token_ids) - 1 and the next step feeds [token_ids[-1], *draft_tokens].
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from onespec.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    target_steps: int = 0              # steps that produced tokens (last prefill chunk included)
    num_draft_tokens: int = 0          # drafts verified
    num_accepted_draft_tokens: int = 0
    num_generated_tokens: int = 0
    num_relaxed_accepted_tokens: int = 0   # emitted drafts only relaxed acceptance took
    # prompt tokens whose KV came from the prefix cache when the request was first
    # scheduled (None until then)
    num_cached_tokens: int | None = None
    num_sa_draft_tokens: int = 0           # drafts verified that the suffix automaton proposed
    num_sa_accepted_draft_tokens: int = 0  # of those, emitted

    @property
    def acceptance_length(self) -> float:
        return self.num_generated_tokens / self.target_steps if self.target_steps else 0.0


@dataclass
class RequestTimes:
    """When (time.monotonic(), seconds) the engine took the request, first scheduled it
    (the time in between is its queue time) and appended its first output token; vLLM's
    names. Apart from RequestMetrics, whose counters equal run for run."""
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None           # "stop", "length", "abort" or "error"
    error: str | None = None                   # why the engine ended it ("error")
    num_computed: int = 0
    in_context: bool = True                    # prefill (or recompute) not finished yet
    block_table: list[int] = field(default_factory=list)
    draft_tokens: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None    # [K, V] q of the drafts (rejection sampling)
    draft_parents: list[int] = field(default_factory=list)  # tree drafts: parent row of each
    thinking_delta: float = 0.0                # relaxed acceptance: delta of this request
    grammar: Any = None                        # xgrammar GrammarMatcher (structured outputs)
    draft_masks: Any = None                    # structured/step.py DraftMasks (graphed steps)
    draft_index: Any = None                    # host-side index of its tokens (host_drafts.py)
    sa_draft_span: tuple[int, int] = (0, 0)    # [start, end) of draft_tokens from the automaton
    sa_match: bool = False     # the automaton matched at the last proposal (used or not)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    times: RequestTimes = field(default_factory=RequestTimes)
    # prefix caching (engine/prefix_cache.py): hashes of full blocks so far, and the cache
    # records of the blocks this request computed or found cached, in order
    block_hashes: list[bytes] = field(default_factory=list)
    prefix_chain: list = field(default_factory=list)
    cache_salt: str | None = None      # its prefix-cache namespace (None: the shared one)
    # log-probabilities (layers/logprobs.py), when asked for: per output token, and per
    # prompt token after the first, {token id: Logprob}
    logprobs: list | None = None
    prompt_logprobs: list | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
