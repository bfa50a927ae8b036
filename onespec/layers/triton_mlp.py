"""A decode-sized MLP as one persistent kernel on Hopper: gate_up and down with no kernel
boundary between them.

Between two GEMV kernels every SM waits for the slowest program of the first one before
the second may read its output: a decode step of an 8B model loses several microseconds a
layer at each such boundary with the memory idle (docs/PERFORMANCE.md, 2m). Here one
program per SM streams its share of gate_up's weight and then its share of down's, and the
down half waits only for the part of the activation it is about to read:

- Phase A (gate_up): tiles of BA gate rows and the BA matching up rows over the whole
  input, dealt round by round (every program's first tile, then every program's second,
  ...), so the activation is finished in column order while the phase runs. Each finished
  tile bumps the counter of its band of activation columns (release).
- Phase B (down): each program owns BB output rows over the whole intermediate size and
  reads the activation in bands that halve towards its end, each thread waiting (acquire)
  at a band's first tile until the band's counter shows all its tiles; by the time a
  program gets to a band it is usually done.
- The programs without down rows (SMs beyond the down's row blocks) take more gate_up
  tiles, so that every program streams about the same number of bytes.

Measured on the H200 (docs/PERFORMANCE.md, 2n) it is correct but slower than the two
small_linear kernels (~120 against ~115 us per layer of the four GEMVs): one program per SM
streams ~30-32 GB/s, where gate_up's small_linear, two programs on most SMs, streams more.
So it is opt-in (ENABLED).

The arithmetic per row is small_linear's (gate_up with the input norm's 1/rms, SiLU * up,
rounded; down + residual, the next norm's share), so results equal the two-kernel path and
never depend on how rows are batched. The last program to finish zeroes the counters for
the next launch; launches sharing a device's counters must not run concurrently (one
stream, as the engine and CUDA graphs run them).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from onespec.layers.triton_linear import (Prenormed, _hopper, _prenorm_rstd,
                                          pdl_launch, pdl_supported, stamp, trace_buffer)

MAX_ROWS = 16    # rows padded to one 16-row tile
BB = 32          # down rows of a program
BLOCK_K = 256    # weight columns per loaded tile, both phases
# Off by default: on the H200 it is still slower than small_linear's two kernels
# (docs/PERFORMANCE.md, 2n). ONESPEC_FUSED_MLP=1 (or ENABLED = True) sends the decode
# path's MLPs here.
ENABLED = os.environ.get("ONESPEC_FUSED_MLP", "0") == "1"
# stages of each phase's weight pipeline; activation bands; early: release the next kernel
# at the start; flat: phase B as one loop (else a loop per band); ba: gate (and up) rows of
# a phase-A tile; a_cost: a gate_up byte weighed as a_cost % of a down byte in the plan;
# warps per program.
# Profiling only: rr=0 deals each program adjacent tiles, sync=0 drops the waits (wrong
# results, the streams' own speed). Best measured: docs/PERFORMANCE.md, 2n.
CONFIG = {"stages_a": 6, "stages_b": 6, "bands": 6, "early": False, "flat": True, "ba": 16,
          "rr": 1, "sync": 1, "a_cost": 120, "warps": 4}


@triton.jit
def _release_one(ptr):
    """*ptr += 1 (release, GPU scope) once for the whole program, after all its threads'
    earlier stores: bar.sync, then thread 0's red. Inline PTX, as Triton's own barrier op
    inside a loop stops the loop's loads from being software-pipelined, and its scalar
    atomic waits for the old value."""
    tl.inline_asm_elementwise(
        """{
        .reg .pred first;
        .reg .u32 tid;
        bar.sync 0;
        mov.u32 tid, %tid.x;
        setp.eq.u32 first, tid, 0;
        @first red.release.gpu.global.add.u32 [$1], 1;
        mov.u32 $0, 0;
        }""", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _band_start(band, KT: tl.constexpr):
    """First weight tile (of KT along the activation) of a band: the bands halve towards
    the end (KT = 56: 0, 28, 42, 49, 53, 55), so the last columns, finished last, are
    waited for in small steps."""
    return tl.where(band == 0, 0, KT - (KT >> band))


@triton.jit
def _band(kt, KT: tl.constexpr, BANDS: tl.constexpr):
    """The band of weight tile kt."""
    band = kt * 0
    for b in tl.static_range(1, BANDS):
        band += (kt >= KT - (KT >> b)).to(band.dtype)
    return band


@triton.jit
def _wait_at_least(ptr, target, wait):
    """If `wait`: spin (each thread, acquire) until *ptr >= target. Returns 0, for a
    load's address to depend on, so the load is not issued before the wait. Declared pure
    (Triton 3.6's pipeliner cannot predicate a side-effecting op in an early stage); the
    data dependence keeps it before the load, and a speculated extra one never waits."""
    return tl.inline_asm_elementwise(
        """{
        .reg .pred wpred, lpred;
        .reg .u32 cval;
        setp.ne.u32 wpred, $3, 0;
        @!wpred bra DONE;
        LOOP:
        ld.acquire.gpu.global.u32 cval, [$1];
        setp.lt.u32 lpred, cval, $2;
        @lpred bra LOOP;
        DONE:
        mov.u32 $0, 0;
        }""", "=r,l,r,r", [ptr, target, wait.to(tl.int32)], dtype=tl.int32, is_pure=True,
        pack=1)


@triton.jit
def _mlp_kernel(X, SS_IN, WGU, WD, RES, Y, NW_OUT, XN_OUT, SS_OUT, ACT, SYNC, TR,
                M, P_IN, stride_xm, stride_ss_in, stride_rm, stride_ym, stride_xn,
                stride_ss_out, eps, G0, S0, C0, S1, C1, C2, NOB_LAST,
                H: tl.constexpr, I: tl.constexpr, G: tl.constexpr, BANDS: tl.constexpr,
                FLAT_B: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr, RR: tl.constexpr,
                WAITS: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, STAGES_A: tl.constexpr,
                STAGES_B: tl.constexpr, NORM_OUT: tl.constexpr, PDL: tl.constexpr,
                EARLY: tl.constexpr, TRACING: tl.constexpr):
    stamp(TR, 0, TRACING)
    p = tl.program_id(0)
    m = tl.arange(0, 16)
    m_ok = m < M
    k = tl.arange(0, BLOCK_K)
    if PDL:
        tl.extra.cuda.gdc_wait()
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    stamp(TR, 1, TRACING)
    rstd = _prenorm_rstd(SS_IN, m, m_ok, P_IN, H, stride_ss_in, eps, BLOCK_P)

    # Phase A. Programs are ranked by their number of tiles, S0 with C0, S1 with C1, the
    # rest with C2 (C0 >= C1 >= C2); round j holds the ranks with more than j tiles, so
    # the tile of rank q in round j is (the tiles of rounds before j) + q. The G0
    # programs without down rows rank first, or last with NOB_LAST.
    rank = tl.where(NOB_LAST != 0, tl.where(p >= G0, p - G0, G - G0 + p), p)
    n_a = tl.where(rank < S0, C0, tl.where(rank < S0 + S1, C1, C2))
    KT_A: tl.constexpr = H // BLOCK_K
    KT_B: tl.constexpr = I // BLOCK_K
    # one weight tile holds a tile's BA gate rows and then its BA up rows, so one dot of
    # 2 BA columns serves both (the warps split its columns rather than repeat it)
    c = tl.arange(0, 2 * BA)
    c_row = (c // BA) * I + c % BA                  # row offset of column c from the tile's
    r = tl.arange(0, BA)
    acc = tl.zeros([16, 2 * BA], tl.float32)
    for i in tl.range(0, n_a * KT_A, num_stages=STAGES_A):
        j = i // KT_A
        kt = i - j * KT_A
        if RR:
            first = (G * tl.minimum(j, C2) + (S0 + S1) *
                     tl.minimum(tl.maximum(j - C2, 0), C1 - C2) + S0 * tl.maximum(j - C1, 0))
            tile = first + rank
        else:   # profiling: each program's tiles adjacent
            tile = (C0 * tl.minimum(rank, S0) + C1 * tl.minimum(tl.maximum(rank - S0, 0), S1)
                    + C2 * tl.maximum(rank - S0 - S1, 0) + j)
        k0 = kt * BLOCK_K
        w = tl.load(WGU + (tile * BA + c_row)[:, None].to(tl.int64) * H + k0 + k[None, :])
        x = tl.load(X + m[:, None] * stride_xm + k0 + k[None, :], mask=m_ok[:, None],
                    other=0.0)
        acc += tl.dot(x, tl.trans(w))
        if kt == KT_A - 1:
            g, u = tl.split(tl.permute(tl.reshape(acc * rstd[:, None], [16, 2, BA]), [0, 2, 1]))
            a = (g * tl.sigmoid(g) * u).to(ACT.dtype.element_ty)
            tl.store(ACT + m[:, None] * I + tile * BA + r[None, :], a, mask=m_ok[:, None])
            if WAITS:
                _release_one(SYNC + _band(tile * BA // BLOCK_K, KT_B, BANDS))
            acc = tl.zeros([16, 2 * BA], tl.float32)
    stamp(TR, 2, TRACING)

    # Phase B: programs G0.. own BB rows of down each.
    if p >= G0:
        rows_b = (p - G0) * BB + tl.arange(0, BB)
        w_rows = WD + rows_b[:, None].to(tl.int64) * I + k[None, :]
        a_rows = ACT + m[:, None] * I + k[None, :]
        acc_b = tl.zeros([16, BB], tl.float32)
        TILES_PER_K: tl.constexpr = BLOCK_K // BA
        if FLAT_B:
            # one software-pipelined loop; at a band's first weight tile each thread waits
            # (its own acquire) for the band, the activation's address depending on it
            for kt in tl.range(0, KT_B, num_stages=STAGES_B):
                band = _band(kt, KT_B, BANDS)
                lo = _band_start(band, KT_B)
                hi = tl.where(band == BANDS - 1, KT_B, _band_start(band + 1, KT_B))
                z = _wait_at_least(SYNC + band, (hi - lo) * TILES_PER_K, (kt == lo) & WAITS)
                w = tl.load(w_rows + kt * BLOCK_K)
                a = tl.load(a_rows + (kt + z) * BLOCK_K, mask=m_ok[:, None], other=0.0,
                            cache_modifier=".cg")
                acc_b += tl.dot(a, tl.trans(w))
        else:
            for band in range(0, BANDS):
                lo = _band_start(band, KT_B)
                hi = tl.where(band == BANDS - 1, KT_B, _band_start(band + 1, KT_B))
                target = (hi - lo) * TILES_PER_K
                if WAITS:
                    seen = tl.atomic_add(SYNC + band, 0, sem="acquire", scope="gpu")
                    while seen < target:
                        seen = tl.atomic_add(SYNC + band, 0, sem="acquire", scope="gpu")
                tl.debug_barrier()   # no thread reads the band before the acquire
                for kt in tl.range(lo, hi, num_stages=STAGES_B):
                    w = tl.load(w_rows + kt * BLOCK_K)
                    a = tl.load(a_rows + kt * BLOCK_K, mask=m_ok[:, None], other=0.0,
                                cache_modifier=".cg")
                    acc_b += tl.dot(a, tl.trans(w))
        out_ok = m_ok[:, None]
        res = tl.load(RES + m[:, None] * stride_rm + rows_b[None, :], mask=out_ok, other=0.0)
        # rounded to the stream's dtype before the residual add, as in PyTorch
        y = (acc_b.to(RES.dtype.element_ty).to(tl.float32) + res.to(tl.float32))
        y = y.to(Y.dtype.element_ty)
        tl.store(Y + m[:, None] * stride_ym + rows_b[None, :], y, mask=out_ok)
        if NORM_OUT:
            yf = tl.where(out_ok, y.to(tl.float32), 0.0)
            nw = tl.load(NW_OUT + rows_b).to(tl.float32)
            tl.store(XN_OUT + m[:, None] * stride_xn + rows_b[None, :],
                     (yf * nw[None, :]).to(XN_OUT.dtype.element_ty), mask=out_ok)
            tl.store(SS_OUT + m * stride_ss_out + (p - G0), tl.sum(yf * yf, 1), mask=m_ok)
    if PDL and not EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    stamp(TR, 3, TRACING)
    # the last program out zeroes the counters (all others have passed every wait)
    tl.debug_barrier()
    done = tl.atomic_add(SYNC + BANDS, 1, sem="acq_rel", scope="gpu")
    if done == G - 1:
        for b in tl.static_range(BANDS + 1):
            tl.atomic_xchg(SYNC + b, 0, sem="relaxed", scope="gpu")


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def plan(hidden: int, inter: int, sms: int, ba: int = 16,
         a_cost: int = 100) -> tuple[int, ...] | None:
    """How the work is dealt: (programs, G0, S0, C0, S1, C1, C2, NOB_LAST), or None if the
    down's row blocks outnumber the SMs. Each of hidden / BB programs owns one row block
    of down; G0 more programs take gate_up tiles only, A0 each; of the first kind, G1 take
    A1 + 1 tiles and the rest A1. G0, A0, A1, G1 are chosen so that the most bytes any
    program streams is as small as it can be (then the fewest programs streaming that
    most). (S, C): the groups by rank, most tiles first (see the kernel)."""
    tiles, blocks = inter // ba, hidden // BB
    if blocks > sms:
        return None
    # 16-bit weights; a gate_up byte counted as a_cost % of a down byte
    tile_bytes, block_bytes = 4 * ba * hidden * a_cost // 100, 2 * BB * inter
    best = None
    for g0 in range(0, sms - blocks + 1):
        for a0 in range(0, tiles // g0 + 1) if g0 else (0,):
            a1, g1 = divmod(tiles - g0 * a0, blocks)
            loads = (a0 * tile_bytes, (a1 + 1) * tile_bytes + block_bytes,
                     a1 * tile_bytes + block_bytes)
            counts = (g0, g1, blocks - g1)
            most = max(load for load, n in zip(loads, counts) if n)
            key = (most, sum(n for load, n in zip(loads, counts) if load == most), -g0)
            if best is None or key < best[0]:
                best = (key, g0, a0, a1, g1)
    _, g0, a0, a1, g1 = best
    if a0 >= a1 + (g1 > 0):     # programs without down rows first
        return blocks + g0, g0, g0, a0, g1, a1 + 1, a1, 0
    return blocks + g0, g0, g1, a1 + 1, blocks - g1, a1, a0, 1


def num_bands(inter: int, bands: int | None = None) -> int:
    """`bands` (default CONFIG's), at most as many as halving the activation's weight
    tiles allows (see _band_start)."""
    return max(1, min(bands or CONFIG["bands"], (inter // BLOCK_K).bit_length()))


def _sync_buffer(device: torch.device) -> torch.Tensor:
    """The device's counters: one per band and the programs-done count (num_bands keeps
    the bands far below 63); all zero between launches."""
    if device not in _SYNC:
        _SYNC[device] = torch.zeros(64, dtype=torch.int32, device=device)
    return _SYNC[device]


_SYNC: dict = {}


def fused_mlp_supported(x: torch.Tensor | Prenormed, gate_up: torch.nn.Linear,
                        down: torch.nn.Linear) -> bool:
    """Whether fused_mlp takes this MLP: compiled Triton on Hopper or newer, 16-bit
    weights without bias, at most MAX_ROWS rows, sizes in whole tiles and no more down
    row blocks than SMs."""
    if not ENABLED:
        return False
    w = gate_up.weight
    hidden, inter = down.weight.shape
    rows = (x.x if isinstance(x, Prenormed) else x).shape[0]
    return (_hopper(w.device) and w.element_size() == 2 and
            gate_up.bias is None and down.bias is None and rows <= MAX_ROWS and
            hidden % BLOCK_K == 0 and
            inter % BLOCK_K == 0 and hidden % BB == 0 and
            plan(hidden, inter, _sm_count(w.device), CONFIG["ba"]) is not None)


def fused_mlp(pre: Prenormed, gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
              residual: torch.Tensor, norm_out: tuple[torch.Tensor, float] | None = None,
              early_release: bool | None = None, config: dict | None = None):
    """residual + down(silu(gate(norm(x))) * up(norm(x))) for a Prenormed input (the norm
    split over the kernel before, see triton_linear.Prenormed). norm_out=(weight, eps):
    also return the next RMSNorm's Prenormed, i.e. (y, Prenormed)."""
    cfg = {**CONFIG, **(config or {})}
    x = pre.x
    m, hidden = x.shape
    inter = down_weight.shape[1]
    if gate_up_weight.shape != (2 * inter, hidden) or down_weight.shape != (hidden, inter):
        raise ValueError(f"fused_mlp: gate_up {tuple(gate_up_weight.shape)} and down "
                         f"{tuple(down_weight.shape)} do not fit x {tuple(x.shape)}")
    if m > MAX_ROWS or hidden % BLOCK_K or inter % BLOCK_K:
        raise ValueError(f"fused_mlp: x {tuple(x.shape)} and intermediate size {inter} need "
                         f"at most {MAX_ROWS} rows and sizes in multiples of {BLOCK_K}")
    bands = num_bands(inter, cfg["bands"])
    deal = plan(hidden, inter, _sm_count(x.device), cfg["ba"], cfg["a_cost"])
    if deal is None:
        raise ValueError(f"fused_mlp: {hidden // BB} row blocks of down for "
                         f"{_sm_count(x.device)} SMs; see fused_mlp_supported")
    programs, *deal = deal
    out = torch.empty(m, hidden, dtype=x.dtype, device=x.device)
    act = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    blocks = hidden // BB
    nxt = None
    if norm_out is not None:
        nxt = Prenormed(torch.empty_like(out),
                        torch.empty(m, blocks, dtype=torch.float32, device=x.device),
                        norm_out[1])
    if m == 0:
        return out if nxt is None else (out, nxt)
    pdl = pdl_supported(x.device)
    early = cfg["early"] if early_release is None else early_release
    tr = trace_buffer("fused_mlp", programs, x.device)
    _mlp_kernel[(programs,)](
        x, pre.ss, gate_up_weight, down_weight, residual, out,
        norm_out[0] if nxt else out, nxt.x if nxt else out, nxt.ss if nxt else out, act,
        _sync_buffer(x.device), tr,
        m, pre.ss.shape[1], x.stride(0), pre.ss.stride(0), residual.stride(0), out.stride(0),
        nxt.x.stride(0) if nxt else 0, nxt.ss.stride(0) if nxt else 0, pre.eps,
        *deal,
        H=hidden, I=inter, G=programs, BANDS=bands, FLAT_B=cfg["flat"], BA=cfg["ba"], BB=BB,
        RR=bool(cfg["rr"]), WAITS=bool(cfg["sync"]),
        BLOCK_K=BLOCK_K, BLOCK_P=triton.next_power_of_2(pre.ss.shape[1]),
        STAGES_A=cfg["stages_a"], STAGES_B=cfg["stages_b"], NORM_OUT=nxt is not None,
        PDL=pdl, EARLY=early,
        TRACING=tr is not None, num_warps=cfg["warps"], **pdl_launch(pdl))
    return out if nxt is None else (out, nxt)
