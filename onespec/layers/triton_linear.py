"""Triton kernels for decode-sized batches on CUDA, where every step is a stream of weights.

A decode step of a batch of a few rows reads each weight matrix once and does almost no
arithmetic, so its time is the time to stream the weights, and every extra kernel launch
between two weight streams is time the memory sits idle. The kernels here:

- `small_linear`: y = x @ W.T (+ bias) for M <= MAX_ROWS rows, rows padded to a tile of
  16 (up to 16 rows) or 32, the weight loads software-pipelined; a gated SiLU after it
  (W holds [gate; up] rows and the result is silu(gate) * up) and a residual added after it.
  An RMSNorm in front of it either runs as its own row kernel (`norm_weight`) or is split
  across the kernels around it (`Prenormed`): the residual kernel before the norm also
  stores rows * norm weight and per-program partial sums of squares, and the GEMV after
  it applies 1/rms in its epilogue.
- `rope_and_cache`: splits a fused qkv projection into heads, applies the optional per-head
  q/k RMSNorm (Qwen3) and rotary embedding, writes k and v into the paged cache (at the
  slot it looks up in the block table) and returns the rotated queries.
- `qkv_rope_and_cache`: the two above as one kernel where no per-head norm is needed: each
  program streams the weight rows of both halves of its rotary pairs (j and HALF + j of
  one head), so the rotation and the cache writes are its epilogue (one launch and one
  kernel boundary fewer per layer; the same arithmetic, so the same results).

On Hopper and newer every kernel is launched with programmatic dependent launch: it may
start while its predecessor finishes (a linear layer begins streaming its first weight
tile), and waits for it (gdc_wait) before reading anything the predecessor wrote. A
linear layer lets its own successor start only after its weight stream (earlier, the
successor's programs would take SMs its last programs need), except where the successor's
programs fit beside its own, one per SM: the qkv GEMV (attention after it) and the down
projection before the next layer's qkv release it right after their wait, so its programs
are waiting on the SMs when this kernel ends.
Each row is computed by the same instructions whatever the number of rows, so results
never depend on how rows are batched. The PyTorch code in layers/linear.py is the reference.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_ROWS = 32        # rows padded to a tile of 16 or 32 (row_tile); larger batches: cuBLAS
CONFIGS: dict[tuple[int, int, bool], tuple[int, ...]] = {}   # (N, K, gated) -> tiling
FUSED_ROPE = True    # qkv_rope_and_cache: the qkv GEMV writes rotated heads and the KV cache
RELEASE_TILES = 0    # a GEMV lets its successor launch this many weight tiles before its end
# The qkv GEMV (qkv_rope_and_cache) and a small_linear called with early_release let their
# successor launch right after their own wait, so its programs sit waiting beside theirs
# and start ~1.3 us sooner after they end (H200: docs/PERFORMANCE.md, 2k)
EARLY_RELEASE = True
# profiling knob: more GEMVs that release at their start, keys (N, K, gated) of small_linear
RELEASE_AT_START: set = set()
# Profiling (scripts/profile_graph_step.py --trace): a list, and every launch of the kernels
# here and in triton_attention appends (kernel name, stamps [programs, 5] int64): each
# program's globaltimer (ns) at its start, after its wait for the previous kernel, after
# its main work (a GEMV's weight stream), at its end, and the SM it ran on.
TRACE: list | None = None


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A small kernel's start under PDL: wait for the predecessor, then let the successor
    launch (it only waits, so it takes no SM time this kernel needs)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def trace_buffer(name: str, programs: int, device) -> torch.Tensor | None:
    """A launch's stamp buffer while TRACE is on, else None. Not zeroed: a kernel launched
    for that inside a CUDA graph would sit between two PDL kernels and serialise them."""
    if TRACE is None:
        return None
    buf = torch.empty(programs, 5, dtype=torch.int64, device=device)
    TRACE.append((name, buf))
    return buf


@triton.jit
def stamp(BUF, i: tl.constexpr, ON: tl.constexpr):
    """Profiling: this program's globaltimer into BUF[program, i] (and at i == 0 its SM)."""
    if ON:
        pid = tl.program_id(0) + tl.num_programs(0) * (
            tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [],
                                        dtype=tl.int64, is_pure=False, pack=1)
        tl.store(BUF + pid * 5 + i, now)
        if i == 0:
            sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                           is_pure=False, pack=1)
            tl.store(BUF + pid * 5 + 4, sm.to(tl.int64))


