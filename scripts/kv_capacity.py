"""Largest KV cache the engine allocates for a benchmark shape on this GPU, measured.

    python scripts/kv_capacity.py [--shape llama3-8b] [--fraction 0.85]

Builds the engine with random weights (load_format="dummy") and a batch/context bound far
above what fits, so the pool is sized by kv_cache_memory_fraction of the free memory, and
prints one JSON line: blocks, tokens, bytes per token, and the context each batch size gets.
"""
from __future__ import annotations

import argparse
import json
import tempfile

import torch

from onespec import LLM
from onespec.bench.models import SHAPES, kv_bytes_per_token, write_model_dirs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--fraction", type=float, default=0.85)
    args = p.parse_args()
    target, _ = write_model_dirs(args.shape, tempfile.mkdtemp())
    max_len = 32768
    llm = LLM(target, load_format="dummy", dtype="bfloat16", device="cuda",
              max_batch_size=256, max_model_len=max_len, cuda_graphs=False,
              kv_cache_memory_fraction=args.fraction)
    eng = llm.engine
    tokens = eng.pool.num_blocks * eng.config.block_size
    per_token = kv_bytes_per_token([layer.self_attn for layer in eng.model.model.layers])
    print(json.dumps({
        "shape": args.shape, "gpu": torch.cuda.get_device_name(),
        "kv_cache_memory_fraction": args.fraction, "blocks": eng.pool.num_blocks,
        "block_size": eng.config.block_size, "kv_tokens": tokens,
        "kv_bytes_per_token": per_token, "kv_gib": round(tokens * per_token / 2**30, 1),
        "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 1),
        "max_context_at_batch": {b: tokens // b for b in (1, 8, 32, 64, 128, 256)}}))


if __name__ == "__main__":
    main()
