"""`onespec demo`: the bundled code model and its EAGLE-3 head, plain vs speculative.

Streams the speculative completions of a few built-in code prompts, then decodes the same
prompts with and without speculation in alternation over a few rounds and prints the
acceptance length, tokens/s and the speedup (median and spread over the rounds), all
measured in this run. Greedy decoding: both must produce the same text.
"""
from __future__ import annotations

import argparse
import os
import statistics
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


UNRELIABLE_SPREAD = 0.2          # (max - min) / median of the per-round speedups


def stream(llm, prompts, sp):
    """Decodes prompts one at a time, printing each prompt (dimmed on a terminal) and its
    completion."""
    from onespec.cli import stream_request
    dim, plain = ("\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "")
    for prompt in prompts:
        print(f"{dim}{prompt}{plain}", end="")
        stream_request(llm, prompt, sp)


def timed_round(llm, prompts, sp) -> tuple[list[list[int]], float]:
    """Decodes prompts one at a time (batch 1, the latency case).
    Returns (token ids per prompt, tokens/s over the round)."""
    start = time.perf_counter()
    outs = [llm.generate([prompt], sp)[0].outputs[0].token_ids for prompt in prompts]
    return outs, sum(map(len, outs)) / (time.perf_counter() - start)


def interleaved_rounds(spec_llm, plain_llm, prompts, sp, rounds: int) -> dict:
    """Times plain and speculative decoding in alternation (spec first in even rounds, plain
    first in odd ones), so a load that comes and goes on the machine hits both alike."""
    spec_tps, plain_tps, same = [], [], True
    for r in range(rounds):
        order = [("spec", spec_llm), ("plain", plain_llm)]
        results = dict((name, timed_round(llm, prompts, sp))
                       for name, llm in (order if r % 2 == 0 else order[::-1]))
        same = same and results["spec"][0] == results["plain"][0]
        spec_tps.append(results["spec"][1])
        plain_tps.append(results["plain"][1])
    return {"same": same, "spec_tps": spec_tps, "plain_tps": plain_tps,
            "speedups": [s / p for s, p in zip(spec_tps, plain_tps)],
            "tokens": sum(map(len, results["spec"][0]))}


def report_speedup(speedups: list[float]):
    median = statistics.median(speedups)
    low, high = min(speedups), max(speedups)
    if len(speedups) == 1:
        print(f"speedup: {median:.2f}x (one round: no spread measured; --rounds 3 or more "
              "gives a figure you can judge)")
        return
    print(f"speedup: {median:.2f}x (median of {len(speedups)} rounds; spread "
          f"{low:.2f}x-{high:.2f}x)")
    if (high - low) / median > UNRELIABLE_SPREAD:
        print(f"warning: the speedup varied by more than {UNRELIABLE_SPREAD:.0%} between "
              "rounds, so this figure is unreliable: another program is probably using the "
              "CPU. Run again on an idle machine or with more --rounds.")


def positive_int(text: str) -> int:
    if not text.lstrip("-").isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def main(argv=None) -> int:
    from onespec.cli import Parser
    p = Parser(prog="onespec demo", description=__doc__)
    p.add_argument("--k", type=positive_int, default=4, help="draft length")
    p.add_argument("--max-tokens", type=positive_int, default=96, help="tokens per prompt")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="timed rounds of plain and speculative decoding, interleaved")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--smoke", action="store_true", help="short run (CI): 2 prompts, 8 tokens")
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
    stream(spec_llm, prompts, sp)                               # shown; also the warm-up
    timed_round(plain_llm, prompts, SamplingParams(max_tokens=4))
    before = spec_llm.stats()
    run = interleaved_rounds(spec_llm, plain_llm, prompts, sp, args.rounds)
    stats = spec_llm.stats()
    steps = stats["target_steps"] - before["target_steps"]
    generated = stats["num_generated_tokens"] - before["num_generated_tokens"]
    per_pos = ", ".join(f"{r:.2f}" for r in stats["acceptance_rate_per_position"])
    print("\n" + "-" * 64)
    print(f"identical output to plain decoding: {'yes' if run['same'] else 'NO'}")
    print(f"acceptance length: {generated / max(steps, 1):.2f} tokens per target step "
          f"(acceptance per draft position: {per_pos})")
    rounds = f"median of {args.rounds} round{'s' if args.rounds > 1 else ''}"
    print(f"plain decoding:       {statistics.median(run['plain_tps']):8.1f} tok/s  "
          f"({rounds} of {run['tokens']} tokens)")
    print(f"speculative decoding: {statistics.median(run['spec_tps']):8.1f} tok/s")
    report_speedup(run["speedups"])
    return 0 if run["same"] else 1
