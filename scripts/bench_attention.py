"""Decode attention of the 8B shape with and without the split over keys, by context.

    python scripts/bench_attention.py [--contexts 256,1024,4096,16384]

One decode row (32 q heads, 8 kv heads, D = 128, bf16) over a paged context: each figure is
one call's time in a CUDA graph of 32 calls on 32 layers' caches (scripts/sweep_small_linear
.py's attention_call), with the default tiling for a single program per (row, kv head)
(splits 1, what launches of more than 16 rows use) and for the split launch that decode
uses. One JSON line per (context, splits), with the KV bytes read per GB/s.
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", default="256,1024,4096,16384")
    p.add_argument("--splits", default=f"1,{ta.SPLITS}")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs CUDA")
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
