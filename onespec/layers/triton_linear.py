"""Triton kernels for decode-sized batches on CUDA, where every step is a stream of weights.

A decode step of a batch of a few rows reads each weight matrix once and does almost no
arithmetic, so its time is the time to stream the weights, and every extra kernel launch
between two weight streams is time the memory sits idle. The kernels here:

- `small_linear`: y = x @ W.T (+ bias) for M <= MAX_ROWS rows, rows padded to one 16-row
  tensor-core tile, the weight loads software-pipelined; a gated SiLU after it (W holds
  [gate; up] rows and the result is silu(gate) * up) and a residual added after it.
  An RMSNorm in front of it either runs as its own row kernel (`norm_weight`) or is split
  across the kernels around it (`Prenormed`): the residual kernel before the norm also
  stores rows * norm weight and per-program partial sums of squares, and the GEMV after
  it applies 1/rms in its epilogue.
- `rope_and_cache`: splits a fused qkv projection into heads, applies the optional per-head
  q/k RMSNorm (Qwen3) and rotary embedding, writes k and v into the paged cache (at the
  slot it looks up in the block table) and returns the rotated queries.

On Hopper and newer every kernel is launched with programmatic dependent launch: it may
start while its predecessor finishes (a linear layer begins streaming its first weight
tile), and waits for it (gdc_wait) before reading anything the predecessor wrote; a
linear layer lets its own successor start only after its weight stream.
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
MAX_ROWS = 16        # one tensor-core tile of rows; larger batches go to cuBLAS
CONFIGS: dict[tuple[int, int, bool], tuple[int, int, int, int]] = {}   # (N, K, gated) -> tiling


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A small kernel's start under PDL: wait for the predecessor, then let the successor
    launch (it only waits, so it takes no SM time this kernel needs)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


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
def _first_tile(W, t, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GATED: tl.constexpr):
    """Tile t's first weight tile (and its up half): it depends on no earlier kernel, so it
    is loaded before waiting for one. A tile past N loads nothing."""
    n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    w_ptrs = W + n[:, None].to(tl.int64) * stride_wn + k[None, :]
    w_mask = (n < N)[:, None] & (k < K)[None, :]
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    wu = w
    if GATED:
        wu = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0)
    return w, wu


@triton.jit
def _gemv_tile(
        t, w, wu, X, W, BIAS, RES, Y, SS_IN, NW_OUT, XN_OUT, SS_OUT, ARG_VAL, ARG_IDX,
        M, N, K, P_IN, stride_xm, stride_wn, stride_rm, stride_ym, stride_ss_in,
        stride_xn_out, stride_ss_out, stride_arg, eps,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
        HAS_BIAS: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
        PRENORMED: tl.constexpr, NORM_OUT: tl.constexpr, ARGMAX: tl.constexpr,
        IEEE: tl.constexpr, RELEASE: tl.constexpr, CACHE: tl.constexpr):
    """Output columns [t * BLOCK_N, (t + 1) * BLOCK_N) of every row, given the tile's first
    weight tile (w, wu) from _first_tile. RELEASE: let the PDL successor launch after the
    weight stream. CACHE: the load cache modifier for what other programs of the same
    kernel wrote (".cg": not from L1)."""
    # Rows are padded to 16 (the smallest tensor-core tile) whatever M is, so every row sees
    # the same instructions; the loop's loads are software-pipelined (num_stages).
    m = tl.arange(0, 16)
    m_ok = m < M
    n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    k = tl.arange(0, BLOCK_K)
    w_ptrs = W + n[:, None].to(tl.int64) * stride_wn + k[None, :]
    x_ptrs = X + m[:, None] * stride_xm + k[None, :]
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    acc_up = tl.zeros([16, BLOCK_N], tl.float32)
    x = tl.load(x_ptrs, mask=m_ok[:, None] & (k < K)[None, :], other=0.0,
                cache_modifier=CACHE)
    acc, acc_up = _accumulate(acc, acc_up, x, w, wu, GATED, IEEE)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k_ok = k0 + k < K
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptrs + k0, mask=w_mask, other=0.0)
        if GATED:
            wu = tl.load(w_ptrs + N * stride_wn + k0, mask=w_mask, other=0.0)
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0,
                    cache_modifier=CACHE)
        acc, acc_up = _accumulate(acc, acc_up, x, w, wu, GATED, IEEE)
    if RELEASE:
        # release the successor only once the weights are streamed: released at the start,
        # its early blocks hold SMs this kernel still needs (H200, 8B decode step: 5.32 ms
        # vs 4.50 ms, docs/PERFORMANCE.md)
        tl.extra.cuda.gdc_launch_dependents()
    if PRENORMED:
        # X held x * norm_weight; the producer left per-row partial sums of x^2: apply 1/rms
        p = tl.arange(0, BLOCK_P)
        parts = tl.load(SS_IN + m[:, None] * stride_ss_in + p[None, :],
                        mask=m_ok[:, None] & (p < P_IN)[None, :], other=0.0,
                        cache_modifier=CACHE)
        rstd = tl.rsqrt(tl.sum(parts, 1) / K + eps)                      # [16]
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
        r = tl.load(RES + m[:, None] * stride_rm + n[None, :], mask=out_ok, other=0.0,
                    cache_modifier=CACHE)
        # the projection is rounded to the stream's dtype before the add, as in PyTorch
        y = y.to(RES.dtype.element_ty).to(tl.float32) + r.to(tl.float32)
    y = y.to(Y.dtype.element_ty)
    if ARGMAX:
        # greedy decoding: this tile's best column per row (first on ties), reduced over
        # the tiles by _argmax_reduce_kernel; the values are the ones Y would hold
        yv = tl.where(n_ok[None, :], y.to(tl.float32), float("-inf"))
        tl.store(ARG_VAL + m * stride_arg + t, tl.max(yv, 1), mask=m_ok)
        tl.store(ARG_IDX + m * stride_arg + t,
                 t * BLOCK_N + tl.argmax(yv, 1, tie_break_left=True), mask=m_ok)
    else:
        tl.store(Y + m[:, None] * stride_ym + n[None, :], y, mask=out_ok)
    if NORM_OUT:
        # the next RMSNorm's share of this tile: y * its weight, and sum(y^2) per row
        yf = tl.where(out_ok, y.to(tl.float32), 0.0)
        nw = tl.load(NW_OUT + n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(XN_OUT + m[:, None] * stride_xn_out + n[None, :],
                 (yf * nw[None, :]).to(XN_OUT.dtype.element_ty), mask=out_ok)
        tl.store(SS_OUT + m * stride_ss_out + t, tl.sum(yf * yf, 1), mask=m_ok)


@triton.jit
def _small_linear_kernel(
        X, W, BIAS, RES, Y, SS_IN, NW_OUT, XN_OUT, SS_OUT, ARG_VAL, ARG_IDX,
        M, N, K, P_IN, stride_xm, stride_wn, stride_rm, stride_ym, stride_ss_in,
        stride_xn_out, stride_ss_out, stride_arg, eps,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
        HAS_BIAS: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
        PRENORMED: tl.constexpr, NORM_OUT: tl.constexpr, ARGMAX: tl.constexpr,
        IEEE: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    # under programmatic dependent launch the first weight tile streams while the previous
    # kernel finishes
    w, wu = _first_tile(W, pid, N, K, stride_wn, BLOCK_N, BLOCK_K, GATED)
    if PDL:
        tl.extra.cuda.gdc_wait()
    _gemv_tile(pid, w, wu, X, W, BIAS, RES, Y, SS_IN, NW_OUT, XN_OUT, SS_OUT, ARG_VAL,
               ARG_IDX, M, N, K, P_IN, stride_xm, stride_wn, stride_rm, stride_ym,
               stride_ss_in, stride_xn_out, stride_ss_out, stride_arg, eps,
               BLOCK_N, BLOCK_K, BLOCK_P, HAS_BIAS, GATED, RESIDUAL, PRENORMED, NORM_OUT,
               ARGMAX, IEEE, PDL, "")


@triton.jit
def _prefetch_l2(W, t, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 LINES: tl.constexpr, GATED: tl.constexpr):
    """Pulls tile t's weights after its first tile, LINES 128-byte lines per row, into L2
    (what a program does before a barrier, so the memory keeps streaming through it)."""
    if LINES > 0:
        per_line: tl.constexpr = 128 // W.dtype.element_ty.primitive_bitwidth * 8
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        col = BLOCK_K + tl.arange(0, LINES) * per_line
        ok = (n < N)[:, None] & (col < K)[None, :]
        ptrs = W + n[:, None].to(tl.int64) * stride_wn + col[None, :]
        if GATED:
            ptrs = tl.join(ptrs, ptrs + N * stride_wn)
            ok = tl.join(ok, ok)
        tl.inline_asm_elementwise("@$2 prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l,b",
                                  [ptrs, ok], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _grid_sync(SYNC, target):
    """A barrier over a persistent kernel's programs (all resident at once): each arrives
    at the counter SYNC[0] and waits until it reaches `target`. Release/acquire at GPU
    scope make the stores before it visible to the loads after it."""
    tl.debug_barrier()                  # every warp of the program has stored its part
    tl.atomic_add(SYNC, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(SYNC, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(SYNC, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _grid_sync_reset(SYNC):
    """After a kernel's last barrier: the last program to get here zeroes both counters
    (every other program has left its wait by then), ready for the next launch."""
    if tl.atomic_add(SYNC + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.atomic_xchg(SYNC, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(SYNC + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _stamp(TIMES, slot: tl.constexpr, TIMING: tl.constexpr):
    """TIMING: TIMES[program, slot] = the GPU's global nanosecond timer (phase profiling,
    scripts/bench_layer_tail.py)."""
    if TIMING:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [],
                                        dtype=tl.int64, is_pure=False, pack=1)
        tl.store(TIMES + tl.program_id(0) * 16 + slot, now)


@triton.jit
def _layer_tail_kernel(
        A, W_O, H_IN, H_MID, NW2, XN2, SS2, W_GU, B_GU, ACT, W_D, B_D, H_OUT, NW3, XN3, SS3,
        W_Q, B_Q, QKV, SYNC, TIMES, M, H, NA, NI, NQ, stride_hi, eps2, eps3,
        BN_O: tl.constexpr, BK_O: tl.constexpr, BN_GU: tl.constexpr, BK_GU: tl.constexpr,
        BN_D: tl.constexpr, BK_D: tl.constexpr, BN_Q: tl.constexpr, BK_Q: tl.constexpr,
        BP_O: tl.constexpr, BP_D: tl.constexpr, GU_BIAS: tl.constexpr,
        D_BIAS: tl.constexpr, Q_BIAS: tl.constexpr, NEXT_NORM: tl.constexpr,
        FIRST: tl.constexpr, LAST: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
        PRE_LINES: tl.constexpr = 0, TIMING: tl.constexpr = False):
    """A decoder layer after its attention, as one persistent kernel whose programs keep
    streaming weights across what were kernel boundaries. Phases, each a set of GEMV tiles
    (one per program at most) separated by grid barriers:
      0  H_MID = H_IN + A @ W_O.T; XN2, SS2 = the post-attention norm's share (Prenormed)
      1  ACT = silu(gate) * up of the normed H_MID @ W_GU.T (+ B_GU)
      2  H_OUT = H_MID + ACT @ W_D.T (+ B_D); with NEXT_NORM also XN3, SS3 (next input norm)
      3  QKV = the normed H_OUT @ W_Q.T (+ B_Q): the next layer's projection
    Before each barrier a program loads its first weight tile of the next phase, so the
    memory stays busy while the barrier waits. FIRST..LAST: the phases this launch runs
    (Triton's interpreter runs programs one after another, so there each phase is its own
    launch and nothing waits)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    SYNCED: tl.constexpr = FIRST < LAST
    T_O = tl.cdiv(H, BN_O)
    T_GU = tl.cdiv(NI, BN_GU)
    T_D = tl.cdiv(H, BN_D)
    _stamp(TIMES, 0, TIMING)
    if FIRST == 0:
        w, wu = _first_tile(W_O, pid, H, NA, NA, BN_O, BK_O, False)
        if PDL:
            tl.extra.cuda.gdc_wait()
        _stamp(TIMES, 1, TIMING)
        if pid < T_O:
            _gemv_tile(pid, w, wu, A, W_O, W_O, H_IN, H_MID, SS2, NW2, XN2, SS2, SS2, SS2,
                       M, H, NA, 0, NA, NA, stride_hi, H, 0, H, T_O, 0, eps2,
                       BN_O, BK_O, 1, False, False, True, False, True, False, IEEE,
                       False, "")
    if FIRST <= 1 and LAST >= 1:
        _stamp(TIMES, 2, TIMING)
        w, wu = _first_tile(W_GU, pid, NI, H, H, BN_GU, BK_GU, True)
        _prefetch_l2(W_GU, pid, NI, H, H, BN_GU, BK_GU, PRE_LINES, True)
        if SYNCED:
            _grid_sync(SYNC, nprog * (1 - FIRST))
        _stamp(TIMES, 3, TIMING)
        if pid < T_GU:
            _gemv_tile(pid, w, wu, XN2, W_GU, B_GU, ACT, ACT, SS2, SS2, SS2, SS2, SS2, SS2,
                       M, NI, H, T_O, H, H, 0, NI, T_O, 0, 0, 0, eps2,
                       BN_GU, BK_GU, BP_O, GU_BIAS, True, False, True, False, False, IEEE,
                       False, ".cg")
    if FIRST <= 2 and LAST >= 2:
        _stamp(TIMES, 4, TIMING)
        w, wu = _first_tile(W_D, pid, H, NI, NI, BN_D, BK_D, False)
        _prefetch_l2(W_D, pid, H, NI, NI, BN_D, BK_D, PRE_LINES, False)
        if SYNCED:
            _grid_sync(SYNC, nprog * (2 - FIRST))
        _stamp(TIMES, 5, TIMING)
        if pid < T_D:
            _gemv_tile(pid, w, wu, ACT, W_D, B_D, H_MID, H_OUT, SS3, NW3, XN3, SS3, SS3, SS3,
                       M, H, NI, 0, NI, NI, H, H, 0, H, T_D, 0, eps3,
                       BN_D, BK_D, 1, D_BIAS, False, True, False, NEXT_NORM, False, IEEE,
                       PDL and LAST == 2, ".cg")
    if LAST == 3:
        _stamp(TIMES, 6, TIMING)
        w, wu = _first_tile(W_Q, pid, NQ, H, H, BN_Q, BK_Q, False)
        _prefetch_l2(W_Q, pid, NQ, H, H, BN_Q, BK_Q, PRE_LINES, False)
        if SYNCED:
            _grid_sync(SYNC, nprog * (3 - FIRST))
        _stamp(TIMES, 7, TIMING)
        if pid < tl.cdiv(NQ, BN_Q):
            _gemv_tile(pid, w, wu, XN3, W_Q, B_Q, QKV, QKV, SS3, SS3, SS3, SS3, SS3, SS3,
                       M, NQ, H, T_D, H, H, 0, NQ, T_D, 0, 0, 0, eps3,
                       BN_Q, BK_Q, BP_D, Q_BIAS, False, False, True, False, False, IEEE,
                       PDL, ".cg")
        elif PDL:
            tl.extra.cuda.gdc_launch_dependents()
    _stamp(TIMES, 8, TIMING)
    if SYNCED:
        _grid_sync_reset(SYNC)


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


