"""MTP drafting (docs/DECODING.md, "MTP") behind the drafter interface of drafter.py.

MTP-Eagle (default): the first MTP layer applied K times. Step 0 reads the target's final
post-norm hidden state of every row; each step's output (shared_head.norm of the block) is
both the next step's hidden input and what the logits are computed from.

Vanilla: draft step j runs MTP layer j (K <= the checkpoint's MTP layers). Layer 0 writes
its KV for every row at step 0, as in MTP-Eagle; layer j >= 1 runs only at step j, on one
row per request, so its KV layer holds the rows it drafted from in earlier steps (other
positions are not written: its drafts are weaker than a layer fed every position, and
verification keeps the output lossless either way).

On DeepSeek-V3.2 (sparse attention) the MTP layers' draft steps 1..K-1 reuse the top-k
selection of step 0's row they continue from (`use_index_share`, models/dsa.py IndexShare).
"""
from __future__ import annotations

import torch

from onespec.models.dsa import IndexShare
from onespec.models.mtp import MTPHead
from onespec.quant.fp8 import linear_dtype


class MTPDrafter:
    capture_layers: tuple[int, ...] = ()

    def __init__(self, head: MTPHead, target, vanilla: bool = False, index_share: bool = True):
        self.head, self.target, self.vanilla = head, target, vanilla
        self.dtype = linear_dtype(head.layers[0].eh_proj)
        self._layer = head.layers[0]        # the layer of the latest forward (its head)
        # sparse-attention layers (DeepSeek-V3.2): one selection shared by the draft steps
        self.index_share = IndexShare() if index_share and any(
            getattr(a, "indexer", None) is not None for a in self.attention_layers) else None
        for a in self.attention_layers if self.index_share is not None else ():
            a.index_share = self.index_share

    @property
    def attention_layers(self):
        return [a for layer in self.head.layers
                for a in (layer.block.attention_layers() if hasattr(layer.block,
                          "attention_layers") else [layer.block.self_attn])]

    @property
    def draft_vocab_size(self) -> int:
        return self.target.config.vocab_size

    def initial_hidden(self, captured, final_hidden):
        return final_hidden.to(self.dtype)                                  # [T, H]

    def forward(self, input_ids, positions, hidden, meta, step: int = 0):
        layer = self.head.layers[step if self.vanilla else 0]
        self._layer = layer
        if self.index_share is not None:
            self.index_share.step = step
        embed = layer.embed_tokens if layer.embed_tokens is not None \
            else self.target.model.embed_tokens
        return layer(embed(input_ids).to(self.dtype), hidden, positions, self.head.rotary,
                     meta)                                                  # [T, H]

    def _head(self) -> torch.nn.Linear:
        head = self._layer.shared_head.head
        return self.target.lm_head if head is None else head

    def compute_logits(self, hidden):
        head = self._head()
        return self.target.ops.logits(head, hidden.to(linear_dtype(head)))   # [N, V]

    def greedy_target_ids(self, hidden):
        head = self._head()
        return self.target.ops.greedy(head, hidden.to(linear_dtype(head)))   # [N]

    def to_target_ids(self, draft_ids):
        return draft_ids

    def draft_vocab_target_ids(self) -> torch.Tensor:
        return torch.arange(self.draft_vocab_size,
                            device=self.head.layers[0].eh_proj.weight.device)  # [V]
