"""Drafters: one class per method behind one small interface used by the spec worker.

    capture_layers                      target layers whose residual stream the drafter reads
    attention_layers                    its KV layers (extra layers of the same block pool)
    initial_hidden(captured, final)     step-0 hidden input           -> [T, H]
    forward(ids, positions, h, meta, step)  one draft pass (step 0..K-1), writes draft KV
                                        -> [T, H] hidden carried to the next step
    compute_logits(h)                   draft-vocab logits            -> [N, Vd]
    greedy_target_ids(h)                their argmax, as target ids   -> [N]
    to_target_ids(ids)                  draft ids -> target ids
"""
from __future__ import annotations

import torch

from onespec.layers.linear import fused_linear
from onespec.models.eagle3 import Eagle3Head
from onespec.models.llama import LlamaForCausalLM


class Eagle3Drafter:
    def __init__(self, head: Eagle3Head, target: LlamaForCausalLM,
                 capture_layers: tuple[int, ...]):
        self.head, self.target = head, target
        self.capture_layers = capture_layers
        self.embed = head.embed_tokens if head.embed_tokens is not None \
            else target.model.embed_tokens
        self.dtype = head.fc.weight.dtype    # may be below the target's: drafts are verified

    @property
    def attention_layers(self):
        return [layer.self_attn for layer in self.head.layers]

    @property
    def draft_vocab_size(self) -> int:
        return self.head.config.draft_vocab_size

    def initial_hidden(self, captured, final_hidden):
        return fused_linear(self.head.fc, captured.to(self.dtype),
                            fast=self.head.fast_kernels)                    # [T, H]

    def forward(self, input_ids, positions, hidden, meta, step: int = 0):
        # the head gathers the embedding rows itself (one kernel with its input norms)
        return self.head(None, hidden, positions, meta, ids=input_ids,
                         table=self.embed.weight)                           # [T, H]

    def compute_logits(self, hidden):
        return self.head.compute_logits(hidden)                             # [N, Vd]

    def greedy_target_ids(self, hidden):
        return self.head.greedy_target_ids(hidden)                          # [N]

    def to_target_ids(self, draft_ids):
        return self.head.to_target_ids(draft_ids)

    def draft_vocab_target_ids(self) -> torch.Tensor:
        ids = torch.arange(self.draft_vocab_size, device=self.head.lm_head.weight.device)
        return self.to_target_ids(ids)                                      # [Vd]
