"""FP8 GEMV for decode-sized batches on CUDA: y = x @ W.T with W held as e4m3 + float32
scales (quant/fp8.py FP8Linear), for the decode and verify row counts (at most MAX_ROWS).

A decode step streams each weight once, so an e4m3 weight halves a linear's bytes against
bf16. One program computes BLOCK_N output columns for every row (rows padded to 16 or 32,
as kernels/gemv.py pads them): it streams its weight rows tile by tile, widens each e4m3
tile to the rows' dtype in registers (exact: every e4m3 value is a bf16 value) and
multiplies on the tensor cores with float32 accumulation. Scales:

- per output channel (`weight_scale` [N]): applied once to the finished dot products;
- per block (bo, bi) (`weight_scale` [ceil(N/bo), ceil(K/bi)]): each BLOCK_K-wide tile
  lies inside one block column (BLOCK_K divides bi), so its partial products are scaled
  by their rows' block scales before they are added.

The epilogue does what kernels/gemv.py's does for the layers around a linear: a bias, a
gated SiLU (W = [gate; up]), a residual add, a Prenormed input's 1/rms. The PyTorch path
(dequantize, then F.linear) is the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onespec.kernels.gemv import Prenormed, gemv_epilogue, row_tile
from onespec.kernels.launch import INTERPRETED, pdl_launch, rows_contiguous
from onespec.kernels.settings import MAX_ROWS

# (BLOCK_N, BLOCK_K, num_warps, num_stages): a first choice, to be swept on the GPU
TILING = (32, 128, 4, 4)


@triton.jit
def _fp8_gemv_kernel(X, W, S, BIAS, RES, Y, SS_IN,
                     M, N, K, P_IN, stride_xm, stride_wn, stride_sn, stride_rm, stride_ym,
                     stride_ss_in, eps,
                     BO: tl.constexpr, BI: tl.constexpr, BLOCKED: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
                     HAS_BIAS: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
                     PRENORMED: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                     ROWS: tl.constexpr):
    pid = tl.program_id(0)
    m = tl.arange(0, ROWS)
    m_ok = m < M
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    k = tl.arange(0, BLOCK_K)
    w_rows = W + n[:, None].to(tl.int64) * stride_wn
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    acc_up = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + k < K
        w_mask = n_ok[:, None] & k_ok[None, :]
        x = tl.load(X + m[:, None] * stride_xm + k0 + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k0 + k[None, :], mask=w_mask, other=0.0)
        if IEEE:
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(w.to(x.dtype)))
        if BLOCKED:
            s = tl.load(S + (n // BO) * stride_sn + k0 // BI, mask=n_ok, other=0.0)
            part = part * s[None, :]
        acc += part
        if GATED:
            wu = tl.load(w_rows + N * stride_wn + k0 + k[None, :], mask=w_mask, other=0.0)
            if IEEE:
                part_up = tl.dot(x.to(tl.float32), tl.trans(wu.to(tl.float32)),
                                 input_precision="ieee")
            else:
                part_up = tl.dot(x, tl.trans(wu.to(x.dtype)))
            if BLOCKED:
                su = tl.load(S + ((n + N) // BO) * stride_sn + k0 // BI, mask=n_ok, other=0.0)
                part_up = part_up * su[None, :]
            acc_up += part_up
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if not BLOCKED:
        acc = acc * tl.load(S + n, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(S + N + n, mask=n_ok, other=0.0)[None, :]
    y, out_ok = gemv_epilogue(acc, acc_up, m, m_ok, n, n_ok, N, K, SS_IN, P_IN, stride_ss_in,
                              eps, BIAS, RES, stride_rm, BLOCK_P, HAS_BIAS, GATED, RESIDUAL,
                              PRENORMED)
    tl.store(Y + m[:, None] * stride_ym + n[None, :], y.to(Y.dtype.element_ty), mask=out_ok)


def fp8_gemv(x: torch.Tensor | Prenormed, weight: torch.Tensor, scale: torch.Tensor,
             block: tuple[int, int] | None = None, bias: torch.Tensor | None = None, *,
             gated: bool = False, residual: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None, pdl: bool = False,
             tiling: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS; or a Prenormed), weight e4m3 [N or 2N (gated), K], scale
    float32 [rows] (per channel) or [ceil(rows/bo), ceil(K/bi)] (block) -> y [M, N] in
    out_dtype (default x's): x @ dequantize(weight).T + bias, then silu(gate) * up
    (gated), then + residual."""
    pre = x if isinstance(x, Prenormed) else None
    x = rows_contiguous(pre.x if pre else x)
    m, k = x.shape
    rows = weight.shape[0]
    n = rows // 2 if gated else rows
    if weight.shape[1] != k or m > MAX_ROWS or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_gemv: x {tuple(x.shape)} and e4m3 weight "
                         f"{tuple(weight.shape)} ({weight.dtype}) need equal K and at most "
                         f"{MAX_ROWS} rows")
    block_n, block_k, warps, stages = tiling or TILING
    if block is not None:
        block_k = min(block_k, block[1])
        if block[1] % block_k:
            raise ValueError(f"fp8_gemv: scale blocks {block} need BLOCK_K {block_k} to "
                             "divide their columns")
        expected = (triton.cdiv(rows, block[0]), triton.cdiv(k, block[1]))
    else:
        expected = (rows,)
    if tuple(scale.shape) != expected:
        raise ValueError(f"fp8_gemv: scale {tuple(scale.shape)}, expected {expected}")
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    res = residual if residual is not None else out
    ss_in = pre.ss if pre else out
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, scale, bias if bias is not None else scale, res, out, ss_in,
        m, n, k, pre.ss.shape[1] if pre else 0, x.stride(0), weight.stride(0),
        scale.stride(0) if block else 0, res.stride(0), out.stride(0), ss_in.stride(0),
        pre.eps if pre else 1e-6,
        BO=block[0] if block else 1, BI=block[1] if block else 1, BLOCKED=block is not None,
        BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_P=triton.next_power_of_2(pre.ss.shape[1]) if pre else 1,
        HAS_BIAS=bias is not None, GATED=gated, RESIDUAL=residual is not None,
        PRENORMED=pre is not None, IEEE=x.dtype == torch.float32 or INTERPRETED, PDL=pdl,
        ROWS=row_tile(m), num_warps=warps, num_stages=stages, **pdl_launch(pdl))
    return out
