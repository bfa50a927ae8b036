"""Token sampling as pure tensor functions: logits -> filtered probs -> one token per row.

No host syncs in the math: every branch is a `torch.where` over rows. Rows of unseeded
requests draw their random numbers from the engine's generator in one batched call. Rows
of seeded requests draw counter-based numbers instead: a hash of (seed, position of the
token being drawn, kind of draw, column), so a seeded request's output depends on nothing
else (not the batch, prefill chunking, preemption or the draft length).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
from torch import Tensor

from onespec.sampling_params import MIN_TEMPERATURE, SamplingParams

# Smallest positive float32: keeps Exp(1) draws away from 0 so 0 / E stays 0 (never NaN).
_TINY = torch.finfo(torch.float32).tiny

# Kinds of draw of a seeded request at one position; each is made once per position.
TARGET_DRAW = 0     # the target's token (exact-match rows, rejection's residual or bonus)
DRAFT_DRAW = 1      # a draft token sampled from q (rejection sampling)
ACCEPT_DRAW = 2     # the uniform that accepts or rejects a draft (rejection sampling)

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mix32(x: Tensor) -> Tensor:
    """A bijective 32-bit integer hash of int64 x in [0, 2**32) (lowbias32-style). Its
    constants are below 2**31, so no int64 product overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def counter_uniform(seeds: Tensor,      # [*S] int64, any int64 value
                    positions: Tensor,  # [*S] int64 (broadcast with seeds)
                    kind: int,          # TARGET_DRAW, DRAFT_DRAW or ACCEPT_DRAW
                    width: int,
                    ) -> Tensor:        # [*S, width] float32 in (0, 1)
    """Uniforms that are a pure function of (seed, position, kind, column): 24 bits of
    hash((hash(seed, position, kind), column)), at the centre of their 2**-24 interval."""
    key = _mix32((positions & _M32) ^ ((kind * _GOLDEN) & _M32))
    key = _mix32(key ^ ((seeds >> 32) & _M32))
    key = _mix32(key ^ (seeds & _M32))                                   # [*S]
    cols = _mix32(torch.arange(width, device=key.device, dtype=torch.int64) + _GOLDEN)
    bits = _mix32(key.unsqueeze(-1) ^ cols) >> 8                        # [*S, width]
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


@dataclass
class SeededRows:
    """The rows of a batch that belong to seeded sampled requests."""
    index: Tensor                  # [S] int64 row numbers, ascending
    seeds: Tensor                  # [S] int64
    positions: Tensor | None       # [S] int64 position of the token each row draws
    host_index: tuple[int, ...]    # index, on the host

    def head(self, n: int) -> "SeededRows | None":
        """The seeded rows among rows [0, n) (a prefix: the index is ascending)."""
        s = sum(1 for i in self.host_index if i < n)
        if s == 0:
            return None
        pos = None if self.positions is None else self.positions[:s]
        return SeededRows(self.index[:s], self.seeds[:s], pos, self.host_index[:s])

    def at(self, positions: Tensor) -> "SeededRows":  # positions: [N] per batch row
        return replace(self, positions=positions[self.index])


def fill_random_rows(out: Tensor,                        # [N, ...] filled in place
                     seeded: SeededRows | None,
                     generator: torch.Generator | None,
                     draw: Callable[[Tensor, torch.Generator | None], Tensor],
                     counter_draw: Callable[[SeededRows], Tensor]) -> Tensor:
    """Fills `out`: unseeded rows by draw(out, generator) in one call, the seeded rows with
    counter_draw(seeded) [S, ...] (numbers that depend only on their seeds and positions)."""
    num_seeded = 0 if seeded is None else len(seeded.host_index)
    if num_seeded < out.shape[0]:
        draw(out, generator)
    if num_seeded:
        if seeded.positions is None:
            raise ValueError("seeded rows need the positions of the tokens they draw")
        values = counter_draw(seeded).to(out.dtype)
        if num_seeded == out.shape[0]:
            out.copy_(values)
        else:
            out.index_copy_(0, seeded.index, values)
    return out


def probs_from_logits(logits: Tensor,       # [N, V] any float dtype
                      temperature: Tensor,  # [N] float32, 0 = greedy
                      top_k: Tensor,        # [N] int64, 0 = off
                      top_p: Tensor,        # [N] float32, 1.0 = off
                      ) -> Tensor:          # [N, V] float32
    """Filtered sampling distribution per row.

    p = softmax(logits / T) restricted to the top-k tokens, then to the smallest prefix (by
    descending prob) whose cumulative prob >= top_p, renormalised. A token is kept by top-p
    iff the mass of the tokens ranked strictly above it is < top_p, so the top token always
    stays. T < MIN_TEMPERATURE rows are a one-hot at argmax(logits). Logits are shifted by
    their row max before the division, so (logits - max) / T is <= 0 and never overflows:
    every row is a finite distribution. One sort serves both filters.
    """
    logits = logits.float()
    num_rows, vocab = logits.shape
    greedy = temperature < MIN_TEMPERATURE                             # [N]
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    shifted = (logits - logits.amax(-1, keepdim=True)) / temp[:, None]
    sorted_logits, order = shifted.sort(dim=-1, descending=True, stable=True)

    rank = torch.arange(vocab, device=logits.device)                  # [V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(-1)                           # [N, V]

    mass_above = sorted_probs.cumsum(-1) - sorted_probs                # [N, V]
    drop = (mass_above >= top_p[:, None]) & (top_p[:, None] < 1.0) & (rank[None, :] > 0)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)

    probs = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def _exponential(t: Tensor, g: torch.Generator | None) -> Tensor:
    return t.exponential_(1.0, generator=g)


