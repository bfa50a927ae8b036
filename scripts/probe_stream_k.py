"""Do the batch-1 GEMVs end sooner when every SM streams the same bytes? (Hopper probe)

    python scripts/probe_stream_k.py [--out probe.jsonl] [--layers 32]

gate_up's 224 programs land two on 92 SMs and one on 40; a program alone on its SM streams
faster, so the launch ends with the paired ones (docs/PERFORMANCE.md, 2m: programs take
43-52 us; qkv's 192 likewise). Here a GEMV's weight tiles (BLOCK_N rows x BLOCK_K columns,
row tile by row tile, k along each) are dealt as equal contiguous runs to P programs
(stream-K): a run starts and ends anywhere inside a row tile, so each SM gets the same
bytes to within one tile. A row tile cut among programs is finished by the one that holds
its first columns (its last run, at its end): the others store their float32 partial sums
and bump the tile's counter (for the next program that is its first run, early in its
stream); the first waits for them, adds them in k order and writes the output. The sums
are deterministic.

The chain is probe_l2_prefetcher.py's (o_proj, gate_up, down, qkv at one row, 32 layers,
one CUDA graph, PDL, no norms or attention). Each variant replaces some GEMVs with the
stream-K kernel; the output is checked against the plain chain (float32 sums in another
order, so near, not equal) and against PyTorch.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from onespec.layers.triton_mlp import _release_one, _wait_at_least
from probe_l2_prefetcher import EARLY, ORDER, SHAPES, TILES, _gemv_kernel
from probe_tma_chain import torch_chain
from timing import graph_us, jsonl_emitter


SLOTS = 4      # programs that may share one row tile (checked by check_plan)


@triton.jit
def owner(i, TOTAL, P):
    """The program whose run holds tile step i (runs: [p * TOTAL // P, (p+1) * TOTAL // P))."""
    return ((i + 1) * P + TOTAL - 1) // TOTAL - 1


@triton.jit
def _stream_k_kernel(X, W, Y, PART, FLAG, M, N, K, TOTAL, P, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, STAGES: tl.constexpr, GATED: tl.constexpr,
                     EARLY: tl.constexpr, SLOTS: tl.constexpr):
    KT = K // BLOCK_K
    pid = tl.program_id(0)
    i0 = pid * TOTAL // P
    i1 = (pid + 1) * TOTAL // P
    m = tl.arange(0, 16)
    r = tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m_ok = m < M
    tl.extra.cuda.gdc_wait()
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    acc_up = tl.zeros([16, BLOCK_N], tl.float32)
    for i in tl.range(i0, i1, num_stages=STAGES):
        t = i // KT
        kk = i - t * KT
        rows = (t * BLOCK_N + r).to(tl.int64)
        wp = W + rows[:, None] * K + kk * BLOCK_K + k[None, :]
        x = tl.load(X + m[:, None] * K + kk * BLOCK_K + k[None, :], mask=m_ok[:, None],
                    other=0.0)
        acc = tl.dot(x, tl.trans(tl.load(wp)), acc)
        if GATED:
            acc_up = tl.dot(x, tl.trans(tl.load(wp + N * K)), acc_up)
        end = (kk == KT - 1) | (i == i1 - 1)
        if end:
            first = owner(t * KT, TOTAL, P)
            sharers = owner(t * KT + KT - 1, TOTAL, P) - first + 1
            pp = PART + ((t * SLOTS + pid - first) * 2 * 16 + m[:, None]) * BLOCK_N + r[None, :]
            if pid != first:
                # later columns of a tile another program began: hand over the partial sums
                tl.store(pp, acc, mask=m_ok[:, None])
                if GATED:
                    tl.store(pp + 16 * BLOCK_N, acc_up, mask=m_ok[:, None])
                _release_one(FLAG + t)
            else:
                if sharers > 1:   # the tile's first columns: add the others', in k order
                    z = _wait_at_least(FLAG + t, sharers - 1, sharers > 1)
                    for sl in tl.static_range(1, SLOTS):
                        ok = m_ok[:, None] & (sl < sharers)
                        q = pp + z + sl * 2 * 16 * BLOCK_N
                        acc += tl.load(q, mask=ok, other=0.0)
                        if GATED:
                            acc_up += tl.load(q + 16 * BLOCK_N, mask=ok, other=0.0)
                    tl.store(FLAG + t, 0)       # ready for the next launch
                y = acc
                if GATED:
                    y = acc / (1.0 + tl.exp(-acc)) * acc_up
                tl.store(Y + m[:, None] * N + t * BLOCK_N + r[None, :],
                         y.to(Y.dtype.element_ty), mask=m_ok[:, None])
        acc = tl.where(end, 0.0, acc)
        acc_up = tl.where(end, 0.0, acc_up)
    if not EARLY:
        tl.extra.cuda.gdc_launch_dependents()


def owners(total: int, p: int) -> list[int]:
    """Host mirror of `owner`, for the plan's self-check."""
    return [((i + 1) * p + total - 1) // total - 1 for i in range(total)]


def check_plan(total: int, p: int, kt: int) -> None:
    """Every step owned by exactly the run [p * total // P, (p + 1) * total // P) that
    holds it, and no row tile cut among more than SLOTS programs."""
    own = owners(total, p)
    for q in range(p):
        for i in range(q * total // p, (q + 1) * total // p):
            assert own[i] == q, (i, q, own[i])
    for t in range(total // kt):
        assert own[t * kt + kt - 1] - own[t * kt] < SLOTS, t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    emit = jsonl_emitter(args.out)

    dt = torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    weights = [{name: torch.randn((2 if g else 1) * n, k, device="cuda", dtype=dt) * k ** -0.5
                for name, (n, k, g) in SHAPES.items()} for _ in range(args.layers)]
    x0 = torch.randn(1, 4096, device="cuda", dtype=dt)
    outs = {name: torch.empty(1, n, device="cuda", dtype=dt) for name, (n, k, g) in SHAPES.items()}
    prog = torch.zeros(1, dtype=torch.int32, device="cuda")
    tiles = {name: (n // TILES[name][0]) for name, (n, k, g) in SHAPES.items()}
    part = torch.zeros(max(tiles.values()) * SLOTS * 2 * 16 * 64, dtype=torch.float32,
                       device="cuda")
    flags = torch.zeros(max(tiles.values()), dtype=torch.int32, device="cuda")

    def chain(stream_k: dict):
        """stream_k: GEMV name -> programs (P) for the ones run by the stream-K kernel."""
        def run(layers=None):
            x = x0
            for w in weights[:layers]:
                for name in ORDER:
                    n, k, g = SHAPES[name]
                    bn, bk, st = TILES[name]
                    y = outs[name]
                    if name in stream_k:
                        total = (n // bn) * (k // bk)
                        _stream_k_kernel[(stream_k[name],)](
                            x, w[name], y, part, flags, 1, n, k, total, stream_k[name],
                            BLOCK_N=bn, BLOCK_K=bk, STAGES=st, GATED=g,
                            EARLY=name in EARLY, SLOTS=SLOTS, num_warps=4,
                            launch_pdl=True)
                    else:
                        _gemv_kernel[(n // bn,)](
                            x, w[name], y, prog, n, k, 0, prog, BLOCK_N=bn, BLOCK_K=bk,
                            STAGES=st, GATED=g, EARLY=name in EARLY, REPORT=False, EVICT="",
                            num_warps=4, launch_pdl=True)
                    x = y
            return x
        return run

    ref1 = torch_chain(weights[:1], x0)
    base = chain({})
    base_out = base().clone()
    two, one = 2 * sms, sms    # gate_up and qkv fit two programs an SM, o_proj and down one
    variants = [("plain", {}), (f"gate_up P={two}", {"gate_up": two}),
                (f"gate_up+qkv P={two}", {"gate_up": two, "qkv": two}),
                (f"gate_up+qkv P={two}, o_proj+down P={one}",
                 {"gate_up": two, "qkv": two, "o_proj": one, "down": one}),
                (f"gate_up+qkv P={one}", {"gate_up": one, "qkv": one}),
                (f"o_proj+down P={one}", {"o_proj": one, "down": one})]
    for label, sk in variants:
        try:
            for name, p in sk.items():
                n, k, g = SHAPES[name]
                check_plan((n // TILES[name][0]) * (k // TILES[name][1]), p,
                           k // TILES[name][1])
            run = chain(sk)
            got1 = run(1)[:, :4096].float()
            err1 = ((got1 - ref1).norm() / ref1.norm()).item()
            got = run().clone()
            err = ((got.float() - base_out.float()).norm() / base_out.float().norm()).item()
            again = torch.equal(run(), got)
            us = graph_us(run, reps=10) / args.layers
            emit(kernel="chain", variant=label, us_per_layer=round(us, 2),
                 rel_err_vs_torch_1_layer=round(err1, 5), rel_err_vs_plain=round(err, 5),
                 deterministic=again, flags_clear=int(flags.sum().item()) == 0)
        except Exception as e:   # one failing variant does not stop the others
            emit(kernel="chain", variant=label, error=str(e)[:400])


if __name__ == "__main__":
    main()
