"""Experiment: a GEMV whose weight ring (shared memory, cp.async) is filled before its PDL
wait, against onespec's Triton small_linear, in a CUDA graph of chained projections.

    python scripts/gluon_gemv_probe.py [--layers 8] [--stages 3,4] [--compile-only]

Question it answers: does keeping weight loads in flight across the kernel boundary (up to
STAGES tiles per program issued before griddepcontrol.wait) shorten a chain of decode
GEMVs (o_proj, gate_up, down, qkv of the 8B shape, one row) towards its bandwidth floor?
Prints one JSON line per variant: µs per layer and the floor. Not used by the engine.
On the H200 (docs/PERFORMANCE.md, 2h): no — 121.5 µs a layer at 3 stages against
small_linear's 120.0, and slower still when the next kernel is released early.
"""
from __future__ import annotations

import argparse
import json

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _gdc_launch():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _ring_gemv_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                      BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                      PDL: gl.constexpr, EARLY: gl.constexpr):
    pid = gl.program_id(0)
    w_load: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    x_load: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    smem: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4],
                                                  instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, BLOCK_K], smem)
    rn = pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_load))
    rk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, w_load))
    w_ptrs = W + rn[:, None].to(gl.int64) * stride_wn + rk[None, :]
    n_ok = rn < N
    num_k = gl.cdiv(K, BLOCK_K)
    # tile j is cp.async group j: the first STAGES go out before the wait
    for s in gl.static_range(STAGES):
        async_copy.async_copy_global_to_shared(
            ring.index(s), w_ptrs + s * BLOCK_K,
            mask=n_ok[:, None] & (s * BLOCK_K + rk < K)[None, :])
        async_copy.commit_group()
    if PDL:
        if EARLY:     # the next kernel may start (and fill its own ring) right away
            _gdc_launch()
        _gdc_wait()
    # x tiles through their own ring, like the weight's: the first STAGES as one group
    # after the wait, then one per iteration together with the weight tile refilled
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 16, BLOCK_K], smem)
    xm = gl.arange(0, 16, layout=gl.SliceLayout(1, x_load))
    xk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_load))
    x_ptrs = X + xm[:, None] * stride_xm + xk[None, :]
    x_rows = (xm < M)[:, None]
    for s in gl.static_range(STAGES):
        async_copy.async_copy_global_to_shared(
            x_ring.index(s), x_ptrs + s * BLOCK_K,
            mask=x_rows & (s * BLOCK_K + xk < K)[None, :])
    async_copy.commit_group()
    acc = gl.zeros([16, BLOCK_N], gl.float32, mma)
    for i in range(num_k):
        # groups: weight tiles 0..STAGES-1, the x tiles 0..STAGES-1, then (w, x) of tile
        # i - 1 + STAGES at iteration i >= 1; at i == 0 everything issued so far is waited
        # for, after that tile i's group is at most STAGES - 2 groups back
        if i == 0:
            async_copy.wait_group(0)
        else:
            async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()      # copies visible; slot (i - 1) % STAGES read by everyone
        refill = i - 1 + STAGES
        if i > 0:      # (a masked-off cp.async would write zeros over the slot's tile)
            slot = (i + STAGES - 1) % STAGES
            async_copy.async_copy_global_to_shared(
                ring.index(slot), w_ptrs + refill * BLOCK_K,
                mask=n_ok[:, None] & (refill * BLOCK_K + rk < K)[None, :])
            async_copy.async_copy_global_to_shared(
                x_ring.index(slot), x_ptrs + refill * BLOCK_K,
                mask=x_rows & (refill * BLOCK_K + xk < K)[None, :])
        async_copy.commit_group()
        w = ring.index(i % STAGES).permute([1, 0]).load(b_op)             # [BLOCK_K, BLOCK_N]
        x = x_ring.index(i % STAGES).load(a_op)                           # [16, BLOCK_K]
        acc = mma_v2(x, w, acc)
    async_copy.wait_group(0)
    if PDL and not EARLY:
        _gdc_launch()
    ym = gl.arange(0, 16, layout=gl.SliceLayout(1, mma))
    yn = pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    gl.store(Y + ym[:, None] * stride_ym + yn[None, :], acc.to(gl.bfloat16),
             mask=(ym < M)[:, None] & (yn < N)[None, :])


