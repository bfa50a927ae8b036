"""Rotary embedding and the KV-cache write, from a qkv projection, for CUDA.

- `rope_and_cache`: splits a fused qkv projection into heads, applies the optional per-head
  q/k RMSNorm (Qwen3) and rotary embedding, writes k and v into the paged cache (at the
  slot it looks up in the block table) and returns the rotated queries.
- `qkv_rope_and_cache`: the qkv GEMV (gemv.py) and the above as one kernel where no
  per-head norm is needed: each program streams the weight rows of both halves of its
  rotary pairs (j and HALF + j of one head), so the rotation and the cache writes are its
  epilogue (one launch and one kernel boundary fewer per layer; the same arithmetic, so the
  same results).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onespec.kernels.gemv import Prenormed, launch_tiling, prenorm_rstd, row_tile, stream_rows
from onespec.kernels.launch import INTERPRETED, pdl_launch, pdl_start, rows_contiguous
from onespec.kernels.settings import MAX_ROWS


@triton.jit
def _cache_value(x, inv_scale, CACHE, dt, KV_FP8: tl.constexpr):
    """What a cache stores of a key or value x (float32): x in the cache's dtype, or, for an
    e4m3 cache, x rounded to the model's dtype dt as the portable path holds it, times
    1 / scale in float32, clamped to the e4m3 range (quant/kv_fp8.py quantize_kv)."""
    if KV_FP8:
        y = tl.clamp(x.to(dt).to(tl.float32) * inv_scale, -448.0, 448.0)
        return _round_e4m3(y).to(CACHE.dtype.element_ty)
    return x.to(CACHE.dtype.element_ty)


@triton.jit
def _round_e4m3(y):
    """y (float32, within ±448) rounded to the nearest e4m3 value, ties to even, in float32
    arithmetic, so the cast after it is exact: the cast's own rounding is right on the GPU,
    but Triton's interpreter drops the carry when rounding up crosses a power of two
    (0.4953 -> 0.25). Normal values keep 3 mantissa bits (integer rounding of the float's
    bits); below 2^-6 (e4m3 subnormals) the step is 2^-9."""
    bits = y.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    z = tl.abs(y) * 512.0
    sub = ((z + 12582912.0) - 12582912.0) * (1.0 / 512.0)     # round to an integer (RNE)
    sub = (sub.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(y) < 0.015625, sub, normal)


@triton.jit
def _rope_cache_kernel(
        QKV, COS_SIN, POSITIONS, ROT_POS, BLOCK_TABLES, TOKEN_REQ, Q_NORM_W, K_NORM_W, Q_OUT,
        K_CACHE, V_CACHE, stride_qkv, stride_cs, stride_qt, stride_qh, stride_ct, stride_ch,
        stride_bt, eps, k_inv, v_inv, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
        HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr,
        KV_FP8: tl.constexpr = False):
    pdl_start(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)              # q heads, then kv heads
    d = tl.arange(0, HALF)
    is_q = head < NUM_Q_HEADS
    base = QKV + row * stride_qkv + head * 2 * HALF
    x1 = tl.load(base + d).to(tl.float32)
    x2 = tl.load(base + HALF + d).to(tl.float32)
    if QK_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
        if is_q:
            w1 = tl.load(Q_NORM_W + d).to(tl.float32)
            w2 = tl.load(Q_NORM_W + HALF + d).to(tl.float32)
        else:
            w1 = tl.load(K_NORM_W + d).to(tl.float32)
            w2 = tl.load(K_NORM_W + HALF + d).to(tl.float32)
        dt = Q_OUT.dtype.element_ty
        x1 = ((x1 * rstd).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * rstd).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    pos = tl.load(POSITIONS + row)              # the cache position
    rot = tl.load(ROT_POS + row)                # the rotary one (a tree row's: its depth's)
    cos = tl.load(COS_SIN + rot * stride_cs + d)
    sin = tl.load(COS_SIN + rot * stride_cs + HALF + d)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_q:
        out = Q_OUT + row * stride_qt + head * stride_qh
        tl.store(out + d, o1.to(Q_OUT.dtype.element_ty))
        tl.store(out + HALF + d, o2.to(Q_OUT.dtype.element_ty))
    else:
        kv_head = head - NUM_Q_HEADS
        # the row's cache slot, from its request's block table (no slot tensor to build)
        req = tl.load(TOKEN_REQ + row)
        block = tl.load(BLOCK_TABLES + req * stride_bt + pos // BLOCK_SIZE).to(tl.int64)
        slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
        dst = slot * stride_ct + kv_head * stride_ch
        qdt = Q_OUT.dtype.element_ty
        tl.store(K_CACHE + dst + d, _cache_value(o1, k_inv, K_CACHE, qdt, KV_FP8))
        tl.store(K_CACHE + dst + HALF + d, _cache_value(o2, k_inv, K_CACHE, qdt, KV_FP8))
        v = QKV + row * stride_qkv + (NUM_Q_HEADS + NUM_KV_HEADS + kv_head) * 2 * HALF
        if KV_FP8:
            tl.store(V_CACHE + dst + d,
                     _cache_value(tl.load(v + d).to(tl.float32), v_inv, V_CACHE, qdt, True))
            tl.store(V_CACHE + dst + HALF + d,
                     _cache_value(tl.load(v + HALF + d).to(tl.float32), v_inv, V_CACHE, qdt,
                                  True))
        else:
            tl.store(V_CACHE + dst + d, tl.load(v + d))
            tl.store(V_CACHE + dst + HALF + d, tl.load(v + HALF + d))


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                   block_tables: torch.Tensor, token_req: torch.Tensor, block_size: int,
                   k_cache: torch.Tensor, v_cache: torch.Tensor,
                   num_heads: int, num_kv_heads: int, q_norm_weight=None, k_norm_weight=None,
                   eps: float = 1e-6, *, rotary_positions: torch.Tensor | None = None,
                   pdl: bool = False,
                   kv_scales: tuple[float, float] | None = None) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] -> rotated q [T, Hq, D]; rotated k and v go to the cache slot
    of each row's position in its request's (token_req [T]) block table [B, nb].
    rotary_positions [T]: rotate at these instead (a dynamic tree's rows: prefix length +
    depth, while row i of the block is cached at prefix length + i). kv_scales (k_scale,
    v_scale): the caches are e4m3 (kv_cache_dtype="fp8"), written quantized."""
    t = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    qk_norm = q_norm_weight is not None
    _rope_cache_kernel[(t, num_heads + num_kv_heads)](
        qkv, cos_sin, positions,
        positions if rotary_positions is None else rotary_positions, block_tables, token_req,
        q_norm_weight if qk_norm else cos_sin, k_norm_weight if qk_norm else cos_sin,
        q, k_cache, v_cache, qkv.stride(0), cos_sin.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), eps,
        *inverse_scales(kv_scales),
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
        BLOCK_SIZE=block_size, QK_NORM=qk_norm, PDL=pdl, KV_FP8=kv_scales is not None,
        num_warps=1, **pdl_launch(pdl))
    return q


