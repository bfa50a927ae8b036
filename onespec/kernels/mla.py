"""Multi-head latent attention (MLA) on CUDA in Triton, in the absorbed form, reading the
paged latent cache directly (models/deepseek_v3.py has the algebra).

Every head of a row attends to the same cached latents [c (RANK), rope(k_pe) (ROPE)] of
its request: the query of head h is [q_nope_h W_UK_h, rope(q_pe_h)] (RANK + ROPE wide),
the value is c. One program takes one row and a group of BLOCK_H heads, so a key tile is
read once for all of them; it walks the row's positions 0 .. pos in tiles of BLOCK_N
through the request's block table with an online softmax, and returns the heads'
attention-weighted latents [BLOCK_H, RANK] (the caller multiplies by W_UV).

Decode-sized launches (at most SPLIT_ROWS rows) split each row's key tiles over SPLITS
programs (tile t goes to split t % SPLITS); a split without a tile leaves at once, a row
whose keys fit one tile stores split 0's result as it is, and otherwise the last split of
the row and head group to finish merges the stored partial softmax states in split order
(kernels/attention.py's _merge_splits, atomic ticket and all): no second kernel. All metadata is read
on the device and the grid depends only on the row count, so a step can be captured in a
CUDA graph. A row's result depends only on its own keys.

Before it, one program per row (mla_rope_and_cache) does the work around the cache that
would otherwise be some fifteen small PyTorch launches a layer: RMSNorm of the row's
latent c and RoPE of its k_pe into the cache slot, RoPE of the heads' q_pe, and the
absorbed query [q_nope W_UK, rope(q_pe)] assembled for the attention kernel. RoPE pairs
are (x_i, x_{i + p/2}), or (x_{2i}, x_{2i+1}) when interleaved; either way the rotated
halves are stored side by side (the layout models/deepseek_v3.py's MLARotary writes), and
everything rounds as the PyTorch operations it replaces.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onespec.kernels.attention import _merge_splits, _ticket_counters
from onespec.kernels.launch import INTERPRETED, dot_t
from onespec.kernels.rows import _rms_row

BLOCK_H = 16          # heads a program takes (tl.dot's smallest tile)
SPLIT_ROWS = 32       # launches of up to this many rows split their keys
SPLITS = 16
# (BLOCK_N, warps, stages): 32 keys of a 576-wide latent are 36 KB in bfloat16
TILING = (32, 8, 2)


@triton.jit
def _mla_kernel(Q, CACHE, BLOCK_TABLES, TOKEN_REQ, POSITIONS, OUT, PART_O, PART_ML, TICKETS,
                stride_qt, stride_qh, stride_c, stride_bt, stride_ot, stride_oh,
                num_heads, scale,
                RANK: tl.constexpr, ROPE: tl.constexpr, R_PAD: tl.constexpr,
                P_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0)
    head_group = tl.program_id(1)
    split = tl.program_id(2)
    pos = tl.load(POSITIONS + row)
    num_tiles = pos // BLOCK_N + 1
    if split >= num_tiles:
        return
    req = tl.load(TOKEN_REQ + row).to(tl.int64)
    h = head_group * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    r = tl.arange(0, R_PAD)
    r_ok = r < RANK
    p = tl.arange(0, P_PAD)
    p_ok = p < ROPE
    q_row = Q + row.to(tl.int64) * stride_qt + h[:, None] * stride_qh
    q_r = tl.load(q_row + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_p = tl.load(q_row + RANK + p[None, :], mask=h_ok[:, None] & p_ok[None, :], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)
    for t in range(split, num_tiles, SPLITS):
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n <= pos
        block = tl.load(BLOCK_TABLES + req * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
        k_r = tl.load(CACHE + slot[:, None] * stride_c + r[None, :],
                      mask=n_ok[:, None] & r_ok[None, :], other=0.0)            # [N, R]
        k_p = tl.load(CACHE + slot[:, None] * stride_c + RANK + p[None, :],
                      mask=n_ok[:, None] & p_ok[None, :], other=0.0)            # [N, P]
        s = dot_t(q_r, k_r, IEEE) + dot_t(q_p, k_p, IEEE)
        s = tl.where(n_ok[None, :], s * scale, float("-inf"))                   # [H, N]
        m_new = tl.maximum(m, tl.max(s, 1))       # finite: every tile has key t * BLOCK_N
        prob = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(prob, 1)
        if IEEE:
            pv = tl.dot(prob, k_r.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(prob.to(k_r.dtype), k_r)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = OUT + row.to(tl.int64) * stride_ot + h[:, None] * stride_oh + r[None, :]
    out_mask = h_ok[:, None] & r_ok[None, :]
    if SPLITS == 1:
        tl.store(out, (acc / l[:, None]).to(OUT.dtype.element_ty), mask=out_mask)
    else:       # the paged attention kernel's split end: a row and head group is one unit
        g = tl.arange(0, BLOCK_H)
        _merge_splits(acc, m, l, PART_O, PART_ML, TICKETS, out, out_mask, out, out_mask, 0,
                      num_tiles - 1, (row * tl.num_programs(1) + head_group).to(tl.int64),
                      split, g, h_ok, g, h_ok, r, BLOCK_H, R_PAD, BLOCK_H, SPLITS,
                      False)


def mla_attention(q: torch.Tensor,              # [T, heads, RANK + ROPE] absorbed queries
                  cache: torch.Tensor,          # [num_slots, RANK + ROPE] latents
                  block_tables: torch.Tensor,   # [B, nb]
                  token_req: torch.Tensor,      # [T] request of each row
                  positions: torch.Tensor,      # [T] a row sees cache positions 0 .. pos
                  rank: int, scale: float, block_size: int) -> torch.Tensor:
    """Attention-weighted latents [T, heads, rank] in q's dtype (the rows' own latents must
    be in the cache already)."""
    rows, heads, width = q.shape
    if cache.dim() != 2 or cache.shape[1] != width or not 0 < rank < width:
        raise ValueError(f"mla_attention: queries {tuple(q.shape)}, cache "
                         f"{tuple(cache.shape)} and rank {rank} do not fit together")
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(rows, heads, rank, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    block_n, warps, stages = TILING
    groups = triton.cdiv(heads, BLOCK_H)
    splits = SPLITS if rows <= SPLIT_ROWS else 1
    # dot operands at least 16 wide, as the paged attention kernel pads them
    r_pad = max(16, triton.next_power_of_2(rank))
    p_pad = max(16, triton.next_power_of_2(width - rank))
    units = rows * groups * splits if splits > 1 else 1
    part_o = torch.empty(units * BLOCK_H * r_pad, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(units * 2 * BLOCK_H, dtype=torch.float32, device=q.device)
    tickets = _ticket_counters(q.device, rows * groups) if splits > 1 else part_ml
    ieee = q.dtype == torch.float32 or INTERPRETED
    _mla_kernel[(rows, groups, splits)](
        q, cache, block_tables, token_req, positions, out, part_o, part_ml, tickets,
        q.stride(0), q.stride(1), cache.stride(0), block_tables.stride(0), out.stride(0),
        out.stride(1), heads, scale, RANK=rank, ROPE=width - rank, R_PAD=r_pad,
        P_PAD=p_pad, BLOCK_H=BLOCK_H, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, SPLITS=splits, IEEE=ieee, num_warps=warps, num_stages=stages)
    return out


@triton.jit
def _rope_halves(base, i, mask, cos, sin, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """The rotated halves (float32) of the rope parts at `base` (pointers, broadcast
    against the pair index i)."""
    if INTERLEAVE:
        first, second = base + 2 * i, base + 2 * i + 1
    else:
        first, second = base + i, base + HALF + i
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(second, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _mla_rope_cache_kernel(Q, Q_LAT, CKV, NORM_W, COS_SIN, POSITIONS, SLOTS, CACHE, QUERY,
                           stride_qt, stride_qh, stride_lt, stride_lh, stride_kt, stride_cs,
                           stride_c, stride_yt, stride_yh, num_heads, eps,
                           NOPE: tl.constexpr, RANK: tl.constexpr, R_PAD: tl.constexpr,
                           HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                           INTERLEAVE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POSITIONS + t)
    slot = tl.load(SLOTS + t)
    i = tl.arange(0, HALF_PAD)
    i_ok = i < HALF
    cos = tl.load(COS_SIN + pos * stride_cs + i, mask=i_ok, other=0.0)
    sin = tl.load(COS_SIN + pos * stride_cs + HALF + i, mask=i_ok, other=0.0)
    # the latent: [RMSNorm(c), rope(k_pe)]
    latent = CACHE + slot * stride_c
    _rms_row(CKV + t * stride_kt, NORM_W, latent, RANK, eps, R_PAD)
    k1, k2 = _rope_halves(CKV + t * stride_kt + RANK, i, i_ok, cos, sin, HALF, INTERLEAVE)
    dt = CACHE.dtype.element_ty
    tl.store(latent + RANK + i, k1.to(dt), mask=i_ok)
    tl.store(latent + RANK + HALF + i, k2.to(dt), mask=i_ok)
    # the absorbed query of every head: [q_nope W_UK, rope(q_pe)]
    r = tl.arange(0, R_PAD)
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_ok = h < num_heads
        out = QUERY + t * stride_yt + h[:, None] * stride_yh
        lat_mask = h_ok[:, None] & (r < RANK)[None, :]
        q_lat = tl.load(Q_LAT + t * stride_lt + h[:, None] * stride_lh + r[None, :],
                        mask=lat_mask, other=0.0)
        tl.store(out + r[None, :], q_lat.to(QUERY.dtype.element_ty), mask=lat_mask)
        rope_mask = h_ok[:, None] & i_ok[None, :]
        q1, q2 = _rope_halves(Q + t * stride_qt + h[:, None] * stride_qh + NOPE, i[None, :],
                              rope_mask, cos[None, :], sin[None, :], HALF, INTERLEAVE)
        tl.store(out + RANK + i[None, :], q1.to(QUERY.dtype.element_ty), mask=rope_mask)
        tl.store(out + RANK + HALF + i[None, :], q2.to(QUERY.dtype.element_ty),
                 mask=rope_mask)


def mla_rope_and_cache(q: torch.Tensor,            # [T, heads, nope + rope] (q_proj's)
                       q_lat: torch.Tensor,        # [T, heads, rank]: q_nope W_UK
                       ckv: torch.Tensor,          # [T, rank + rope]: kv_a_proj's
                       norm: tuple[torch.Tensor, float],    # kv_a_layernorm (weight, eps)
                       cos_sin: torch.Tensor,      # [positions, rope]: cos | sin
                       positions: torch.Tensor, slots: torch.Tensor,    # [T] each
                       cache: torch.Tensor,        # [num_slots, rank + rope] latents
                       interleave: bool) -> torch.Tensor:
    """Writes each row's latent [RMSNorm(c), rope(k_pe)] to its cache slot; returns the
    absorbed queries [T, heads, rank + rope] (in q_lat's dtype) for mla_attention."""
    rows, heads, rank = q_lat.shape
    rope = cache.shape[1] - rank
    nope = q.shape[2] - rope
    if rope % 2 or nope < 0 or ckv.shape != (rows, rank + rope) or q.shape[:2] != (rows, heads):
        raise ValueError(f"mla_rope_and_cache: q {tuple(q.shape)}, q_lat "
                         f"{tuple(q_lat.shape)}, ckv {tuple(ckv.shape)} and cache "
                         f"{tuple(cache.shape)} do not fit together (an even rope width)")
    query = torch.empty(rows, heads, rank + rope, dtype=q_lat.dtype, device=q_lat.device)
    if rows == 0:
        return query
    if q.stride(-1) != 1 or q_lat.stride(-1) != 1 or ckv.stride(-1) != 1:
        q, q_lat, ckv = q.contiguous(), q_lat.contiguous(), ckv.contiguous()
    _mla_rope_cache_kernel[(rows,)](
        q, q_lat, ckv, norm[0], cos_sin, positions, slots, cache, query,
        q.stride(0), q.stride(1), q_lat.stride(0), q_lat.stride(1), ckv.stride(0),
        cos_sin.stride(0), cache.stride(0), query.stride(0), query.stride(1), heads, norm[1],
        NOPE=nope, RANK=rank, R_PAD=triton.next_power_of_2(rank), HALF=rope // 2,
        HALF_PAD=triton.next_power_of_2(rope // 2), BLOCK_H=BLOCK_H, INTERLEAVE=interleave,
        num_warps=4)
    return query
