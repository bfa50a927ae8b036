"""Aggregate speculation counters (docs/DECODING.md, "metrics")."""
from __future__ import annotations

from collections import Counter

from onespec.engine.request import RequestMetrics


class SpecStats:
    def __init__(self, max_draft_len: int, policy=None):
        self.policy = policy                    # DraftLenPolicy (draft_len_schedule="auto")
        self.steps_by_k: Counter[int] = Counter()   # engine steps run at each draft length
        self.proposed = [0] * max_draft_len     # drafts verified at position j
        self.accepted = [0] * max_draft_len     # drafts accepted at position j
        self.path_lengths = [0] * (max_draft_len + 1)   # steps that accepted j drafts
        self.totals = RequestMetrics()
        self.num_requests = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0            # prompt tokens found in the prefix cache

    def record_step(self, k: int, drafted: list[tuple[int, int]]):
        """drafted: (num_accepted, real drafts) per generation request that had drafts
        this step; positions past its real drafts (padding after K grew) are not counted."""
        self.steps_by_k[k] += 1
        for n, num_drafts in drafted:
            if k:
                self.path_lengths[n - 1] += 1
            for j in range(num_drafts):
                self.proposed[j] += 1
                self.accepted[j] += j < n - 1

    def record_request(self, m: RequestMetrics, num_prompt_tokens: int):
        self.num_prompt_tokens += num_prompt_tokens
        self.num_cached_tokens += m.num_cached_tokens or 0
        t = self.totals
        t.target_steps += m.target_steps
        t.num_draft_tokens += m.num_draft_tokens
        t.num_accepted_draft_tokens += m.num_accepted_draft_tokens
        t.num_generated_tokens += m.num_generated_tokens
        t.num_relaxed_accepted_tokens += m.num_relaxed_accepted_tokens
        t.num_sa_draft_tokens += m.num_sa_draft_tokens
        t.num_sa_accepted_draft_tokens += m.num_sa_accepted_draft_tokens
        self.num_requests += 1

    def as_dict(self) -> dict:
        t = self.totals
        return {
            "num_requests": self.num_requests,
            "target_steps": t.target_steps,
            "num_generated_tokens": t.num_generated_tokens,
            "num_draft_tokens": t.num_draft_tokens,
            "num_accepted_draft_tokens": t.num_accepted_draft_tokens,
            "num_relaxed_accepted_tokens": t.num_relaxed_accepted_tokens,
            "num_sa_draft_tokens": t.num_sa_draft_tokens,
            "num_sa_accepted_draft_tokens": t.num_sa_accepted_draft_tokens,
            "acceptance_length": t.acceptance_length,
            "acceptance_rate": (t.num_accepted_draft_tokens / t.num_draft_tokens
                                if t.num_draft_tokens else 0.0),
            "acceptance_rate_per_position": [a / p if p else 0.0
                                             for a, p in zip(self.accepted, self.proposed)],
            "num_draft_tokens_per_position": list(self.proposed),
            "num_accepted_tokens_per_position": list(self.accepted),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "prefix_cache_hit_rate": (self.num_cached_tokens / self.num_prompt_tokens
                                      if self.num_prompt_tokens else 0.0),
            "steps_by_draft_len": dict(sorted(self.steps_by_k.items())),
            **({"draft_len_policy": self.policy.as_dict()} if self.policy else {}),
            # steps by accepted drafts (a tree's accepted path length; depth = position)
            "accepted_path_length_counts": list(self.path_lengths),
        }
