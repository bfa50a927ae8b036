"""`onespec demo`: the bundled code model and its EAGLE-3 head, plain vs speculative.

Streams the speculative completions of a few built-in code prompts, then decodes the same
prompts without speculation and prints acceptance length, tokens/s and the speedup, all
measured in this run. Greedy decoding: both runs must produce the same text.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

DEMO_DIR = os.path.join(os.path.dirname(__file__), "_demo")
TARGET_DIR = os.path.join(DEMO_DIR, "target")
HEAD_DIR = os.path.join(DEMO_DIR, "eagle3")

PROMPTS = [
    "def binary_search(items, target):\n    \"\"\"Return the index of target in items.\"\"\"\n",
    "class Stack:\n    \"\"\"A simple LIFO stack.\"\"\"\n\n    def __init__(self):\n",
    "import os\n\n\ndef list_python_files(root):\n",
    "    def __repr__(self):\n        return",
]


def timed_run(llm, prompts, sp, stream: bool):
    """Decodes prompts one at a time (batch 1, the latency case). Returns (outputs, seconds);
    with stream=True the text is printed as it is produced and nothing is returned."""
    from onespec.cli import stream_request
    outs, elapsed = [], 0.0
    for prompt in prompts:
        start = time.perf_counter()
        if stream:
            print(f"\033[2m{prompt}\033[0m", end="")
            stream_request(llm, prompt, sp)
        else:
            outs.append(llm.generate([prompt], sp)[0])
        elapsed += time.perf_counter() - start
    return outs, elapsed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="onespec demo", description=__doc__)
    p.add_argument("--k", type=int, default=4, help="draft length")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--device", default="auto")
    p.add_argument("--smoke", action="store_true", help="short run (CI)")
    args = p.parse_args(argv)
    from onespec import LLM, Eagle3Config, SamplingParams
    if not os.path.isfile(os.path.join(HEAD_DIR, "config.json")):
        print(f"onespec demo: the bundled head is missing from {HEAD_DIR}", file=sys.stderr)
        return 1
    prompts = PROMPTS[:2] if args.smoke else PROMPTS
    sp = SamplingParams(max_tokens=8 if args.smoke else args.max_tokens)
    # auto: float32 on CPU (where bf16 rounding differs between 1-row and K+1-row matmuls
    # often enough to split greedy paths), bfloat16 on CUDA
    kw = dict(device=args.device, dtype="auto", max_batch_size=4)
    # the head runs in bf16 even over a float32 target: its drafts are verified by the target,
    # so its precision moves only the acceptance rate, never the output
    spec = Eagle3Config(HEAD_DIR, max_draft_len=args.k, draft_dtype="bfloat16")
    spec_llm = LLM(TARGET_DIR, speculative_config=spec, **kw)
    plain_llm = LLM(TARGET_DIR, **kw)
    device = spec_llm.engine.device
    print(f"onespec demo: 8-layer code model + EAGLE-3 head on {device}, K={args.k}, greedy\n")
    timed_run(spec_llm, prompts, sp, stream=True)               # shown; also the warm-up
    timed_run(plain_llm, prompts, SamplingParams(max_tokens=4), stream=False)
    spec_before = spec_llm.stats()
    spec_reqs, spec_s = timed_run(spec_llm, prompts, sp, stream=False)
    plain_reqs, plain_s = timed_run(plain_llm, prompts, sp, stream=False)
    spec_tokens = sum(len(o.outputs[0].token_ids) for o in spec_reqs)
    plain_tokens = sum(len(o.outputs[0].token_ids) for o in plain_reqs)
    same = all(a.outputs[0].token_ids == b.outputs[0].token_ids
               for a, b in zip(spec_reqs, plain_reqs))
    stats = spec_llm.stats()
    steps = stats["target_steps"] - spec_before["target_steps"]
    generated = stats["num_generated_tokens"] - spec_before["num_generated_tokens"]
    per_pos = ", ".join(f"{r:.2f}" for r in stats["acceptance_rate_per_position"])
    spec_tps, plain_tps = spec_tokens / spec_s, plain_tokens / plain_s
    print("\n" + "-" * 64)
    print(f"identical output to plain decoding: {'yes' if same else 'NO'}")
    print(f"acceptance length: {generated / max(steps, 1):.2f} tokens per target step "
          f"(acceptance per draft position: {per_pos})")
    print(f"plain decoding:       {plain_tps:8.1f} tok/s  ({plain_tokens} tokens)")
    print(f"speculative decoding: {spec_tps:8.1f} tok/s  ({spec_tokens} tokens)")
    print(f"speedup: {spec_tps / plain_tps:.2f}x")
    return 0 if same else 1
