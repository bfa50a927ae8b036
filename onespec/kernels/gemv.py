"""GEMV kernels for decode-sized batches on CUDA, where every step is a stream of weights.

A decode step of a batch of a few rows reads each weight matrix once and does almost no
arithmetic, so its time is the time to stream the weights, and every extra kernel launch
between two weight streams is time the memory sits idle. One kernel computes
y = x @ W.T (+ bias) for M <= MAX_ROWS rows, rows padded to a tile of 16 (up to 16 rows)
or 32, the weight loads software-pipelined, with the work around it as its epilogue:

- `gemv`: optionally a gated SiLU (W holds [gate; up] rows and the result is
  silu(gate) * up) or a residual added;
- `gemv_prenorm`: the residual added, and the RMSNorm after it begun (a `Prenormed`):
  the kernel stores rows * norm weight and per-program partial sums of squares, and the
  GEMV that consumes it applies 1/rms in its epilogue;
- `gemv_argmax`: greedy tokens, each program reducing its own columns (no logits written),
  then one small kernel over the programs.

Under programmatic dependent launch a GEMV streams its first weight tile while its
predecessor finishes. It lets its own successor start only after its weight stream
(earlier, the successor's programs would take SMs its last programs need; on an H200, 8B
decode step: 5.32 ms vs 4.50 ms), except where the successor's programs fit beside its
own, one per SM (`early_release`: the down projection before the next layer's qkv, and
the qkv GEMV of rope_kv.py before attention), whose programs then wait on the SMs when
this kernel ends and start ~1.3 us sooner.
Each row is computed by the same instructions whatever the number of rows, so results
never depend on how rows are batched. The PyTorch path (layers/ops.py) is the reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from onespec.kernels.launch import (INTERPRETED, block_smem, hopper, pdl_launch, pdl_start,
                                    rows_contiguous)
from onespec.kernels.settings import MAX_ROWS


@dataclass
class Prenormed:
    """An RMSNorm split across two kernels: `x` = rows * norm weight [M, K], `ss` = partial
    sums of the rows' squares [M, P] (one per producer program); the consuming GEMV
    multiplies by 1/rms(row) in its epilogue, where the sums are complete."""
    x: torch.Tensor
    ss: torch.Tensor
    eps: float


@triton.jit
def accumulate(acc, acc_up, x, w, wu, GATED: tl.constexpr, IEEE: tl.constexpr):
    """acc (+ acc_up) += x @ w.T (and x @ wu.T) for one tile, in float32."""
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
def stream_rows(X, w_rows, n_ok, m, m_ok, K, stride_xm, stride_wn, N,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE: tl.constexpr,
                GATED: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                EARLY: tl.constexpr, ROWS: tl.constexpr):
    """x @ W[rows].T for one program's BLOCK_N weight rows (w_rows: their pointers, any
    rows; with GATED also the rows N further), rows of x padded to ROWS (m: their indices):
    (acc, acc_up) [ROWS, BLOCK_N] in float32. Waits for the previous kernel after the first
    PRE tiles and releases the next one after the stream, or right after the wait (EARLY)."""
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
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    acc_up = tl.zeros([ROWS, BLOCK_N], tl.float32)
    if PRE > 0:
        x_p = tl.load(X + m[:, None] * stride_xm + kp[None, :],
                      mask=m_ok[:, None] & (kp < K)[None, :], other=0.0)
        acc, acc_up = accumulate(acc, acc_up, x_p, w_p, wu_p, GATED, IEEE)
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_rows + k[None, :]
    x_ptrs = X + m[:, None] * stride_xm + k[None, :]
    for k0 in range(PRE * BLOCK_K, K, BLOCK_K):
        k_ok = k0 + k < K
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptrs + k0, mask=w_mask, other=0.0)
        wu = w
        if GATED:
            wu = tl.load(w_ptrs + N * stride_wn + k0, mask=w_mask, other=0.0)
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc, acc_up = accumulate(acc, acc_up, x, w, wu, GATED, IEEE)
    if PDL and not EARLY:
        # release the successor only once the weights are streamed
        tl.extra.cuda.gdc_launch_dependents()
    return acc, acc_up


@triton.jit
def prenorm_rstd(SS_IN, m, m_ok, P_IN, K, stride_ss_in, eps, BLOCK_P: tl.constexpr):
    """X held x * norm_weight; the producer left per-row partial sums of x^2: 1/rms [rows]."""
    p = tl.arange(0, BLOCK_P)
    parts = tl.load(SS_IN + m[:, None] * stride_ss_in + p[None, :],
                    mask=m_ok[:, None] & (p < P_IN)[None, :], other=0.0)
    return tl.rsqrt(tl.sum(parts, 1) / K + eps)


@triton.jit
def gemv_epilogue(acc, acc_up, m, m_ok, n, n_ok, N, K, SS_IN, P_IN, stride_ss_in, eps, BIAS,
                  RES, stride_rm, BLOCK_P: tl.constexpr, HAS_BIAS: tl.constexpr,
                  GATED: tl.constexpr, RESIDUAL: tl.constexpr, PRENORMED: tl.constexpr):
    """The GEMV kernels' shared epilogue on the float32 accumulators: the prenorm's 1/rms,
    the bias, silu(gate) * up, the residual: (y float32 [ROWS, BLOCK_N], its store mask)."""
    if PRENORMED:
        rstd = prenorm_rstd(SS_IN, m, m_ok, P_IN, K, stride_ss_in, eps, BLOCK_P)
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
    return y, out_ok


@triton.jit
def _gemv_kernel(
        X, W, BIAS, RES, Y, SS_IN, NW_OUT, XN_OUT, SS_OUT, ARG_VAL, ARG_IDX,
        M, N, K, P_IN, stride_xm, stride_wn, stride_rm, stride_ym, stride_ss_in,
        stride_xn_out, stride_ss_out, stride_arg, eps,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE: tl.constexpr, BLOCK_P: tl.constexpr,
        HAS_BIAS: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
        PRENORMED: tl.constexpr, NORM_OUT: tl.constexpr, ARGMAX: tl.constexpr,
        IEEE: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr, ROWS: tl.constexpr):
    # Rows are padded to ROWS (16, the smallest tensor-core tile, or 32), so every row sees
    # the same instructions whatever M is up to ROWS; each row's dot products add the same
    # terms in the same order in a tile of either height. The loop's loads are
    # software-pipelined (num_stages).
    pid = tl.program_id(0)
    m = tl.arange(0, ROWS)
    m_ok = m < M
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc, acc_up = stream_rows(X, W + n[:, None].to(tl.int64) * stride_wn, n_ok, m, m_ok, K,
                              stride_xm, stride_wn, N, BLOCK_N, BLOCK_K, PRE, GATED, IEEE,
                              PDL, EARLY, ROWS)
    y, out_ok = gemv_epilogue(acc, acc_up, m, m_ok, n, n_ok, N, K, SS_IN, P_IN, stride_ss_in,
                              eps, BIAS, RES, stride_rm, BLOCK_P, HAS_BIAS, GATED, RESIDUAL,
                              PRENORMED)
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


def gemv(x: torch.Tensor | Prenormed, weight: torch.Tensor, bias: torch.Tensor | None = None,
         *, gated: bool = False, residual: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, pdl: bool = False,
         tiling: tuple[int, ...] | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS; or a Prenormed), weight [N or 2N (gated), K] -> y [M, N]:
    x @ weight.T + bias, then silu(gate) * up (gated), then + residual [M, N].
    tiling: (BLOCK_N, BLOCK_K, num_warps, num_stages[, PRE]) instead of the tuned one, PRE
    (0 or a power of two, default 1) the weight tiles loaded before waiting for the
    previous kernel. pdl: launch with programmatic dependent launch."""
    x, pre = _unpack(x, weight)
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty(x.shape[0], n, dtype=out_dtype or x.dtype, device=x.device)
    _launch(x, pre, weight, bias, out, gated=gated, residual=residual, pdl=pdl, tiling=tiling)
    return out


