"""Paged attention for CUDA in Triton: reads keys/values straight from the block pool.

One program per (query row, kv head) handles the kv head's group of query heads, walks the
row's visible key positions [max(0, pos - window + 1), pos] in tiles of BLOCK_N through the
request's block table, and keeps an online softmax. Prefill chunks, K+1 verify rows and
single-token draft rows are all just rows with a request index and a position, so one
kernel serves all three, and its metadata is built on the device (CUDA-graph safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onespec.layers.triton_linear import pdl_launch, pdl_start, pdl_supported

NO_WINDOW = 1 << 30


@triton.jit
def _paged_attention_kernel(
        Q, K_CACHE, V_CACHE, BLOCK_TABLES, TOKEN_REQ, POSITIONS, OUT,
        stride_qt, stride_qh, stride_ct, stride_ch, stride_bt, stride_ot, stride_oh,
        scale, window,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(TOKEN_REQ + row)
    pos = tl.load(POSITIONS + row)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(Q + row * stride_qt + (kv_head * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)          # [G, D]
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    lo = tl.maximum(pos - window + 1, 0)
    for start in range(lo, pos + 1, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n <= pos
        block = tl.load(BLOCK_TABLES + req * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
        kv_off = slot[:, None] * stride_ct + kv_head * stride_ch + d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K_CACHE + kv_off, mask=kv_mask, other=0.0)          # [N, D]
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(n_ok[None, :], s * scale, float("-inf"))          # [G, N]
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V_CACHE + kv_off, mask=kv_mask, other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / l[:, None]
    tl.store(OUT + row * stride_ot + (kv_head * GROUP + g)[:, None] * stride_oh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def triton_paged_attention(q, k_cache, v_cache, block_tables, token_req, positions,
                           scale: float, block_size: int, window: int | None = None,
                           config: tuple[int, int, int] | None = None):
    """q [T, Hq, D]; caches [slots, Hkv, D]; block_tables [B, nb]; token_req/positions [T].
    Returns [T, Hq, D]. Keys for the rows' own positions must already be in the cache.
    config: (BLOCK_N, num_warps, num_stages) instead of the default."""
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_rows == 0:
        return out
    # 256-key tiles: at 256..1024 positions 5.5..17 us per 8B-shape layer vs 8.6..32 with
    # 64 (scripts/sweep_small_linear.py on an H200)
    if config is None:
        wide = head_dim <= 128 and q.element_size() <= 2      # float32 tiles need 2x smem
        config = (256, 8, 3) if wide else (64 if head_dim <= 128 else 32, 4, 3)
    block_n, warps, stages = config
    pdl = pdl_supported(q.device)
    grid = (num_rows, num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, token_req, positions, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), scale, window or NO_WINDOW,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        BLOCK_N=block_n, IEEE=q.dtype == torch.float32, PDL=pdl, num_warps=warps,
        num_stages=stages, **pdl_launch(pdl))
    return out
