"""GPU time of one plain decode step of the Llama-3.1-8B shape, by kernel kind.

    python scripts/profile_8b_step.py

Runs eager steps at batch 1 under torch.profiler and sums CUDA kernel time into GEMM/GEMV,
attention, and everything else (norms, rotary, casts, cache writes, ...), next to the graph
step time, to show where the distance to the bandwidth floor comes from.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from onespec import LLM, SamplingParams
from onespec.bench_cli import write_model_dirs


def kind(name: str) -> str:
    n = name.lower()
    if "gemm" in n or "gemv" in n or "cutlass" in n or "sm90" in n or "nvjet" in n \
            or "small_linear" in n:
        return "matmul"
    if "rope_cache" in n:
        return "rope+kv-write"
    if "paged_attention" in n:
        return "attention"
    return "other"


def mean_ms(fn, sync, n: int = 50) -> float:
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return 1000 * (time.perf_counter() - t) / n


def main():
    shape = sys.argv[1] if len(sys.argv) > 1 else "llama3-8b"
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    root = tempfile.mkdtemp()
    target, _ = write_model_dirs(shape, root)
    for graphs in (True, False):
        llm = LLM(target, load_format="dummy", dtype="bfloat16", device=device,
                  max_batch_size=1, max_model_len=1024, cuda_graphs=graphs)
        eng = llm.engine
        req = eng.add_request(list(range(1, 129)), SamplingParams(max_tokens=200,
                                                                 ignore_eos=True))
        for _ in range(10):
            eng.step()
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        step_ms = mean_ms(eng.step, sync)
        if graphs:
            # the captured step replayed back to back: GPU time without the host's share
            key, = eng.runner.graphs.graphs
            replay_ms = mean_ms(eng.runner.graphs.standalone(key).replay, sync)
            print(json.dumps({"mode": "cuda-graph", "step_ms": round(step_ms, 3),
                              "replay_only_ms": round(replay_ms, 3),
                              "host_ms": round(step_ms - replay_ms, 3)}), flush=True)
            eng.abort(req.request_id)
            del llm, eng
            if device == "cuda":
                torch.cuda.empty_cache()
            continue
        acts = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
        with profile(activities=acts) as prof:
            for _ in range(10):
                eng.step()
            sync()
        per_kind, count = defaultdict(float), defaultdict(int)
        for ev in prof.key_averages():
            if ev.device_type.name != "CUDA":
                continue
            per_kind[kind(ev.key)] += ev.device_time_total / 10         # us per step
            count[kind(ev.key)] += ev.count / 10
        print(json.dumps({"mode": "eager", "step_ms": round(step_ms, 3),
                          "gpu_ms_per_step": {k: round(v / 1000, 3) for k, v in per_kind.items()},
                          "kernels_per_step": {k: round(v) for k, v in count.items()}}),
              flush=True)


if __name__ == "__main__":
    main()