def _config(n: int, k: int, gated: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages), from scripts/sweep_small_linear.py on an
    H200 (docs/PERFORMANCE.md)."""
    return (64, 128, 4, 3) if gated else (32, 256, 4, 5)


@functools.lru_cache(maxsize=None)
def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (a kernel starts while its predecessor finishes and
    waits for it with gdc_wait): Hopper or newer, compiled Triton; ONESPEC_PDL=0 disables."""
    return (device.type == "cuda" and not INTERPRETED
            and os.environ.get("ONESPEC_PDL", "1") != "0"
            and torch.cuda.get_device_capability(device)[0] >= 9)


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
                 config: tuple[int, int, int, int] | None = None):
    """x [M, K] (M <= MAX_ROWS), weight [N or 2N, K] -> [M, N]; see the module docstring.

    x may be a Prenormed (the RMSNorm of its producer). norm_out=(weight, eps), with a
    residual: also return the next RMSNorm of the result as a Prenormed, i.e. returns
    (y, Prenormed). argmax: return y.argmax(-1) [M] int64 instead of y (y, in out_dtype,
    is never written), plus argmax_offsets[argmax] [N] int64 if given.
    config: (BLOCK_N, BLOCK_K, num_warps, num_stages)."""
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
    block_n, block_k, warps, stages = config or CONFIGS.get((n, k, gated)) or \
        _config(n, k, gated)
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
    _small_linear_kernel[(grid,)](
        x, weight, bias if bias is not None else weight, res, out, ss_in,
        norm_out[0] if nxt else weight, nxt.x if nxt else out, nxt.ss if nxt else out,
        arg[0] if arg else out, arg[1] if arg else out,
        m, n, k, pre.ss.shape[1] if pre else 0, x.stride(0), weight.stride(0),
        res.stride(0), out.stride(0), ss_in.stride(0),
        nxt.x.stride(0) if nxt else 0, nxt.ss.stride(0) if nxt else 0,
        grid if arg else 0, pre.eps if pre else eps,
        BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_P=triton.next_power_of_2(pre.ss.shape[1]) if pre else 1,
        HAS_BIAS=bias is not None, GATED=gated, RESIDUAL=residual is not None,
        PRENORMED=pre is not None, NORM_OUT=nxt is not None, ARGMAX=argmax,
        IEEE=weight.dtype == torch.float32 or INTERPRETED, PDL=pdl,
        num_warps=warps, num_stages=stages,
        **pdl_launch(pdl))
    if argmax:
        offsets = arg[2] if argmax_offsets is None else argmax_offsets
        _argmax_reduce_kernel[(m,)](arg[0], arg[1], offsets, arg[2], grid, grid,
                                    BLOCK_P=triton.next_power_of_2(grid),
                                    HAS_OFFSETS=argmax_offsets is not None, PDL=pdl,
                                    num_warps=4, **pdl_launch(pdl))
        return arg[2]
    return out if nxt is None else (out, nxt)