def ring_gemv(x: torch.Tensor, w: torch.Tensor, stages: int, block_n: int = 32,
              block_k: int = 256, early: bool = False) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = torch.cuda.get_device_capability(x.device)[0] >= 9
    _ring_gemv_kernel[(-(-n // block_n),)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, PDL=pdl, EARLY=early, num_warps=4,
        **({"launch_pdl": True} if pdl else {}))
    return y


def compile_only(stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    fn = _ring_gemv_kernel
    cons = {"BLOCK_N": 32, "BLOCK_K": 256, "STAGES": stages, "PDL": True, "EARLY": False}
    sig = {n: "constexpr" if n in cons else ("*bf16" if n in ("X", "W", "Y") else "i32")
           for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] != "constexpr"}
    kern = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=cons, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = kern.asm["ptx"]
    before = ptx.split("griddepcontrol.wait")[0]
    print(json.dumps({"stages": stages, "shared_bytes": kern.metadata.shared,
                      "cp_async_before_wait": before.count("cp.async.cg") +
                      before.count("cp.async.ca"), "mma": ptx.count("mma.sync")}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--stages", default="4,6")
    p.add_argument("--compile-only", action="store_true")
    args = p.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    if args.compile_only:
        for s in stages:
            compile_only(s)
        return
    from onespec.layers.triton_linear import small_linear
    dev = torch.device("cuda")
    torch.manual_seed(0)
    shapes = [(4096, 4096), (28672, 4096), (4096, 14336), (6144, 4096)]  # o, gate_up, down, qkv
    ws = [[torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for n, k in shapes]
          for _ in range(args.layers)]
    x0 = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    # correctness of the ring GEMV against small_linear (same row, bf16)
    for s in stages:
        for w in ws[0]:
            xx = torch.randn(3, w.shape[1], device=dev, dtype=torch.bfloat16)
            ref = small_linear(xx, w)
            got = ring_gemv(xx, w, s)
            err = (got.float() - ref.float()).abs().max().item()
            assert err < 2e-2 * max(1.0, ref.float().abs().max().item()), (s, w.shape, err)
    copy = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(copy)
    for _ in range(3):
        dst.copy_(copy)
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(10):
        dst.copy_(copy)
    t1.record()
    torch.cuda.synchronize()
    bw = 2 * copy.numel() * 10 / (t0.elapsed_time(t1) * 1e-3)
    floor_us = sum(n * k * 2 for n, k in shapes) / bw * 1e6

    flat = [w for lw in ws for w in lw]

    def chain(gemv):
        def run():
            h = x0
            for i, w in enumerate(flat):      # each output sliced to the next weight's K
                h = gemv(h, w)[:, :flat[(i + 1) % len(flat)].shape[1]]
            return h
        return run

    variants = [("triton small_linear", lambda h, w: small_linear(h, w))]
    variants += [(f"ring {s} stages{' early release' if e else ''}",
                  lambda h, w, s=s, e=e: ring_gemv(h, w, s, early=e))
                 for s in stages for e in (False, True)]
    for name, gemv in variants * 2:
        run = chain(gemv)
        for _ in range(2):
            run()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        t0.record()
        for _ in range(50):
            g.replay()
        t1.record()
        torch.cuda.synchronize()
        us = t0.elapsed_time(t1) * 1e3 / 50 / args.layers
        print(json.dumps({"variant": name, "us_per_layer": round(us, 2),
                          "floor_us": round(floor_us, 2), "copy_GBps": round(bw / 1e9)}),
              flush=True)


if __name__ == "__main__":
    main()