def gemv_prenorm(x: torch.Tensor | Prenormed, weight: torch.Tensor, residual: torch.Tensor,
                 norm: tuple[torch.Tensor, float], bias: torch.Tensor | None = None, *,
                 early_release: bool = False, pdl: bool = False,
                 tiling: tuple[int, ...] | None = None) -> tuple[torch.Tensor, Prenormed]:
    """h = residual + x @ weight.T (+ bias) [M, N], and the RMSNorm (weight, eps) of h
    begun as a Prenormed for the next GEMV: (h, Prenormed).
    early_release: the next kernel may launch as soon as this one's wait returns (its
    programs must fit beside this one's, one per SM: the next layer's qkv after the MLP's
    down projection); otherwise after this one's weight stream."""
    x, pre = _unpack(x, weight)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    block_n = launch_tiling(weight.shape[0], x.shape[1], False, row_tile(x.shape[0]), weight,
                            x, tiling)[0]
    nxt = Prenormed(torch.empty_like(out),
                    torch.empty(x.shape[0], triton.cdiv(weight.shape[0], block_n),
                                dtype=torch.float32, device=x.device), norm[1])
    _launch(x, pre, weight, bias, out, residual=residual, norm_out=(norm[0], nxt),
            early_release=early_release, pdl=pdl, tiling=tiling)
    return out, nxt


