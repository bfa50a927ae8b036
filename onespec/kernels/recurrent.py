"""Decode / verify recurrences of hybrid targets (models/qwen3_next.py, models/nemotron_h.py):
the K+1 rows of each generation request in one launch, the state after every row written
as a snapshot (engine/state_pool.py), the initial state read from the request's slot of
the pool (zeros where the request starts fresh). With keep_all=False (prompt chunks) only
the state after the last row is written. Same arithmetic as layers/recurrent.py's
scans (float32 state), which are the reference in tests.

- `gated_delta_verify`: one program per (request, value head, block of BV value columns);
  it keeps its [Dk, BV] slice of the state in registers over the rows, L2-normalising q
  and k of its key head itself (every program of the head recomputes the same norms).
- `mamba2_verify`: one program per (request, head, block of BP head channels); its
  [BP, N] slice of the state stays in registers.

A row's output and state never depend on other requests in the launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gated_delta_kernel(Q, K, V, G, BETA, POOL, SLOTS, FRESH, O, SNAP,
                        L, HK, HV, DK, DV, scale,
                        BK: tl.constexpr, BV: tl.constexpr, KEEP_ALL: tl.constexpr):
    b = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    hk = hv // (HV // HK)
    kk = tl.arange(0, BK)
    vv = vb * BV + tl.arange(0, BV)
    km, vm = kk < DK, vv < DV
    sm = km[:, None] & vm[None, :]
    slot = tl.load(SLOTS + b)
    keep = 1.0 - tl.load(FRESH + b).to(tl.float32)
    s = tl.load(POOL + ((slot * HV + hv) * DK + kk[:, None]) * DV + vv[None, :], mask=sm,
                other=0.0) * keep
    for t in range(L):
        row = b * L + t
        q = tl.load(Q + (row * HK + hk) * DK + kk, mask=km, other=0.0).to(tl.float32)
        k = tl.load(K + (row * HK + hk) * DK + kk, mask=km, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        v = tl.load(V + (row * HV + hv) * DV + vv, mask=vm, other=0.0).to(tl.float32)
        g = tl.load(G + row * HV + hv).to(tl.float32)
        beta = tl.load(BETA + row * HV + hv).to(tl.float32)
        s = s * tl.exp(g)
        kv = tl.sum(s * k[:, None], 0)                                       # [BV]
        delta = (v - kv) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(O + (row * HV + hv) * DV + vv, o.to(O.dtype.element_ty), mask=vm)
        if KEEP_ALL:
            tl.store(SNAP + ((row * HV + hv) * DK + kk[:, None]) * DV + vv[None, :], s,
                     mask=sm)
    if not KEEP_ALL:
        tl.store(SNAP + ((b * HV + hv) * DK + kk[:, None]) * DV + vv[None, :], s, mask=sm)


def gated_delta_verify(q, k, v, g, beta, pool: torch.Tensor, slots: torch.Tensor,
                       fresh: torch.Tensor, keep_all: bool = True, block_v: int = 32):
    """q, k [B, L, Hk, Dk], v [B, L, Hv, Dv], g, beta [B, L, Hv]; pool [slots, Hv, Dk, Dv]
    float32, slots [B], fresh [B] bool -> (o [B, L, Hv, Dv] in v's dtype, the state after
    each row [B, L, Hv, Dk, Dv] float32, or after the last [B, Hv, Dk, Dv])."""
    b, length, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    o = torch.empty_like(v)
    snap = torch.empty(b, *([length] if keep_all else []), hv, dk, dv, dtype=torch.float32,
                       device=v.device)
    bv = min(block_v, triton.next_power_of_2(dv))
    grid = (b, hv, triton.cdiv(dv, bv))
    _gated_delta_kernel[grid](q, k, v, g, beta, pool, slots, fresh.to(torch.int32), o, snap,
                              length, hk, hv, dk, dv, dk ** -0.5,
                              BK=triton.next_power_of_2(dk), BV=bv, KEEP_ALL=keep_all)
    return o, snap


@triton.jit
def _mamba2_kernel(X, DT, A, B_, C_, D_, POOL, SLOTS, FRESH, Y, SNAP,
                   L, H, G, P, N,
                   BP: tl.constexpr, BN: tl.constexpr, KEEP_ALL: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    grp = h // (H // G)
    pp = pb * BP + tl.arange(0, BP)
    nn = tl.arange(0, BN)
    pm, nm = pp < P, nn < N
    sm = pm[:, None] & nm[None, :]
    slot = tl.load(SLOTS + b)
    keep = 1.0 - tl.load(FRESH + b).to(tl.float32)
    s = tl.load(POOL + ((slot * H + h) * P + pp[:, None]) * N + nn[None, :], mask=sm,
                other=0.0) * keep
    a = tl.load(A + h).to(tl.float32)
    d = tl.load(D_ + h).to(tl.float32)
    for t in range(L):
        row = b * L + t
        x = tl.load(X + (row * H + h) * P + pp, mask=pm, other=0.0).to(tl.float32)
        dt = tl.load(DT + row * H + h).to(tl.float32)
        bb = tl.load(B_ + (row * G + grp) * N + nn, mask=nm, other=0.0).to(tl.float32)
        cc = tl.load(C_ + (row * G + grp) * N + nn, mask=nm, other=0.0).to(tl.float32)
        s = s * tl.exp(dt * a) + (dt * x)[:, None] * bb[None, :]
        y = tl.sum(s * cc[None, :], 1) + d * x
        tl.store(Y + (row * H + h) * P + pp, y, mask=pm)
        if KEEP_ALL:
            tl.store(SNAP + ((row * H + h) * P + pp[:, None]) * N + nn[None, :], s, mask=sm)
    if not KEEP_ALL:
        tl.store(SNAP + ((b * H + h) * P + pp[:, None]) * N + nn[None, :], s, mask=sm)


def mamba2_verify(x, dt, A, B, C, D, pool: torch.Tensor, slots: torch.Tensor,
                  fresh: torch.Tensor, keep_all: bool = True, block_p: int = 32):
    """x [B, L, H, P], dt [B, L, H] (after softplus and limits), A, D [H], B, C
    [B, L, G, N]; pool [slots, H, P, N] float32 -> (y [B, L, H, P] float32, the state
    after each row [B, L, H, P, N] float32, or after the last [B, H, P, N])."""
    b, length, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))
    y = torch.empty(b, length, h, p, dtype=torch.float32, device=x.device)
    snap = torch.empty(b, *([length] if keep_all else []), h, p, n, dtype=torch.float32,
                       device=x.device)
    bp = min(block_p, triton.next_power_of_2(p))
    grid = (b, h, triton.cdiv(p, bp))
    _mamba2_kernel[grid](x, dt, A.float().contiguous(), B, C, D.float().contiguous(), pool,
                         slots, fresh.to(torch.int32), y, snap, length, h, g, p, n,
                         BP=bp, BN=triton.next_power_of_2(n), KEEP_ALL=keep_all)
    return y, snap
