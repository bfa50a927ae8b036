"""Decode attention of the 8B shape with and without the split over keys, by context.

    python scripts/bench_attention.py [--contexts 256,1024,4096,16384]
    python scripts/bench_attention.py --verify 32:6,64:6,8:6 --contexts 340

One decode row (32 q heads, 8 kv heads, D = 128, bf16) over a paged context: each figure is
one call's time in a CUDA graph of 32 calls on 32 layers' caches (scripts/sweep_small_linear
.py's attention_call), with the default tiling for a single program per (row, kv head)
(splits 1, what launches of more than 16 rows use) and for the split launch that decode
uses. One JSON line per (context, splits), with the KV bytes read per GB/s.

--verify BATCH:ROWS,...: instead, verify launches of BATCH requests of ROWS rows each
(K + 1) after `context` positions, with a request's rows packed into tiles of at most 16
and of at most ta.PACK_TILE_ROWS (row, query head) rows; `equal` says whether the two
give the same bits.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweep_small_linear import attention_call, graph_time_us  # noqa: E402

from onespec.layers import triton_attention as ta  # noqa: E402


def verify_call(batch: int, rows: int, context: int, layers: int = 32):
    """Attention of a verify step: `batch` requests of `rows` rows at positions context..,
    on `layers` layers' caches (8B shape, bf16, 16-slot blocks)."""
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

    def run():
        return [ta.triton_paged_attention(q, kc, vc, tables, req, pos, d ** -0.5, bs,
                                          rows_per_request=rows) for kc, vc in caches]
    kv_bytes = batch * 2 * (context + rows) * kv_heads * d * 2
    return run, kv_bytes, layers


def verify_rows(spec: str, context: int):
    default = ta.PACK_TILE_ROWS
    batch, rows = (int(x) for x in spec.split(":"))
    run, kv_bytes, layers = verify_call(batch, rows, context)
    outs = {}
    for tile in sorted({16, default}):
        ta.PACK_TILE_ROWS = tile
        outs[tile] = run()[0]
        us = graph_time_us(run, layers)
        print(json.dumps({"batch": batch, "rows": rows, "context": context,
                          "pack_tile_rows": tile, "us": round(us, 2),
                          "kv_gbs": round(kv_bytes / us / 1e3, 1)}), flush=True)
    ta.PACK_TILE_ROWS = default
    print(json.dumps({"batch": batch, "rows": rows, "context": context,
                      "equal": torch.equal(outs[16], outs[default]),
                      "max_abs_diff": (outs[16].float() - outs[default].float()).abs().max()
                      .item()}), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", default="256,1024,4096,16384")
    p.add_argument("--splits", default=f"1,{ta.SPLITS}")
    p.add_argument("--verify", default=None, help="BATCH:ROWS,... (see the docstring)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs CUDA")
    if args.verify:
        for context in (int(c) for c in args.contexts.split(",")):
            for spec in args.verify.split(","):
                verify_rows(spec, context)
        return
    default = ta.SPLITS
    for context in (int(c) for c in args.contexts.split(",")):
        run, kv_bytes, layers = attention_call(context)
        for splits in (int(s) for s in args.splits.split(",")):
            ta.SPLITS = splits
            us = graph_time_us(functools.partial(run, None), layers)
            print(json.dumps({"context": context, "splits": splits, "us": round(us, 2),
                              "kv_gbs": round(kv_bytes / us / 1e3, 1)}), flush=True)
        ta.SPLITS = default


if __name__ == "__main__":
    main()