def gemv_argmax(x: torch.Tensor | Prenormed, weight: torch.Tensor,
                bias: torch.Tensor | None = None, *, offsets: torch.Tensor | None = None,
                pdl: bool = False, tiling: tuple[int, ...] | None = None) -> torch.Tensor:
    """(x @ weight.T + bias).argmax(-1) [M] int64 over the float32 results (the first
    column on ties), plus offsets[argmax] if given (offsets [N] int64); no logits written."""
    x, pre = _unpack(x, weight)
    m, n = x.shape[0], weight.shape[0]
    block_n = launch_tiling(n, x.shape[1], False, row_tile(m), weight, x, tiling)[0]
    grid = triton.cdiv(n, block_n)
    dev = x.device
    val = torch.empty(m, grid, dtype=torch.float32, device=dev)
    idx = torch.empty(m, grid, dtype=torch.int32, device=dev)
    tokens = torch.empty(m, dtype=torch.int64, device=dev)
    if m == 0:
        return tokens
    _launch(x, pre, weight, bias, torch.empty(0, n, dtype=torch.float32, device=dev),
            argmax=(val, idx), pdl=pdl, tiling=tiling)
    _argmax_reduce_kernel[(m,)](val, idx, tokens if offsets is None else offsets, tokens,
                                grid, grid, BLOCK_P=triton.next_power_of_2(grid),
                                HAS_OFFSETS=offsets is not None, PDL=pdl, num_warps=4,
                                **pdl_launch(pdl))
    return tokens


def _unpack(x: torch.Tensor | Prenormed, weight: torch.Tensor
            ) -> tuple[torch.Tensor, Prenormed | None]:
    """(rows [M, K] with unit stride, the Prenormed they come from or None), checked
    against weight [N, K]."""
    pre = x if isinstance(x, Prenormed) else None
    x = pre.x if pre else x
    if weight.shape[1] != x.shape[1] or x.shape[0] > MAX_ROWS:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         f"need equal K and at most {MAX_ROWS} rows")
    return rows_contiguous(x), pre


