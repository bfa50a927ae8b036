"""Acceptance of the demo pair on held-out code (packages it was never trained on), K = 1..7
and dynamic trees, next to transformers' prompt-lookup decoding on the same model and
prompts. Prints one JSON line per setting.

    python scripts/eval_acceptance.py --data data/code/heldout.jsonl.gz [--device cuda]
    python scripts/eval_acceptance.py --ks 5 --trees 6x4x8,6x4x16,6x4x32,6x4x64 \
        --no-hf          # trees: depth x top-k x nodes

--sa-min-match 4 adds EAGLE-3 with the suffix-automaton enhancer (that minimum match
length; a comma-separated list runs each) for every K; --ngram 5 adds onespec's n-gram
drafter with K = 5 (a list runs each K); --parallel-head DIR adds a P-EAGLE head's parallel
drafting for every K, beside the chain head's line of the same K (prompts_lower_higher
against it); --no-hf leaves out transformers' prompt lookup.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time

import torch

from onespec import LLM, Eagle3Config, NGramConfig, SamplingParams
from onespec.demo import HEAD_DIR, TARGET_DIR


def heldout_prompts(path: str, tokenizer, num: int, prompt_len: int) -> list[list[int]]:
    """Deterministic prompts: a window of prompt_len tokens from the middle of each of num
    files spread evenly over the held-out set (so every held-out package is sampled)."""
    with gzip.open(path, "rt") as f:
        texts = [json.loads(line)["text"] for line in f]
    windows = []
    for text in texts:
        ids = tokenizer.encode(text)
        if len(ids) >= 2 * prompt_len:
            start = (len(ids) - prompt_len) // 2
            windows.append(ids[start:start + prompt_len])
    step = max(1, len(windows) // num)
    return windows[::step][:num]


def prompt_lookup(prompts, gen_len: int, device, num_tokens: int) -> dict:
    """transformers generate with prompt_lookup_num_tokens: tokens per target forward."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).to(device)
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    generated = 0
    start = time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=gen_len, min_new_tokens=gen_len,
                             prompt_lookup_num_tokens=num_tokens, eos_token_id=None,
                             pad_token_id=0)
        generated += out.shape[1] - len(p)
    return {"method": f"hf-prompt-lookup-{num_tokens}", "acceptance_length": generated / calls[0],
            "tokens": generated, "seconds": time.perf_counter() - start}


