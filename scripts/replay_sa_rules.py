"""Acceptance of suffix-match drafting rules on top of the demo pair's EAGLE-3 drafts,
replayed offline. Prints one JSON line per rule.

Greedy output does not depend on the drafts, and the head's drafts at a position depend
only on the tokens before it, so one run records them at every position (forced
acceptance 1: one token a step) and any rule for replacing them can then be replayed on
the fixed outputs in pure Python: a step accepts the drafts' longest prefix that equals
the output. The plain rule's figures equal scripts/eval_acceptance.py's real runs.

    python scripts/replay_sa_rules.py --data data/code/heldout.jsonl.gz --k 5
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
from collections import Counter

from eval_acceptance import heldout_prompts

from onespec import LLM, Eagle3Config, SamplingParams
from onespec.demo import HEAD_DIR, TARGET_DIR


def record_drafts(args) -> list[tuple[list[int], list[int], dict[int, list[int]]]]:
    """(prompt, greedy output, {output length: the head's K drafts there}) per prompt."""
    llm = LLM(TARGET_DIR, device=args.device, dtype="float32", speculative_config=Eagle3Config(
        HEAD_DIR, max_draft_len=args.k, force_acceptance_length=1.0))
    prompts = heldout_prompts(args.data, llm.tokenizer, args.num_prompts, args.prompt_len)
    eng = llm.engine
    reqs = [eng.add_request(p, SamplingParams(max_tokens=args.gen_len, ignore_eos=True))
            for p in prompts]
    drafts: dict[str, dict[int, list[int]]] = {r.request_id: {} for r in reqs}
    while eng.has_unfinished():
        for r in eng.step():
            if not r.is_finished:
                drafts[r.request_id][len(r.output_token_ids)] = list(r.draft_tokens)
    return [(r.prompt_token_ids, r.output_token_ids, drafts[r.request_id]) for r in reqs]


def occurrences(seq: list[int], text: list[int], earlier: bool) -> tuple[int, list[int]]:
    """(m, ends): the longest suffix of text that occurs in seq (earlier: ending before
    seq's last token) has m tokens and ends at these indices of seq."""
    last = len(seq) - 1 if earlier else len(seq)
    ends = [e for e in range(last) if seq[e] == text[-1]]
    if not ends:
        return 0, []
    m = 1
    while m < len(text):
        longer = [e for e in ends if e - m >= 0 and seq[e - m] == text[-m - 1]]
        if not longer:
            break
        ends, m = longer, m + 1
    return m, ends


def first(seq, ends, n):
    return seq[ends[0] + 1:ends[0] + 1 + n]


def recent(seq, ends, n):
    return seq[ends[-1] + 1:ends[-1] + 1 + n]


def vote(seq, ends, n):
    """Token by token, the commonest next token among the occurrences that still agree
    (ties: the most recent)."""
    out, live = [], list(ends)
    for i in range(n):
        votes = Counter(seq[e + 1 + i] for e in live if e + 1 + i < len(seq))
        if not votes:
            break
        best = max(votes, key=lambda t: (votes[t], max(
            e for e in live if e + 1 + i < len(seq) and seq[e + 1 + i] == t)))
        out.append(best)
        live = [e for e in live if e + 1 + i < len(seq) and seq[e + 1 + i] == best]
    return out


def rule(choose, min_first: int, min_later: int | None, k: int):
    """Drafts for the next step from (tokens, the head's drafts): at the first j (0 only
    when min_later is None) where tokens + d1..dj end in a repeat of at least min_first
    (j = 0) or min_later tokens, d1..dj + choose(...) up to k; else the head's drafts."""
    def drafts_for(seq: list[int], model: list[int]) -> list[int]:
        for j in range(len(model) if min_later else 1):
            m, ends = occurrences(seq, seq + model[:j], earlier=j == 0)
            ends = [e for e in ends if e + 1 < len(seq)]
            if ends and m >= (min_first if j == 0 else min_later):
                cont = choose(seq, ends, k - j)
                return model[:j] + cont + model[j + len(cont):]
        return model
    return drafts_for


def replay(data, drafts_for, k: int, gen_len: int) -> float:
    """Acceptance length (tokens / target steps, the prefill step included)."""
    tokens = steps = 0
    for prompt, out, model in data:
        n, num_steps = 1, 1                       # the prefill step emits out[0]
        while n < gen_len:
            d = drafts_for(prompt + out[:n], model[n][:k])[:k]
            a = 0
            while a < len(d) and n + a < len(out) and d[a] == out[n + a]:
                a += 1
            n = min(n + a + 1, gen_len)
            num_steps += 1
        tokens, steps = tokens + n, steps + num_steps
    return tokens / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", default="data/code/heldout.jsonl.gz")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--cache", default=None, help="keep the recorded drafts in this file")
    args = ap.parse_args()
    if args.cache and os.path.exists(args.cache):
        with open(args.cache, "rb") as f:
            data = pickle.load(f)
    else:
        data = record_drafts(args)
        if args.cache:
            with open(args.cache, "wb") as f:
                pickle.dump(data, f)
    k = args.k
    base = replay(data, lambda seq, model: model, k, args.gen_len)
    print(json.dumps({"rule": "eagle3", "k": k, "acceptance_length": round(base, 3)}))
    for name, choose in (("first", first), ("recent", recent), ("vote", vote)):
        for min_first, min_later in ((3, None), (4, None), (6, None), (8, None), (4, 4),
                                     (4, 6), (2, 2), (8, 8)):
            al = replay(data, rule(choose, min_first, min_later, k), k, args.gen_len)
            print(json.dumps({"rule": f"sa-{name}", "min_match": min_first,
                              "splice_min_match": min_later, "k": k,
                              "acceptance_length": round(al, 3),
                              "gain": f"{100 * (al / base - 1):+.1f}%"}), flush=True)


if __name__ == "__main__":
    main()
