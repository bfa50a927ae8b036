"""Plain decoding, every fixed draft length and the auto draft length on the bundled demo
pair, timed in interleaved trials (the order rotates each trial, so a load that comes and
goes on the machine hits every configuration alike).

    python scripts/compare_auto_k.py [--device cpu|cuda] [--batch 1] [--trials 5] [--max-k 5]

Prints a table (median tok/s, spread, speedup over plain, acceptance length) and one JSON
line per configuration; exits 1 if any configuration's greedy output differs from plain's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from onespec import LLM, Eagle3Config, SamplingParams  # noqa: E402
from onespec.demo import HEAD_DIR, PROMPTS, TARGET_DIR  # noqa: E402


def build(args) -> dict[str, tuple[LLM, int | str | None]]:
    """{name: (engine, K)}: one plain engine, one engine for every fixed K (its
    set_draft_len per run), one with draft_len_schedule='auto'."""
    kw = dict(device=args.device, dtype="auto", max_batch_size=args.batch)
    head = dict(max_draft_len=args.max_k, draft_dtype="bfloat16")      # as `onespec demo`
    fixed = LLM(TARGET_DIR, speculative_config=Eagle3Config(HEAD_DIR, **head), **kw)
    auto = LLM(TARGET_DIR, speculative_config=Eagle3Config(HEAD_DIR, draft_len_schedule="auto",
                                                           **head), **kw)
    configs = {"plain": (LLM(TARGET_DIR, **kw), None)}
    configs.update({f"K={k}": (fixed, k) for k in range(1, args.max_k + 1)})
    configs["auto"] = (auto, "auto")
    return configs


def run_once(llm: LLM, k, prompts, sp) -> tuple[list[list[int]], float, int]:
    """Decodes `prompts` in groups of the batch size. Returns (token ids, tok/s, target
    steps)."""
    if isinstance(k, int):
        llm.engine.set_draft_len(k)
    steps0 = llm.stats()["target_steps"]
    start = time.perf_counter()
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    seconds = time.perf_counter() - start
    return outs, sum(map(len, outs)) / seconds, llm.stats()["target_steps"] - steps0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--max-k", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads: on a shared small CPU, two threads that "
                         "wait for each other make steps many times slower")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    configs = build(args)
    sp = SamplingParams(max_tokens=args.max_tokens)
    groups = [[PROMPTS[(g * args.batch + i) % len(PROMPTS)] for i in range(args.batch)]
              for g in range(max(1, len(PROMPTS) // args.batch))]
    for llm, k in configs.values():                                     # warm-up
        run_once(llm, k, groups[0], SamplingParams(max_tokens=8))
    names = list(configs)
    tps = {n: [] for n in names}
    steps = {n: 0 for n in names}
    tokens = {n: 0 for n in names}
    reference, same = None, {n: True for n in names}
    for t in range(args.trials):
        order = names[t % len(names):] + names[:t % len(names)]
        for name in order:
            llm, k = configs[name]
            outs, rate, n_steps = [], 0.0, 0
            for group in groups:
                o, r, s = run_once(llm, k, group, sp)
                outs += o
                rate += r / len(groups)
                n_steps += s
            if reference is None:            # trial 0 runs plain first
                reference = outs
            tps[name].append(rate)
            steps[name] += n_steps
            tokens[name] += sum(map(len, outs))
            same[name] = same[name] and outs == reference
    plain = statistics.median(tps["plain"])
    best = max(statistics.median(tps[n]) for n in names if n != "auto")
    print(f"\ndemo pair on {configs['plain'][0].engine.device}, batch {args.batch}, "
          f"{args.trials} interleaved trials, {args.max_tokens} tokens a prompt")
    print(f"{'config':>7} {'tok/s':>8} {'spread':>16} {'vs plain':>9} {'tok/step':>9}")
    for n in names:
        med = statistics.median(tps[n])
        spread = f"{min(tps[n]):.0f}-{max(tps[n]):.0f}"
        print(f"{n:>7} {med:8.1f} {spread:>16} {med / plain:8.2f}x "
              f"{tokens[n] / max(steps[n], 1):9.2f}")
    auto = statistics.median(tps["auto"])
    print(f"auto / fastest fixed (plain included): {auto / best:.2f}")
    policy = configs["auto"][0].engine.policy.as_dict()
    print(f"auto: chosen K {policy['chosen_k']}, acceptance estimates "
          f"{policy['acceptance_rate_estimates']}")
    for n in names:
        print(json.dumps({"config": n, "tok_s": statistics.median(tps[n]), "tok_s_trials": tps[n],
                          "tokens_per_step": tokens[n] / max(steps[n], 1),
                          "same_as_plain": same[n]}))
    print(json.dumps({"auto_over_best_fixed": auto / best, "policy": policy}))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
