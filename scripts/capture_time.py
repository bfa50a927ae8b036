"""How long CUDA-graph capture of every batch-size bucket takes (issue 5: under 60 s).

    python scripts/capture_time.py [--max-batch 64] [--k 3] [--shape llama3-8b]
        [--threads N] [--cold]

Builds the benchmark's engine (random weights, with the EAGLE-3 head when --k > 0), whose
construction captures every bucket up to --max-batch for draft length k, compiling the
Triton kernels on the way, and times that capture call. --threads: how many threads warm
the buckets up before capture (cuda_graph.COMPILE_THREADS; 1: one by one in the capture
loop); --cold: Triton's cache in a new empty directory, as on a fresh machine. Prints one
JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from types import SimpleNamespace

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--threads", type=int, default=0, help="0: the default (CPU count)")
    p.add_argument("--cold", action="store_true")
    args = p.parse_args()
    if args.cold:       # before Triton is imported
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_cache_")
    from onespec.bench.decode import build_llm
    from onespec.bench.models import write_model_dirs
    from onespec.engine import cuda_graph
    from onespec.engine.cuda_graph import CudaGraphRunner
    if args.threads:
        cuda_graph.COMPILE_THREADS = args.threads
    ns = SimpleNamespace(prompt_len=128, batch_sizes=[args.max_batch], dtype="bfloat16",
                         device="cuda", seed=0)
    spent: list[float] = []
    capture = CudaGraphRunner.capture

    def timed(self, *a, **kw):
        t = time.perf_counter()
        capture(self, *a, **kw)
        torch.cuda.synchronize()
        spent.append(time.perf_counter() - t)
    CudaGraphRunner.capture = timed
    with tempfile.TemporaryDirectory() as root:
        target, head = write_model_dirs(args.shape, root)
        t0 = time.perf_counter()
        llm = build_llm(target, head if args.k else None, args.k, ns, 512)
        print(json.dumps({"shape": args.shape, "k": args.k, "cold": args.cold,
                          "threads": cuda_graph.COMPILE_THREADS,
                          "buckets": llm.engine.runner.graphs.buckets,
                          "capture_s": round(spent[0], 1),
                          "engine_build_s": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