def _launch(x: torch.Tensor, pre: Prenormed | None, weight: torch.Tensor,
            bias: torch.Tensor | None, out: torch.Tensor, *, gated: bool = False,
            residual: torch.Tensor | None = None,
            norm_out: tuple[torch.Tensor, Prenormed] | None = None,
            argmax: tuple[torch.Tensor, torch.Tensor] | None = None,
            early_release: bool = False, pdl: bool, tiling: tuple[int, ...] | None):
    """One _gemv_kernel launch into `out` [M, N] (its rows unwritten with argmax: the
    tiles' (max, argmax) go to argmax's (values, indices) [M, programs] instead)."""
    m, k = x.shape
    n = out.shape[1]
    if m == 0:
        return
    tile = row_tile(m)
    block_n, block_k, warps, stages, preload = launch_tiling(n, k, gated, tile, weight, x,
                                                             tiling)
    grid = triton.cdiv(n, block_n)
    res = residual if residual is not None else out
    ss_in = pre.ss if pre else out
    nw, nxt = norm_out if norm_out else (weight, None)
    val, idx = argmax if argmax else (out, out)
    _gemv_kernel[(grid,)](
        x, weight, bias if bias is not None else weight, res, out, ss_in, nw,
        nxt.x if nxt else out, nxt.ss if nxt else out, val, idx,
        m, n, k, pre.ss.shape[1] if pre else 0, x.stride(0), weight.stride(0),
        res.stride(0), out.stride(0), ss_in.stride(0),
        nxt.x.stride(0) if nxt else 0, nxt.ss.stride(0) if nxt else 0,
        grid if argmax else 0, pre.eps if pre else 1e-6,
        BLOCK_N=block_n, BLOCK_K=block_k, PRE=preload,
        BLOCK_P=triton.next_power_of_2(pre.ss.shape[1]) if pre else 1,
        HAS_BIAS=bias is not None, GATED=gated, RESIDUAL=residual is not None,
        PRENORMED=pre is not None, NORM_OUT=nxt is not None, ARGMAX=argmax is not None,
        IEEE=weight.dtype == torch.float32 or INTERPRETED, PDL=pdl, EARLY=early_release,
        ROWS=tile, num_warps=warps, num_stages=stages, **pdl_launch(pdl))


def default_tiling(n: int, k: int, gated: bool, deep: bool = False
                   ) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages), swept on an H200. `deep`: 16-bit weights
    on a GPU with Hopper's shared memory, where (H200, 8B shape)
    - a square projection (o_proj, after attention) streams 8 tiles deep (172 KB): plain
      batch 1 4.34-4.43 vs 4.49-4.52 ms in alternating benchmark processes;
    - a projection down to fewer outputs than inputs (the MLP's down, EAGLE-3's fc) in
      16-row tiles, 2 warps, 6 deep (80 KB: two programs on most SMs, where 32-row tiles
      left 4 of 132 SMs idle; one of the next qkv's fits beside one): 4.052 / 4.048 /
      4.054 / 4.056 vs 4.062 / 4.064 / 4.066 / 4.066 ms;
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


def stages_for_rows(w_rows: int, block_k: int, stages: int, rows: int, w_bytes: int,
                    x_bytes: int, smem: int) -> int:
    """num_stages for a tile of `rows` rows, from one tuned for 16: the pipeline holds
    stages - 1 buffers of the weight tile [w_rows, block_k] and of the x tile [rows,
    block_k], so taller x tiles take more shared memory; keep as many programs per SM as
    the 16-row tiling allowed, with at least 3 stages."""
    per_stage = lambda r: (w_rows * w_bytes + r * x_bytes) * block_k  # noqa: E731
    sm = smem + 1024
    per_sm = max(1, sm // ((stages - 1) * per_stage(16) + 1024))
    budget = min(smem, sm // per_sm - 1024)
    return max(3, min(stages, 1 + budget // per_stage(rows)))


def launch_tiling(n: int, k: int, gated: bool, rows: int, weight: torch.Tensor,
                  x: torch.Tensor, tiling: tuple[int, ...] | None = None,
                  deep: bool | None = None) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, PRE) of a launch: `tiling` as given, else
    default_tiling's with its pipeline fitted to the row tile."""
    if tiling:
        return _checked(tiling)
    if deep is None:
        deep = weight.element_size() <= 2 and hopper(weight.device)
    block_n, block_k, warps, stages, preload = _checked(default_tiling(n, k, gated, deep))
    if rows > 16:
        stages = stages_for_rows(block_n * (2 if gated else 1), block_k, stages, rows,
                                 weight.element_size(), x.element_size(),
                                 block_smem(weight.device))
    return block_n, block_k, warps, stages, preload


def _checked(tiling: tuple[int, ...]) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages[, PRE]) with PRE (default 1) checked."""
    block_n, block_k, warps, stages, *preload = tiling
    preload = preload[0] if preload else 1
    if preload < 0 or preload & (preload - 1):
        raise ValueError(f"gemv: tiling's preload tiles must be 0 or a power of two, "
                         f"got {preload}")
    return block_n, block_k, warps, stages, preload
