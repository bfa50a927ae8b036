"""Shrink a trained EAGLE-3 head's draft vocabulary to its N most frequent tokens.

    python scripts/prune_draft_vocab.py --head onespec/_demo/eagle3 --target onespec/_demo/target \
        --data data/stdlib/train.jsonl.gz --size 2048 --out /tmp/eagle3-2048

The draft lm_head is the largest weight read by every draft step; on a small target its
rows cost as much as a third of the target's own step. Keeping the rows of the N most
frequent target tokens (counted on the training data, the rule the trainer uses to pick
the vocabulary in the first place) changes a draft only when its argmax was one of the
rare tokens dropped.
"""
from __future__ import annotations

import argparse
import gzip
import json

import torch

from onespec.engine.engine import load_target, load_tokenizer
from onespec.models.eagle3 import make_vocab_maps
from onespec.models.eagle3_io import load_eagle3_head, save_eagle3_head
from onespec.models.eagle3 import default_capture_layers


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--head", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    target = load_target(args.target, "cpu", torch.float32)
    cfg = target.config
    head = load_eagle3_head(args.head, cfg, len(default_capture_layers(cfg.num_hidden_layers)),
                            "cpu", torch.float32)
    if head.d2t is None or args.size >= head.config.draft_vocab_size:
        raise SystemExit("--size must be below the head's draft vocabulary size")
    tok = load_tokenizer(args.target)
    counts = torch.zeros(cfg.vocab_size, dtype=torch.int64)
    with gzip.open(args.data, "rt") as f:
        for line in f:
            ids = torch.tensor(tok.encode(json.loads(line)["text"]), dtype=torch.int64)
            counts += torch.bincount(ids, minlength=cfg.vocab_size)
    draft_targets = head.to_target_ids(torch.arange(head.config.draft_vocab_size))
    order = torch.argsort(-counts[draft_targets], stable=True)[:args.size]
    keep = order.sort().values                                # draft ids, target order kept
    head.lm_head.weight.data = head.lm_head.weight.data[keep].clone()
    head.lm_head.out_features = args.size
    d2t, t2d = make_vocab_maps(draft_targets[keep], cfg.vocab_size)
    head.d2t, head.t2d = d2t, t2d
    head.config.draft_vocab_size = args.size
    save_eagle3_head(head, args.out, head.config.fmt, dtype=torch.bfloat16)
    covered = counts[draft_targets[keep]].sum() / counts.sum()
    print(f"kept {args.size} of {len(draft_targets)} draft tokens, covering "
          f"{covered:.1%} of training tokens -> {args.out}")


if __name__ == "__main__":
    main()
