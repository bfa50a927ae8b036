"""One entry point for the linear layers of a decoder, with the work around them fused.

`fused_linear(layer, x, norm=..., gated=..., residual=...)` computes

    y = layer(norm(x))                     (norm optional)
    y = silu(y[:, :N]) * y[:, N:]          (gated: the layer holds [gate; up] rows)
    y = residual + y                       (residual optional)

With `fast` set (CUDA, Triton available) and a decode-sized batch it runs as one Triton
kernel that streams the weight once (layers/triton_linear.py); larger batches with `fast`
run the layer through cuBLAS with the norm and SiLU * up as Triton row kernels; otherwise,
and always on the CPU or under autograd, as the PyTorch operations above, which are also
the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onespec.layers.norm import RMSNorm

MAX_FAST_ROWS = 32      # <= triton_linear.MAX_ROWS; kept here so the CPU never imports Triton


def decode_sized(x: torch.Tensor, fast: bool) -> bool:
    """Whether rows x [M, K] take the Triton decode kernels: `fast` set, M <= MAX_FAST_ROWS,
    and no autograd (training and the CPU keep the PyTorch path)."""
    return fast and x.dim() == 2 and x.shape[0] <= MAX_FAST_ROWS and not torch.is_grad_enabled()


def row_kernels(x: torch.Tensor, fast: bool) -> bool:
    """Whether rows x [M, K] take Triton row kernels (RMSNorm, residual add + RMSNorm,
    SiLU * up) around their cuBLAS linears: `fast` set and no autograd."""
    return fast and x.dim() == 2 and not torch.is_grad_enabled()


def fused_linear(layer: nn.Linear, x: torch.Tensor, *, norm: RMSNorm | None = None,
                 gated: bool = False, residual: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, fast: bool = False) -> torch.Tensor:
    if decode_sized(x, fast):
        from onespec.layers.triton_linear import small_linear
        return small_linear(x, layer.weight, layer.bias,
                            norm_weight=None if norm is None else norm.weight,
                            eps=1e-6 if norm is None else norm.eps, gated=gated,
                            residual=residual, out_dtype=out_dtype)
    y = layer(x if norm is None else fused_rms_norm(norm, x, fast))
    if gated and row_kernels(y, fast):
        from onespec.layers.triton_linear import silu_mul
        y = silu_mul(y)
    elif gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = residual + y
    return y if out_dtype is None else y.to(out_dtype)


def fused_linear_argmax(layer: nn.Linear, x: torch.Tensor, *, norm: RMSNorm | None = None,
                        offsets: torch.Tensor | None = None, fast: bool = False
                        ) -> torch.Tensor:
    """argmax over the float32 outputs of layer(norm(x)) per row [N] int64 (greedy
    decoding), plus offsets[argmax] if given: with `fast`, the GEMV's tiles reduce their
    own columns and the logits are never written (small_linear(argmax=True))."""
    if decode_sized(x, fast):
        from onespec.layers.triton_linear import small_linear
        return small_linear(x, layer.weight, layer.bias,
                            norm_weight=None if norm is None else norm.weight,
                            eps=1e-6 if norm is None else norm.eps,
                            out_dtype=torch.float32, argmax=True, argmax_offsets=offsets)
    ids = fused_linear(layer, x, norm=norm, out_dtype=torch.float32).argmax(-1)
    return ids if offsets is None else ids + offsets[ids]


def fused_rms_norm(norm: RMSNorm, x: torch.Tensor, fast: bool = False,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """norm(x), as one Triton kernel when `fast` (optionally into `out`, e.g. a column slice
    of a concatenation), else the module itself."""
    if row_kernels(x, fast):
        from onespec.layers.triton_linear import rms_norm
        return rms_norm(x, norm.weight, norm.eps, out)
    y = norm(x)
    if out is not None:
        out.copy_(y)
    return y


def fused_add_rms_norm(norm: RMSNorm, y: torch.Tensor, residual: torch.Tensor,
                       fast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, norm(h)) for h = residual + y: one Triton kernel when `fast`, else PyTorch."""
    if row_kernels(y, fast):
        from onespec.layers.triton_linear import add_rms_norm
        return add_rms_norm(y, residual, norm.weight, norm.eps)
    h = residual + y
    return h, norm(h)
