"""Log-probabilities of emitted and prompt tokens, from the target's raw logits (before
logit processors, temperature, top-k and top-p: vLLM's default, "raw_logprobs").

Under speculation the emitted tokens' log-probabilities come from the verify pass: verify
row j of a request gives the distribution plain decoding has at that position once drafts
0..j-1 are accepted, and only rows of emitted tokens are read. So they equal plain
decoding's (to the rounding of a different batch shape).

A step asks for them with a LogprobRows (which rows, which tokens, how many alternatives);
the worker answers with TokenLogprobs; the scheduler stores one Logprob dict per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Logprob:
    """One token's entry (vLLM's shape): its log-probability, its rank in the distribution
    (1 = likeliest) and its text."""
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class LogprobRows:
    """Rows of a step whose log-probabilities are wanted."""
    index: torch.Tensor                 # [M] int64 rows they read (logit rows for output
    #                                     tokens, hidden rows for prompt tokens)
    tokens: torch.Tensor | None         # [M] the token each row scores (None: the step's
    #                                     chosen tokens, known after acceptance)
    num_tops: list[int]                 # [M] alternatives each row's request asks for
    owners: list[int]                   # [M] host: whose row (logit row, or context chunk)

    @property
    def num_top(self) -> int:
        return max(self.num_tops)


@dataclass
class TokenLogprobs:
    tokens: torch.Tensor                # [M] int64 the scored tokens
    logprob: torch.Tensor               # [M] float32, of the scored token
    rank: torch.Tensor                  # [M] int64, 1 = the likeliest
    top_ids: torch.Tensor               # [M, N] int64
    top_logprobs: torch.Tensor          # [M, N] float32


def token_logprobs(logits: torch.Tensor,     # [M, V] raw logits of the rows
                   tokens: torch.Tensor,     # [M] int64 the token each row scores
                   num_top: int) -> TokenLogprobs:
    lp = logits.float().log_softmax(-1)                                       # [M, V]
    chosen = lp.gather(1, tokens.view(-1, 1)).squeeze(1)                       # [M]
    rank = (lp > chosen.unsqueeze(1)).sum(1) + 1                               # [M]
    top = lp.topk(num_top, dim=-1) if num_top else None
    empty = lp.new_empty(lp.shape[0], 0)
    return TokenLogprobs(tokens, chosen, rank, top.indices if top else empty.long(),
                         top.values if top else empty)


def host_entries(res: TokenLogprobs, num_tops: list[int]) -> list[dict[int, Logprob]]:
    """Per row m, {token id: Logprob} of its scored token and its num_tops[m] likeliest
    alternatives (one host copy of the tensors)."""
    tokens, lps, ranks = res.tokens.tolist(), res.logprob.tolist(), res.rank.tolist()
    ids, tops = res.top_ids.tolist(), res.top_logprobs.tolist()
    out = []
    for m, n in enumerate(num_tops):
        entry = {i: Logprob(v, r + 1) for r, (i, v) in enumerate(zip(ids[m][:n], tops[m][:n]))}
        entry[tokens[m]] = Logprob(lps[m], ranks[m])
        out.append(entry)
    return out
