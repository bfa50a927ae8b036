"""Where the GPU time of one CUDA-graph step goes, kernel by kernel, for any benchmark shape.

    python scripts/kernel_table.py [--shape llama3-8b] [--batch 1] [--k 0]
        [--acceptance 3.0] [--tree 6x4x32] [--prompt-len 128] [--out table.json]

Builds the benchmark's engine (random weights; with --k > 0 the shape's drafter: the
EAGLE-3 head, or the MTP layer of an MTP shape; --tree: a dynamic tree of depth x top-k x
nodes, depth = --k), runs requests until their step replays a captured graph, then
reports: step_ms (engine.step, host included), replay_ms (the graph alone), the kernels a
step launches, and a table of kernel names with launches and summed duration per step
(from torch.profiler over ten replays). Durations under programmatic dependent launch
include the time a kernel waits for its predecessor, so the sum can exceed replay_ms.
Prints one JSON line (the table's top 40 rows); --out writes the whole table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import mean_ms  # noqa: E402

from onespec import SamplingParams  # noqa: E402
from onespec.bench.decode import build_llm, set_draft  # noqa: E402
from onespec.bench.models import write_model_dirs  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--k", type=int, default=0, help="draft length (a tree's depth)")
    p.add_argument("--acceptance", type=float, default=3.0, help="forced acceptance length")
    p.add_argument("--tree", default=None, metavar="DxKxN", help="a dynamic tree (EAGLE-3)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--out", default=None, help="write the whole table here (JSON)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_table.py needs CUDA")
    tree = tuple(int(x) for x in args.tree.split("x")) if args.tree else None
    if tree and tree[0] != args.k:
        sys.exit(f"--tree depth {tree[0]} must equal --k {args.k}")
    target_dir, head_dir = write_model_dirs(args.shape, tempfile.mkdtemp())
    ns = SimpleNamespace(prompt_len=args.prompt_len, batch_sizes=[args.batch],
                         dtype="bfloat16", device="cuda", seed=0)
    llm = build_llm(target_dir, head_dir if args.k else None, args.k, ns, 2048, tree=tree)
    eng = llm.engine
    set_draft(eng, args.k, args.acceptance if args.k else 1.0)
    vocab = eng.model.config.vocab_size
    prompts = torch.randint(0, vocab, (args.batch, args.prompt_len),
                            generator=torch.Generator().manual_seed(0)).tolist()
    reqs = [eng.add_request(q, SamplingParams(max_tokens=1500, ignore_eos=True))
            for q in prompts]
    graphs = eng.runner.graphs
    key = (graphs.bucket(args.batch), args.k, eng.runner.worker.forced_key)
    for _ in range(200):        # prefill, then until the step's graph is captured
        eng.step()
        if key in graphs.graphs and not any(r.in_context for r in reqs):
            break
    for _ in range(10):
        eng.step()
    step_ms = mean_ms(eng.step, 50)
    graph = graphs.standalone(key)
    mean_ms(graph.replay, 5)
    replay_ms = mean_ms(graph.replay, 50)
    replays = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    table: dict[str, list] = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        row = table.setdefault(e.name, [0, 0.0])
        row[0] += 1
        row[1] += e.time_range.end - e.time_range.start
    rows = sorted(([name, n / replays, round(us / replays, 1)] for name, (n, us) in
                   table.items()), key=lambda r: -r[2])
    out = {"shape": args.shape, "batch": args.batch, "k": args.k, "tree": args.tree,
           "acceptance": args.acceptance if args.k else 1.0,
           "device": torch.cuda.get_device_name(), "step_ms": round(step_ms, 3),
           "replay_ms": round(replay_ms, 3),
           "kernels_per_step": sum(r[1] for r in rows),
           "kernel_sum_us": round(sum(r[2] for r in rows), 1),
           "table": [[name[:120], n, us] for name, n, us in rows]}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(dict(out, table=out["table"][:40])), flush=True)
    for r in reqs:
        eng.abort(r.request_id)


if __name__ == "__main__":
    main()
