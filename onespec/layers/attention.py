"""Attention metadata over the paged KV cache, for two backends (layers/ops.py runs them):

- "torch" (portable: CPU and CUDA, the reference in tests): gathers each request's keys and
  values through its block table into a padded [B, KVmax] view and runs SDPA with a mask.
- "triton" (CUDA): kernels/attention.py reads the block pool directly; its metadata is
  built on the device, so a step can be captured in a CUDA graph.

Either way a query row at position p sees cache positions j <= p (and j > p - window with a
sliding window), so one forward mixes prefill chunks, K+1 verify rows and draft rows. A
layer may narrow the window itself and add attention sinks (gpt-oss: windowed_attention).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from onespec.quant.kv_fp8 import read_kv

BACKENDS = ("torch", "triton")


@dataclass
class AttentionMetadata:
    token_req: torch.Tensor             # [T] request index of each row
    positions: torch.Tensor             # [T]
    block_tables: torch.Tensor          # [B, nb]
    block_size: int
    sliding_window: int | None
    # torch backend only
    token_idx: torch.Tensor | None = None   # [T] row index inside its request
    kv_slots: torch.Tensor | None = None    # [B, KVmax] cache slot of each key position
    mask: torch.Tensor | None = None        # [B, 1, Qmax, KVmax] True = attend
    max_q: int = 0
    rows_per_request: int = 0               # every request's row count, if all are equal
    slots: torch.Tensor | None = None       # slot_mapping once built
    # triton backend, dynamic trees only (speculative/tree.py, mask_tree_block): row r sees
    # keys at tree_base[r] .. tree_base[r] + W - 1 only where tree_mask[r, key - base] is set
    tree_mask: torch.Tensor | None = None   # [T, W] int8 (1: the key is visible)
    tree_base: torch.Tensor | None = None   # [T]
    q_lens: tuple[int, ...] | None = None   # rows per request, where built from a host list
    packs: dict = field(default_factory=dict)   # triton: prefill row packs, by rows a pack
    # hybrid targets: the step's recurrent-state slots (engine/state_pool.py RecurrentBatch)
    recurrent: object | None = None

    @property
    def slot_mapping(self) -> torch.Tensor:
        """[T] cache slot each new row writes; built on first use (the Triton decode path
        looks slots up inside its rotary kernel and never needs it)."""
        if self.slots is None:
            self.slots = (self.block_tables[self.token_req, self.positions // self.block_size]
                          * self.block_size + self.positions % self.block_size)
        return self.slots

    def row_packs(self, rows: int) -> torch.Tensor | None:
        """The Triton kernel's prefill packs of up to `rows` rows (kernels/attention.py
        row_packs), built once a step; None without a host list of rows per request."""
        if self.q_lens is None:
            return None
        if rows not in self.packs:
            from onespec.kernels.attention import row_packs
            self.packs[rows] = row_packs(self.q_lens, rows, self.positions.device)
        return self.packs[rows]


def build_attention_metadata(block_tables: torch.Tensor, q_lens: list[int] | int,
                             positions: torch.Tensor, block_size: int, max_kv: int = 0,
                             sliding_window: int | None = None, backend: str = "torch"
                             ) -> AttentionMetadata:
    """block_tables [B, nb] (device); q_lens: rows per request (host list), or one int when
    every request has the same number of rows (then nothing is built on the host);
    positions [T] (device); max_kv: host bound on positions + 1 (torch backend)."""
    device = positions.device
    num_rows = positions.shape[0]
    if isinstance(q_lens, int):
        rows = torch.arange(num_rows, device=device)
        token_req = rows if q_lens == 1 else rows // q_lens
        token_idx, max_q = None, q_lens        # built below for the torch backend only
    else:
        lens = torch.tensor(q_lens, dtype=torch.int64)
        req = torch.repeat_interleave(torch.arange(len(q_lens)), lens)
        idx = torch.arange(num_rows) - (torch.cumsum(lens, 0) - lens)[req]
        token_req, token_idx, max_q = req.to(device), idx.to(device), max(q_lens)
    meta = AttentionMetadata(token_req, positions, block_tables, block_size, sliding_window,
                             rows_per_request=q_lens if isinstance(q_lens, int) else 0,
                             q_lens=None if isinstance(q_lens, int) else tuple(q_lens))
    if backend == "triton":
        return meta
    if token_idx is None:
        token_idx = rows % q_lens
    return _with_torch_mask(meta, token_idx, max_q, max_kv)


def metadata_for_rows(block_tables: torch.Tensor, token_req: torch.Tensor,
                      token_idx: torch.Tensor | None, positions: torch.Tensor,
                      block_size: int, max_q: int, max_kv: int,
                      sliding_window: int | None = None, backend: str = "torch"
                      ) -> AttentionMetadata:
    """Metadata of rows given on the device, in any order: token_req [T] (request of each
    row), token_idx [T] (its index among the request's rows; the torch backend only),
    positions [T]; max_q, max_kv: host bounds on rows per request and positions + 1.
    (Parallel drafting's forward: speculative/parallel.py.)"""
    meta = AttentionMetadata(token_req, positions, block_tables, block_size, sliding_window)
    if backend == "triton":
        return meta
    return _with_torch_mask(meta, token_idx, max_q, max_kv)


def _with_torch_mask(meta: AttentionMetadata, token_idx: torch.Tensor, max_q: int,
                     max_kv: int) -> AttentionMetadata:
    """The torch backend's key slots [B, KVmax] and causal (and window) mask."""
    block_tables, block_size, sliding_window = meta.block_tables, meta.block_size, \
        meta.sliding_window
    token_req, positions, device = meta.token_req, meta.positions, meta.positions.device
    kv_pos = torch.arange(max_kv, device=device)                             # [KVmax]
    need = -(-max_kv // block_size)
    tables = block_tables if block_tables.shape[1] >= need else \
        F.pad(block_tables, (0, need - block_tables.shape[1]))
    meta.kv_slots = tables[:, kv_pos // block_size] * block_size + kv_pos % block_size
    q_pos = torch.full((block_tables.shape[0], max_q), -1, dtype=torch.int64, device=device)
    q_pos[token_req, token_idx] = positions                                  # [B, Qmax]
    key, qp = kv_pos.view(1, 1, -1), q_pos.unsqueeze(-1)
    mask = key <= qp
    if sliding_window is not None:
        mask &= key > qp - sliding_window
    mask |= (qp < 0) & (key == 0)           # padding rows see one key: no NaN rows
    meta.token_idx, meta.mask, meta.max_q = token_idx, mask.unsqueeze(1), max_q
    return meta


def advance_decode_metadata(meta: AttentionMetadata, positions: torch.Tensor
                            ) -> AttentionMetadata:
    """Metadata of one row per request (q_lens == 1) moved to new positions [B]: the draft
    loop's later steps reuse the gathered key slots and rebuild only what moved."""
    if meta.kv_slots is None:
        return replace(meta, positions=positions, slots=None)
    rows = meta.token_req
    key = torch.arange(meta.kv_slots.shape[1], device=positions.device)[None, :]
    mask = key <= positions[:, None]
    if meta.sliding_window is not None:
        mask &= key > positions[:, None] - meta.sliding_window
    return replace(meta, positions=positions, slots=meta.kv_slots[rows, positions],
                   mask=mask[:, None, None, :])


def windowed_attention(q: torch.Tensor,              # [T, Hq, D]
                       k_cache: torch.Tensor,        # [slots, Hkv, D]
                       v_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float,
                       sinks: torch.Tensor | None = None,   # [Hq] sink logits
                       window: int | None = None,
                       kv_scales: tuple[float, float] | None = None) -> torch.Tensor:
    """The portable path's paged attention (torch metadata: kv_slots, mask) for a layer with
    its own window (keys j > p - window on top of meta's mask) and/or per-head sinks: one
    more softmax column of logit sinks[h], dropped after normalisation, so the weights on
    the keys sum to less than one. Scores and softmax in float32. kv_scales: e4m3 caches
    (quant/kv_fp8.py), dequantized as they are read. -> [T, Hq, D]"""
    k_scale, v_scale = kv_scales or (None, None)
    keys = read_kv(k_cache, meta.kv_slots, k_scale, q.dtype)              # [B, KV, Hkv, D]
    values = read_kv(v_cache, meta.kv_slots, v_scale, q.dtype)
    groups = q.shape[1] // k_cache.shape[1]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=2)
        values = values.repeat_interleave(groups, dim=2)
    b, kv = meta.kv_slots.shape
    queries = q.new_zeros(b, meta.max_q, q.shape[1], q.shape[2])
    queries[meta.token_req, meta.token_idx] = q
    scores = torch.einsum("bqhd,bkhd->bhqk", queries.float(), keys.float()) * scale
    mask = meta.mask                                                       # [B, 1, Q, KV]
    if window is not None:
        q_pos = torch.full((b, meta.max_q), -1, dtype=torch.int64, device=q.device)
        q_pos[meta.token_req, meta.token_idx] = meta.positions
        key = torch.arange(kv, device=q.device)
        # padding rows (position -1) keep their one key 0, as the mask gives them
        mask = mask & ((key[None, None, :] > q_pos[:, :, None] - window)
                       | (q_pos[:, :, None] < 0)).unsqueeze(1)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(b, -1, meta.max_q, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, values.float()).to(q.dtype)
    return out[meta.token_req, meta.token_idx]
