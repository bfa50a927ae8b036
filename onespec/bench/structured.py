"""What a JSON-schema constraint costs: decode throughput of the same random-weight target
with and without `structured_outputs`, plain and with drafting at a forced acceptance length,
in one run. Takes `onespec bench decode`'s options (see its --help; --hf is ignored).

The target gets the bundled demo model's tokenizer (the grammar needs real token strings;
ids past its vocabulary are never allowed), and every constrained request follows SCHEMA: an
object holding at least 40 records, so no request can complete its JSON inside the timed
steps and every step decodes the whole batch, as in the unconstrained rows. One JSON line per
configuration; `cost` = 1 - constrained tok/s / unconstrained tok/s at the same batch and K.

    python bench/structured.py --batch-sizes 1,8 --ks 3 --acceptance 3      # GPU, 8B shape
    python bench/structured.py --shape tiny --device cpu --batch-sizes 1 --ks 3 \\
        --acceptance 3 --gen-len 8 --trials 1
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import onespec
from onespec.bench import decode as bc
from onespec.structured.params import StructuredOutputsParams

SCHEMA = {"type": "object", "required": ["rows"], "properties": {"rows": {
    "type": "array", "minItems": 40, "items": {
        "type": "object", "required": ["id", "name", "ok"], "properties": {
            "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12},
            "ok": {"type": "boolean"}}}}}}
DEMO_TARGET = os.path.join(os.path.dirname(onespec.__file__), "_demo", "target")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def update_config(model_dir: str, fields):
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    with open(path, "w") as f:
        json.dump({**cfg, **fields(cfg)}, f, indent=2)


def add_tokenizer(target_dir: str, head_dir: str | None):
    """Copies the demo tokenizer next to the random-weight target and takes its EOS; a
    shape whose vocabulary is smaller than the tokenizer's (tiny) gets the tokenizer's."""
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(DEMO_TARGET, name), target_dir)
    with open(os.path.join(DEMO_TARGET, "config.json")) as f:
        demo = json.load(f)
    size = demo["vocab_size"]
    update_config(target_dir, lambda c: dict(bos_token_id=demo["bos_token_id"],
                                             eos_token_id=demo["eos_token_id"],
                                             vocab_size=max(c["vocab_size"], size)))
    if head_dir is not None:
        update_config(head_dir, lambda c: dict(vocab_size=max(c["vocab_size"], size)))


def main(argv) -> int:
    args = bc.parse_args(["decode", *argv])
    device = bc.torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    emit = bc.make_emitter(args, bc.shape_label(args.shape), device)
    bandwidth = bc.copy_bandwidth(args.device)
    constraint = StructuredOutputsParams(json=SCHEMA)
    configs = [(k, a) for k in args.ks for a in
               ([1.0] if k == 0 else [a for kk, a in bc.spec_configs(args.ks, args.acceptance)
                                      if kk == k])]
    with tempfile.TemporaryDirectory(prefix="onespec-bench-") as root:
        target_dir, head_dir = bc.write_model_dirs(args.shape, root)
        add_tokenizer(target_dir, head_dir)
        budget = max(bc.request_budget(args, k, a) for k, a in configs)
        llm = bc.build_llm(target_dir, head_dir, max(args.ks), args, budget)
        llm.engine.grammars.compile(constraint)             # compiled once, before timing
        for batch in args.batch_sizes:
            for k, a in configs:
                free = None
                for structured in (None, constraint):
                    draft = bc.Draft(k, a)
                    m = bc.measure_decode(llm, batch, draft, args,
                                          structured_outputs=structured)
                    row, _ = bc.onespec_row(llm, batch, draft, m, bandwidth)
                    row["structured"] = "json_schema" if structured else None
                    if structured is None:
                        free = row
                    else:
                        row["cost"] = 1.0 - row["tok_s"] / free["tok_s"]
                    emit({"batch": batch, **row})
    return 0