def sample_from_probs(probs: Tensor,                            # [N, V]
                      generator: torch.Generator | None = None,
                      seeded: SeededRows | None = None,
                      kind: int = TARGET_DRAW,
                      ) -> Tensor:                              # [N] int64
    """Exponential race: token = argmax_v probs[v] / E[v], E ~ Exp(1) i.i.d.

    P(v wins) = probs[v] / sum(probs), so probs need not be normalised; a zero-prob token
    scores 0 and can never beat a positive one. Seeded rows take E = -log(U) with U their
    counter_uniform numbers of `kind`.
    """
    noise = torch.empty(probs.shape, dtype=torch.float32, device=probs.device)
    width = probs.shape[1]
    fill_random_rows(noise, seeded, generator, _exponential,
                     lambda s: counter_uniform(s.seeds, s.positions, kind, width).log_().neg_())
    return (probs.float() / noise.clamp_min_(_TINY)).argmax(-1)


@dataclass
class SamplingTensors:
    temperature: Tensor                            # [N] float32
    top_k: Tensor                                  # [N] int64
    top_p: Tensor                                  # [N] float32
    seeded: SeededRows | None                      # rows of seeded sampled requests
    all_greedy: bool

    @staticmethod
    def build(params_per_row: Sequence[SamplingParams],
              positions_per_row: Sequence[int] | None,
              device: torch.device | str) -> "SamplingTensors":
        """One entry per logits row: a request verifying K drafts repeats its params K+1
        times. positions_per_row: the position of the token each row draws (None: given
        later with SeededRows.at, or no row is seeded)."""
        n = len(params_per_row)
        if positions_per_row is not None and len(positions_per_row) != n:
            raise ValueError(f"positions_per_row has {len(positions_per_row)} entries, "
                             f"expected {n}")
        rows = tuple(i for i, p in enumerate(params_per_row)
                     if p.seed is not None and not p.greedy)
        seeded = None
        if rows:
            as_long = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
            pos = None if positions_per_row is None else \
                as_long([positions_per_row[i] for i in rows])
            seeded = SeededRows(as_long(rows), as_long([params_per_row[i].seed for i in rows]),
                                pos, rows)
        return SamplingTensors(
            temperature=torch.tensor([p.temperature for p in params_per_row],
                                     dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params_per_row],
                               dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params_per_row],
                               dtype=torch.float32, device=device),
            seeded=seeded,
            all_greedy=all(p.greedy for p in params_per_row),
        )

    def seeded_head(self, n: int) -> SeededRows | None:
        """The seeded rows among the first n rows."""
        return None if self.seeded is None else self.seeded.head(n)

    def seeded_at(self, positions: Tensor) -> SeededRows | None:  # positions: [N]
        """The seeded rows, drawing the tokens at `positions` (one per row)."""
        return None if self.seeded is None else self.seeded.at(positions)


class GreedySampling:
    """All-greedy SamplingTensors per row count, built once per count: steps of greedy
    batches make no host copies, and CUDA graphs keep pointing at the same tensors."""

    def __init__(self, device: torch.device | str):
        self.device = device
        self._cache: dict[int, SamplingTensors] = {}

    def __call__(self, num_rows: int) -> SamplingTensors:
        if num_rows not in self._cache:
            params = [SamplingParams(temperature=0.0)] * num_rows
            self._cache[num_rows] = SamplingTensors.build(params, None, self.device)
        return self._cache[num_rows]


def sample(logits: Tensor,                # [N, V]
           st: SamplingTensors,
           default_generator: torch.Generator | None = None) -> Tensor:  # [N] int64
    """Samples every row; unseeded rows draw from default_generator."""
    if st.all_greedy:
        return logits.argmax(-1)
    probs = probs_from_logits(logits, st.temperature, st.top_k, st.top_p)
    return sample_from_probs(probs, default_generator, st.seeded)


def masked_logits(logits: Tensor,    # [N, V]
                  bitmask: Tensor,   # [N, ceil(V / 32)] int32 token bitmask (xgrammar's)
                  ) -> Tensor:       # [N, V] float32
    """logits with every token whose bit is 0 set to -inf (grammar masks; the bitmask is on
    the logits' device). Returns float32 logits, masked in place when they were already."""
    from onespec.structured.backend import import_xgrammar
    logits = logits.float()
    import_xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])
    return logits
