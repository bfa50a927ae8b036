"""Routed experts on CUDA in Triton: a grouped GEMM over the (token, expert) pairs a step
routes, reading only the experts some pair chose, with no host sync and fixed shapes (so
a step with MoE layers can be captured in a CUDA graph).

The T x top_k pairs are sorted by expert on the device; OFFSETS[e] .. OFFSETS[e + 1] are
expert e's pairs in that order. Two kernels then run one program per (expert, column
tile); a program whose expert has no pair leaves before reading anything:

    gate_up   h[pair]   = silu(x[token] W_gate[e]^T) * (x[token] W_up[e]^T)     [P, I]
    down      y[pair]   = weight[pair] * h[pair] W_down[e]^T                    [P, H]

(gpt-oss: biases on both, and its clamped SwiGLU in place of silu(gate) * up.)

A program walks its expert's pairs in tiles of BLOCK_M, so an expert's weight tile is
read once per BLOCK_M pairs (once per step at decode batch sizes). y is written at each
pair's place in the unsorted [T, top_k] order and summed over top_k in float32, in the
same order for every token: a token's result never depends on the rest of the batch.

FP8 experts (quant/fp8.py: e4m3 weights with float32 scales per row or per (bo, bi) block)
are read as e4m3 and widened in registers: a per-row scale multiplies the finished dot
products, a block's scale each BLOCK_K-wide partial product (BLOCK_K divides bi).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from onespec.kernels.launch import INTERPRETED, dot_t

BLOCK_M = 16          # pairs a program multiplies at once (tl.dot's smallest tile)
# (BLOCK_N, BLOCK_K, warps, stages): column tiles of 64 keep a DeepSeek-V2-Lite expert
# (I = 1408) at 22 programs, so the six experts of a batch-1 step fill the SMs
TILING = (64, 64, 4, 3)


@triton.jit
def _scaled(part, S, n, n_ok, k0, stride_sn, SCALED: tl.constexpr, BO: tl.constexpr,
            BI: tl.constexpr):
    """A BLOCK_K-wide partial product times its rows' block scales (SCALED == 2)."""
    if SCALED == 2:
        part = part * tl.load(S + (n // BO) * stride_sn + k0 // BI, mask=n_ok,
                              other=0.0)[None, :]
    return part


@triton.jit
def _gate_up_kernel(X, W, B, PAIR_TOKEN, OFFSETS, H_OUT, S, hidden, inter,
                    stride_xt, stride_we, stride_wn, stride_be, stride_ht, stride_se,
                    stride_sn, alpha, limit,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    IEEE: tl.constexpr, SCALED: tl.constexpr, BO: tl.constexpr,
                    BI: tl.constexpr, HAS_BIAS: tl.constexpr = False,
                    CLAMPED: tl.constexpr = False):
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    start = tl.load(OFFSETS + e)
    end = tl.load(OFFSETS + e + 1)
    w_base = W + e.to(tl.int64) * stride_we
    s_base = S + e.to(tl.int64) * stride_se
    for m0 in range(start, end, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)        # places m0 .. of expert e's sorted pairs
        m_ok = m < end
        token = tl.load(PAIR_TOKEN + m, mask=m_ok, other=0).to(tl.int64)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            x = tl.load(X + token[:, None] * stride_xt + k[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = n_ok[:, None] & k_ok[None, :]
            w_g = tl.load(w_base + n[:, None] * stride_wn + k[None, :], mask=w_mask, other=0.0)
            w_u = tl.load(w_base + (n + inter)[:, None] * stride_wn + k[None, :], mask=w_mask,
                          other=0.0)
            acc_g += _scaled(dot_t(x, w_g.to(x.dtype), IEEE), s_base, n, n_ok, k0,
                             stride_sn, SCALED, BO, BI)
            acc_u += _scaled(dot_t(x, w_u.to(x.dtype), IEEE), s_base, n + inter, n_ok, k0,
                             stride_sn, SCALED, BO, BI)
        if SCALED == 1:
            acc_g = acc_g * tl.load(s_base + n, mask=n_ok, other=0.0)[None, :]
            acc_u = acc_u * tl.load(s_base + inter + n, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc_g += tl.load(B + e.to(tl.int64) * stride_be + n, mask=n_ok,
                             other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(B + e.to(tl.int64) * stride_be + inter + n, mask=n_ok,
                             other=0.0).to(tl.float32)[None, :]
        if CLAMPED:     # gpt-oss: (clamp(u) + 1) * g' * sigmoid(alpha g'), g' = min(g, limit)
            g = tl.minimum(acc_g, limit)
            u = tl.minimum(tl.maximum(acc_u, -limit), limit)
            h = (u + 1.0) * g / (1.0 + tl.exp(-alpha * g))
        else:
            h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(H_OUT + m[:, None].to(tl.int64) * stride_ht + n[None, :],
                 h.to(H_OUT.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(H, W, B, PAIR_SLOT, PAIR_WEIGHT, OFFSETS, Y, S, hidden, inter,
                 stride_ht, stride_we, stride_wn, stride_be, stride_yt, stride_se, stride_sn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr, SCALED: tl.constexpr, BO: tl.constexpr,
                 BI: tl.constexpr, HAS_BIAS: tl.constexpr = False):
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    start = tl.load(OFFSETS + e)
    end = tl.load(OFFSETS + e + 1)
    w_base = W + e.to(tl.int64) * stride_we
    s_base = S + e.to(tl.int64) * stride_se
    for m0 in range(start, end, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)        # places m0 .. of expert e's sorted pairs
        m_ok = m < end
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < inter
            h = tl.load(H + m[:, None].to(tl.int64) * stride_ht + k[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + n[:, None] * stride_wn + k[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += _scaled(dot_t(h, w.to(h.dtype), IEEE), s_base, n, n_ok, k0, stride_sn,
                           SCALED, BO, BI)
        if SCALED == 1:
            acc = acc * tl.load(s_base + n, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(B + e.to(tl.int64) * stride_be + n, mask=n_ok,
                           other=0.0).to(tl.float32)[None, :]
        weight = tl.load(PAIR_WEIGHT + m, mask=m_ok, other=0.0)
        slot = tl.load(PAIR_SLOT + m, mask=m_ok, other=0).to(tl.int64)
        tl.store(Y + slot[:, None] * stride_yt + n[None, :], acc * weight[:, None],
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(Y, R, OUT, hidden, stride_yt, stride_rt, stride_ot, TOP_K: tl.constexpr,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[t] = (R[t] +) sum_j Y[t * TOP_K + j]: the pairs summed in float32 in choice
    order and rounded to OUT's dtype, then the residual added (float32, rounded again),
    as `residual + y.sum(1).to(dtype)` rounds."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(Y + (t * TOP_K + j) * stride_yt + c, mask=ok, other=0.0)
    out = acc.to(OUT.dtype.element_ty)
    if HAS_RESIDUAL:
        r = tl.load(R + t * stride_rt + c, mask=ok, other=0.0)
        out = (r.to(tl.float32) + out.to(tl.float32)).to(OUT.dtype.element_ty)
    tl.store(OUT + t * stride_ot + c, out, mask=ok)


COMBINE_BLOCK = 1024


@dataclass
class Routing:
    """A step's routed pairs (pair p = token * k + j is the token's j-th choice), sorted
    by expert: place i holds pair slots[i] of token pair_token[i] with weight
    pair_weight[i]; expert e's places are offsets[e] .. offsets[e + 1]."""
    ids: torch.Tensor            # [T, k] expert of each pair
    weights: torch.Tensor        # [T, k] routing weight of each pair
    slots: torch.Tensor          # [P] int32
    pair_token: torch.Tensor     # [P] int32
    pair_weight: torch.Tensor    # [P] float32
    offsets: torch.Tensor        # [E + 1] int32


def sort_pairs(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Routing:
    """ids / weights [T, k] sorted by expert on the device, in shapes fixed by T and k (a
    stable sort: ties keep token order), through PyTorch (any number of tokens)."""
    flat = ids.reshape(-1)
    experts, slots = torch.sort(flat, stable=True)
    bounds = torch.arange(num_experts + 1, device=ids.device, dtype=experts.dtype)
    return Routing(ids, weights, slots.to(torch.int32),
                   (slots // ids.shape[1]).to(torch.int32),
                   weights.reshape(-1).float()[slots],
                   torch.searchsorted(experts, bounds).to(torch.int32))


def grouped_experts(x: torch.Tensor,            # [T, H]
                    gate_up: torch.Tensor,      # [E, 2I, H] (gate rows first)
                    down: torch.Tensor,         # [E, H, I]
                    routing: Routing,
                    residual: torch.Tensor | None = None,
                    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                    block: tuple[int, int] | None = None,
                    gate_up_bias: torch.Tensor | None = None,    # [E, 2I]
                    down_bias: torch.Tensor | None = None,       # [E, H]
                    swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """(residual +) sum_j weights[:, j] * expert_{ids[:, j]}(x) [T, H] in x's dtype, each
    expert being down(silu(gate(x)) * up(x)); only the routed experts' weights are read.
    The sum and the residual's add are one kernel (_combine_kernel). FP8 experts: e4m3
    gate_up / down with `scales` (gate_up's, down's): float32 [E, rows] per row, or
    [E, ceil(rows/bo), ceil(cols/bi)] per `block`. gpt-oss's experts: the biases added to
    gate/up and down, and swiglu = (alpha, limit) for its clamped activation
    (models/gpt_oss.py clamped_swiglu)."""
    num_tokens, top_k = routing.ids.shape
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    if x.shape != (num_tokens, hidden) or down.shape != (num_experts, hidden, inter) or \
            routing.offsets.shape[0] != num_experts + 1 or \
            (residual is not None and residual.shape != x.shape):
        raise ValueError(f"grouped_experts: x {tuple(x.shape)}, gate_up "
                         f"{tuple(gate_up.shape)}, down {tuple(down.shape)} and ids "
                         f"{tuple(routing.ids.shape)} of {routing.offsets.shape[0] - 1} "
                         "experts (and the residual) do not fit together")
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    pairs = num_tokens * top_k
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    block_n, block_k, warps, stages = TILING
    ieee = x.dtype == torch.float32 or INTERPRETED
    s_gu, s_down = scales if scales is not None else (x, x)
    quant = dict(SCALED=0 if scales is None else 2 if block else 1,
                 BO=block[0] if block else 1, BI=block[1] if block else 1)
    if block is not None:
        block_k = min(block_k, block[1])
        if block[1] % block_k:
            raise ValueError(f"grouped_experts: scale blocks {block} need BLOCK_K {block_k} "
                             "to divide their columns")
    sn = (lambda s: s.stride(1)) if block else (lambda s: 0)      # noqa: E731
    gu_bias = gate_up_bias.contiguous() if gate_up_bias is not None else gate_up
    d_bias = down_bias.contiguous() if down_bias is not None else down
    alpha, limit = swiglu if swiglu is not None else (1.0, 0.0)
    _gate_up_kernel[(num_experts, triton.cdiv(inter, block_n))](
        x, gate_up, gu_bias, routing.pair_token, routing.offsets, h, s_gu, hidden, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gu_bias.stride(0), h.stride(0),
        s_gu.stride(0) if scales is not None else 0, sn(s_gu), float(alpha), float(limit),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, **quant,
        HAS_BIAS=gate_up_bias is not None, CLAMPED=swiglu is not None,
        num_warps=warps, num_stages=stages)
    _down_kernel[(num_experts, triton.cdiv(hidden, block_n))](
        h, down, d_bias, routing.slots, routing.pair_weight, routing.offsets, y, s_down,
        hidden, inter, h.stride(0), down.stride(0), down.stride(1), d_bias.stride(0),
        y.stride(0), s_down.stride(0) if scales is not None else 0, sn(s_down),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, **quant,
        HAS_BIAS=down_bias is not None,
        num_warps=warps, num_stages=stages)
    res = residual if residual is not None else out
    if res.stride(-1) != 1:
        res = res.contiguous()
    _combine_kernel[(num_tokens, triton.cdiv(hidden, COMBINE_BLOCK))](
        y, res, out, hidden, y.stride(0), res.stride(0), out.stride(0), TOP_K=top_k,
        HAS_RESIDUAL=residual is not None, BLOCK=COMBINE_BLOCK, num_warps=4)
    return out
