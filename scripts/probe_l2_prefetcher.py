"""Can a side kernel that prefetches weights into L2 keep the memory busy across the
decode GEMVs' boundaries? (Hopper probe)

    python scripts/probe_l2_prefetcher.py [--out probe.jsonl] [--layers 32]

At batch 1 the GEMV chain (no attention, no norms) takes ~113 us a layer against ~94 at
the read floor (docs/PERFORMANCE.md, 2m): at each of the four kernel boundaries the memory
idles while the last programs of one GEMV finish and the next one's start. The weights do
not depend on the activations, so a separate kernel could stream them into L2 ahead of the
GEMVs, whatever those are waiting for. Three parts:

1. L2 residency: a GEMV reading its weight cold, after L2 prefetches of it, and after a
   read of it (is prefetched data served from L2, and how fast?).
2. The chain of probe_tma_chain.py (o_proj, gate_up, down, qkv at one row, 32 layers of
   distinct weights, one CUDA graph, PDL) with GEMVs whose program 0 stores the index of
   its current weight slice (BLOCK_K columns of every row) to a progress word, and a
   prefetcher on a second stream of the same graph: a few small programs walk every slice
   of the step in order and prefetch it into L2 once it is less than LEAD bytes ahead of
   the progress word. Microseconds per layer with and without it.
3. (`--part 3`) The same with the prefetcher's programs holding an SM each (a shared-memory
   reservation no GEMV program fits beside), 2-8 of them, and pieces of 1 or 4 k-tiles.

Found on the H200 (docs/PERFORMANCE.md, 2t): prefetched data is served from L2, but every
prefetcher made the chain slower (120-183 us a layer against 111), so it was not built
into the engine.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from probe_tma_chain import EARLY, ORDER, SHAPES, small_linear_chain
from timing import graph_us, jsonl_emitter

TILES = {"o_proj": (32, 256, 8), "gate_up": (64, 128, 3), "down": (32, 256, 6),
         "qkv": (32, 256, 5)}   # BLOCK_N, BLOCK_K, stages: the engine's batch-1 tilings


@triton.jit
def _prefetch(addr, size, BULK: tl.constexpr):
    """L2 prefetch of [addr, addr + size) (BULK: one TMA bulk prefetch; else the 128-byte
    line at addr only)."""
    if BULK:
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
            [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [addr],
            dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_rows(base, rr, rows, stride, piece, BULK: tl.constexpr, LINES: tl.constexpr):
    """Prefetch `piece` bytes at base + rr * stride for each row index rr < rows (BULK: one
    bulk prefetch each; else LINES 128-byte lines each)."""
    a = base + tl.where(rr < rows, rr, 0).to(tl.int64) * stride
    if BULK:
        _prefetch(a, tl.zeros_like(rr).to(tl.int32) + piece, True)
    else:
        for line in tl.static_range(LINES):
            _prefetch(a + line * 128, piece, False)


@triton.jit
def _prefetch_region_kernel(BASE, NBYTES, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    off = i.to(tl.int64) * CHUNK
    addr = tl.where(off < NBYTES, BASE + off, BASE)
    _prefetch(addr, tl.full([BLOCK], CHUNK, tl.int32), True)


@triton.jit
def _gemv_kernel(X, W, Y, PROG, N, K, SLICE0, TS, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 STAGES: tl.constexpr, GATED: tl.constexpr, EARLY: tl.constexpr,
                 REPORT: tl.constexpr, EVICT: tl.constexpr, STAMP: tl.constexpr = False,
                 GROUP: tl.constexpr = 1):
    pid = tl.program_id(0)
    if STAMP:
        tl.store(TS + 2 * pid, _now())
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, 16)
    k = tl.arange(0, BLOCK_K)
    wp = W + n[:, None].to(tl.int64) * K + k[None, :]
    w = tl.load(wp)
    wu = w
    if GATED:
        wu = tl.load(wp + N * K)
    tl.extra.cuda.gdc_wait()
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(X + m[:, None] * 0 + k[None, :], mask=(m < 1)[:, None], other=0.0)
    acc = tl.dot(x, tl.trans(w))
    acc_up = acc
    if GATED:
        acc_up = tl.dot(x, tl.trans(wu))
    for j in tl.range(1, K // BLOCK_K, num_stages=STAGES):
        if REPORT:
            tl.store(PROG + m * 0, tl.full([16], 0, tl.int32) + SLICE0 + j // GROUP,
                     mask=(m == 0) & (pid == 0))
        w = tl.load(wp + j * BLOCK_K, eviction_policy=EVICT)
        x = tl.load(X + m[:, None] * 0 + j * BLOCK_K + k[None, :], mask=(m < 1)[:, None],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:
            wu = tl.load(wp + N * K + j * BLOCK_K, eviction_policy=EVICT)
            acc_up = tl.dot(x, tl.trans(wu), acc_up)
    if not EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    y = acc
    if GATED:
        y = acc / (1.0 + tl.exp(-acc)) * acc_up
    row0 = tl.sum(tl.where((m == 0)[:, None], y, 0.0), axis=0)
    tl.store(Y + n, row0.to(Y.dtype.element_ty))
    if STAMP:
        tl.store(TS + 2 * pid + 1, _now())


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _prefetcher_kernel(PROG, ADDR, ROWS, STRIDE, PIECE, CUM, S, LEAD,
                       BLOCK: tl.constexpr, BULK: tl.constexpr, LINES: tl.constexpr,
                       HOG: tl.constexpr = False):
    """Walks the step's weight slices in order; prefetches slice s once CUM[s] is at most
    LEAD bytes past the slice the GEMVs report. Program p takes the row blocks p, p + P,
    ... of each slice (P programs). It re-reads the progress word only while it waits, so
    it skips slices the GEMVs have passed only after a wait: one that falls behind
    prefetches every slice, late. HOG: a dot that never runs (S >= 0) makes the kernel
    hold ~160 KB of shared memory, so no GEMV program shares an SM with a prefetcher
    program."""
    pid = tl.program_id(0)
    if HOG:
        if S < 0:
            ra = tl.arange(0, 64)
            rb = tl.arange(0, 256)
            a = tl.load(ADDR.to(tl.pointer_type(tl.bfloat16)) + ra[:, None] * 256 + rb[None, :])
            b = tl.load(ADDR.to(tl.pointer_type(tl.bfloat16)) + rb[:, None] * 256 + rb[None, :])
            c = tl.dot(a, b)
            tl.store(ADDR.to(tl.pointer_type(tl.float32)) + ra[:, None] * 256 + rb[None, :], c)
    nprog = tl.num_programs(0)
    r = tl.arange(0, BLOCK)
    prog = tl.load(PROG, volatile=True)
    for s in range(0, S):
        if s >= prog:
            c = tl.load(CUM + s)
            while c - tl.load(CUM + prog) > LEAD:
                prog = tl.load(PROG, volatile=True)
            addr = tl.load(ADDR + s)
            rows = tl.load(ROWS + s)
            stride = tl.load(STRIDE + s)
            piece = tl.load(PIECE + s)
            for r0 in range(pid * BLOCK, rows, nprog * BLOCK):
                _prefetch_rows(addr, r0 + r, rows, stride, piece, BULK, LINES)


def plan_slices(weights: list[dict], device, group: int = 1) -> dict:
    """Every weight slice (`group` k-tiles of every row) of the step in the order the
    GEMVs read them: (address of its first piece, rows, row stride in bytes, piece bytes,
    bytes before it), and each launch's first slice index."""
    addr, rows, stride, piece, first = [], [], [], [], []
    for w in weights:
        first.append({})
        for name in ORDER:
            n, k, g = SHAPES[name]
            bk = TILES[name][1] * group
            first[-1][name] = len(addr)
            t = w[name]
            for j in range(k // bk):
                addr.append(t.data_ptr() + j * bk * t.element_size())
                rows.append(t.shape[0])
                stride.append(t.stride(0) * t.element_size())
                piece.append(bk * t.element_size())
    nbytes = [r * p for r, p in zip(rows, piece)]
    cum = [0]
    for b in nbytes:
        cum.append(cum[-1] + b)

    def t(v, dt=torch.int64):
        return torch.tensor(v, dtype=dt, device=device)
    return {"ADDR": t(addr), "ROWS": t(rows, torch.int32), "STRIDE": t(stride),
            "PIECE": t(piece, torch.int32), "CUM": t(cum), "S": len(addr), "first": first}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--part", default="12")
    args = ap.parse_args()
    emit = jsonl_emitter(args.out)

    dt = torch.bfloat16
    if "1" in args.part:
        l2_residency(emit)
    if "2" not in args.part and "3" not in args.part:
        return
    weights = [{name: torch.randn((2 if g else 1) * n, k, device="cuda", dtype=dt) * k ** -0.5
                for name, (n, k, g) in SHAPES.items()} for _ in range(args.layers)]
    layer_bytes = sum(w.numel() * 2 for w in weights[0].values())
    plans = {g: plan_slices(weights, "cuda", g) for g in (1, 4)}
    plan = plans[1]
    prog = torch.zeros(1, dtype=torch.int32, device="cuda")
    x0 = torch.randn(1, 4096, device="cuda", dtype=dt)
    outs = {name: torch.empty(1, n, device="cuda", dtype=dt) for name, (n, k, g) in SHAPES.items()}

    def chain(report: bool, evict: str, pf: dict | None):
        side = torch.cuda.Stream()
        group = pf.get("group", 1) if pf else 1
        plan = plans[group]

        def run():
            prog.zero_()
            if pf is not None:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    _prefetcher_kernel[(pf["programs"],)](
                        prog, plan["ADDR"], plan["ROWS"], plan["STRIDE"], plan["PIECE"],
                        plan["CUM"], plan["S"], pf["lead_mb"] << 20, BLOCK=pf["block"],
                        BULK=pf["bulk"], LINES=pf.get("lines", 4), HOG=pf.get("hog", False),
                        num_warps=pf["warps"])
            x = x0
            for li, w in enumerate(weights):
                for name in ORDER:
                    n, k, g = SHAPES[name]
                    bn, bk, st = TILES[name]
                    y = outs[name]
                    _gemv_kernel[(n // bn,)](
                        x, w[name], y, prog, n, k, plan["first"][li][name], prog, BLOCK_N=bn,
                        BLOCK_K=bk, STAGES=st, GATED=g, EARLY=name in EARLY, REPORT=report,
                        EVICT=evict, GROUP=group, num_warps=4, launch_pdl=True)
                    x = y
            if pf is not None:
                torch.cuda.current_stream().wait_stream(side)
            return x
        return run

    emit(kernel="floor", layer_mb=round(layer_bytes / 1e6, 1),
         us_at_4636=round(layer_bytes / 4636e3, 2), slices=plan["S"])
    emit(kernel="small_linear",
         us_per_layer=round(graph_us(lambda: small_linear_chain(weights, x0)) / args.layers, 2))
    variants = [("no report", False, "", None), ("report", True, "", None)]
    if "3" in args.part:      # prefetchers on SMs of their own, pieces of 1 or 4 k-tiles
        for group in (1, 4):
            for programs in (2, 4, 8):
                for lead in (8, 24):
                    variants.append((f"hog bulk lead {lead} MB, {programs}x2w, group {group}",
                                     True, "", {"lead_mb": lead, "programs": programs,
                                                "warps": 2, "block": 64, "bulk": True,
                                                "hog": True, "group": group}))
        variants.append(("bulk lead 8 MB, 8x2w, group 4 (no hog)", True, "",
                         {"lead_mb": 8, "programs": 8, "warps": 2, "block": 64, "bulk": True,
                          "group": 4}))
        variants.append(("hog lines lead 8 MB, 8x4w", True, "",
                         {"lead_mb": 8, "programs": 8, "warps": 4, "block": 128,
                          "bulk": False, "lines": 4, "hog": True}))
    for lead in (8, 16, 32) if "2" in args.part else ():
        for programs, warps, block in ((8, 1, 32), (16, 2, 64)):
            variants.append((f"bulk lead {lead} MB, {programs}x{warps}w", True, "",
                             {"lead_mb": lead, "programs": programs, "warps": warps,
                              "block": block, "bulk": True}))
    if "2" in args.part:
        variants.append(("bulk lead 16 MB, 8x1w, evict_first", True, "evict_first",
                         {"lead_mb": 16, "programs": 8, "warps": 1, "block": 32, "bulk": True}))
        variants.append(("lines lead 16 MB, 16x2w", True, "",
                         {"lead_mb": 16, "programs": 16, "warps": 2, "block": 64,
                          "bulk": False, "lines": 4}))
        variants.append(("bulk lead 64 MB, 16x2w", True, "",
                         {"lead_mb": 64, "programs": 16, "warps": 2, "block": 64,
                          "bulk": True}))
    ref = None
    for label, report, evict, pf in variants:
        try:
            run = chain(report, evict, pf)
            got = run().clone()
            ref = got if ref is None else ref
            us = graph_us(run, reps=10) / args.layers
            emit(kernel="chain", variant=label, us_per_layer=round(us, 2),
                 same_output=bool(torch.equal(got, ref)))
        except Exception as e:  # one failing variant does not stop the others
            emit(kernel="chain", variant=label, error=str(e)[:400])


def l2_residency(emit):
    """Microseconds for a GEMV (o_proj's tiling, one kernel, first program's start to last
    program's end by %globaltimer) to read an [N, 4096] weight cold, after L2 prefetches
    of it (contiguous 16 KB bulk prefetches; the chain's 512-byte strided pieces; one
    prefetch.global.L2 per line) and after reading it once."""
    import time
    flush = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    ts = torch.zeros(2 * 1024, dtype=torch.int64, device="cuda")
    bn, bk, st = TILES["o_proj"]
    for rows in (1024, 2048, 3072, 4096, 6144):
        w = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, rows, device="cuda", dtype=torch.bfloat16)
        nbytes = w.numel() * 2

        def gemv():
            _gemv_kernel[(rows // bn,)](x, w, y, ts, rows, 4096, 0, ts, BLOCK_N=bn, BLOCK_K=bk,
                                        STAGES=st, GATED=False, EARLY=False, REPORT=False,
                                        EVICT="", STAMP=True, num_warps=4)

        def contiguous():
            chunk = 16384
            _prefetch_region_kernel[(triton.cdiv(nbytes // chunk, 128),)](
                w.data_ptr(), nbytes, CHUNK=chunk, BLOCK=128, num_warps=4)

        def pieces(bulk):
            def go():
                for j in range(4096 // bk):
                    _strided_prefetch_kernel[(triton.cdiv(rows, 128),)](
                        w.data_ptr() + j * bk * 2, rows, w.stride(0) * 2, bk * 2,
                        BLOCK=128, BULK=bulk, LINES=bk * 2 // 128, num_warps=4)
            return go
        modes = {"cold": None, "bulk 16 KB": contiguous, "bulk 512 B pieces": pieces(True),
                 "lines": pieces(False), "read before": gemv}
        got = {}
        for how, before in modes.items():
            times = []
            for _ in range(5):
                flush.fill_(1)                 # 1 GB written: L2 holds none of w
                if before is not None:
                    before()
                torch.cuda.synchronize()
                time.sleep(0.002)              # prefetches still in flight land
                gemv()
                torch.cuda.synchronize()
                t = ts[: 2 * (rows // bn)].view(-1, 2)
                times.append((t[:, 1].max() - t[:, 0].min()).item() / 1e3)
            got[how] = round(sorted(times)[2], 2)
        emit(kernel="l2_residency", mb=round(nbytes / 2 ** 20), us=got,
             us_at_4636=round(nbytes / 4636e3, 2))


@triton.jit
def _strided_prefetch_kernel(BASE, ROWS, STRIDE, PIECE, BLOCK: tl.constexpr,
                             BULK: tl.constexpr, LINES: tl.constexpr):
    _prefetch_rows(BASE, tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), ROWS, STRIDE, PIECE,
                   BULK, LINES)


if __name__ == "__main__":
    main()
