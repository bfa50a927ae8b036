"""The interface every drafter implements, so the worker runs any of them the same way.

    capture_layers                      target layers whose residual stream it reads
    attention_layers                    its KV layers (extra layers of the same block pool)
    draft_vocab_size                    size of its vocabulary (mapped to target ids)
    initial_hidden(captured, final)     step 0's hidden input                   -> [T, H]
    forward(ids, positions, h, meta, step)  draft pass `step` (0..K-1), writes draft KV
                                        -> the hidden carried to the next pass [T, H]
    compute_logits(h)                   draft-vocab logits                      -> [N, Vd]
    greedy_target_ids(h)                their argmax, as target ids             -> [N]
    to_target_ids(ids)                  draft ids -> target ids
    draft_vocab_target_ids()            the target id of every draft id         -> [Vd]

eagle3.py and mtp.py implement it; a new model drafter adds one file here with a class of
this shape. Drafts from the request's own tokens (the suffix-automaton enhancer, n-gram
lookup) need no model and run on the host after the step instead (host_drafts.py).
"""
from __future__ import annotations

from typing import Protocol

import torch


class Drafter(Protocol):
    capture_layers: tuple[int, ...]

    @property
    def attention_layers(self) -> list: ...

    @property
    def draft_vocab_size(self) -> int: ...

    def initial_hidden(self, captured: torch.Tensor | None,
                       final_hidden: torch.Tensor) -> torch.Tensor: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                meta, step: int = 0) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def greedy_target_ids(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor: ...

    def draft_vocab_target_ids(self) -> torch.Tensor: ...
