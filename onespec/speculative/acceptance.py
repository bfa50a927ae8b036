"""Acceptance of drafted tokens (docs/DECODING.md, "acceptance") as pure tensor functions.

Every function returns `accepted_tokens [B, K+1]` and `num_accepted [B]` (>= 1): the
first num_accepted entries of a row are its emitted tokens, the last of them being the
target's own correction or bonus token; the entries after them are don't-cares.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from onespec.layers.sampler import (ACCEPT_DRAW, SeededRows, counter_uniform, fill_random_rows,
                                    sample_from_probs)

FORCED_POOL_SIZE = 4096
FORCED_POOL_SEED = 0
FORCED_POOL_STRIDE = 131   # step stride into the pool; coprime with the pool size
FORCED_RATE_DRAW = 3       # counter_uniform kind of forced per-position draws (not a sampler's)
_forced_pools: dict[str, Tensor] = {}
_forced_counts: dict[tuple, Tensor] = {}


def _num_leading_true(mask: Tensor) -> Tensor:  # [B, K] bool -> [B] int64
    return mask.long().cumprod(-1).sum(-1)


def strict_accept(draft_tokens: Tensor,   # [B, K] int64
                  target_tokens: Tensor,  # [B, K+1] int64 (argmax, or sampled per position)
                  ) -> tuple[Tensor, Tensor]:  # ([B, K+1] int64, [B] int64)
    """num_accepted = 1 + #leading j < K with draft[j] == target[j]; emitted = target[:n].

    drafts [1,3,4], targets [1,3,2,4] -> accepted [1,3,2], num_accepted 3.
    """
    k = draft_tokens.shape[1]
    if k == 0:           # plain decoding: one kernel, not a comparison of empty rows
        return target_tokens, target_tokens.new_ones(target_tokens.shape[0])
    num_accepted = 1 + _num_leading_true(draft_tokens == target_tokens[:, :k])
    return target_tokens, num_accepted


def _uniform(t: Tensor, g: torch.Generator | None) -> Tensor:
    return t.uniform_(0.0, 1.0, generator=g)


def rejection_accept(draft_tokens: Tensor,   # [B, K] int64
                     draft_probs: Tensor,    # [B, K, V] q, in target-vocab space
                     target_probs: Tensor,   # [B, K+1, V] p, same filters as q
                     seeded: SeededRows | None = None,  # positions: each row's first draft
                     default_generator: torch.Generator | None = None,
                     ) -> tuple[Tensor, Tensor]:  # ([B, K+1] int64, [B] int64)
    """Speculative rejection sampling (lossless: emitted tokens are distributed as p).

    Accept d_j while u_j < p_j(d_j) / q_j(d_j), u_j ~ U[0, 1) (written u * q < p, no
    division). At the first rejection j emit r ~ normalize(max(p_j - q_j, 0)); if all K
    pass, emit r ~ p_K (q_K := 0 gives that from the same formula). An all-zero residual
    (p_j == q_j up to rounding, or a draft outside q's support) falls back to p_j.
    Unseeded rows draw from default_generator (the K uniforms, then the residual sample).
    A seeded row whose first draft is at position P draws u_j as the ACCEPT_DRAW number of
    position P + j and the residual as the TARGET_DRAW of position P + (accepted drafts).
    """
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)            # [B]
    uniforms = torch.empty((batch, k), dtype=torch.float32, device=draft_tokens.device)
    offsets = torch.arange(k, device=draft_tokens.device)             # [K]
    fill_random_rows(uniforms, seeded, default_generator, _uniform,
                     lambda s: counter_uniform(s.seeds[:, None], s.positions[:, None] + offsets,
                                               ACCEPT_DRAW, 1).squeeze(-1))

    index = draft_tokens.unsqueeze(-1)                                 # [B, K, 1]
    p_draft = target_probs[:, :k].gather(-1, index).squeeze(-1).float()  # [B, K]
    q_draft = draft_probs.gather(-1, index).squeeze(-1).float()        # [B, K]
    num_drafts_accepted = _num_leading_true(uniforms * q_draft < p_draft)  # [B] in [0, K]

    p_stop = target_probs[rows, num_drafts_accepted].float()          # [B, V]
    if k > 0:
        q_stop = draft_probs[rows, num_drafts_accepted.clamp(max=k - 1)].float()  # [B, V]
        q_stop = q_stop * (num_drafts_accepted < k).unsqueeze(-1)
        residual = (p_stop - q_stop).clamp_min(0.0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_stop)
    else:
        residual = p_stop
    stop_seeded = None if seeded is None else \
        replace(seeded, positions=seeded.positions + num_drafts_accepted[seeded.index])
    last_token = sample_from_probs(residual, default_generator, stop_seeded)  # [B]

    accepted_tokens = torch.cat([draft_tokens, last_token.unsqueeze(-1)], dim=1)  # [B, K+1]
    accepted_tokens.scatter_(1, num_drafts_accepted.unsqueeze(-1), last_token.unsqueeze(-1))
    return accepted_tokens, num_drafts_accepted + 1


def _forced_pool(device: torch.device) -> Tensor:  # [FORCED_POOL_SIZE] float32
    key = str(device)
    if key not in _forced_pools:
        g = torch.Generator().manual_seed(FORCED_POOL_SEED)   # CPU: identical on every rank
        _forced_pools[key] = torch.rand(FORCED_POOL_SIZE, generator=g).to(device)
    return _forced_pools[key]


def forced_num_accepted(acceptance_length: float, num_requests: int, k: int, step: int,
                        device: torch.device | str) -> Tensor:  # [num_requests] int64
    """Benchmark override: n = floor(a) + [u < frac(a)], clamped to [1, k+1], E[n] = a.

    u for request i at `step` is pool[(step * 131 + i) % 4096] from a fixed seeded pool.
    """
    device = torch.device(device)
    key = (str(device), acceptance_length, k)
    if key not in _forced_counts:          # n for every pool entry, built once per (a, K)
        whole = math.floor(acceptance_length)
        frac = acceptance_length - whole
        n = whole + (_forced_pool(device) < frac).long()
        _forced_counts[key] = n.clamp(min=1, max=k + 1)
    idx = torch.arange(num_requests, device=device).add_(step, alpha=FORCED_POOL_STRIDE) \
        .remainder_(FORCED_POOL_SIZE)
    return _forced_counts[key][idx]


def forced_num_accepted_by_rates(rates: Tensor,   # [>= K] float32 conditional rate a_j
                                 num_requests: int, k: int, step: Tensor,  # [] int64
                                 ) -> Tensor:      # [num_requests] int64 in [1, K+1]
    """Benchmark override by per-position rates: draft j of request i is kept when
    u(step, i, j) < a_j, and n = 1 + the number of leading kept drafts, so
    E[n] = 1 + sum_{i<=K} prod_{j<=i} a_j. u is counter_uniform of (step, request i,
    column j): a pure function on the device, identical on every rank and graph-safe.

    rates [1.0, 0.0, 1.0], K 3 -> n 2 for every request (the second draft always fails)."""
    rows = torch.arange(num_requests, device=rates.device)                  # [B]
    u = counter_uniform(step, rows, FORCED_RATE_DRAW, max(k, 1))[:, :k]     # [B, K]
    return 1 + _num_leading_true(u < rates[:k])


def forced_run(draft_tokens: Tensor,   # [B, K] int64
               target_tokens: Tensor,  # [B, K+1] int64
               num_accepted: Tensor,   # [B] int64 in [1, K+1] (forced)
               ) -> Tensor:            # [B, K+1] int64
    """A forced count's emitted tokens as drafts then the target's token at the row the run
    stops: [d_1 .. d_(n-1), t_(n-1)], the sequence the rows' grammar masks assumed.

    drafts [5, 6, 7], targets [1, 2, 3, 4], n 3 -> [5, 6, 3, 4] (entries past n: don't-care).
    """
    last = (num_accepted - 1).unsqueeze(-1)                           # [B, 1]
    out = torch.cat([draft_tokens, target_tokens[:, -1:]], dim=1)     # [B, K+1]
    return out.scatter_(1, last, target_tokens.gather(1, last))


def relaxed_accept(draft_tokens: Tensor,   # [B, K] int64
                   target_logits: Tensor,  # [B, K+1, V]
                   delta: Tensor,          # [B] float: relaxed_delta inside thinking, else 0
                   topk: int,
                   ) -> tuple[Tensor, Tensor, Tensor]:  # ([B, K+1], [B], [B, K]) int64
    """Relaxed acceptance for thinking phases (greedy only; lossy by design).

    At position j take the top-`topk` probabilities p_1 >= p_2 >= ... (softmax) and the
    threshold p_1 - delta; draft j is accepted if it is candidate 1, or candidate c > 1 with
    p_c >= threshold (the scan stops at the first c below it). Accepted drafts are emitted
    as drafted; the token at the first rejected position (or the bonus) is the top-1.
    Returns (accepted_tokens, num_accepted, relaxed [B, K]: accepted drafts that differ
    from the top-1). topk == 1, or delta == 0 without ties, is strict acceptance.

    probs [.5 .3 .1 .05 .05], [.1 .6 .2 .05 .05], [.4 .1 .35 .1 .05], drafts [1, 1, 3],
    topk 2, delta 0.3 -> accepted [1, 1, 0], num_accepted 3, relaxed [1, 0, 0].
    """
    k = draft_tokens.shape[1]
    top1 = target_logits.argmax(-1)                                     # [B, K+1]
    if k == 0:
        return top1, top1.new_ones(top1.shape[0]), draft_tokens
    probs = target_logits[:, :k].float().softmax(-1)                    # [B, K, V]
    top_p, top_i = probs.topk(topk, dim=-1)                             # [B, K, topk]
    candidate = top_p >= top_p[..., :1] - delta.view(-1, 1, 1)
    candidate[..., 0] = True
    ok = ((top_i == draft_tokens.unsqueeze(-1)) & candidate).any(-1)    # [B, K]
    num_drafts = _num_leading_true(ok)                                  # [B]
    accepted = torch.cat([draft_tokens, top1[:, -1:]], dim=1)           # [B, K+1]
    accepted.scatter_(1, num_drafts.unsqueeze(-1), top1.gather(1, num_drafts.unsqueeze(-1)))
    emitted_draft = torch.arange(k, device=ok.device) < num_drafts.unsqueeze(-1)
    relaxed = ((draft_tokens != top1[:, :k]) & emitted_draft).long()
    return accepted, num_drafts + 1, relaxed