PERSISTENT = os.environ.get("ONESPEC_PERSISTENT", "1") != "0"   # layer_tail's one kernel
TAIL_STAGES = 5
TAIL_WARPS = 4
TAIL_STAGE_BYTES = 16384        # weight bytes per pipeline stage and program (x2 gated)
TAIL_PREFETCH = 0               # 128-byte lines per weight row pulled into L2 before a barrier


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Programs a persistent kernel may run at once (one per SM); 16 in the interpreter."""
    if device.type != "cuda" or INTERPRETED:
        return 16
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tail_tiling(n: int, k: int, gated: bool, elem: int, sms: int) -> tuple[int, int] | None:
    """(BLOCK_N, BLOCK_K) of one layer_tail phase: the narrowest power-of-two tile (>= 16
    rows) that needs at most one program per SM, and ~16 KB of weights per pipeline stage
    (twice that when gated); None if no tile up to 256 rows fits the SMs."""
    block_n = 16
    while triton.cdiv(n, block_n) > sms:
        block_n *= 2
        if block_n > 256:
            return None
    block_k = TAIL_STAGE_BYTES // (block_n * elem)
    return block_n, max(16, min(256, block_k, triton.next_power_of_2(k)))


def grid_sync_counter(owner, device: torch.device) -> torch.Tensor:
    """The barrier counters of a persistent kernel's call site `owner` (int32 [2], zeros
    when made on first use; the kernel leaves them zeroed)."""
    sync = getattr(owner, "_grid_sync", None)
    if sync is None or sync.device != device:
        sync = torch.zeros(2, dtype=torch.int32, device=device)
        owner._grid_sync = sync
    return sync


def layer_tail(attn_out: torch.Tensor, o_weight: torch.Tensor, h: torch.Tensor,
               post_norm: tuple[torch.Tensor, float], gate_up_weight: torch.Tensor,
               gate_up_bias: torch.Tensor | None, down_weight: torch.Tensor,
               down_bias: torch.Tensor | None, sync: torch.Tensor, *,
               next_norm: tuple[torch.Tensor, float] | None = None,
               next_qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None,
               sms: int | None = None, times: torch.Tensor | None = None):
    """A decoder layer from its attention output to its end in one persistent kernel (see
    _layer_tail_kernel): h2 = h + attn_out @ o_weight.T; out = h2 + mlp(post_norm(h2)).
    next_norm=(weight, eps): also the next RMSNorm of `out`, and with next_qkv=(weight,
    bias) the next layer's qkv projection of it. Returns (out, qkv) with next_qkv,
    (out, Prenormed) with next_norm only, else (out, None); or None when a phase would need
    more programs than there are SMs (the caller then runs the kernels one by one).
    sync: an int32 [2] of zeros owned by the call site (the kernel leaves it zeroed).
    times: int64 [programs, 16] for the kernel's per-phase timer stamps (profiling)."""
    if next_qkv is not None and next_norm is None:
        raise ValueError("layer_tail: next_qkv needs next_norm (the qkv input is its norm)")
    m, hidden = h.shape
    if h.stride(-1) != 1:
        h = h.contiguous()
    ni = down_weight.shape[1]
    nq = next_qkv[0].shape[0] if next_qkv is not None else 0
    sms = sms or num_sms(h.device)
    elem = o_weight.element_size()
    shapes = [(hidden, attn_out.shape[1], False), (ni, hidden, True), (hidden, ni, False)]
    if next_qkv is not None:
        shapes.append((nq, hidden, False))
    tilings = [_tail_tiling(n, k, g, elem, sms) for n, k, g in shapes]
    if m > MAX_ROWS or None in tilings:
        return None
    (bn_o, bk_o), (bn_gu, bk_gu), (bn_d, bk_d) = tilings[:3]
    bn_q, bk_q = tilings[3] if next_qkv is not None else (16, 16)
    grid = max(triton.cdiv(n, t[0]) for (n, _, _), t in zip(shapes, tilings))
    t_o, t_d = triton.cdiv(hidden, bn_o), triton.cdiv(hidden, bn_d)
    dev, dt = h.device, h.dtype
    attn_out = attn_out.contiguous()
    h_mid, out, xn2 = (torch.empty(m, hidden, dtype=dt, device=dev) for _ in range(3))
    ss2 = torch.empty(m, t_o, dtype=torch.float32, device=dev)
    act = torch.empty(m, ni, dtype=dt, device=dev)
    nxt = None
    if next_norm is not None:
        nxt = Prenormed(torch.empty_like(h_mid),
                        torch.empty(m, t_d, dtype=torch.float32, device=dev), next_norm[1])
    qkv = torch.empty(m, nq, dtype=dt, device=dev) if next_qkv is not None else None
    if m:
        q_w, q_b = next_qkv if next_qkv is not None else (o_weight, None)
        pdl = pdl_supported(dev)
        phases = [(0, 3 if next_qkv is not None else 2)]
        if INTERPRETED:     # programs run one after another: one launch per phase
            phases = [(i, i) for i in range(phases[0][0], phases[0][1] + 1)]
        for first, last in phases:
            _layer_tail_kernel[(grid,)](
                attn_out, o_weight, h, h_mid, post_norm[0], xn2, ss2,
                gate_up_weight, gate_up_bias if gate_up_bias is not None else o_weight, act,
                down_weight, down_bias if down_bias is not None else o_weight, out,
                next_norm[0] if nxt else o_weight, nxt.x if nxt else out,
                nxt.ss if nxt else ss2, q_w, q_b if q_b is not None else o_weight,
                qkv if qkv is not None else out, sync, times if times is not None else sync,
                m, hidden, attn_out.shape[1], ni, nq, h.stride(0), post_norm[1],
                next_norm[1] if nxt else post_norm[1],
                BN_O=bn_o, BK_O=bk_o, BN_GU=bn_gu, BK_GU=bk_gu, BN_D=bn_d, BK_D=bk_d,
                BN_Q=bn_q, BK_Q=bk_q, BP_O=triton.next_power_of_2(t_o),
                BP_D=triton.next_power_of_2(t_d), GU_BIAS=gate_up_bias is not None,
                D_BIAS=down_bias is not None, Q_BIAS=q_b is not None,
                NEXT_NORM=nxt is not None, FIRST=first, LAST=last, PRE_LINES=TAIL_PREFETCH,
                TIMING=times is not None,
                IEEE=o_weight.dtype == torch.float32 or INTERPRETED, PDL=pdl,
                num_warps=TAIL_WARPS, num_stages=TAIL_STAGES, **pdl_launch(pdl))
    if qkv is not None:
        return out, qkv
    return out, nxt


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
