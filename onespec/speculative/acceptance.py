"""Acceptance of drafted tokens (docs/DECODING.md, "acceptance") as pure tensor functions.

Every function returns `accepted_tokens [B, K+1]` and `num_accepted [B]` (>= 1): the
first num_accepted entries of a row are its emitted tokens, the last of them being the
target's own correction or bonus token; the entries after them are don't-cares.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from onespec.layers.sampler import fill_random_rows, sample_from_probs

FORCED_POOL_SIZE = 4096
FORCED_POOL_SEED = 0
FORCED_POOL_STRIDE = 131   # step stride into the pool; coprime with the pool size
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
                     generators: Sequence[torch.Generator | None],  # len B
                     default_generator: torch.Generator | None = None,
                     ) -> tuple[Tensor, Tensor]:  # ([B, K+1] int64, [B] int64)
    """Speculative rejection sampling (lossless: emitted tokens are distributed as p).

    Accept d_j while u_j < p_j(d_j) / q_j(d_j), u_j ~ U[0, 1) (written u * q < p, no
    division). At the first rejection j emit r ~ normalize(max(p_j - q_j, 0)); if all K
    pass, emit r ~ p_K (q_K := 0 gives that from the same formula). An all-zero residual
    (p_j == q_j up to rounding, or a draft outside q's support) falls back to p_j.
    Per request the generator draws the K uniforms first, then the residual sample.
    """
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)            # [B]
    uniforms = torch.empty((batch, k), dtype=torch.float32, device=draft_tokens.device)
    fill_random_rows(uniforms, generators, default_generator, _uniform)

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
    last_token = sample_from_probs(residual, generators, default_generator)  # [B]

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
