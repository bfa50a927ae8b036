"""Draft vocabulary: the N most frequent target tokens under the loss mask (the head's d2t
and t2d maps, docs/DECODING.md "EAGLE-3 head")."""
from __future__ import annotations

from typing import Iterable

import torch

from onespec.models.eagle3 import make_vocab_maps


def count_tokens(samples: Iterable, vocab_size: int) -> torch.Tensor:
    """Counts of every token that is a loss target (loss_mask True) -> [V] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        ids = torch.as_tensor(s.input_ids, dtype=torch.int64)
        mask = torch.as_tensor(s.loss_mask, dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab_size)
    return counts


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """counts [V] -> the draft_vocab_size most frequent ids, ties to the lower id, sorted [Vd]."""
    order = torch.sort(-counts, stable=True).indices                        # ties keep id order
    return torch.sort(order[:draft_vocab_size]).values


def draft_vocab_maps(counts: torch.Tensor, draft_vocab_size: int):
    """-> (draft_ids [Vd], d2t [Vd], t2d [V]), or (None, None, None) when Vd >= V (no map)."""
    vocab_size = len(counts)
    if draft_vocab_size >= vocab_size:
        return None, None, None
    draft_ids = select_draft_vocab(counts, draft_vocab_size)
    d2t, t2d = make_vocab_maps(draft_ids, vocab_size)
    return draft_ids, d2t, t2d
