"""The plain batch-1 benchmark of kernel variants in alternating processes.

    python scripts/ab_bench.py --variants default,linear=4096:4096:0:32:256:4:5:2 --runs 3

Graph replays of two variants inside one process have disagreed with the benchmark run in
separate processes (docs/PERFORMANCE.md, 2e), so a kernel choice is settled here: each run
starts one fresh process per variant, in turn (the order alternating between runs), and
each process times `onespec bench decode --batch-sizes 1 --ks 0` with the variant's knobs
set (the knobs of scripts/profile_graph_step.py --variants, and `sync`: the overlap
scheduler off). One JSON line per process.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path


def one(variant: str, gen_len: int, shape: str) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from profile_graph_step import apply_variant

    from onespec.bench_cli import main
    knobs = variant.split("+")
    apply_variant("+".join(x for x in knobs if x != "sync"))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["decode", "--gen-len", str(gen_len), "--batch-sizes", "1", "--ks", "0",
              "--no-hf", "--shape", shape] + (["--no-overlap-scheduler"] if "sync" in knobs
                                              else []))
    row = next(r for r in map(json.loads, buf.getvalue().splitlines())
               if r.get("engine") == "onespec")
    return {"variant": variant, "step_ms": row["step_ms"], "trials": row["step_ms_trials"],
            "hbm_fraction": row["hbm_fraction"]}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", required=True, help="comma-separated, as profile_graph_step")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--gen-len", type=int, default=96)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.gen_len, args.shape)), flush=True)
        return
    variants = args.variants.split(",")
    for run in range(args.runs):
        for v in variants if run % 2 == 0 else variants[::-1]:
            out = subprocess.run([sys.executable, __file__, "--one", v, "--gen-len",
                                  str(args.gen_len), "--shape", args.shape, "--variants", v],
                                 capture_output=True, text=True)
            line = out.stdout.strip().splitlines()[-1] if out.returncode == 0 else \
                json.dumps({"variant": v, "error": out.stderr.strip()[-500:]})
            print(json.dumps({"run": run, **json.loads(line)}), flush=True)


if __name__ == "__main__":
    main()
