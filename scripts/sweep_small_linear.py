"""Tilings of the Triton decode kernels on the Llama-3.1-8B shapes, against cuBLAS.

    python scripts/sweep_small_linear.py [--rows 1,4,16] [--pdl both] [--out sweep.jsonl]

Linear layers: each measurement is a CUDA graph of one call per copy of the weight (32
copies, as in 32 layers, so nothing is served from L2); one JSON line per (shape, rows,
kernel) gives microseconds per call and GB/s of weights streamed, next to the
device-to-device copy bandwidth (bytes read + written) that bench/decode.py's floor uses.
Attention: one decode row of the 8B shape (32 q heads, 8 kv heads, D=128) over a paged
context, 32 layers' caches per graph. Kernels are compiled first in parallel processes.
"""
from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F

from timing import graph_us

# name -> (N outputs, K inputs, fused work, copies)
SHAPES = {
    "qkv": (6144, 4096, "norm", 32),
    "o_proj": (4096, 4096, "residual", 32),
    "gate_up": (14336, 4096, "norm-gated", 32),
    "down": (4096, 14336, "residual", 32),
    "lm_head": (128256, 4096, "fp32-out", 4),
}
LINEAR_GRID = list(itertools.product((32, 64), (256,), (4,), (4, 5)))
GATED_GRID = list(itertools.product((16, 32, 64), (128, 256), (4,), (3, 4)))
ATTN_GRID = list(itertools.product((64, 128, 256), (4, 8), (2, 3)))
ATTN_CONTEXTS = (256, 1024)


def linear_call(name: str, rows: int, copies: int | None = None):
    """(fn(config) running the kernel over every weight copy, bytes per call, copies)."""
    from onespec.layers.triton_linear import small_linear
    n, k, kind, default_copies = SHAPES[name]
    copies = copies or default_copies
    gated = "gated" in kind
    dt = torch.bfloat16
    weights = [torch.randn(2 * n if gated else n, k, device="cuda", dtype=dt) * 0.02
               for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=dt)
    kw = dict(norm_weight=torch.ones(k, device="cuda", dtype=dt) if "norm" in kind else None,
              gated=gated,
              residual=torch.randn(rows, n, device="cuda", dtype=dt)
              if kind == "residual" else None,
              out_dtype=torch.float32 if kind == "fp32-out" else None)

    def run(config):
        if config == "cublas":
            return [F.linear(x, w) for w in weights]
        return [small_linear(x, w, config=config, **kw) for w in weights]
    return run, weights[0].numel() * weights[0].element_size(), copies


def attention_call(context: int, layers: int = 32):
    from onespec.layers.triton_attention import triton_paged_attention
    bs, heads, kv_heads, d = 16, 32, 8, 128
    blocks = -(-context // bs) + 1
    dt = torch.bfloat16
    caches = [(torch.randn(blocks * bs, kv_heads, d, device="cuda", dtype=dt),
               torch.randn(blocks * bs, kv_heads, d, device="cuda", dtype=dt))
              for _ in range(layers)]
    q = torch.randn(1, heads, d, device="cuda", dtype=dt)
    table = torch.randperm(blocks, device="cuda")[None, :]
    req = torch.zeros(1, dtype=torch.int64, device="cuda")
    pos = torch.tensor([context - 1], device="cuda")

    def run(config):
        return [triton_paged_attention(q, kc, vc, table, req, pos, d ** -0.5, bs,
                                       config=config) for kc, vc in caches]
    kv_bytes = 2 * context * kv_heads * d * 2
    return run, kv_bytes, layers


def _compile(job):
    """Runs one (what, config) once in a worker process, which fills Triton's disk cache."""
    what, arg, rows, config = job
    try:
        run = (linear_call(arg, rows, copies=1) if what == "linear" else
               attention_call(arg, layers=1))[0]
        run(config)
        torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{what} {arg} {config}: {e}"[:300]


def graph_time_us(fn, calls: int, reps: int = 20) -> float:
    """One call's microseconds in a CUDA graph of fn's `calls` calls (one timed round)."""
    return graph_us(fn, per=calls, reps=reps, trials=1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--attention", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--grid", action=argparse.BooleanOptionalAction, default=True,
                   help="--no-grid: only cuBLAS and the default tiling")
    p.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = open(args.out, "a") if args.out else None
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = args.shapes.split(",")

    def emit(row):
        line = json.dumps(row)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    def linear_grid(shape):
        return [] if not args.grid else GATED_GRID if "gated" in SHAPES[shape][2] \
            else LINEAR_GRID
    attn_grid = ATTN_GRID if args.grid else []
    jobs = [("linear", s, 1, c) for s in shapes for c in linear_grid(s)]
    if args.attention:
        jobs += [("attention", 256, 1, c) for c in attn_grid]
    with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
        for err in pool.map(_compile, jobs):
            if err:
                print("compile:", err, file=sys.stderr)
    print("compiled", len(jobs), "kernels", file=sys.stderr)

    from onespec.bench_cli import copy_bandwidth
    bw = copy_bandwidth("cuda")
    emit({"copy_bandwidth_gbs": round(bw / 1e9, 1), "device": torch.cuda.get_device_name(),
          "pdl": os.environ.get("ONESPEC_PDL", "1") != "0"})

    def sweep(label: dict, run, nbytes: int, calls: int, grid, baseline=None):
        best = None
        for config in ([baseline] if baseline else []) + [None] + list(grid):
            try:
                us = graph_time_us(lambda: run(config), calls)
            except Exception as e:                    # a tiling that does not compile
                emit({**label, "config": config, "error": str(e)[:200]})
                continue
            emit({**label, "config": config or "default", "us": round(us, 2),
                  "gbs": round(nbytes / us / 1e3, 1),
                  "of_copy_bw": round(nbytes / us / 1e-6 / bw, 3)})
            if config not in (None, baseline) and (best is None or us < best[0]):
                best = (us, config)
        if best:
            emit({**label, "best": best[1], "us": round(best[0], 2),
                  "of_copy_bw": round(nbytes / best[0] / 1e-6 / bw, 3)})
            print(f"{label}: best {best}", file=sys.stderr)
        return best

    for name in shapes:
        for rows in rows_list:
            run, nbytes, calls = linear_call(name, rows)
            sweep({"shape": name, "rows": rows}, run, nbytes, calls,
                  linear_grid(name) if rows == rows_list[0] else [], baseline="cublas")
            del run
            torch.cuda.empty_cache()
    if args.attention:
        for ctx in ATTN_CONTEXTS:
            run, nbytes, calls = attention_call(ctx)
            sweep({"attention_context": ctx}, run, nbytes, calls, attn_grid)


if __name__ == "__main__":
    main()
