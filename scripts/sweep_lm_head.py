"""Tilings of the greedy lm_head (small_linear with argmax) on the 8B shape's vocabulary.

    python scripts/sweep_lm_head.py [--rows 1] [--out sweep.jsonl]

A 128256 x 4096 bf16 weight, one decode row; each figure is one call (the GEMV with its
argmax epilogue, and the argmax reduction) in a CUDA graph of 8 calls, best of three timed
rounds of 20 replays (the weight is 20 times L2, so nothing is served from it). One JSON
line per tiling (BLOCK_N, BLOCK_K, warps, stages; null = the default), with GB/s of weight
streamed and whether its token equals the default tiling's.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from timing import graph_us

TILINGS = [None, (32, 256, 4, 5), (64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 5),
           (64, 256, 4, 3), (32, 256, 4, 3), (32, 256, 4, 4), (64, 128, 8, 4), (128, 128, 8, 3),
           (32, 512, 4, 3), (16, 512, 4, 4), (128, 64, 4, 4), (64, 64, 4, 6)]


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sweep_lm_head.py needs CUDA")
    from onespec.layers.triton_linear import small_linear
    out = open(args.out, "w") if args.out else sys.stdout
    torch.manual_seed(0)
    w = torch.randn(128256, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(args.rows, 4096, device="cuda", dtype=torch.bfloat16)
    ref = small_linear(x, w, argmax=True)
    for cfg in TILINGS:
        try:
            got = small_linear(x, w, argmax=True, config=cfg)
            us = graph_us(lambda: [small_linear(x, w, argmax=True, config=cfg) for _ in range(8)],
                          per=8, warmup=1)
        except Exception as e:      # e.g. out of shared memory
            out.write(json.dumps({"cfg": cfg, "error": str(e)[:150]}) + "\n")
            continue
        out.write(json.dumps({"cfg": cfg, "us": round(us, 1),
                              "gbps": round(w.numel() * 2 / us / 1e3, 1),
                              "same_token": bool((got == ref).all())}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