@triton.jit
def _qkv_rope_kernel(
        X, W, BIAS, SS_IN, COS_SIN, POSITIONS, ROT_POS, BLOCK_TABLES, TOKEN_REQ, Q_OUT,
        K_CACHE, V_CACHE, M, K, P_IN, stride_xm, stride_wn, stride_ss_in, stride_cs, stride_qt,
        stride_qh, stride_ct, stride_ch, stride_bt, eps, k_inv, v_inv,
        NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
        PAIRS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr,
        PRE: tl.constexpr, BLOCK_P: tl.constexpr, HAS_BIAS: tl.constexpr,
        PRENORMED: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
        ROWS: tl.constexpr, KV_FP8: tl.constexpr = False):
    # Program = (head, PAIRS rotary pairs of it): its weight rows are j and HALF + j for the
    # pairs' j, so both halves of each pair land in its own tile and the rotation, and the
    # stores rope_and_cache would make, are its epilogue. It releases attention after it
    # right after its wait: attention's programs fit beside its own, one per SM.
    pid = tl.program_id(0)
    per_head: tl.constexpr = HALF // PAIRS
    head = pid // per_head
    j = (pid % per_head) * PAIRS + tl.arange(0, PAIRS)                  # [PAIRS]
    c = tl.arange(0, 2 * PAIRS)
    n = head * 2 * HALF + (pid % per_head) * PAIRS + c % PAIRS + (c // PAIRS) * HALF
    m = tl.arange(0, ROWS)
    m_ok = m < M
    # this step's positions, cache slots and cos/sin: inputs, so read before the wait
    pos = tl.load(POSITIONS + m, mask=m_ok, other=0)
    req = tl.load(TOKEN_REQ + m, mask=m_ok, other=0)
    block = tl.load(BLOCK_TABLES + req * stride_bt + pos // BLOCK_SIZE, mask=m_ok, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    rot = tl.load(ROT_POS + m, mask=m_ok, other=0)       # rotary positions (see rope_and_cache)
    cs = COS_SIN + rot[:, None] * stride_cs + j[None, :]
    cos = tl.load(cs, mask=m_ok[:, None], other=0.0)
    sin = tl.load(cs + HALF, mask=m_ok[:, None], other=0.0)
    acc, _ = stream_rows(X, W + n[:, None].to(tl.int64) * stride_wn, n >= 0, m, m_ok, K,
                         stride_xm, stride_wn, 0, 2 * PAIRS, BLOCK_K, PRE, False, IEEE, PDL,
                         True, ROWS)
    if PRENORMED:
        acc = acc * prenorm_rstd(SS_IN, m, m_ok, P_IN, K, stride_ss_in, eps, BLOCK_P)[:, None]
    if HAS_BIAS:
        acc += tl.load(BIAS + n).to(tl.float32)[None, :]
    dt = Q_OUT.dtype.element_ty
    # the projection rounded as gemv stores it, then rope_and_cache's arithmetic
    y = acc.to(dt).to(tl.float32)
    x1, x2 = tl.split(tl.permute(tl.reshape(y, [ROWS, 2, PAIRS]), [0, 2, 1]))  # [ROWS, PAIRS]
    mask = m_ok[:, None]
    if head < NUM_Q_HEADS + NUM_KV_HEADS:
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
    else:
        o1, o2 = x1, x2
    if head < NUM_Q_HEADS:
        out = Q_OUT + m[:, None] * stride_qt + head * stride_qh + j[None, :]
        tl.store(out, o1.to(dt), mask=mask)
        tl.store(out + HALF, o2.to(dt), mask=mask)
    else:
        kv_head = (head - NUM_Q_HEADS) % NUM_KV_HEADS
        dst = slot[:, None] * stride_ct + kv_head * stride_ch + j[None, :]
        if head < NUM_Q_HEADS + NUM_KV_HEADS:
            tl.store(K_CACHE + dst, _cache_value(o1, k_inv, K_CACHE, dt, KV_FP8), mask=mask)
            tl.store(K_CACHE + dst + HALF, _cache_value(o2, k_inv, K_CACHE, dt, KV_FP8),
                     mask=mask)
        else:
            tl.store(V_CACHE + dst, _cache_value(o1, v_inv, V_CACHE, dt, KV_FP8), mask=mask)
            tl.store(V_CACHE + dst + HALF, _cache_value(o2, v_inv, V_CACHE, dt, KV_FP8),
                     mask=mask)


def inverse_scales(kv_scales: tuple[float, float] | None) -> tuple[float, float]:
    """(1 / k_scale, 1 / v_scale), as the portable path multiplies by them (quant/kv_fp8.py);
    (1.0, 1.0) without an e4m3 cache (unused there)."""
    if kv_scales is None:
        return 1.0, 1.0
    return tuple(torch.tensor(1.0 / s, dtype=torch.float32).item() for s in kv_scales)


def qkv_rope_fusable(x: torch.Tensor | Prenormed, weight: torch.Tensor, head_dim: int,
                     qk_norm: bool) -> bool:
    """Whether qkv_rope_and_cache takes this projection: at most MAX_ROWS rows, no per-head
    q/k norm (it needs the whole head), a power-of-two half head >= 8."""
    half = head_dim // 2
    rows = (x.x if isinstance(x, Prenormed) else x).shape[0]
    return not qk_norm and head_dim % 2 == 0 and half >= 8 and \
        half & (half - 1) == 0 and rows <= MAX_ROWS and weight.shape[0] % head_dim == 0


def qkv_rope_and_cache(x: torch.Tensor | Prenormed, weight: torch.Tensor,
                       bias: torch.Tensor | None, positions: torch.Tensor,
                       cos_sin: torch.Tensor, block_tables: torch.Tensor,
                       token_req: torch.Tensor, block_size: int, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, *,
                       rotary_positions: torch.Tensor | None = None,
                       pdl: bool = False,
                       kv_scales: tuple[float, float] | None = None) -> torch.Tensor:
    """gemv(x, weight, bias) followed by rope_and_cache, as one kernel (see
    qkv_rope_fusable): rotated q [M, Hq, D] returned, k and v written to the cache. The
    same arithmetic as the two kernels, so the same results. rotary_positions,
    kv_scales: as in rope_and_cache."""
    pre = x if isinstance(x, Prenormed) else None
    x = rows_contiguous(pre.x if pre else x)
    m, k = x.shape
    head_dim = k_cache.shape[-1]
    half = head_dim // 2
    if weight.shape != ((num_heads + 2 * num_kv_heads) * head_dim, k) or m > MAX_ROWS:
        raise ValueError(f"qkv_rope_and_cache: x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)} do not make {num_heads} + 2 x {num_kv_heads} "
                         f"heads of {head_dim} from at most {MAX_ROWS} rows")
    q = torch.empty(m, num_heads, head_dim, dtype=x.dtype, device=x.device)
    if m == 0:
        return q
    pairs = min(16, half)
    tile = row_tile(m)
    _, block_k, warps, stages, preload = launch_tiling(weight.shape[0], k, False, tile,
                                                       weight, x, deep=False)
    ss_in = pre.ss if pre else x
    grid = weight.shape[0] // (2 * pairs)
    _qkv_rope_kernel[(grid,)](
        x, weight, bias if bias is not None else weight, ss_in, cos_sin, positions,
        positions if rotary_positions is None else rotary_positions, block_tables, token_req,
        q, k_cache, v_cache, m, k,
        pre.ss.shape[1] if pre else 0,
        x.stride(0), weight.stride(0), ss_in.stride(0), cos_sin.stride(0), q.stride(0),
        q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        pre.eps if pre else 1e-6, *inverse_scales(kv_scales),
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, PAIRS=pairs,
        BLOCK_SIZE=block_size, BLOCK_K=block_k, PRE=preload,
        BLOCK_P=triton.next_power_of_2(pre.ss.shape[1]) if pre else 1,
        HAS_BIAS=bias is not None, PRENORMED=pre is not None,
        IEEE=weight.dtype == torch.float32 or INTERPRETED, PDL=pdl, ROWS=tile,
        KV_FP8=kv_scales is not None, num_warps=warps, num_stages=stages, **pdl_launch(pdl))
    return q
