"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): the lightning indexer that picks, for
every query, the `index_topk` past tokens its MLA attends to.

Per token (x the layer's normed input, q_lat = q_a_layernorm(q_a_proj(x)), H_i heads of
width D_i, the first qk_rope_head_dim channels rotated in neox layout, not interleaved):

    k_idx      = rope(LayerNorm(wk(x)))                   # [D_i], cached per token
    q_idx_h    = rope(wq_b(q_lat)_h)                      # [H_i, D_i]
    w_h        = weights_proj(x)_h * H_i^-1/2             # float32 weights
    score(s,t) = sum_h w_h(s) * relu(q_idx_h(s) . k_idx(t) * D_i^-1/2)

Query s attends (in MLA) only to the top min(index_topk, visible) tokens t by score among
the tokens it may see (causal, or its tree's ancestors). The keys live in an extra
per-layer cache of the paged pool beside the MLA latents (`MLAttention.index_cache`,
[slots, D_i]), indexed by the same block ids, so prefix caching, preemption and tree
compaction treat it as they treat the latents. The choice is a `Selection` (positions
and whether each counts): MLA's absorbed rows gather only those latents, its expanded
prefill chunks take it as a mask.

MTP index sharing (docs/DECODING.md, "MTP on DeepSeek-V3.2"): an `IndexShare` lets the
MTP layers' draft steps 1..K-1 skip scoring. Step 0 records every row's selection; a later
step's row (position p) attends to the selection of the row it continues from (the
step-0 row of its request's last accepted token, position c) plus the keys c + 1 .. p
(the draft chain's own tokens). Keys are still written every step, so the cache stays
whole.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from onespec.layers.attention import AttentionMetadata
from onespec.layers.rotary import RotaryEmbedding
from onespec.models.moe import Float32Router

SCORE_BUDGET = 1 << 24     # float32 scores [rows, H_i, keys] computed at once, at most


class Float32Linear(Float32Router):
    """A bias-free linear whose weight stays float32 in any model dtype (weights_proj:
    the checkpoints keep it so; its output weighs the heads' scores)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x):
        return F.linear(x.float(), self.weight.float())


class Indexer(nn.Module):
    """The lightning indexer's weights (checkpoint names under `self_attn.indexer.`)."""

    def __init__(self, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int,
                 rope_dim: int, topk: int):
        super().__init__()
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = Float32Linear(hidden_size, num_heads)
        self.num_heads, self.head_dim, self.rope_dim, self.topk = (num_heads, head_dim,
                                                                   rope_dim, topk)

    def _rope(self, positions, q, k, rotary: RotaryEmbedding):
        """Neox rotary (never interleaved, unlike MLA's) on the first rope_dim channels."""
        d = self.rope_dim
        q_rot, k_rot = RotaryEmbedding.__call__(rotary, positions, q[..., :d], k[..., :d])
        return torch.cat([q_rot, q[..., d:]], -1), torch.cat([k_rot, k[..., d:]], -1)

    def project(self, x, q_latent, positions, rotary):
        """-> queries [T, H_i, D_i], keys [T, D_i] (rotated), head weights [T, H_i]."""
        q = self.wq_b(q_latent).view(-1, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).unsqueeze(1)
        q, k = self._rope(positions, q, k, rotary)
        weights = self.weights_proj(x) * self.num_heads ** -0.5
        return q, k.squeeze(1), weights

    def scores(self, q, weights, keys, meta: AttentionMetadata):
        """Padded queries [B, Qmax, H_i, D_i], weights [B, Qmax, H_i], keys [B, KV, D_i]
        -> index scores [B, Qmax, KV] float32, -inf where the query may not look."""
        b, qmax, heads, _ = q.shape
        kv = keys.shape[1]
        keys = keys.float()
        out = torch.empty(b, qmax, kv, dtype=torch.float32, device=q.device)
        step = max(1, SCORE_BUDGET // max(1, b * heads * kv))
        scale = self.head_dim ** -0.5
        for i in range(0, qmax, step):       # bounded memory for long prefill chunks
            s = torch.einsum("bqhd,bkd->bqhk", q[:, i:i + step].float(), keys) * scale
            out[:, i:i + step] = torch.einsum("bqh,bqhk->bqk", weights[:, i:i + step],
                                              s.relu_())
        return out.masked_fill_(~meta.mask[:, 0], float("-inf"))

    def select(self, scores) -> torch.Tensor:
        """-> key positions [B, Qmax, k] of each query's top k; a query that sees fewer
        than k keys selects every key it sees (the rest of its k are keys it may not see,
        marked invalid by Selection)."""
        return scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices


@dataclass
class Selection:
    """The keys each (padded) query row attends to: positions [B, Qmax, n] and whether each
    counts [B, Qmax, n] (no position counts twice)."""
    picked: torch.Tensor
    valid: torch.Tensor

    def mask(self, num_keys: int) -> torch.Tensor:
        """The selection as an attention mask [B, 1, Qmax, KV] (True: attend)."""
        b, q, _ = self.picked.shape
        out = torch.zeros(b, q, num_keys + 1, dtype=torch.bool, device=self.picked.device)
        index = torch.where(self.valid, self.picked, num_keys)   # (last column: dropped)
        return out.scatter_(-1, index, True)[..., :num_keys].unsqueeze(1)


@dataclass
class IndexShare:
    """The MTP draft loop's shared selection (module docstring). The drafter sets `step`
    before each forward; the MTP layers' attention reads and writes the rest."""
    step: int = 0
    slots: torch.Tensor | None = None        # step 0: [T] the slot each row wrote
    positions: torch.Tensor | None = None    # step 0: [T] each row's position
    picked: torch.Tensor | None = None       # step 0: [T, k] the rows' selected positions
    roots: tuple | None = None               # steps >= 1: (picked [Bd, k], position [Bd])

    def capture(self, meta: AttentionMetadata, picked_padded):
        self.slots, self.positions = meta.slot_mapping, meta.positions
        self.picked = picked_padded[meta.token_req, meta.token_idx]
        self.roots = None

    def shared(self, meta: AttentionMetadata) -> Selection:
        """Draft step >= 1 (one row per request): the step-0 selection of the row each
        request continues from (position c) plus the keys c + 1 .. its own position."""
        if self.roots is None:       # the step-0 row each request continues from
            root_pos = meta.positions - self.step
            root_slot = meta.kv_slots.gather(1, root_pos[:, None])        # [B, 1]
            match = self.slots[None, :] == root_slot                      # [B, T]
            row, found = match.int().argmax(1), match.any(1)
            # a request without a recorded row keeps only its chain's keys (never expected)
            root_pos = torch.where(found, self.positions[row], root_pos)
            never = meta.kv_slots.shape[1]            # a position no key has: invalid
            self.roots = (torch.where(found[:, None], self.picked[row], never), root_pos)
        picked, root_pos = self.roots
        chain = root_pos[:, None] + torch.arange(1, self.step + 1, device=picked.device)
        positions = torch.cat([picked, chain], -1)                        # [B, k + step]
        valid = torch.cat([picked <= root_pos[:, None], chain <= meta.positions[:, None]], -1)
        valid &= positions < meta.kv_slots.shape[1]
        return Selection(positions[:, None], valid[:, None])


def select_keys(attn, x, q_latent, positions, rotary, meta: AttentionMetadata) -> Selection:
    """Writes this step's indexer keys into attn.index_cache and returns the keys each row
    attends to, for an MLAttention `attn` with an indexer; under an IndexShare (an MTP
    layer's draft loop) steps >= 1 reuse step 0's selection."""
    indexer: Indexer = attn.indexer
    q, k, weights = indexer.project(x, q_latent, positions, rotary)
    attn.index_cache.index_copy_(0, meta.slot_mapping, k.to(attn.index_cache.dtype))
    share: IndexShare | None = attn.index_share
    if share is not None and share.step > 0:
        return share.shared(meta)
    qp = q.new_zeros(meta.kv_slots.shape[0], meta.max_q, *q.shape[1:])
    qp[meta.token_req, meta.token_idx] = q
    wp = weights.new_zeros(meta.kv_slots.shape[0], meta.max_q, weights.shape[1])
    wp[meta.token_req, meta.token_idx] = weights
    scores = indexer.scores(qp, wp, attn.index_cache[meta.kv_slots], meta)
    picked = indexer.select(scores)                                       # [B, Qmax, k]
    if share is not None:
        share.capture(meta, picked)
    return Selection(picked, meta.mask[:, 0].gather(-1, picked))
