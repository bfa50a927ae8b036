"""Decode attention of the 8B shape with and without the split over keys, by context.

    python scripts/bench_attention.py [--contexts 256,1024,4096,16384]
    python scripts/bench_attention.py --verify 32:6,64:6,8:6 --contexts 340

One decode row (32 q heads, 8 kv heads, D = 128, bf16) over a paged context: each figure is
one call's time in a CUDA graph of 32 calls on 32 layers' caches, with the default tiling
for a single program per (row, kv head) (splits 1, what launches of more than 16 rows use)
and for the split launch that decode uses. One JSON line per (context, splits), with the
KV bytes read per GB/s.

--verify BATCH:ROWS,...: instead, verify launches of BATCH requests of ROWS rows each
(K + 1) after `context` positions, with a request's rows packed into tiles of at most 16
and of at most PACK_TILE_ROWS (row, query head) rows; `equal` says whether the two
give the same bits. With --split-programs N,...: instead, the default packing with each
split budget (0: launches of more than 16 rows never split; "default": two programs an
SM), e.g. `--verify 8:4 --contexts 4096,16384 --split-programs 0,default`.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graph_us  # noqa: E402

from onespec.kernels import attention as ta  # noqa: E402
from onespec.kernels.launch import pdl_supported  # noqa: E402


def graph_time_us(fn, calls: int, reps: int = 20) -> float:
    """One call's microseconds in a CUDA graph of fn's `calls` calls (one timed round)."""
    return graph_us(fn, per=calls, reps=reps, trials=1)


def attention_call(context: int, splits: int, layers: int = 32):
    """One decode row's attention after `context` positions on `layers` layers' caches."""
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

    def run():
        return [ta.paged_attention(q, kc, vc, table, req, pos, d ** -0.5, bs, splits=splits,
                                   pdl=pdl_supported(q.device))
                for kc, vc in caches]
    kv_bytes = 2 * context * kv_heads * d * 2
    return run, kv_bytes, layers


def verify_call(batch: int, rows: int, context: int, layers: int = 32):
    """Attention of a verify step: `batch` requests of `rows` rows at positions context..,
    on `layers` layers' caches (8B shape, bf16, 16-slot blocks); run(pack_tile_rows)."""
    bs, heads, kv_heads, d = 16, 32, 8, 128
    per = -(-(context + rows) // bs)
    dt = torch.bfloat16
    caches = [(torch.randn(batch * per * bs, kv_heads, d, device="cuda", dtype=dt),
               torch.randn(batch * per * bs, kv_heads, d, device="cuda", dtype=dt))
              for _ in range(layers)]
    tables = torch.randperm(batch * per, device="cuda").view(batch, per)
    q = torch.randn(batch * rows, heads, d, device="cuda", dtype=dt)
    req = torch.arange(batch, device="cuda").repeat_interleave(rows)
    pos = (context + torch.arange(rows, device="cuda")).repeat(batch)

    def run(pack_tile_rows: int = ta.PACK_TILE_ROWS, split_programs: int | None = None):
        return [ta.paged_attention(q, kc, vc, tables, req, pos, d ** -0.5, bs,
                                   rows_per_request=rows, pack_tile_rows=pack_tile_rows,
                                   split_programs=split_programs,
                                   pdl=pdl_supported(q.device))
                for kc, vc in caches]
    kv_bytes = batch * 2 * (context + rows) * kv_heads * d * 2
    return run, kv_bytes, layers


def verify_rows(spec: str, context: int):
    default = ta.PACK_TILE_ROWS
    batch, rows = (int(x) for x in spec.split(":"))
    run, kv_bytes, layers = verify_call(batch, rows, context)
    outs = {}
    for tile in sorted({16, default}):
        outs[tile] = run(tile)[0]
        us = graph_time_us(functools.partial(run, tile), layers)
        print(json.dumps({"batch": batch, "rows": rows, "context": context,
                          "pack_tile_rows": tile, "us": round(us, 2),
                          "kv_gbs": round(kv_bytes / us / 1e3, 1)}), flush=True)
    print(json.dumps({"batch": batch, "rows": rows, "context": context,
                      "equal": torch.equal(outs[16], outs[default]),
                      "max_abs_diff": (outs[16].float() - outs[default].float()).abs().max()
                      .item()}), flush=True)


def verify_splits(spec: str, context: int, budgets: list[int | None]):
    """Verify attention with each split budget (None: the default), and the largest
    difference from the first budget's result."""
    batch, rows = (int(x) for x in spec.split(":"))
    run, kv_bytes, layers = verify_call(batch, rows, context)
    first = None
    for budget in budgets:
        out = run(split_programs=budget)[0].float()
        first = out if first is None else first
        us = graph_time_us(functools.partial(run, split_programs=budget), layers)
        print(json.dumps({"batch": batch, "rows": rows, "context": context,
                          "split_programs": "default" if budget is None else budget,
                          "us": round(us, 2), "kv_gbs": round(kv_bytes / us / 1e3, 1),
                          "max_abs_diff": (out - first).abs().max().item()}), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", default="256,1024,4096,16384")
    p.add_argument("--splits", default=f"1,{ta.SPLITS}")
    p.add_argument("--verify", default=None, help="BATCH:ROWS,... (see the docstring)")
    p.add_argument("--split-programs", default=None,
                   help="with --verify: split budgets to compare, e.g. 0,default")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs CUDA")
    if args.verify:
        for context in (int(c) for c in args.contexts.split(",")):
            for spec in args.verify.split(","):
                if args.split_programs:
                    verify_splits(spec, context, [None if b == "default" else int(b)
                                                  for b in args.split_programs.split(",")])
                else:
                    verify_rows(spec, context)
        return
    for context in (int(c) for c in args.contexts.split(",")):
        for splits in (int(s) for s in args.splits.split(",")):
            run, kv_bytes, layers = attention_call(context, splits)
            us = graph_time_us(run, layers)
            print(json.dumps({"context": context, "splits": splits, "us": round(us, 2),
                              "kv_gbs": round(kv_bytes / us / 1e3, 1)}), flush=True)


if __name__ == "__main__":
    main()
