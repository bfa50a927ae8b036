"""Row kernels: RMSNorm, residual add + RMSNorm, SiLU * up, and an EAGLE-3 layer's input
(embedding and hidden rows, each normalised, side by side), one program per row.

Around the cuBLAS linears of batches beyond the decode GEMVs they replace PyTorch's
elementwise kernels (its RMSNorm is four kernels and SiLU * up two: on an H200, 8B shape,
batch 32, ~30 us a layer of them around 120 us of GEMMs). Each rounds as the PyTorch
operations it replaces. `pdl`: launch with programmatic dependent launch (launch.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from onespec.kernels.launch import pdl_launch, pdl_start, rows_contiguous


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
                      hidden_norm: tuple[torch.Tensor, float], *, pdl: bool = False
                      ) -> torch.Tensor:
    """concat(norm_e(table[ids]), norm_h(hidden)) [T, 2H] in hidden's dtype (the embedding
    rows cast to it first): an EAGLE-3 layer's input in one kernel. Norms: (weight, eps)."""
    t, k = hidden.shape
    hidden = rows_contiguous(hidden)
    out = torch.empty(t, 2 * k, dtype=hidden.dtype, device=hidden.device)
    if t:
        _embed_norm_concat_kernel[(t, 2)](
            ids, table, hidden, embed_norm[0], hidden_norm[0], out, k, table.stride(0),
            hidden.stride(0), out.stride(0), embed_norm[1], hidden_norm[1],
            BLOCK=min(4096, triton.next_power_of_2(k)), PDL=pdl, num_warps=8,
            **pdl_launch(pdl))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None, *, pdl: bool = False) -> torch.Tensor:
    """RMSNorm of the rows of x [M, K] (into `out`, which may be a column slice of a wider
    buffer): one program per row."""
    x = rows_contiguous(x)
    out = torch.empty_like(x) if out is None else out
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, weight, out, x.shape[1], x.stride(0), out.stride(0), eps,
            BLOCK=min(4096, triton.next_power_of_2(x.shape[1])), PDL=pdl, num_warps=8,
            **pdl_launch(pdl))
    return out


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
                 eps: float, *, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """h = residual + y and RMSNorm(h) * weight for rows [M, K], one program per row:
    (h, normed), as `residual + y` followed by rms_norm."""
    if y.shape != residual.shape or y.dim() != 2:
        raise ValueError(f"add_rms_norm: y {tuple(y.shape)} and residual "
                         f"{tuple(residual.shape)} must be the same [rows, K]")
    y = rows_contiguous(y)
    residual = rows_contiguous(residual)
    h, xn = torch.empty_like(residual), torch.empty_like(residual)
    if y.shape[0]:
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


def silu_mul(y: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """silu(y[:, :N]) * y[:, N:] for y [M, 2N] (a gated MLP's [gate; up] projection)."""
    if y.dim() != 2 or y.shape[1] % 2:
        raise ValueError(f"silu_mul: y must be [rows, 2 * N], got {tuple(y.shape)}")
    y = rows_contiguous(y)
    n = y.shape[1] // 2
    out = torch.empty(y.shape[0], n, dtype=y.dtype, device=y.device)
    if y.shape[0] and n:
        block = min(2048, triton.next_power_of_2(n))
        _silu_mul_kernel[(y.shape[0], triton.cdiv(n, block))](
            y, out, n, y.stride(0), out.stride(0), BLOCK=block, PDL=pdl, num_warps=4,
            **pdl_launch(pdl))
    return out
