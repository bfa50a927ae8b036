"""Decode attention of the 8B shape with and without the split over keys, by context.

    python scripts/bench_attention.py [--contexts 256,1024,4096,16384]
    python scripts/bench_attention.py --verify 32:6,64:6,8:6 --contexts 340

One decode row (32 q heads, 8 kv heads, D = 128, bf16) over a paged context: each figure is
one call's time in a CUDA graph of 32 calls on 32 layers' caches, with the default tiling
for a single program per (row, kv head) (splits 1, what launches of more than 16 rows use)
and for the split launch that decode uses. One JSON line per (context, splits), with the
KV bytes read per GB/s. --batch B: a decode step of B requests (B <= 16) instead of one,
each at `context`; --configs BLOCK_N:WARPS:STAGES,...: time each tiling too ("default":
the kernel's own), e.g. `--contexts 65536 --splits 16,32 --configs default,128:4:2`.
Splits are taken as given, not fitted to the GPU.

--verify BATCH:ROWS,...: instead, verify launches of BATCH requests of ROWS rows each
(K + 1) after `context` positions, with a request's rows packed into tiles of at most 16
and of at most PACK_TILE_ROWS (row, query head) rows; `equal` says whether the two
give the same bits. With --split-programs N,...: instead, the default packing with each
split budget (0: launches of more than 16 rows never split; "default": two programs an
SM), e.g. `--verify 8:4 --contexts 4096,16384 --split-programs 0,default`.

--prefill CHUNK: instead, one request's prefill chunk of CHUNK rows ending at `context`
positions (a 16k prompt's last 2,048-row chunk: `--prefill 2048 --contexts 16384`), its
rows in packs (the engine's launch); with --configs and --tile-rows 64,128 (tile rows a
pack, PREFILL_TILE_ROWS) each combination is timed, with its attention TFLOP/s and its
largest difference from the first.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graph_us  # noqa: E402

from onespec.kernels import attention as ta  # noqa: E402
from onespec.kernels.launch import pdl_supported  # noqa: E402


def graph_time_us(fn, calls: int, reps: int = 20) -> float:
    """One call's microseconds in a CUDA graph of fn's `calls` calls (one timed round)."""
    return graph_us(fn, per=calls, reps=reps, trials=1)


BS, HEADS, KV_HEADS, D = 16, 32, 8, 128      # the 8B shape, 16-slot blocks


def paged_caches(batch: int, per: int, layers: int):
    """`layers` layers' bf16 key and value caches of `batch` requests with `per` blocks
    each, and their block tables (blocks shuffled through the pool)."""
    caches = [tuple(torch.randn(batch * per * BS, KV_HEADS, D, device="cuda",
                                dtype=torch.bfloat16) for _ in range(2))
              for _ in range(layers)]
    return caches, torch.randperm(batch * per, device="cuda").view(batch, per)


def attention_call(context: int, batch: int = 1, layers: int = 32):
    """A decode step of `batch` requests, each after `context` positions, on `layers`
    layers' caches: run(splits, config)."""
    caches, tables = paged_caches(batch, -(-context // BS) + 1, layers)
    q = torch.randn(batch, HEADS, D, device="cuda", dtype=torch.bfloat16)
    req = torch.arange(batch, device="cuda")
    pos = torch.full((batch,), context - 1, device="cuda")

    def run(splits: int, config: tuple[int, int, int] | None = None):
        # a split budget of one program per split: the splits as given
        return [ta.paged_attention(q, kc, vc, tables, req, pos, D ** -0.5, BS, splits=splits,
                                   config=config, split_programs=splits * batch * KV_HEADS,
                                   rows_per_request=1, pdl=pdl_supported(q.device))
                for kc, vc in caches]
    kv_bytes = batch * 2 * context * KV_HEADS * D * 2
    return run, kv_bytes, layers


def verify_call(batch: int, rows: int, context: int, layers: int = 32):
    """Attention of a verify step: `batch` requests of `rows` rows at positions context..,
    on `layers` layers' caches (8B shape, bf16, 16-slot blocks); run(pack_tile_rows)."""
    caches, tables = paged_caches(batch, -(-(context + rows) // BS), layers)
    q = torch.randn(batch * rows, HEADS, D, device="cuda", dtype=torch.bfloat16)
    req = torch.arange(batch, device="cuda").repeat_interleave(rows)
    pos = (context + torch.arange(rows, device="cuda")).repeat(batch)

    def run(pack_tile_rows: int = ta.PACK_TILE_ROWS, split_programs: int | None = None):
        return [ta.paged_attention(q, kc, vc, tables, req, pos, D ** -0.5, BS,
                                   rows_per_request=rows, pack_tile_rows=pack_tile_rows,
                                   split_programs=split_programs,
                                   pdl=pdl_supported(q.device))
                for kc, vc in caches]
    kv_bytes = batch * 2 * (context + rows) * KV_HEADS * D * 2
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


def prefill_call(chunk: int, context: int, layers: int = 32):
    """Attention of one request's prefill chunk of `chunk` rows at positions context -
    chunk .. context - 1, on `layers` layers' caches: run(config, tile_rows), and the
    chunk's attention FLOPs (QK and PV over each row's visible keys)."""
    caches, tables = paged_caches(1, -(-context // BS), layers)
    q = torch.randn(chunk, HEADS, D, device="cuda", dtype=torch.bfloat16)
    req = torch.zeros(chunk, dtype=torch.int64, device="cuda")
    pos = torch.arange(context - chunk, context, device="cuda")

    @functools.cache
    def packs(rows: int):     # built on the eager first call, reused by the graph's calls
        return ta.row_packs([chunk], rows, q.device)

    def run(config, tile_rows: int):
        ta.PREFILL_TILE_ROWS = tile_rows      # read by prefill_pack_rows at each launch
        return [ta.paged_attention(q, kc, vc, tables, req, pos, D ** -0.5, BS, config=config,
                                   packs=packs, pdl=pdl_supported(q.device))
                for kc, vc in caches]
    flops = 4 * HEADS * D * sum(range(context - chunk + 1, context + 1))
    return run, flops, layers


def prefill_tilings(chunk: int, context: int, configs, tile_rows: list[int]):
    run, flops, layers = prefill_call(chunk, context)
    default_tile, first = ta.PREFILL_TILE_ROWS, None
    for tile in tile_rows:
        for config in configs:
            name = "default" if config is None else ":".join(map(str, config))
            row = {"prefill_rows": chunk, "context": context, "tile_rows": tile,
                   "config": name}
            try:
                out = run(config, tile)[0].float()
            except triton.runtime.errors.OutOfResources as e:
                print(json.dumps({**row, "error": str(e)}), flush=True)
                continue
            first = out if first is None else first
            us = graph_time_us(functools.partial(run, config, tile), layers)
            print(json.dumps({**row, "us": round(us, 2), "tflops": round(flops / us / 1e6, 1),
                              "max_abs_diff": (out - first).abs().max().item()}), flush=True)
    ta.PREFILL_TILE_ROWS = default_tile


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", default="256,1024,4096,16384")
    p.add_argument("--splits", default=f"1,{ta.SPLITS}")
    p.add_argument("--verify", default=None, help="BATCH:ROWS,... (see the docstring)")
    p.add_argument("--batch", type=int, default=1, help="decode rows (at most 16)")
    p.add_argument("--configs", default="default",
                   help="tilings BLOCK_N:WARPS:STAGES,... or default")
    p.add_argument("--split-programs", default=None,
                   help="with --verify: split budgets to compare, e.g. 0,default")
    p.add_argument("--prefill", type=int, default=None,
                   help="rows of a prefill chunk (see the docstring)")
    p.add_argument("--tile-rows", default=str(ta.PREFILL_TILE_ROWS),
                   help="with --prefill: (row, query head) tile rows a pack, e.g. 64,128")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs CUDA")
    configs = [None if c == "default" else tuple(int(x) for x in c.split(":"))
               for c in args.configs.split(",")]
    if args.prefill:
        for context in (int(c) for c in args.contexts.split(",")):
            prefill_tilings(args.prefill, context, configs,
                            [int(t) for t in args.tile_rows.split(",")])
        return
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
        run, kv_bytes, layers = attention_call(context, args.batch)
        first = None
        for splits in (int(s) for s in args.splits.split(",")):
            for config in configs:
                name = "default" if config is None else ":".join(map(str, config))
                try:
                    out = run(splits, config)[0].float()
                except triton.runtime.errors.OutOfResources as e:
                    print(json.dumps({"context": context, "batch": args.batch,
                                      "splits": splits, "config": name, "error": str(e)}),
                          flush=True)
                    continue
                first = out if first is None else first
                us = graph_time_us(functools.partial(run, splits, config), layers)
                print(json.dumps({"context": context, "batch": args.batch, "splits": splits,
                                  "config": name,
                                  "us": round(us, 2), "kv_gbs": round(kv_bytes / us / 1e3, 1),
                                  "max_abs_diff": (out - first).abs().max().item()}),
                      flush=True)
        del run
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
