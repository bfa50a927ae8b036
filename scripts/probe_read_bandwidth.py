"""How fast can the GPU read its memory, next to the copy rate the benchmark's floor uses?

    python scripts/probe_read_bandwidth.py [--gb 2] [--out probe.jsonl]

One JSON line per kernel: GB/s of bytes read (a copy counts bytes read + written, as
bench/decode.py's floor does). The kernels:
- `read`: each program sums its own contiguous share of one large bf16 buffer, BLOCK
  elements a load, the loop's loads pipelined `stages` deep;
- `read_strided`: the same loads, but program p takes the chunks p, p + P, p + 2P, ... so
  that all programs sweep the buffer together;
- `gemv_tma`: one decode row times a weight of the lm_head's shape, weight tiles through
  TMA tensor descriptors (Hopper), tl.dot on 16 padded rows as small_linear does;
- `small_linear`: onespec's GEMV on the same weight.
Every figure is the best of a few timed repetitions of one launch over the whole buffer
(far larger than L2).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton
import triton.language as tl

from timing import best_us


@triton.jit
def _read_kernel(X, OUT, per_prog, P, BLOCK: tl.constexpr, STAGES: tl.constexpr,
                 STRIDED: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    chunks = per_prog // BLOCK
    for i in tl.range(0, chunks, num_stages=STAGES):
        if STRIDED:
            base = (i.to(tl.int64) * P + pid) * BLOCK
        else:
            base = pid.to(tl.int64) * per_prog + i * BLOCK
        acc += tl.load(X + base + offs).to(tl.float32)
    tl.store(OUT + pid, tl.sum(acc, 0))


@triton.jit
def _gemv_tma_kernel(x_ptr, w_desc, Y, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr):
    pid = tl.program_id(0)
    n0 = pid * BLOCK_N
    m = tl.arange(0, 16)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([n0, k0])
        x = tl.load(x_ptr + m[:, None] * K + k0 + k[None, :], mask=(m < 1)[:, None], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    n = n0 + tl.arange(0, BLOCK_N)
    tl.store(Y + n[None, :] + m[:, None] * 0, acc.to(Y.dtype.element_ty),
             mask=(m < 1)[:, None] & (n < N)[None, :])


def eager_us(fn) -> float:
    """One launch's microseconds, launched 5 times in a row, best of 3 rounds."""
    fn()
    torch.cuda.synchronize()
    return best_us(fn, reps=5)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=2.0)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_read_bandwidth.py needs CUDA")
    from onespec.bench_cli import copy_bandwidth
    from onespec.layers.triton_linear import small_linear
    out = open(args.out, "w") if args.out else sys.stdout
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def emit(**row):
        out.write(json.dumps(row) + "\n")
        out.flush()

    emit(kernel="copy", gbps=round(copy_bandwidth("cuda") / 1e9, 1))
    n = int(args.gb * 2 ** 30) // 2
    buf = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    res = torch.empty(1 << 16, device="cuda", dtype=torch.float32)
    for strided, programs, block, warps, stages in itertools.product(
            (False, True), (sms, 2 * sms, 4 * sms, 8 * sms), (4096, 8192), (4, 8), (2, 4)):
        per_prog = n // programs // block * block
        used = per_prog * programs
        try:
            us = eager_us(lambda: _read_kernel[(programs,)](
                buf, res, per_prog, programs, BLOCK=block, STAGES=stages, STRIDED=strided,
                num_warps=warps))
        except Exception as e:   # e.g. out of shared memory
            emit(kernel="read", error=str(e)[:200])
            continue
        emit(kernel="read_strided" if strided else "read", programs=programs, block=block,
             warps=warps, stages=stages, us=round(us, 1), gbps=round(used * 2 / us / 1e3, 1))
    buf = None    # free the 2 GiB before the lm_head weight
    w = torch.randn(128256, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, 128256, device="cuda", dtype=torch.float32)
    wbytes = w.numel() * 2
    us = eager_us(lambda: small_linear(x, w, out_dtype=torch.float32))
    emit(kernel="small_linear", shape=list(w.shape), us=round(us, 1),
         gbps=round(wbytes / us / 1e3, 1))
    from triton.tools.tensor_descriptor import TensorDescriptor
    for bn, bk, warps, stages in itertools.product((32, 64), (128, 256), (4,), (3, 5, 8)):
        desc = TensorDescriptor.from_tensor(w, [bn, bk])
        try:
            us = eager_us(lambda: _gemv_tma_kernel[(triton.cdiv(w.shape[0], bn),)](
                x, desc, y, w.shape[0], w.shape[1], BLOCK_N=bn, BLOCK_K=bk, STAGES=stages,
                num_warps=warps))
            ok = torch.allclose(y, x.float() @ w.float().T, atol=1e-2, rtol=1e-2)
        except Exception as e:
            emit(kernel="gemv_tma", bn=bn, bk=bk, stages=stages, error=str(e)[:200])
            continue
        emit(kernel="gemv_tma", bn=bn, bk=bk, warps=warps, stages=stages, us=round(us, 1),
             gbps=round(wbytes / us / 1e3, 1), matches=ok)


if __name__ == "__main__":
    main()
