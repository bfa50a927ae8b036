"""Aggregate speculation counters (docs/DECODING.md, "metrics")."""
from __future__ import annotations

from onespec.engine.request import RequestMetrics


class SpecStats:
    def __init__(self, max_draft_len: int):
        self.proposed = [0] * max_draft_len     # drafts verified at position j
        self.accepted = [0] * max_draft_len     # drafts accepted at position j
        self.path_lengths = [0] * (max_draft_len + 1)   # steps that accepted j drafts
        self.totals = RequestMetrics()
        self.num_requests = 0

    def record_step(self, k: int, num_accepted: list[int]):
        """num_accepted: per generation request whose drafts were real this step."""
        for n in num_accepted:
            if k:
                self.path_lengths[n - 1] += 1
            for j in range(k):
                self.proposed[j] += 1
                self.accepted[j] += j < n - 1

    def record_request(self, m: RequestMetrics):
        t = self.totals
        t.target_steps += m.target_steps
        t.num_draft_tokens += m.num_draft_tokens
        t.num_accepted_draft_tokens += m.num_accepted_draft_tokens
        t.num_generated_tokens += m.num_generated_tokens
        t.num_relaxed_accepted_tokens += m.num_relaxed_accepted_tokens
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
            "acceptance_length": t.acceptance_length,
            "acceptance_rate": (t.num_accepted_draft_tokens / t.num_draft_tokens
                                if t.num_draft_tokens else 0.0),
            "acceptance_rate_per_position": [a / p if p else 0.0
                                             for a, p in zip(self.accepted, self.proposed)],
            # steps by accepted drafts (a tree's accepted path length; depth = position)
            "accepted_path_length_counts": list(self.path_lengths),
        }
