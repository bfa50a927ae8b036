"""Multi-head latent attention (MLA) on CUDA in Triton, in the absorbed form, reading the
paged latent cache directly (models/deepseek_v3.py has the algebra).

Every head of a row attends to the same cached latents [c (RANK), rope(k_pe) (ROPE)] of
its request: the query of head h is [q_nope_h W_UK_h, rope(q_pe_h)] (RANK + ROPE wide),
the value is c. One program takes one row and a group of BLOCK_H heads, so a key tile is
read once for all of them; it walks the row's positions 0 .. pos in tiles of BLOCK_N
through the request's block table with an online softmax, and returns the heads'
attention-weighted latents [BLOCK_H, RANK] (the caller multiplies by W_UV).

Decode-sized launches (at most SPLIT_ROWS rows) split each row's key tiles over SPLITS
programs (tile t goes to split t % SPLITS) and a second kernel merges the partial softmax
states in split order; a split without a tile leaves at once and the merge skips it. All
metadata is read on the device and the grid depends only on the row count, so a step can
be captured in a CUDA graph. A row's result depends only on its own keys.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onespec.kernels.launch import INTERPRETED

BLOCK_H = 16          # heads a program takes (tl.dot's smallest tile)
SPLIT_ROWS = 32       # launches of up to this many rows split their keys
SPLITS = 16
# (BLOCK_N, warps, stages): 32 keys of a 576-wide latent are 36 KB in bfloat16
TILING = (32, 8, 2)


@triton.jit
def _dot(a, b_t, IEEE: tl.constexpr):
    """a [M, K] . b_t^T ([N, K]) in float32."""
    if IEEE:   # float32, or Triton's interpreter (whose bf16 dot is wrong)
        return tl.dot(a.to(tl.float32), tl.trans(b_t.to(tl.float32)), input_precision="ieee")
    return tl.dot(a, tl.trans(b_t))


@triton.jit
def _mla_kernel(Q, CACHE, BLOCK_TABLES, TOKEN_REQ, POSITIONS, OUT, PART_O, PART_ML,
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
        s = _dot(q_r, k_r, IEEE) + _dot(q_p, k_p, IEEE)
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
    if SPLITS == 1:
        out = OUT + row.to(tl.int64) * stride_ot + h[:, None] * stride_oh + r[None, :]
        tl.store(out, (acc / l[:, None]).to(OUT.dtype.element_ty),
                 mask=h_ok[:, None] & r_ok[None, :])
    else:
        unit = ((row * tl.num_programs(1) + head_group) * SPLITS + split).to(tl.int64)
        tl.store(PART_O + (unit * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]) * R_PAD
                 + r[None, :], acc)
        tl.store(PART_ML + unit * 2 * BLOCK_H + tl.arange(0, BLOCK_H), m)
        tl.store(PART_ML + (unit * 2 + 1) * BLOCK_H + tl.arange(0, BLOCK_H), l)


@triton.jit
def _merge_kernel(POSITIONS, OUT, PART_O, PART_ML, stride_ot, stride_oh, num_heads,
                  RANK: tl.constexpr, R_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """The splits' partial states of one row and head group, merged in split order."""
    row = tl.program_id(0)
    head_group = tl.program_id(1)
    num_tiles = tl.load(POSITIONS + row) // BLOCK_N + 1
    g = tl.arange(0, BLOCK_H)
    r = tl.arange(0, R_PAD)
    m_all = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_all = tl.zeros([BLOCK_H], tl.float32)
    o_all = tl.zeros([BLOCK_H, R_PAD], tl.float32)
    base = (row * tl.num_programs(1) + head_group).to(tl.int64) * SPLITS
    for s in tl.static_range(SPLITS):
        if s < num_tiles:
            unit = base + s
            m_s = tl.load(PART_ML + unit * 2 * BLOCK_H + g)
            l_s = tl.load(PART_ML + (unit * 2 + 1) * BLOCK_H + g)
            o_s = tl.load(PART_O + (unit * BLOCK_H + g[:, None]) * R_PAD + r[None, :])
            m_new = tl.maximum(m_all, m_s)
            a = tl.exp(m_all - m_new)
            b = tl.exp(m_s - m_new)
            l_all = l_all * a + l_s * b
            o_all = o_all * a[:, None] + o_s * b[:, None]
            m_all = m_new
    h = head_group * BLOCK_H + g
    out = OUT + row.to(tl.int64) * stride_ot + h[:, None] * stride_oh + r[None, :]
    tl.store(out, (o_all / l_all[:, None]).to(OUT.dtype.element_ty),
             mask=(h < num_heads)[:, None] & (r < RANK)[None, :])


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
    r_pad = triton.next_power_of_2(rank)
    units = rows * groups * splits if splits > 1 else 1
    part_o = torch.empty(units * BLOCK_H * r_pad, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(units * 2 * BLOCK_H, dtype=torch.float32, device=q.device)
    ieee = q.dtype == torch.float32 or INTERPRETED
    _mla_kernel[(rows, groups, splits)](
        q, cache, block_tables, token_req, positions, out, part_o, part_ml,
        q.stride(0), q.stride(1), cache.stride(0), block_tables.stride(0), out.stride(0),
        out.stride(1), heads, scale, RANK=rank, ROPE=width - rank, R_PAD=r_pad,
        P_PAD=triton.next_power_of_2(width - rank), BLOCK_H=BLOCK_H, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, SPLITS=splits, IEEE=ieee, num_warps=warps, num_stages=stages)
    if splits > 1:
        _merge_kernel[(rows, groups)](
            positions, out, part_o, part_ml, out.stride(0), out.stride(1), heads,
            RANK=rank, R_PAD=r_pad, BLOCK_H=BLOCK_H, BLOCK_N=block_n, SPLITS=splits,
            num_warps=4)
    return out
