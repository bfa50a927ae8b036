"""One request: its tokens, KV bookkeeping, draft tokens and statistics; what a feature
(grammar, host drafts, thinking phase, rejection sampling) keeps per request sits in its
FeatureState, one writer each.

Invariant between steps: `num_computed` tokens have target KV in the cache. In the context
phase (`in_context`) chunks of token_ids[num_computed:] are fed until all are computed and
the last chunk's logits give the next token; in the generation phase num_computed ==
len(token_ids) - 1 and the next step feeds [token_ids[-1], *draft_tokens].
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from onespec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from onespec.speculative.host_drafts import HostDraftState
    from onespec.speculative.thinking import ThinkingState
    from onespec.structured.state import GrammarState


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
class FeatureState:
    """A request's state for the features that need some, each written only by the module
    named beside it (None: the feature is off, or has not run for this request yet). The
    scheduler never reads these; it drops them all when the request finishes (release)."""
    grammar: GrammarState | None = None        # structured/state.py: matcher, draft masks
    host_drafts: HostDraftState | None = None  # speculative/host_drafts.py: token index
    thinking: ThinkingState | None = None      # speculative/thinking.py: relaxed delta
    # engine/model_runner.py (rejection sampling): [K, V] q of the model's draft_tokens
    draft_probs: torch.Tensor | None = None

    def release(self):
        self.grammar = self.host_drafts = self.thinking = self.draft_probs = None


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
    # entries [0, released_blocks) of block_table went back to the pool behind a sliding
    # window (Scheduler._release_behind_window; they name BlockPool.released)
    released_blocks: int = 0
    state_slot: int | None = None   # recurrent-state slot (hybrid targets, state_pool.py)
    draft_tokens: list[int] = field(default_factory=list)
    draft_parents: list[int] = field(default_factory=list)  # tree drafts: parent row of each
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    times: RequestTimes = field(default_factory=RequestTimes)
    features: FeatureState = field(default_factory=FeatureState)
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
