"""`onespec demo`: the bundled code model and its EAGLE-3 head, plain vs speculative.

Streams the speculative completions of a few built-in code prompts, picks the draft length
that decodes fastest on this machine (a short timed trial of each K in 2..6 on one engine),
then decodes the same prompts with and without speculation in alternation over a few rounds
and prints the acceptance length, tokens/s and the speedup (median and spread over the
rounds), all measured in this run. Greedy decoding: both must produce the same text.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

DEMO_DIR = os.path.join(os.path.dirname(__file__), "_demo")
TARGET_DIR = os.path.join(DEMO_DIR, "target")
HEAD_DIR = os.path.join(DEMO_DIR, "eagle3")

# Each prompt stops inside a line: the tokenizer merges a newline with the next line's
# indentation, so a prompt that ends on a bare newline tells the model that a column-0 line
# comes next.
PROMPTS = [
    'def binary_search(items, target):\n    """Return the index of target in items."""\n'
    "    lo = 0\n    hi = len(items)\n    while lo",
    'class Stack:\n    """A simple LIFO stack."""\n\n    def __init__(self):\n        self.',
    'import os\n\n\ndef list_python_files(root):\n'
    '    """Return the paths of the .py files under root."""\n    result = []\n    for',
    'def read_config(path):\n    """Read a JSON config file."""\n    with open(path) as f:\n'
    "        return",
]


UNRELIABLE_SPREAD = 0.2          # (max - min) / median of the per-round speedups
DRAFT_LENS = range(2, 7)         # the draft lengths the demo tries
TRIAL_TOKENS = 48                # tokens per prompt in each trial of a draft length


def stream(llm, prompts, sp):
    """Decodes prompts one at a time, printing each prompt and its completion under their
    own headings (dimmed on a terminal), so that a pipe shows where one ends."""
    from onespec.cli import stream_request
    dim, plain = ("\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "")
    for prompt in prompts:
        print(f"{dim}[prompt]{plain}\n{prompt}\n{dim}[completion]{plain}")
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


def pick_draft_len(llm, prompts, max_tokens: int) -> tuple[int, dict[int, float]]:
    """The fastest K in DRAFT_LENS on this machine: each K decodes the prompts twice, the
    passes in opposite orders of K so a load that comes and goes hits every K alike; a K
    keeps its better pass. Returns (best K, {K: tokens/s})."""
    from onespec import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens)
    best: dict[int, float] = {}
    for order in (list(DRAFT_LENS), list(DRAFT_LENS)[::-1]):
        for k in order:
            llm.engine.set_draft_len(k)     # (its CUDA graphs captured first)
            best[k] = max(best.get(k, 0.0), timed_round(llm, prompts, sp)[1])
    return max(best, key=best.get), best


def model_summary(path: str) -> str:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    return f"{cfg['num_hidden_layers']}-layer code model"


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


def choose_draft_len(llm, prompts, max_tokens: int) -> int:
    """pick_draft_len on the first two prompts, printed; leaves llm at the chosen K."""
    k, rates = pick_draft_len(llm, prompts[:2], max_tokens)
    llm.engine.set_draft_len(k)
    trials = ", ".join(f"K={j}: {r:.0f}" for j, r in sorted(rates.items()))
    print(f"\ndraft length: K={k}, the fastest here (speculative tok/s over a short trial: "
          f"{trials})")
    return k


def main(argv=None) -> int:
    from onespec.cli import Parser
    p = Parser(prog="onespec demo", description=__doc__)
    p.add_argument("--k", type=positive_int, default=None,
                   help=f"draft length (default: the fastest of {DRAFT_LENS.start}.."
                        f"{DRAFT_LENS.stop - 1}, measured at start)")
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
    spec = Eagle3Config(HEAD_DIR, max_draft_len=args.k or max(DRAFT_LENS),
                        draft_dtype="bfloat16")
    spec_llm = LLM(TARGET_DIR, speculative_config=spec, **kw)
    plain_llm = LLM(TARGET_DIR, **kw)
    device = spec_llm.engine.device
    graphs = "CUDA graphs on" if spec_llm.engine.uses_cuda_graphs else "eager"
    print(f"onespec demo: {model_summary(TARGET_DIR)} + EAGLE-3 head on {device} ({graphs}), "
          "greedy\n")
    stream(spec_llm, prompts, sp)                               # shown; also the warm-up
    timed_round(plain_llm, prompts, SamplingParams(max_tokens=4))
    k = args.k or choose_draft_len(spec_llm, prompts, 8 if args.smoke else TRIAL_TOKENS)
    # count the timed rounds alone: the streaming and the trials ran other draft lengths
    spec_llm.engine.reset_stats()
    run = interleaved_rounds(spec_llm, plain_llm, prompts, sp, args.rounds)
    stats = spec_llm.stats()
    steps, generated = stats["target_steps"], stats["num_generated_tokens"]
    per_pos = ", ".join(f"{r:.2f}" for r in stats["acceptance_rate_per_position"][:k])
    print("\n" + "-" * 64)
    print(f"identical output to plain decoding: {'yes' if run['same'] else 'NO'}")
    print(f"acceptance length: {generated / max(steps, 1):.2f} tokens per target step at K={k} "
          f"(acceptance per draft position: {per_pos})")
    rounds = f"median of {args.rounds} round{'s' if args.rounds > 1 else ''}"
    print(f"plain decoding:       {statistics.median(run['plain_tps']):8.1f} tok/s  "
          f"({rounds} of {run['tokens']} tokens)")
    print(f"speculative decoding: {statistics.median(run['spec_tps']):8.1f} tok/s")
    report_speedup(run["speedups"])
    return 0 if run["same"] else 1
