"""Token sampling as pure tensor functions: logits -> filtered probs -> one token per row.

No host syncs in the math: every branch is a `torch.where` over rows, and the only Python
loop walks the per-request generators to draw their random numbers in row order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from onespec.sampling_params import SamplingParams

# Smallest positive float32: keeps Exp(1) draws away from 0 so 0 / E stays 0 (never NaN).
_TINY = torch.finfo(torch.float32).tiny


def probs_from_logits(logits: Tensor,       # [N, V] any float dtype
                      temperature: Tensor,  # [N] float32, 0 = greedy
                      top_k: Tensor,        # [N] int64, 0 = off
                      top_p: Tensor,        # [N] float32, 1.0 = off
                      ) -> Tensor:          # [N, V] float32
    """Filtered sampling distribution per row.

    p = softmax(logits / T) restricted to the top-k tokens, then to the smallest prefix (by
    descending prob) whose cumulative prob >= top_p, renormalised. A token is kept by top-p
    iff the mass of the tokens ranked strictly above it is < top_p, so the top token always
    stays. T = 0 rows are a one-hot at argmax(logits). One sort serves both filters.
    """
    logits = logits.float()
    num_rows, vocab = logits.shape
    greedy = temperature <= 0                                          # [N]
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    sorted_logits, order = (logits / temp[:, None]).sort(dim=-1, descending=True, stable=True)

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


def fill_random_rows(out: Tensor,                                   # [N, ...] filled in place
                     generators: Sequence[torch.Generator | None],  # len N
                     default_generator: torch.Generator | None,
                     draw: Callable[[Tensor, torch.Generator | None], Tensor]) -> Tensor:
    """Fill `out` with random numbers, row i from generators[i] (None -> default_generator).

    Unseeded rows come from one batched call; each seeded row is drawn alone, in row order,
    so its numbers do not depend on what else is in the batch.
    """
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < out.shape[0]:
        draw(out, default_generator)
    for i in seeded:
        draw(out[i], generators[i])
    return out


def _exponential(t: Tensor, g: torch.Generator | None) -> Tensor:
    return t.exponential_(1.0, generator=g)


def sample_from_probs(probs: Tensor,                                   # [N, V]
                      generators: Sequence[torch.Generator | None],  # len N
                      default_generator: torch.Generator | None = None,
                      ) -> Tensor:                                     # [N] int64
    """Exponential race: token = argmax_v probs[v] / E[v], E ~ Exp(1) i.i.d.

    P(v wins) = probs[v] / sum(probs), so probs need not be normalised; a zero-prob token
    scores 0 and can never beat a positive one.
    """
    noise = torch.empty(probs.shape, dtype=torch.float32, device=probs.device)
    fill_random_rows(noise, generators, default_generator, _exponential)
    return (probs.float() / noise.clamp_min_(_TINY)).argmax(-1)


@dataclass
class SamplingTensors:
    temperature: Tensor                            # [N] float32
    top_k: Tensor                                  # [N] int64
    top_p: Tensor                                  # [N] float32
    generators: list[torch.Generator | None]       # len N
    all_greedy: bool

    @staticmethod
    def build(params_per_row: Sequence[SamplingParams],
              generators_per_row: Sequence[torch.Generator | None] | None,
              device: torch.device | str) -> "SamplingTensors":
        """One entry per logits row: a request verifying K drafts repeats its params K+1 times."""
        n = len(params_per_row)
        generators = list(generators_per_row) if generators_per_row is not None else [None] * n
        if len(generators) != n:
            raise ValueError(f"generators_per_row has {len(generators)} entries, expected {n}")
        return SamplingTensors(
            temperature=torch.tensor([p.temperature for p in params_per_row],
                                     dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params_per_row],
                               dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params_per_row],
                               dtype=torch.float32, device=device),
            generators=generators,
            all_greedy=all(p.temperature == 0.0 for p in params_per_row),
        )


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
    if st.all_greedy:
        return logits.argmax(-1)
    probs = probs_from_logits(logits, st.temperature, st.top_k, st.top_p)
    return sample_from_probs(probs, st.generators, default_generator)
