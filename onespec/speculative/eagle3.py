"""EAGLE-3 drafting (docs/DECODING.md, "EAGLE-3 head"): the head over the target's
captured layers, behind the drafter interface of drafter.py."""
from __future__ import annotations

import torch

from onespec.distributed.layers import VocabParallelEmbedding
from onespec.models.eagle3 import Eagle3Head
from onespec.models.llama import LlamaForCausalLM
from onespec.quant.fp8 import linear_dtype


class Eagle3Drafter:
    def __init__(self, head: Eagle3Head, target: LlamaForCausalLM,
                 capture_layers: tuple[int, ...]):
        self.head, self.target = head, target
        self.capture_layers = capture_layers
        self.embed = head.embed_tokens if head.embed_tokens is not None \
            else target.model.embed_tokens
        self.dtype = linear_dtype(head.fc)    # may be below the target's: drafts are verified

    @property
    def attention_layers(self):
        return [layer.self_attn for layer in self.head.layers]

    @property
    def draft_vocab_size(self) -> int:
        return self.head.config.draft_vocab_size

    def initial_hidden(self, captured, final_hidden):
        return self.head.initial_hidden(captured.to(self.dtype))           # [T, H]

    def forward(self, input_ids, positions, hidden, meta, step: int = 0):
        if isinstance(self.embed, VocabParallelEmbedding):    # the target's, split by rank
            return self.head(self.embed(input_ids), hidden, positions, meta)
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