@triton.jit
def _accumulate(acc, acc_up, x, w, wu, GATED: tl.constexpr, IEEE: tl.constexpr):
    if IEEE:   # float32 weights, or Triton's interpreter (whose bf16 dot is wrong)
        xf = x.to(tl.float32)
        acc += tl.dot(xf, tl.trans(w.to(tl.float32)), input_precision="ieee")
        if GATED:
            acc_up += tl.dot(xf, tl.trans(wu.to(tl.float32)), input_precision="ieee")
    else:
        acc += tl.dot(x, tl.trans(w))
        if GATED:
            acc_up += tl.dot(x, tl.trans(wu))
    return acc, acc_up


@triton.jit
def _stream_rows(X, w_rows, n_ok, m, m_ok, K, stride_xm, stride_wn, N,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE: tl.constexpr,
                 GATED: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, TR,
                 TRACING: tl.constexpr, REL: tl.constexpr, ROWS: tl.constexpr):
    """x @ W[rows].T for one program's BLOCK_N weight rows (w_rows: their pointers, any
    rows; with GATED also the rows N further), rows of x padded to ROWS (m: their indices):
    (acc, acc_up) [ROWS, BLOCK_N] in float32. Waits for the previous kernel after the first
    PRE tiles and releases the next one after the stream (REL = 0), REL tiles before its
    end (REL > 0) or right after the wait (REL < 0)."""
    # The first PRE weight tiles do not depend on the previous kernel: under programmatic
    # dependent launch they stream while that kernel finishes. (ptxas stores such a tile to
    # shared memory for the dot before the wait, so the wait returns only once it has
    # arrived; with PRE = 0 a program launched after its predecessor's end waits at once
    # and its pipelined loads leave right after.)
    if PRE > 0:
        kp = tl.arange(0, PRE * BLOCK_K)
        mask_p = n_ok[:, None] & (kp < K)[None, :]
        w_p = tl.load(w_rows + kp[None, :], mask=mask_p, other=0.0)
        wu_p = w_p
        if GATED:
            wu_p = tl.load(w_rows + N * stride_wn + kp[None, :], mask=mask_p, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        if REL < 0:
            tl.extra.cuda.gdc_launch_dependents()
    stamp(TR, 1, TRACING)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    acc_up = tl.zeros([ROWS, BLOCK_N], tl.float32)
    if PRE > 0:
        x_p = tl.load(X + m[:, None] * stride_xm + kp[None, :],
                      mask=m_ok[:, None] & (kp < K)[None, :], other=0.0)
        acc, acc_up = _accumulate(acc, acc_up, x_p, w_p, wu_p, GATED, IEEE)
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_rows + k[None, :]
    x_ptrs = X + m[:, None] * stride_xm + k[None, :]
    k_rel = PRE * BLOCK_K + tl.maximum(tl.cdiv(K, BLOCK_K) - PRE - REL, 0) * BLOCK_K
    for k0 in range(PRE * BLOCK_K, K, BLOCK_K):
        if REL > 0 and PDL:
            if k0 == k_rel:
                tl.extra.cuda.gdc_launch_dependents()
        k_ok = k0 + k < K
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptrs + k0, mask=w_mask, other=0.0)
        wu = w
        if GATED:
            wu = tl.load(w_ptrs + N * stride_wn + k0, mask=w_mask, other=0.0)
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc, acc_up = _accumulate(acc, acc_up, x, w, wu, GATED, IEEE)
    stamp(TR, 2, TRACING)
    if PDL and REL >= 0:
        # release the successor only once the weights are streamed: released at the start,
        # its early blocks hold SMs this kernel still needs (H200, 8B decode step: 5.32 ms
        # vs 4.50 ms, docs/PERFORMANCE.md)
        tl.extra.cuda.gdc_launch_dependents()
    return acc, acc_up


@triton.jit
def _prenorm_rstd(SS_IN, m, m_ok, P_IN, K, stride_ss_in, eps, BLOCK_P: tl.constexpr):
    """X held x * norm_weight; the producer left per-row partial sums of x^2: 1/rms [rows]."""
    p = tl.arange(0, BLOCK_P)
    parts = tl.load(SS_IN + m[:, None] * stride_ss_in + p[None, :],
                    mask=m_ok[:, None] & (p < P_IN)[None, :], other=0.0)
    return tl.rsqrt(tl.sum(parts, 1) / K + eps)


