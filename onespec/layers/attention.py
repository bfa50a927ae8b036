"""Attention over the paged KV cache.

The portable path (CPU and CUDA) gathers each request's keys/values through its block table
into a padded [B, KVmax] view and runs SDPA with an explicit mask, so one forward can mix
prefill chunks, multi-token verify rows and single-token draft rows. The mask lets query row
at position p see cache positions j <= p (and j > p - window with a sliding window).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor   # [T] int64: cache slot each new row writes
    token_req: torch.Tensor      # [T] int64: request index of each row
    token_idx: torch.Tensor      # [T] int64: row index inside its request
    kv_slots: torch.Tensor       # [B, KVmax] int64: cache slot of each key position
    mask: torch.Tensor           # [B, 1, Qmax, KVmax] bool: True = attend
    num_reqs: int
    max_q: int


def build_attention_metadata(block_tables: torch.Tensor, q_lens: list[int],
                             positions: torch.Tensor, kv_lens: torch.Tensor, max_kv: int,
                             block_size: int, sliding_window: int | None = None
                             ) -> AttentionMetadata:
    """block_tables [B, nb] int64 (device); q_lens: rows per request (host); positions [T]
    (device); kv_lens [B] (device): keys visible to each request after this step's writes;
    max_kv: a host-side upper bound on kv_lens."""
    device = positions.device
    num_reqs = len(q_lens)
    q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
    token_req = torch.repeat_interleave(torch.arange(num_reqs), q_lens_t)
    starts = torch.cumsum(q_lens_t, 0) - q_lens_t
    token_idx = torch.arange(int(q_lens_t.sum())) - starts[token_req]
    token_req, token_idx = token_req.to(device), token_idx.to(device)
    max_q = max(q_lens)

    kv_pos = torch.arange(max_kv, device=device)                             # [KVmax]
    num_blocks_needed = (max_kv + block_size - 1) // block_size
    tables = block_tables
    if tables.shape[1] < num_blocks_needed:
        tables = F.pad(tables, (0, num_blocks_needed - tables.shape[1]))
    kv_slots = tables[:, kv_pos // block_size] * block_size + kv_pos % block_size  # [B, KVmax]
    slot_mapping = kv_slots[token_req, positions]                            # [T]

    q_pos = torch.full((num_reqs, max_q), -1, dtype=torch.int64, device=device)
    q_pos[token_req, token_idx] = positions                                  # [B, Qmax]
    key = kv_pos.view(1, 1, -1)
    qp = q_pos.unsqueeze(-1)
    mask = (key <= qp) & (key < kv_lens.view(-1, 1, 1))
    if sliding_window is not None:
        mask &= key > qp - sliding_window
    mask |= (qp < 0) & (key == 0)           # padding rows see one key: no NaN rows
    return AttentionMetadata(slot_mapping, token_req, token_idx, kv_slots, mask.unsqueeze(1),
                             num_reqs, max_q)


def paged_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """q [T, Hq, D], k/v [T, Hkv, D]; k_cache/v_cache [num_slots, Hkv, D]. Returns [T, Hq, D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    keys = k_cache[meta.kv_slots].transpose(1, 2)                            # [B, Hkv, KV, D]
    values = v_cache[meta.kv_slots].transpose(1, 2)
    queries = q.new_zeros(meta.num_reqs, meta.max_q, q.shape[1], q.shape[2])
    queries[meta.token_req, meta.token_idx] = q
    out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values,
                                         attn_mask=meta.mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)[meta.token_req, meta.token_idx]               # [T, Hq, D]
