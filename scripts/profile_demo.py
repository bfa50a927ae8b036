"""Where a demo step's time goes: plain vs speculative decode on the bundled pair.

    python scripts/profile_demo.py [--device cpu|cuda] [--dtype float32|bfloat16] [--k 4]

Per engine: prefill time, decode ms/step, tokens/s, CUDA-graph replays; then, in an eager
engine, the split of a speculative step into target forward, acceptance and draft loop.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from onespec import LLM, Eagle3Config, SamplingParams
from onespec.demo import HEAD_DIR, PROMPTS, TARGET_DIR


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_timing(llm, max_tokens: int) -> dict:
    eng = llm.engine
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8))            # warm-up
    prefill = decode = 0.0
    steps = tokens = 0
    for p in PROMPTS:
        req = eng.add_request(p, SamplingParams(max_tokens=max_tokens))
        sync(eng.device)
        t0 = time.perf_counter()
        eng.step()
        sync(eng.device)
        t1 = time.perf_counter()
        while not req.is_finished:
            eng.step()
            steps += 1
        sync(eng.device)
        prefill += t1 - t0
        decode += time.perf_counter() - t1
        tokens += len(req.output_token_ids)
    graphs = eng.runner.graphs
    return {"prefill_ms": round(1000 * prefill / len(PROMPTS), 3),
            "decode_ms_per_step": round(1000 * decode / steps, 3),
            "tok_s": round(tokens / (prefill + decode), 1),
            "tokens_per_step": round((tokens - len(PROMPTS)) / steps, 3),
            "graph_replays": graphs.num_replays if graphs else None}


def step_breakdown(llm, max_tokens: int) -> dict:
    """Times the parts of each eager speculative step (synchronising around each part)."""
    eng = llm.engine
    worker = eng.runner.worker
    spent = defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **kw):
            sync(eng.device)
            t = time.perf_counter()
            out = fn(*a, **kw)
            sync(eng.device)
            spent[name] += time.perf_counter() - t
            return out
        return wrapper

    worker.target.forward = timed("target_forward", worker.target.forward)
    worker.acceptor.accept = timed("accept", worker.acceptor.accept)
    worker._propose = timed("draft_loop", worker._propose)
    eng.runner.prepare = timed("prepare_inputs", eng.runner.prepare)
    eng.step = timed("engine_step", eng.step)
    llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens))
    total = spent.pop("engine_step")
    parts = {k: round(1000 * v, 1) for k, v in spent.items()}
    parts["other_host_ms"] = round(1000 * (total - sum(spent.values())), 1)
    parts["engine_total_ms"] = round(1000 * total, 1)
    return parts


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    kw = dict(device=args.device, dtype=args.dtype, max_batch_size=4)
    spec = Eagle3Config(HEAD_DIR, max_draft_len=args.k)
    for name, sc in (("plain", None), (f"eagle3-k{args.k}", spec)):
        llm = LLM(TARGET_DIR, speculative_config=sc, **kw)
        print(json.dumps({"engine": name, "device": str(llm.engine.device),
                          "dtype": str(llm.engine.dtype), **decode_timing(llm, args.max_tokens)}),
              flush=True)
    eager = LLM(TARGET_DIR, speculative_config=spec, cuda_graphs=False, **kw)
    print(json.dumps({"engine": f"eagle3-k{args.k}-eager-breakdown",
                      **step_breakdown(eager, args.max_tokens)}), flush=True)


if __name__ == "__main__":
    main()