@triton.jit
def _small_linear_kernel(
        X, W, BIAS, RES, Y, SS_IN, NW_OUT, XN_OUT, SS_OUT, ARG_VAL, ARG_IDX, TR,
        M, N, K, P_IN, stride_xm, stride_wn, stride_rm, stride_ym, stride_ss_in,
        stride_xn_out, stride_ss_out, stride_arg, eps,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE: tl.constexpr, BLOCK_P: tl.constexpr,
        HAS_BIAS: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
        PRENORMED: tl.constexpr, NORM_OUT: tl.constexpr, ARGMAX: tl.constexpr,
        IEEE: tl.constexpr, PDL: tl.constexpr, TRACING: tl.constexpr, REL: tl.constexpr,
        ROWS: tl.constexpr):
    # Rows are padded to ROWS (16, the smallest tensor-core tile, or 32), so every row sees
    # the same instructions whatever M is up to ROWS; each row's dot products add the same
    # terms in the same order in a tile of either height. The loop's loads are
    # software-pipelined (num_stages).
    stamp(TR, 0, TRACING)
    pid = tl.program_id(0)
    m = tl.arange(0, ROWS)
    m_ok = m < M
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc, acc_up = _stream_rows(X, W + n[:, None].to(tl.int64) * stride_wn, n_ok, m, m_ok, K,
                               stride_xm, stride_wn, N, BLOCK_N, BLOCK_K, PRE, GATED, IEEE,
                               PDL, TR, TRACING, REL, ROWS)
    if PRENORMED:
        rstd = _prenorm_rstd(SS_IN, m, m_ok, P_IN, K, stride_ss_in, eps, BLOCK_P)
        acc = acc * rstd[:, None]
        acc_up = acc_up * rstd[:, None]
    y = acc
    if HAS_BIAS:
        y += tl.load(BIAS + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        up = acc_up
        if HAS_BIAS:
            up += tl.load(BIAS + N + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = y * tl.sigmoid(y) * up
    out_ok = m_ok[:, None] & n_ok[None, :]
    if RESIDUAL:
        r = tl.load(RES + m[:, None] * stride_rm + n[None, :], mask=out_ok, other=0.0)
        # the projection is rounded to the stream's dtype before the add, as in PyTorch
        y = y.to(RES.dtype.element_ty).to(tl.float32) + r.to(tl.float32)
    y = y.to(Y.dtype.element_ty)
    if ARGMAX:
        # greedy decoding: this tile's best column per row (first on ties), reduced over
        # the tiles by _argmax_reduce_kernel; the values are the ones Y would hold
        yv = tl.where(n_ok[None, :], y.to(tl.float32), float("-inf"))
        tl.store(ARG_VAL + m * stride_arg + pid, tl.max(yv, 1), mask=m_ok)
        tl.store(ARG_IDX + m * stride_arg + pid,
                 pid * BLOCK_N + tl.argmax(yv, 1, tie_break_left=True), mask=m_ok)
    else:
        tl.store(Y + m[:, None] * stride_ym + n[None, :], y, mask=out_ok)
    if NORM_OUT:
        # the next RMSNorm's share of this tile: y * its weight, and sum(y^2) per row
        yf = tl.where(out_ok, y.to(tl.float32), 0.0)
        nw = tl.load(NW_OUT + n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(XN_OUT + m[:, None] * stride_xn_out + n[None, :],
                 (yf * nw[None, :]).to(XN_OUT.dtype.element_ty), mask=out_ok)
        tl.store(SS_OUT + m * stride_ss_out + pid, tl.sum(yf * yf, 1), mask=m_ok)
    stamp(TR, 3, TRACING)


@triton.jit
def _argmax_reduce_kernel(VAL, IDX, OFFSETS, OUT, P, stride, BLOCK_P: tl.constexpr,
                          HAS_OFFSETS: tl.constexpr, PDL: tl.constexpr):
    """Per row: the best of the tiles' (max, argmax) pairs, the lowest column on ties (as
    torch.argmax picks the first maximal value), plus OFFSETS[column] if given (a draft
    vocabulary's map to target ids)."""
    pdl_start(PDL)
    row = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    ok = p < P
    v = tl.load(VAL + row * stride + p, mask=ok, other=float("-inf"))
    i = tl.load(IDX + row * stride + p, mask=ok, other=0)
    best = tl.max(v, 0)
    big = tl.full([BLOCK_P], 2147483647, tl.int32)
    token = tl.min(tl.where(ok & (v == best), i, big), 0).to(tl.int64)
    if HAS_OFFSETS:
        token += tl.load(OFFSETS + token)
    tl.store(OUT + row, token)


@triton.jit
def _rms_row(X, W, Y, K, eps, BLOCK: tl.constexpr):
    """Y[:K] = RMSNorm(X[:K]) * W for one row; X is read as Y's dtype (a cast first)."""
    k = tl.arange(0, BLOCK)
    dt = Y.dtype.element_ty
    sq = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(X + k0 + k, mask=k0 + k < K, other=0.0).to(dt).to(tl.float32)
        sq += x * x
    rstd = tl.rsqrt(tl.sum(sq, 0) / K + eps)
    for k0 in range(0, K, BLOCK):
        ok = k0 + k < K
        x = tl.load(X + k0 + k, mask=ok, other=0.0).to(dt).to(tl.float32)
        w = tl.load(W + k0 + k, mask=ok, other=0.0).to(tl.float32)
        # as RMSNorm does: normalise in float32, cast back, then scale by the weight
        normed = (x * rstd).to(dt).to(tl.float32)
        tl.store(Y + k0 + k, (normed * w).to(dt), mask=ok)


@triton.jit
def _rms_norm_kernel(X, W, Y, K, stride_x, stride_y, eps, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0)
    _rms_row(X + row * stride_x, W, Y + row * stride_y, K, eps, BLOCK)


@triton.jit
def _embed_norm_concat_kernel(IDS, TABLE, HID, W_E, W_H, Y, K, stride_t, stride_h, stride_y,
                              eps_e, eps_h, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Y[row] = concat(RMSNorm_e(TABLE[IDS[row]]), RMSNorm_h(HID[row])): program (row, 0)
    gathers and normalises the token's embedding, (row, 1) the hidden state."""
    pdl_start(PDL)
    row = tl.program_id(0)
    if tl.program_id(1) == 0:
        token = tl.load(IDS + row).to(tl.int64)
        _rms_row(TABLE + token * stride_t, W_E, Y + row * stride_y, K, eps_e, BLOCK)
    else:
        _rms_row(HID + row * stride_h, W_H, Y + row * stride_y + K, K, eps_h, BLOCK)


def embed_norm_concat(ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor,
                      embed_norm: tuple[torch.Tensor, float],
                      hidden_norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    """concat(norm_e(table[ids]), norm_h(hidden)) [T, 2H] in hidden's dtype (the embedding
    rows cast to it first): an EAGLE-3 layer's input in one kernel. Norms: (weight, eps)."""
    t, k = hidden.shape
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    out = torch.empty(t, 2 * k, dtype=hidden.dtype, device=hidden.device)
    if t:
        pdl = pdl_supported(hidden.device)
        _embed_norm_concat_kernel[(t, 2)](
            ids, table, hidden, embed_norm[0], hidden_norm[0], out, k, table.stride(0),
            hidden.stride(0), out.stride(0), embed_norm[1], hidden_norm[1],
            BLOCK=min(4096, triton.next_power_of_2(k)), PDL=pdl, num_warps=8,
            **pdl_launch(pdl))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of x [M, K] (into `out`, which may be a column slice of a wider
    buffer): one program per row."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty_like(x) if out is None else out
    if x.shape[0]:
        pdl = pdl_supported(x.device)
        _rms_norm_kernel[(x.shape[0],)](
            x, weight, out, x.shape[1], x.stride(0), out.stride(0), eps,
            BLOCK=min(4096, triton.next_power_of_2(x.shape[1])), PDL=pdl, num_warps=8,
            **pdl_launch(pdl))
    return out


# Row kernels around the cuBLAS linears of batches beyond MAX_ROWS rows: PyTorch's RMSNorm
# is four elementwise kernels and SiLU * up two (H200, 8B shape, batch 32: ~30 us a layer
# of such kernels around 120 us of GEMMs; docs/PERFORMANCE.md 2r).

@triton.jit
def _add_rms_norm_kernel(Y, RES, W, H, XN, K, stride_y, stride_r, stride_h, stride_xn, eps,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    dt = H.dtype.element_ty
    k = tl.arange(0, BLOCK)
    for k0 in range(0, K, BLOCK):
        ok = k0 + k < K
        y = tl.load(Y + row * stride_y + k0 + k, mask=ok, other=0.0).to(tl.float32)
        r = tl.load(RES + row * stride_r + k0 + k, mask=ok, other=0.0).to(tl.float32)
        # rounded to the stream's dtype, as PyTorch's residual + y
        tl.store(H + row * stride_h + k0 + k, (r + y).to(dt), mask=ok)
    # the sums are read back below, maybe by other threads of the program: a block-wide
    # barrier makes its global stores visible to all of them
    tl.debug_barrier()
    _rms_row(H + row * stride_h, W, XN + row * stride_xn, K, eps, BLOCK)


def add_rms_norm(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = residual + y and RMSNorm(h) * weight for rows [M, K], one program per row:
    (h, normed), as `residual + y` followed by rms_norm."""
    if y.shape != residual.shape or y.dim() != 2:
        raise ValueError(f"add_rms_norm: y {tuple(y.shape)} and residual "
                         f"{tuple(residual.shape)} must be the same [rows, K]")
    y = y if y.stride(-1) == 1 else y.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    h, xn = torch.empty_like(residual), torch.empty_like(residual)
    if y.shape[0]:
        pdl = pdl_supported(y.device)
        _add_rms_norm_kernel[(y.shape[0],)](
            y, residual, weight, h, xn, y.shape[1], y.stride(0), residual.stride(0),
            h.stride(0), xn.stride(0), eps, BLOCK=min(4096, triton.next_power_of_2(y.shape[1])),
            PDL=pdl, num_warps=8, **pdl_launch(pdl))
    return h, xn


@triton.jit
def _silu_mul_kernel(Y, OUT, N, stride_y, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    gate = tl.load(Y + row * stride_y + n, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(Y + row * stride_y + N + n, mask=ok, other=0.0)
    dt = OUT.dtype.element_ty
    # as F.silu(gate) * up: the SiLU rounded to the dtype, then the product
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up.to(tl.float32)
    tl.store(OUT + row * stride_o + n, act.to(dt), mask=ok)


def silu_mul(y: torch.Tensor) -> torch.Tensor:
    """silu(y[:, :N]) * y[:, N:] for y [M, 2N] (a gated MLP's [gate; up] projection)."""
    if y.dim() != 2 or y.shape[1] % 2:
        raise ValueError(f"silu_mul: y must be [rows, 2 * N], got {tuple(y.shape)}")
    y = y if y.stride(-1) == 1 else y.contiguous()
    n = y.shape[1] // 2
    out = torch.empty(y.shape[0], n, dtype=y.dtype, device=y.device)
    if y.shape[0] and n:
        block = min(2048, triton.next_power_of_2(n))
        pdl = pdl_supported(y.device)
        _silu_mul_kernel[(y.shape[0], triton.cdiv(n, block))](
            y, out, n, y.stride(0), out.stride(0), BLOCK=block, PDL=pdl, num_warps=4,
            **pdl_launch(pdl))
    return out


def _config(n: int, k: int, gated: bool, deep: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages), from scripts/sweep_small_linear.py on an
    H200 (docs/PERFORMANCE.md). `deep`: 16-bit weights on a GPU with Hopper's shared memory,
    where (H200, 8B shape, docs/PERFORMANCE.md 2f and 2m)
    - a square projection (o_proj, after attention) streams 8 tiles deep (172 KB): plain
      batch 1 4.34-4.43 vs 4.49-4.52 ms in alternating benchmark processes;
    - a projection down to fewer outputs than inputs (the MLP's down, EAGLE-3's fc) in
      16-row tiles, 2 warps, 6 deep (80 KB: two programs on most SMs, where 32-row tiles
      left 4 of 132 SMs idle; one of the next qkv's fits beside one): 4.052 / 4.048 /
      4.054 / 4.056 vs 4.062 / 4.064 / 4.066 / 4.066 ms (2p);
    - a vocabulary-sized one (lm_head, N >= 64K) in 64 x 128 tiles, 4 deep: 237.5 vs 244.8
      us for the 128256 x 4096 lm_head with its argmax."""
    if gated:
        return 64, 128, 4, 3
    if deep and n >= 1 << 16:
        return 64, 128, 4, 4
    if deep and k > n:
        return 16, 256, 2, 6
    return (32, 256, 4, 8) if deep and n == k else (32, 256, 4, 5)


def row_tile(m: int) -> int:
    """The padded height of the row tile a launch of m rows computes: 16 up to 16, else 32."""
    return 16 if m <= 16 else 32


@functools.lru_cache(maxsize=None)
def _block_smem(device: torch.device) -> int:
    """Shared memory one block may use (sm_90: 227 KB; an SM holds 1 KB more per block)."""
    if device.type != "cuda" or INTERPRETED:
        return 232448
    props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    return props["max_shared_mem"]


def _stages_for_rows(w_rows: int, block_k: int, stages: int, rows: int, w_bytes: int,
                     x_bytes: int, block_smem: int) -> int:
    """num_stages for a tile of `rows` rows, from one tuned for 16: the pipeline holds
    stages - 1 buffers of the weight tile [w_rows, block_k] and of the x tile [rows,
    block_k], so taller x tiles take more shared memory; keep as many programs per SM as
    the 16-row tiling allowed, with at least 3 stages."""
    per_stage = lambda r: (w_rows * w_bytes + r * x_bytes) * block_k
    sm = block_smem + 1024
    per_sm = max(1, sm // ((stages - 1) * per_stage(16) + 1024))
    budget = min(block_smem, sm // per_sm - 1024)
    return max(3, min(stages, 1 + budget // per_stage(rows)))


def _launch_tiling(n: int, k: int, gated: bool, rows: int, weight: torch.Tensor,
                   x: torch.Tensor, config: tuple[int, ...] | None = None,
                   deep: bool | None = None) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, PRE) of a launch: `config` or CONFIGS'
    entry as given, else _config's with its pipeline fitted to the row tile."""
    given = config or CONFIGS.get((n, k, gated))
    if given:
        return _tiling(given)
    if deep is None:
        deep = weight.element_size() <= 2 and _hopper(weight.device)
    block_n, block_k, warps, stages, preload = _tiling(_config(n, k, gated, deep))
    if rows > 16:
        stages = _stages_for_rows(block_n * (2 if gated else 1), block_k, stages, rows,
                                  weight.element_size(), x.element_size(),
                                  _block_smem(weight.device))
    return block_n, block_k, warps, stages, preload


def _tiling(config: tuple[int, ...]) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages[, PRE]) with PRE (default 1) checked."""
    block_n, block_k, warps, stages, *preload = config
    preload = preload[0] if preload else 1
    if preload < 0 or preload & (preload - 1):
        raise ValueError(f"small_linear: config's preload tiles must be 0 or a power of two, "
                         f"got {preload}")
    return block_n, block_k, warps, stages, preload


@functools.lru_cache(maxsize=None)
def _hopper(device: torch.device) -> bool:
    """Compiled Triton on Hopper or newer (PDL, 227 KB of shared memory per block)."""
    return device.type == "cuda" and not INTERPRETED and \
        torch.cuda.get_device_capability(device)[0] >= 9


@functools.lru_cache(maxsize=None)
def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (a kernel starts while its predecessor finishes and
    waits for it with gdc_wait): Hopper or newer, compiled Triton; ONESPEC_PDL=0 disables."""
    return _hopper(device) and os.environ.get("ONESPEC_PDL", "1") != "0"


def pdl_launch(pdl: bool) -> dict:
    return {"launch_pdl": True} if pdl else {}


@dataclass
class Prenormed:
    """An RMSNorm split across two kernels: `x` = rows * norm weight [M, K], `ss` = partial
    sums of the rows' squares [M, P] (one per producer program); the consuming
    small_linear multiplies by 1/rms(row) in its epilogue, where the sums are complete."""
    x: torch.Tensor
    ss: torch.Tensor
    eps: float


def small_linear(x: torch.Tensor | Prenormed, weight: torch.Tensor,
                 bias: torch.Tensor | None = None, *,
                 norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                 gated: bool = False, residual: torch.Tensor | None = None,
                 norm_out: tuple[torch.Tensor, float] | None = None,
                 out_dtype: torch.dtype | None = None, argmax: bool = False,
                 argmax_offsets: torch.Tensor | None = None,
                 config: tuple[int, ...] | None = None,
                 early_release: bool = False):
    """x [M, K] (M <= MAX_ROWS), weight [N or 2N, K] -> [M, N]; see the module docstring.

    x may be a Prenormed (the RMSNorm of its producer). norm_out=(weight, eps), with a
    residual: also return the next RMSNorm of the result as a Prenormed, i.e. returns
    (y, Prenormed). argmax: return y.argmax(-1) [M] int64 instead of y (y, in out_dtype,
    is never written), plus argmax_offsets[argmax] [N] int64 if given.
    config: (BLOCK_N, BLOCK_K, num_warps, num_stages[, PRE]), PRE (0 or a power of two,
    default 1) the number of weight tiles loaded before waiting for the previous kernel.
    early_release: the next kernel may launch as soon as this one's wait returns (its
    programs must fit beside this one's, one per SM: e.g. the next layer's qkv after the
    MLP's down projection); otherwise after this one's weight stream."""
    pre = x if isinstance(x, Prenormed) else None
    x = pre.x if pre else x
    m, k = x.shape
    rows, k_w = weight.shape
    if k_w != k or m > MAX_ROWS:
        raise ValueError(f"small_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         f"need equal K and at most {MAX_ROWS} rows")
    if norm_out is not None and residual is None:
        raise ValueError("small_linear: norm_out needs a residual (it normalises the sum)")
    if argmax and (norm_out is not None or gated):
        raise ValueError("small_linear: argmax takes neither norm_out nor gated")
    x = x if x.stride(-1) == 1 else x.contiguous()
    n = rows // 2 if gated else rows
    out = torch.empty(0 if argmax else m, n, dtype=out_dtype or x.dtype, device=x.device)
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    tile = row_tile(m)
    block_n, block_k, warps, stages, preload = _launch_tiling(n, k, gated, tile, weight, x,
                                                              config)
    grid = triton.cdiv(n, block_n)
    nxt = None
    if norm_out is not None:
        nxt = Prenormed(torch.empty_like(out),
                        torch.empty(m, grid, dtype=torch.float32, device=x.device),
                        norm_out[1])
    arg = None
    if argmax:
        arg = (torch.empty(m, grid, dtype=torch.float32, device=x.device),
               torch.empty(m, grid, dtype=torch.int32, device=x.device),
               torch.empty(m, dtype=torch.int64, device=x.device))
    if m == 0:
        return arg[2] if argmax else out if nxt is None else (out, nxt)
    res = residual if residual is not None else out
    ss_in = pre.ss if pre else out
    pdl = pdl_supported(x.device)
    tr = trace_buffer("small_linear", grid, x.device)
    _small_linear_kernel[(grid,)](
        x, weight, bias if bias is not None else weight, res, out, ss_in,
        norm_out[0] if nxt else weight, nxt.x if nxt else out, nxt.ss if nxt else out,
        arg[0] if arg else out, arg[1] if arg else out, tr,
        m, n, k, pre.ss.shape[1] if pre else 0, x.stride(0), weight.stride(0),
        res.stride(0), out.stride(0), ss_in.stride(0),
        nxt.x.stride(0) if nxt else 0, nxt.ss.stride(0) if nxt else 0,
        grid if arg else 0, pre.eps if pre else eps,
        BLOCK_N=block_n, BLOCK_K=block_k, PRE=preload,
        BLOCK_P=triton.next_power_of_2(pre.ss.shape[1]) if pre else 1,
        HAS_BIAS=bias is not None, GATED=gated, RESIDUAL=residual is not None,
        PRENORMED=pre is not None, NORM_OUT=nxt is not None, ARGMAX=argmax,
        IEEE=weight.dtype == torch.float32 or INTERPRETED, PDL=pdl,
        TRACING=tr is not None,
        REL=-1 if early_release and EARLY_RELEASE or (n, k, gated) in RELEASE_AT_START
        else RELEASE_TILES, ROWS=tile, num_warps=warps, num_stages=stages,
        **pdl_launch(pdl))
    if argmax:
        offsets = arg[2] if argmax_offsets is None else argmax_offsets
        _argmax_reduce_kernel[(m,)](arg[0], arg[1], offsets, arg[2], grid, grid,
                                    BLOCK_P=triton.next_power_of_2(grid),
                                    HAS_OFFSETS=argmax_offsets is not None, PDL=pdl,
                                    num_warps=4, **pdl_launch(pdl))
        return arg[2]
    return out if nxt is None else (out, nxt)


@triton.jit
def _rope_cache_kernel(
        QKV, COS_SIN, POSITIONS, BLOCK_TABLES, TOKEN_REQ, Q_NORM_W, K_NORM_W, Q_OUT, K_CACHE,
        V_CACHE, stride_qkv, stride_cs, stride_qt, stride_qh, stride_ct, stride_ch, stride_bt,
        eps, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr):
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
    pos = tl.load(POSITIONS + row)
    cos = tl.load(COS_SIN + pos * stride_cs + d)
    sin = tl.load(COS_SIN + pos * stride_cs + HALF + d)
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
        tl.store(K_CACHE + dst + d, o1.to(K_CACHE.dtype.element_ty))
        tl.store(K_CACHE + dst + HALF + d, o2.to(K_CACHE.dtype.element_ty))
        v = QKV + row * stride_qkv + (NUM_Q_HEADS + NUM_KV_HEADS + kv_head) * 2 * HALF
        tl.store(V_CACHE + dst + d, tl.load(v + d))
        tl.store(V_CACHE + dst + HALF + d, tl.load(v + HALF + d))


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                   block_tables: torch.Tensor, token_req: torch.Tensor, block_size: int,
                   k_cache: torch.Tensor, v_cache: torch.Tensor,
                   num_heads: int, num_kv_heads: int, q_norm_weight=None, k_norm_weight=None,
                   eps: float = 1e-6) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] -> rotated q [T, Hq, D]; rotated k and v go to the cache slot
    of each row's position in its request's (token_req [T]) block table [B, nb]."""
    t = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    qk_norm = q_norm_weight is not None
    pdl = pdl_supported(qkv.device)
    _rope_cache_kernel[(t, num_heads + num_kv_heads)](
        qkv, cos_sin, positions, block_tables, token_req,
        q_norm_weight if qk_norm else cos_sin, k_norm_weight if qk_norm else cos_sin,
        q, k_cache, v_cache, qkv.stride(0), cos_sin.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), eps,
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
        BLOCK_SIZE=block_size, QK_NORM=qk_norm, PDL=pdl, num_warps=1, **pdl_launch(pdl))
    return q


@triton.jit
def _qkv_rope_kernel(
        X, W, BIAS, SS_IN, COS_SIN, POSITIONS, BLOCK_TABLES, TOKEN_REQ, Q_OUT, K_CACHE,
        V_CACHE, TR, M, K, P_IN, stride_xm, stride_wn, stride_ss_in, stride_cs, stride_qt,
        stride_qh, stride_ct, stride_ch, stride_bt, eps,
        NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
        PAIRS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr,
        PRE: tl.constexpr, BLOCK_P: tl.constexpr, HAS_BIAS: tl.constexpr,
        PRENORMED: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
        TRACING: tl.constexpr, REL: tl.constexpr, ROWS: tl.constexpr):
    # Program = (head, PAIRS rotary pairs of it): its weight rows are j and HALF + j for the
    # pairs' j, so both halves of each pair land in its own tile and the rotation, and the
    # stores rope_and_cache would make, are its epilogue.
    stamp(TR, 0, TRACING)
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
    cs = COS_SIN + pos[:, None] * stride_cs + j[None, :]
    cos = tl.load(cs, mask=m_ok[:, None], other=0.0)
    sin = tl.load(cs + HALF, mask=m_ok[:, None], other=0.0)
    acc, _ = _stream_rows(X, W + n[:, None].to(tl.int64) * stride_wn, n >= 0, m, m_ok, K,
                          stride_xm, stride_wn, 0, 2 * PAIRS, BLOCK_K, PRE, False, IEEE, PDL,
                          TR, TRACING, REL, ROWS)
    if PRENORMED:
        acc = acc * _prenorm_rstd(SS_IN, m, m_ok, P_IN, K, stride_ss_in, eps, BLOCK_P)[:, None]
    if HAS_BIAS:
        acc += tl.load(BIAS + n).to(tl.float32)[None, :]
    dt = Q_OUT.dtype.element_ty
    # the projection rounded as small_linear stores it, then rope_and_cache's arithmetic
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
            tl.store(K_CACHE + dst, o1.to(K_CACHE.dtype.element_ty), mask=mask)
            tl.store(K_CACHE + dst + HALF, o2.to(K_CACHE.dtype.element_ty), mask=mask)
        else:
            tl.store(V_CACHE + dst, o1.to(V_CACHE.dtype.element_ty), mask=mask)
            tl.store(V_CACHE + dst + HALF, o2.to(V_CACHE.dtype.element_ty), mask=mask)
    stamp(TR, 3, TRACING)


def qkv_rope_fusable(x: torch.Tensor | Prenormed, weight: torch.Tensor, head_dim: int,
                     qk_norm: bool) -> bool:
    """Whether qkv_rope_and_cache takes this projection: FUSED_ROPE on, at most MAX_ROWS
    rows, no per-head q/k norm (it needs the whole head), a power-of-two half head >= 8."""
    half = head_dim // 2
    rows = (x.x if isinstance(x, Prenormed) else x).shape[0]
    return FUSED_ROPE and not qk_norm and head_dim % 2 == 0 and half >= 8 and \
        half & (half - 1) == 0 and rows <= MAX_ROWS and weight.shape[0] % head_dim == 0


def qkv_rope_and_cache(x: torch.Tensor | Prenormed, weight: torch.Tensor,
                       bias: torch.Tensor | None, positions: torch.Tensor,
                       cos_sin: torch.Tensor, block_tables: torch.Tensor,
                       token_req: torch.Tensor, block_size: int, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, *,
                       norm_weight: torch.Tensor | None = None,
                       eps: float = 1e-6) -> torch.Tensor:
    """small_linear(x, weight, bias) followed by rope_and_cache, as one kernel (see
    qkv_rope_fusable): rotated q [M, Hq, D] returned, k and v written to the cache. The
    same arithmetic as the two kernels, so the same results."""
    pre = x if isinstance(x, Prenormed) else None
    x = pre.x if pre else x
    x = x if x.stride(-1) == 1 else x.contiguous()
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
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
    _, block_k, warps, stages, preload = _launch_tiling(weight.shape[0], k, False, tile,
                                                        weight, x, deep=False)
    pdl = pdl_supported(x.device)
    ss_in = pre.ss if pre else x
    grid = weight.shape[0] // (2 * pairs)
    tr = trace_buffer("qkv_rope", grid, x.device)
    _qkv_rope_kernel[(grid,)](
        x, weight, bias if bias is not None else weight, ss_in, cos_sin, positions,
        block_tables, token_req, q, k_cache, v_cache, tr, m, k,
        pre.ss.shape[1] if pre else 0,
        x.stride(0), weight.stride(0), ss_in.stride(0), cos_sin.stride(0), q.stride(0),
        q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        pre.eps if pre else eps,
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, PAIRS=pairs,
        BLOCK_SIZE=block_size, BLOCK_K=block_k, PRE=preload,
        BLOCK_P=triton.next_power_of_2(pre.ss.shape[1]) if pre else 1,
        HAS_BIAS=bias is not None, PRENORMED=pre is not None,
        IEEE=weight.dtype == torch.float32 or INTERPRETED, PDL=pdl,
        TRACING=tr is not None, REL=-1 if EARLY_RELEASE else RELEASE_TILES, ROWS=tile,
        num_warps=warps, num_stages=stages, **pdl_launch(pdl))
    return q