def bf16_agreement(prompts, sp, k: int) -> dict:
    """Share of output positions where bf16 speculative equals bf16 plain decoding (bf16
    verify of K+1 rows rounds differently from single-row decode, so greedy paths can split)."""
    kw = dict(device="cuda", dtype="bfloat16")
    plain = LLM(TARGET_DIR, **kw).generate(prompts, sp)
    spec = LLM(TARGET_DIR, speculative_config=Eagle3Config(HEAD_DIR, max_draft_len=k),
               **kw).generate(prompts, sp)
    same = total = identical = 0
    for a, b in zip(plain, spec):
        x, y = a.outputs[0].token_ids, b.outputs[0].token_ids
        same += sum(i == j for i, j in zip(x, y))
        total += len(x)
        identical += x == y
    return {"method": "bf16-agreement", "k": k, "token_share_identical": round(same / total, 4),
            "sequences_identical": f"{identical}/{len(prompts)}"}


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def run_onespec(name: str, spec, prompts, sp, ref, device: str, baseline=None,
                **fields) -> list[float]:
    """Decodes the prompts with `spec` and prints its acceptance as one JSON line; returns
    each prompt's acceptance length. baseline: those of another run, to count the prompts
    whose acceptance this one lowers."""
    llm = LLM(TARGET_DIR, device=device, dtype="float32", speculative_config=spec)
    start = time.perf_counter()
    outs = llm.generate(prompts, sp)
    st = llm.stats()
    per_prompt = [o.metrics.acceptance_length for o in outs]
    line = {"method": name, **fields, "device": str(llm.engine.device),
            "acceptance_length": round(st["acceptance_length"], 3),
            "acceptance_rate_per_position":
                [round(r, 3) for r in st["acceptance_rate_per_position"]],
            "accepted_path_length_counts": st["accepted_path_length_counts"],
            "seconds": round(time.perf_counter() - start, 1),
            "identical_to_plain": [o.outputs[0].token_ids for o in outs] == ref}
    if st["num_sa_draft_tokens"]:
        line["sa_drafts"] = st["num_sa_draft_tokens"]
        line["sa_accepted"] = st["num_sa_accepted_draft_tokens"]
    if baseline is not None:
        changes = [a - b for a, b in zip(per_prompt, baseline)]
        line["prompts_lower_higher"] = [sum(c < 0 for c in changes), sum(c > 0 for c in changes)]
        line["largest_drop"] = round(-min(changes), 3)
    print(json.dumps(line), flush=True)
    return per_prompt


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", default="data/code/heldout.jsonl.gz")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--ks", default="1,2,3,4,5,6,7")
    ap.add_argument("--sa-min-match", type=int_list, default=[],
                    help="also run the suffix-automaton enhancer with these minimum matches")
    ap.add_argument("--ngram", type=int_list, default=[],
                    help="also run the n-gram drafter with these draft lengths")
    ap.add_argument("--trees", default="",
                    help="dynamic trees as DEPTHxTOPKxNODES, comma-separated (e.g. 6x4x32)")
    ap.add_argument("--parallel-head", default=None, metavar="DIR",
                    help="also run this P-EAGLE head with parallel_drafting at every K")
    ap.add_argument("--no-hf", "--no-prompt-lookup", dest="no_hf", action="store_true",
                    help="skip transformers' prompt lookup")
    args = ap.parse_args()
    dtype = "float32"
    plain = LLM(TARGET_DIR, device=args.device, dtype=dtype)
    prompts = heldout_prompts(args.data, plain.tokenizer, args.num_prompts, args.prompt_len)
    sp = SamplingParams(max_tokens=args.gen_len, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    device = str(plain.engine.device)
    print(f"{len(prompts)} held-out prompts of {args.prompt_len} tokens, {args.gen_len} new",
          file=sys.stderr)
    for k in int_list(args.ks):
        base = run_onespec("onespec-eagle3", Eagle3Config(HEAD_DIR, max_draft_len=k), prompts,
                           sp, ref, args.device, k=k)
        if args.parallel_head:
            spec = Eagle3Config(args.parallel_head, max_draft_len=k, parallel_drafting=True)
            run_onespec("onespec-peagle", spec, prompts, sp, ref, args.device, base, k=k)
        for m in args.sa_min_match:
            spec = Eagle3Config(HEAD_DIR, max_draft_len=k, use_sa_enhancer=True,
                                sa_min_match_len=m)
            run_onespec("onespec-eagle3-sa", spec, prompts, sp, ref, args.device, base, k=k,
                        sa_min_match_len=m)
    for k in args.ngram:
        run_onespec("onespec-ngram", NGramConfig(max_draft_len=k), prompts, sp, ref,
                    args.device, k=k)
    for tree in filter(None, args.trees.split(",")):
        depth, top_k, nodes = (int(x) for x in tree.split("x"))
        spec = Eagle3Config(HEAD_DIR, max_draft_len=depth, use_dynamic_tree=True,
                            dynamic_tree_max_topK=top_k, max_total_draft_tokens=nodes)
        run_onespec("onespec-eagle3-tree", spec, prompts, sp, ref, args.device, depth=depth,
                    top_k=top_k, nodes=nodes)
    if plain.engine.device.type == "cuda":
        print(json.dumps(bf16_agreement(prompts, sp, k=4)), flush=True)
    for n in () if args.no_hf else (3, 10):
        print(json.dumps({**prompt_lookup(prompts, args.gen_len, plain.engine.device, n),
                          "device": device}), flush=True)


if __name__ == "__main__":
    main()
