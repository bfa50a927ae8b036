"""DFlash drafting (docs/DECODING.md, "DFlash block drafters"): one forward of the block
drafter a step proposes up to block_size - 1 drafts.

The forward takes every target row of the step as a context row (its captured features
at its position: keys and values of each draft layer, written to the cache) and, for
each drafting request, one block of block_size rows right after its last verified
position p: the anchor (the token just chosen at p + 1) and block_size - 1 mask tokens
at p + 2 .. p + block_size. Block rows attend to every key up to the block's end (the
context before it and the whole block: non-causal inside the block), so their metadata
gives each block row the block's last position as its visibility bound while RoPE uses
the rows' own positions. Draft i is read at block row i.

Rejected verify rows write context keys past the accepted prefix; the block starts at
the first of them and overwrites them (it is written after the context rows), and the
next step's context rows overwrite the block. Slots: a generation step writes up to
P + K + block_size, a prompt's last chunk block_size past its end (shape.py).
"""
from __future__ import annotations

import torch

from onespec.layers.attention import metadata_for_rows
from onespec.models.dflash import DFlashHead
from onespec.quant.fp8 import linear_dtype


class DFlashDrafter:
    """The drafter interface (drafter.py) for a DFlash head; SpecWorker calls
    `propose_block` once a step instead of the draft loop's passes."""

    parallel = True

    def __init__(self, head: DFlashHead, target, capture_layers: tuple[int, ...]):
        self.head, self.target = head, target
        self.capture_layers = capture_layers
        self.block_size = head.config.block_size
        self.max_depth = self.block_size - 1       # K may not exceed it (engine/parts.py)
        self.mask_token_id = head.config.mask_token_id
        self.dtype = head.fc.weight.dtype
        self.lm_dtype = linear_dtype(target.lm_head)       # (draft_dtype may differ)

    @property
    def attention_layers(self):
        return [layer.self_attn for layer in self.head.layers]

    @property
    def draft_vocab_size(self) -> int:
        return self.target.config.vocab_size          # the target's LM head

    def initial_hidden(self, captured, final_hidden):
        return self.head.context(captured.to(self.dtype))                  # [T, H]

    def forward(self, input_ids, positions, hidden, meta, step: int = 0):
        raise NotImplementedError("a DFlash drafter drafts a whole block in propose_block")

    def compute_logits(self, hidden):
        return self.head.ops.logits(self.target.lm_head, *self._final(hidden))   # [N, V]

    def greedy_target_ids(self, hidden):
        return self.head.ops.greedy(self.target.lm_head, *self._final(hidden))   # [N]

    def _final(self, hidden):
        """(rows, norm) for the target's LM head: the final norm fused where the drafter
        computes in the head's dtype, else applied here and the rows cast to it."""
        if self.dtype == self.lm_dtype:
            return hidden, self.head.norm
        return self.head.norm(hidden).to(self.lm_dtype), None

    def to_target_ids(self, draft_ids):
        return draft_ids

    def draft_vocab_target_ids(self) -> torch.Tensor:
        return torch.arange(self.draft_vocab_size, device=self.head.fc.weight.device)

    def propose_block(self, inp, captured, context_tokens, accepted, num_accepted,
                      attn_backend: str):
        """The step's one forward (module docstring). accepted [Bg, K+1], num_accepted
        [Bg]. Returns the hidden rows of every drafting request's K drafts [K, Bd, H] and
        its root positions [Bd] (the last verified position), in draft_reqs order, or None
        when nothing is drafted (the context keys are written either way)."""
        k, g, start, bs = inp.k, inp.num_gen, inp.gen_start, self.block_size
        meta, device = inp.meta, inp.positions.device
        ctx = self.initial_hidden(captured, None)                             # [T, H]
        drafting = k > 0 and len(inp.draft_reqs) > 0
        g_root = start + torch.arange(g, device=device) * (k + 1) + num_accepted - 1
        g_anchor = accepted.gather(1, (num_accepted - 1).clamp(min=0)[:, None])[:, 0]
        if inp.num_ctx:
            last_tokens = inp.positions.new_zeros(inp.positions.shape[0])
            last_tokens[inp.ctx_last_rows] = context_tokens
            roots = torch.cat([inp.draft_ctx_rows, g_root])                   # [Bd]
            anchors = torch.cat([last_tokens[inp.draft_ctx_rows], g_anchor])
        else:
            roots, anchors = g_root, g_anchor
        if not drafting:
            roots, anchors = roots[:0], anchors[:0]
        n = roots.shape[0]
        root_pos, req = inp.positions[roots], meta.token_req[roots]           # [Bd]
        j = torch.arange(bs, device=device)
        ids = torch.where(j[None, :] == 0, anchors[:, None], self.mask_token_id)  # [Bd, bs]
        pos = (root_pos[:, None] + 1 + j[None, :]).reshape(-1)                # [Bd·bs]
        rows_req = req.repeat_interleave(bs)
        bsz = inp.block_size
        slots = inp.block_tables[rows_req, pos // bsz] * bsz + pos % bsz
        seen = (root_pos + bs).repeat_interleave(bs)        # every row sees its whole block
        block_meta = metadata_for_rows(inp.block_tables, rows_req, j.repeat(n), seen, bsz, bs,
                                       inp.max_kv_draft, None, attn_backend)
        x = self.target.model.embed_tokens(ids.reshape(-1)).to(self.dtype)  # [Bd·bs, H]
        out = self.head(ctx, inp.positions, meta.slot_mapping, x, pos, slots, block_meta)
        if not drafting:
            return None
        drafts = out.view(n, bs, -1)[:, 1:k + 1]                              # [Bd, K, H]
        return drafts.transpose(0, 1), root_pos
